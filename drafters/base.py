"""The drafter contract and the hand-off types (kinds by name: drafters/registry.py, kinds.py).

A drafter proposes, for each decoding request, one `TokenTree` whose root is the
request's last token (chosen, not yet run through the target). The target verifies
the whole tree in one forward pass; exact rejection sampling then decides what is
kept, so a drafter can only change speed, never the output distribution.

Rules every drafter keeps:
- `propose` is called once per step with every speculating request; it must return one
  proposal per request, in order, with at most `req.max_nodes` draft nodes and depth at
  most `req.max_depth`.
- A drafter that samples children must report the distribution it sampled them from
  (`Proposal.draft`); a deterministic drafter (n-gram, top-k expansion) leaves it None,
  and acceptance then treats each child as a point mass.
- Drafter state (its own KV, hidden states) is keyed by `seq_id`; `release(seq_id)`
  drops it (finish, cancel, preemption). After a preemption the request comes back
  with the same seq_id and num_computed 0; the drafter must cope (recompute its state).
- `finish(seq_id, token_ids, num_prompt)` comes before `release` when a request ends (finished
  or cancelled, not preempted): a drafter that learns from served outputs (suffix decoding)
  keeps them there; `forget_history()` drops what it learned across requests.
- A request may carry a `Prediction` (OpenAI's Predicted Outputs): the engine drafts it itself
  (drafters/prediction.py) and joins it to the drafter's proposal; a drafter may read it too.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

import torch

from drafters.config import SpecConfig
from tree.token_tree import TokenTree
from verifier.sampling.sampling_params import SamplingParams


@dataclass(frozen=True)
class Prediction:
    """The reply a client expects (OpenAI's `prediction`, e.g. the file it asked to have edited),
    as token ids. It is drafted, so it can speed the reply up and never change it."""
    token_ids: tuple[int, ...]

    def __post_init__(self):
        ids = tuple(self.token_ids)
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
            raise ValueError("prediction token ids must be ints >= 0")
        object.__setattr__(self, "token_ids", ids)

    @classmethod
    def from_text(cls, text: str, tokenizer) -> "Prediction":
        """The text's tokens, with no special token added (a reply never starts with a BOS)."""
        return cls(tuple(tokenizer.encode(text, add_special_tokens=False)) if text else ())


@dataclass
class DraftRequest:
    """One request as a drafter sees it this step (built by the engine, read-only)."""
    seq_id: int
    token_ids: list[int]            # prompt + output; the last one is the tree root
    params: SamplingParams
    generator: torch.Generator | None
    max_depth: int                  # deepest draft node allowed (tokens left to emit - 1, γ)
    max_nodes: int                  # draft nodes allowed (root excluded)
    topk: int = 1                   # children per expanded node (branches) this request allows
    # The last `unverified` token_ids are the grammar's forced tokens, drafted ahead of this
    # tree in the same step (only for drafters with `drafts_ahead`): not yet verified, and
    # replaced by what the target accepts if the forced string is spelled otherwise.
    unverified: int = 0
    num_prompt: int = 0             # token_ids[:num_prompt] is the prompt, the rest the output
    prediction: Prediction | None = None    # the reply the client expects, if it sent one
    # The ids min_tokens masks while the output is shorter (EOS, stop tokens); a sampling
    # drafter draws from the target's transform (verifier/sampling/sampler.py:transform_logits) with them.
    held_back: frozenset[int] = frozenset()
    adapter: str | None = None      # the LoRA adapter the target runs it under (None: the base)

    @property
    def verified_ids(self) -> list[int]:
        return self.token_ids[:len(self.token_ids) - self.unverified]


DraftMode = Literal["iid", "without_replacement"]


@dataclass(frozen=True)
class DraftDistributions:
    """How a sampling drafter drew each node's children (a deterministic drafter passes None).

    Row u of `probs` is q_u, the distribution u's children were drawn from; rows of nodes
    without children are never read (zeros are fine). Defined here, with `Proposal`, because
    drafters produce it; exact acceptance (spec/rejection.py) reads it."""
    probs: torch.Tensor   # [num_nodes, V] fp32, rows sum to 1 (on the device of the target's p)
    mode: DraftMode       # "iid": one child per node (chains); "without_replacement": siblings
    #                       drawn in index order, each from q_u minus the earlier siblings' tokens

    def __post_init__(self):
        if self.mode not in ("iid", "without_replacement"):
            raise ValueError(f"mode must be 'iid' or 'without_replacement', got {self.mode!r}")
        if self.probs.dim() != 2:
            raise ValueError(f"probs must be [num_nodes, V], got shape {tuple(self.probs.shape)}")


@dataclass
class Proposal:
    tree: TokenTree
    draft: DraftDistributions | None = None   # None: deterministic (point-mass) proposals
    # Per draft node, in node order, the drafter's confidence in [0, 1] (a path probability,
    # or a match's strength), and what kind of number it is: the adaptive controller learns
    # how often nodes of each kind, confidence and depth are accepted (spec/adaptive.py).
    # None: no confidence; the controller goes by the node's rank.
    scores: tuple[float, ...] | None = None
    score_kind: str = ""

    def __post_init__(self):
        if self.scores is not None and len(self.scores) != self.num_draft_nodes:
            raise ValueError(f"a proposal of {self.num_draft_nodes} draft nodes got {len(self.scores)} scores")

    @property
    def num_draft_nodes(self) -> int:
        return self.tree.num_nodes - 1

    def truncated(self, draft_nodes: int) -> "Proposal":
        """Its first `draft_nodes` draft nodes, a proposal in its own right: nodes are
        topological and siblings come in the order they were drawn, so the cut keeps every
        kept node's parent and, under each node, the first children drawn."""
        if draft_nodes >= self.num_draft_nodes:
            return self
        n = draft_nodes + 1
        draft = None if self.draft is None else DraftDistributions(self.draft.probs[:n], self.draft.mode)
        scores = None if self.scores is None else self.scores[:draft_nodes]
        return Proposal(self.tree.truncated(n), draft, scores, self.score_kind)


@dataclass
class PrefillChunk:
    """A prompt chunk the target just ran for a request (the drafter may run it too)."""
    seq_id: int
    token_ids: list[int]            # the request's tokens; the chunk is token_ids[start:end]
    start: int
    end: int
    adapter: str | None = None      # the LoRA adapter the target ran it under (None: the base)


@dataclass
class TargetHidden:
    """Target hidden states for positions the target just computed and kept (prefill chunk
    rows, or a verified tree's root plus accepted path), for drafters that read features."""
    seq_id: int
    start: int                      # target position of the first row
    hidden: torch.Tensor            # [n, sum of tapped widths]: `capture_layers` concatenated in order


class Drafter(ABC):
    name = "?"
    # Decoder layers whose input hidden states this drafter reads (EAGLE: three taps).
    # Non-empty: the engine captures them in every target forward and calls `observe`.
    capture_layers: tuple[int, ...] = ()
    # Proposes from token_ids alone (a lookup: no KV cache, no target states of its own), so it
    # can draft after the grammar's forced tokens before the target has verified them: a
    # constrained step is then the forced chain with this drafter's tree below it.
    drafts_ahead: bool = False
    # Its time grows with each node it drafts (a draft model runs a forward per depth): the
    # adaptive controller then caps the nodes it drafts, not only the nodes verified after.
    drafts_per_node: bool = False

    def observe(self, states: list[TargetHidden]) -> None:
        """Target hidden states of newly kept positions, in position order per request."""

    def prefill(self, chunks: list[PrefillChunk]) -> None:
        """Called after each target prefill step, so a drafter with its own KV keeps pace
        with the target in the same chunks instead of catching up in one long forward."""

    @abstractmethod
    def propose(self, reqs: list[DraftRequest]) -> list[Proposal]:
        """One proposal tree per request, in order."""

    def release(self, seq_id: int) -> None:
        """Forget a request's state (finish, cancel or preemption)."""

    def finish(self, seq_id: int, token_ids: list[int], num_prompt: int) -> None:
        """A request finished (or was cancelled) with these tokens, the first num_prompt its
        prompt; called before `release`. Drafters that learn from served outputs keep them."""

    def forget_history(self) -> None:
        """Drop what was learned from earlier requests (benchmarks that replay prompts call it)."""


class LookupDrafter(Drafter):
    """A drafter that looks each request's tokens up on its own (n-gram, datastore, suffix):
    no model, no batching, so it also drafts after the grammar's forced tokens."""
    drafts_ahead = True

    def propose(self, reqs: list[DraftRequest]) -> list[Proposal]:
        return [self.propose_one(r) if r.max_depth >= 1 and r.max_nodes >= 1
                else Proposal(TokenTree.single(r.token_ids[-1])) for r in reqs]

    @abstractmethod
    def propose_one(self, req: DraftRequest) -> Proposal:
        """One request's proposal; it may draft (max_depth and max_nodes are at least 1)."""
