"""Exact acceptance: which draft nodes to keep and which token to emit after them.

Pure functions of probabilities and tokens; no model. Node 0 of a tree is the root (the
last token already chosen); the target's distribution AT node u, p_u, is its prediction
for u's children. A verify step walks from the root, keeps a path of accepted nodes and
emits one more token, and the tokens emitted are distributed exactly as sampling the
target one token at a time (docs/design.md, "The exactness contract").

The p/q maths, at one node with target p and candidate children x_1..x_k tried in order:

  One candidate (the speculative-sampling lemma). Draw x ~ q; accept with probability
  min(1, p(x)/q(x)); on rejection sample from the residual r = max(0, p - q) / (1 - β),
  where β = Σ_x min(p(x), q(x)) and so Σ_x max(0, p(x) - q(x)) = 1 - β. Then
      P(emit y) = q(y)·min(1, p(y)/q(y)) + (1 - β)·r(y)
                = min(p(y), q(y)) + max(0, p(y) - q(y))  =  p(y).

  Several candidates (recursive rejection). Replace "sample from r" by "try the next
  candidate against r". By induction on the candidates left, whatever follows a rejection
  emits exactly r, so the lemma holds at every step and the node emits exactly p. The
  induction needs x_i ~ q_i given everything before it, where q_i is:
    - point mass (deterministic drafter, draft=None): q_i = δ(x_i). Accept with p(x_i);
      r = p with x_i zeroed, renormalised. This is plain sequential sampling from p, so it
      is exact for ANY candidates chosen independently of this step's randomness.
    - "iid": q_i = q_u. Used for chains (one child per node): TokenTree forbids repeated
      sibling tokens, so several iid draws could not be represented faithfully.
    - "without_replacement": x_i was drawn from q_u with x_1..x_{i-1} removed,
          q_i(x) = q_u(x)·[x ∉ {x_1..x_{i-1}}] / (1 - Σ_{j<i} q_u(x_j)),
      so the children must be in the drafter's draw order (TokenTree's index order).
  A rejected x_i had p(x_i) < q_i(x_i), so r(x_i) = 0, and it stays 0 through later
  residuals: the emitted token never equals a rejected sibling, "emit y" and "accept the
  child y" are the same event, and the walk continues in the accepted child with that
  child's own p (a new, independent step). A node without children (a leaf, or the root of
  an empty tree) emits from its untouched p: the bonus token.

Randomness: one uniform per node, drawn at once (node c uses it when c is tried), then one
torch.multinomial for the emitted token; both from `generator`, so a seed reproduces the
result and every call consumes the same amount of randomness whatever the path.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch

if TYPE_CHECKING:
    from drafters.base import DraftDistributions
    from tree.token_tree import TokenTree

# Below this residual mass p and q agree to within fp32 rounding, so max(0, p - q) is
# rounding noise, not a distribution. In exact arithmetic the mass is TV(p, q) > 0 after
# any rejection (a rejection needs p(x) < q(x), hence p != q), so the guard never fires;
# in floating point it can only fire when the rejection itself had probability about
# 1e-6 or less, which bounds what the fallback can change.
_MIN_RESIDUAL_MASS = 1e-6


@dataclass(frozen=True)
class AcceptResult:
    """What one verify step keeps: a path of accepted draft nodes and one emitted token."""
    accepted: tuple[int, ...]   # accepted node indices from the root down (root excluded)
    token: int                  # emitted after them: from the residual if a child was
    #                             rejected at the last node, else from its p (bonus token)

    @property
    def num_accepted(self) -> int:
        return len(self.accepted)

    @property
    def last_node(self) -> int:
        """The node whose target distribution `token` came from (0: the root)."""
        return self.accepted[-1] if self.accepted else 0

    def output_tokens(self, tree: TokenTree) -> list[int]:
        """The tokens this step emits, in order: the accepted nodes' tokens, then `token`."""
        return [tree.tokens[c] for c in self.accepted] + [self.token]


# ----- temperature 0 ---------------------------------------------------------------------


def accept_greedy(tree: TokenTree, target_argmax: Callable[[int], int]) -> AcceptResult:
    """T = 0: follow the child carrying the target's argmax at each node; emit the argmax
    where no child does. Token-identical to plain greedy decoding of the target.

    target_argmax(u): the target's argmax at node u (called once per visited node)."""
    accepted, u = [], 0
    while True:
        best = target_argmax(u)
        nxt = next((c for c in tree.children[u] if tree.tokens[c] == best), None)
        if nxt is None:
            return AcceptResult(tuple(accepted), int(best))
        accepted.append(nxt)
        u = nxt


# ----- temperature > 0 -------------------------------------------------------------------


def accept_tree(tree: TokenTree, target_probs: Callable[[int], torch.Tensor],
                draft: DraftDistributions | None, generator: torch.Generator | None) -> AcceptResult:
    """Multi-candidate rejection sampling over a verification tree.

    target_probs(u): p_u, [V] fp32 probabilities after the logits transform (temperature,
        top-k/top-p/min-p, penalties); called once per visited node, root first. Never
        modified in place.
    draft: how the children were drawn; None for deterministic (point-mass) proposals.
    generator: every random draw comes from it (same device as p); None uses torch's
        global generator."""
    q_row = None
    if draft is not None:
        if draft.probs.shape[0] != tree.num_nodes:
            raise ValueError(f"draft probs have {draft.probs.shape[0]} rows for a tree of "
                             f"{tree.num_nodes} nodes")
        if draft.mode == "iid" and any(len(kids) > 1 for kids in tree.children):
            raise ValueError("iid draft distributions are for chains (one child per node); "
                             "sample siblings without replacement instead")
        q_row = draft.probs.__getitem__
    return _walk(tree.tokens, tree.children, target_probs, q_row,
                 draft is not None and draft.mode == "without_replacement", generator)


