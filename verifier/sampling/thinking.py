"""A thinking budget (vLLM's `thinking_token_budget`, the Messages API's `thinking.budget_tokens`):
at most `tokens` tokens inside a reply's reasoning block, then its closing marker forced, token by
token, and the answer follows.

The rule is a function of the reply's tokens alone (`forced`), so it is part of the logits
transform (`verifier/sampling/sampler.py:transform_logits`): plain decoding applies it to the last
row, verification to every tree node with the node's path, and the drafters' own distributions
with it or without it change only speed. Counting in tokens (not text) keeps it that: the block
opens with `start_ids` as the reply's first tokens (None: the template opened it, the reply starts
inside) and has closed where `end_ids` appear in order. Reasoning models write their markers as
one special token each; a model that spells them in pieces is matched only where it writes the
pieces the tokenizer gives the marker alone. Where a constraint's mask leaves the forced token
out, the mask stands (the rule then forces nothing at that row).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ThinkingBudget:
    tokens: int                              # the block's tokens (its opening marker not counted)
    end_ids: tuple[int, ...]                 # the closing marker, forced once the budget is spent
    start_ids: tuple[int, ...] | None = None  # the opening marker; None: the reply starts inside the block

    def __post_init__(self):
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 1:
            raise ValueError(f"thinking_token_budget must be an int >= 1, got {self.tokens!r}")
        if not self.end_ids or self.start_ids == ():
            raise ValueError("a thinking budget needs its block's markers as token ids")
        object.__setattr__(self, "end_ids", tuple(self.end_ids))
        if self.start_ids is not None:
            object.__setattr__(self, "start_ids", tuple(self.start_ids))

    def forced(self, output_ids: list[int]) -> int | None:
        """The token the next position must take, given the reply so far: the closing marker's
        next token once the block has spent its budget without closing; else None."""
        opened = 0 if self.start_ids is None else len(self.start_ids)
        spent = len(output_ids) - opened - self.tokens       # tokens past the budget: the marker's index
        if spent < 0 or spent >= len(self.end_ids):
            return None
        if self.start_ids is not None and tuple(output_ids[:opened]) != self.start_ids:
            return None                                     # the reply answered without a block
        if _contains(output_ids[opened:opened + self.tokens], self.end_ids):
            return None                                     # the block closed within its budget
        return self.end_ids[spent]


def _contains(seq: list[int], part: tuple[int, ...]) -> bool:
    n = len(part)
    return any(tuple(seq[i:i + n]) == part for i in range(len(seq) - n + 1))
