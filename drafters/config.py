"""`SpecConfig`: how far the drafter may speculate each step.

It lives in drafters/ because it is the drafters' config: each drafter kind registers the
SpecConfig it is tuned for and its factory reads the fields that apply to it. The engine
(spec/), the server and bench build one and pass it down; they sit above drafters/.
Plain Python, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from verifier.checks import positive_int


@dataclass(frozen=True)
class SpecConfig:
    """How far to speculate each step; each drafter reads the fields that apply to it."""
    num_speculative_tokens: int = 4   # γ: depth of the deepest draft node
    topk: int = 1                     # children per expanded node, n-gram branches (1 = a chain)
    budget: int | None = None         # draft nodes per request per step; None: γ × topk

    def __post_init__(self):
        positive_int("num_speculative_tokens", self.num_speculative_tokens)
        positive_int("topk", self.topk)
        if self.budget is not None:
            positive_int("budget", self.budget)
            if self.budget < self.num_speculative_tokens:
                raise ValueError(f"budget ({self.budget}) must be >= num_speculative_tokens "
                                 f"({self.num_speculative_tokens}) so the deepest path fits")

    @property
    def max_nodes(self) -> int:
        return self.budget if self.budget is not None else self.num_speculative_tokens * self.topk

    def first_above(self, gamma: int | None, topk: int | None, nodes: int | None) -> tuple[str, int, int] | None:
        """This config as a cap: the first of depth, top-k and draft nodes asked above it, as
        (name, asked, cap); None when all are within (a None asks nothing)."""
        for name, asked, cap in (("gamma", gamma, self.num_speculative_tokens), ("topk", topk, self.topk),
                                 ("budget", nodes, self.max_nodes)):
            if asked is not None and asked > cap:
                return name, asked, cap
        return None