def accept_chain(draft_tokens: Sequence[int], target_probs: torch.Tensor,
                 draft_probs: torch.Tensor | None, generator: torch.Generator | None) -> AcceptResult:
    """A chain of γ draft tokens: the same rule as `accept_tree` on `TokenTree.chain`
    (node i + 1 carries draft_tokens[i]), and the same draws for the same generator state.

    target_probs: [γ+1, V], row i = p after i draft tokens (row γ gives the bonus token).
    draft_probs: [γ, V], row i = q that draft_tokens[i] was sampled from; None for
        deterministic drafts (point masses)."""
    gamma = len(draft_tokens)
    if target_probs.shape[0] != gamma + 1:
        raise ValueError(f"target_probs needs γ+1 = {gamma + 1} rows, got {target_probs.shape[0]}")
    if draft_probs is not None and draft_probs.shape[0] < gamma:
        raise ValueError(f"draft_probs needs γ = {gamma} rows, got {draft_probs.shape[0]}")
    tokens = (-1, *(int(t) for t in draft_tokens))          # the root's token is never read
    children = tuple((i + 1,) for i in range(gamma)) + ((),)
    q_row = None if draft_probs is None else draft_probs.__getitem__
    return _walk(tokens, children, target_probs.__getitem__, q_row, False, generator)


def _walk(tokens: Sequence[int], children: Sequence[Sequence[int]],
          target_probs: Callable[[int], torch.Tensor], q_row: Callable[[int], torch.Tensor] | None,
          without_replacement: bool, generator: torch.Generator | None) -> AcceptResult:
    device = generator.device if generator is not None else "cpu"
    uniforms = torch.rand(len(tokens), generator=generator, device=device).tolist()  # host sync
    accepted, u = [], 0
    while True:
        p = target_probs(u)                                                       # [V]
        q_u = None if q_row is None or not children[u] else q_row(u)              # [V]
        nxt, p = _try_children(p, q_u, [(c, tokens[c]) for c in children[u]],
                               without_replacement, uniforms)
        if nxt is None:
            # Every child rejected: p is the final residual. No children: p is p_u (bonus).
            token = torch.multinomial(p, 1, generator=generator)
            return AcceptResult(tuple(accepted), int(token))                      # host sync
        accepted.append(nxt)
        u = nxt


def _try_children(p: torch.Tensor, q_u: torch.Tensor | None, candidates: list[tuple[int, int]],
                  without_replacement: bool, uniforms: list[float]) -> tuple[int | None, torch.Tensor]:
    """Try (node, token) candidates in order against p. Returns (accepted node, p) or
    (None, the residual left after rejecting them all)."""
    tried: list[int] = []
    for c, x in candidates:
        q = _proposal(q_u, tried, without_replacement)      # None: point mass δ(x)
        px = float(p[x])                                      # host sync (one per candidate)
        qx = 1.0 if q is None else float(q[x])
        if qx <= 0.0:
            raise ValueError(f"the drafter proposed token {x}, which its own distribution "
                             f"gives probability {qx}: the proposal was not drawn from q")
        # u ~ U[0, 1), so P(u·q(x) < p(x)) = min(1, p(x)/q(x)). No division, and a token the
        # target's truncation removed (p(x) = 0) is never accepted.
        if uniforms[c] * qx < px:
            return c, p
        tried.append(x)
        p = _residual(p, q, tried)
    return None, p


def _proposal(q_u: torch.Tensor | None, tried: list[int], without_replacement: bool) -> torch.Tensor | None:
    """q_i for the next candidate; None means the point mass on it."""
    if q_u is None or not without_replacement or not tried:
        return q_u
    # q_i = q_u without the earlier siblings, renormalised: the distribution the drafter's
    # i-th draw without replacement actually came from.
    q = q_u.clone()
    q[tried] = 0.0
    return q / q.sum().clamp_min(torch.finfo(q.dtype).tiny)


def _residual(p: torch.Tensor, q: torch.Tensor | None, tried: list[int]) -> torch.Tensor:
    """normalize(max(0, p - q)) after rejecting tried[-1]; `tried` holds every token rejected
    at this node so far. For a point mass max(0, p - δ(x)) is p with x zeroed (p(x) <= 1)."""
    if q is None:
        r = p.clone()
        r[tried[-1]] = 0.0
    else:
        r = (p - q).clamp_min(0.0)
    mass = r.sum()
    # Guard (see _MIN_RESIDUAL_MASS): when the mass is rounding noise, fall back to p
    # without the tokens rejected here, which keeps the exact residual's one structural
    # property (zero on rejected tokens); if even that is empty, p itself. torch.where
    # keeps this free of host syncs.
    fallback = p.clone()
    fallback[tried] = 0.0
    fb_mass = fallback.sum()
    tiny = torch.finfo(p.dtype).tiny
    fallback = torch.where(fb_mass > 0, fallback / fb_mass.clamp_min(tiny), p)
    return torch.where(mass > _MIN_RESIDUAL_MASS, r / mass.clamp_min(tiny), fallback)
