"""Grammar constraints inside a speculative step (docs/structured.md).

Three rules keep a constrained request exact under speculation, that is, distributed as
plain decoding from the target's masked, renormalised distribution:

1. Every tree node u gets the mask of the grammar state after u's path (`Matcher.tree_masks`),
   and the target's logits at u are masked with it before acceptance: p_u is masked.
2. A drafted child outside its parent's mask is pruned with its subtree before the target
   runs. Pruning depends only on the child's own token, so what is kept of a sampling
   drafter's draws was drawn from q masked and renormalised, and acceptance must use that
   q (rule 3); what is pruned would have had p = 0 and been rejected anyway. For a
   deterministic drafter (point masses) any candidates are exact.
3. A sampling drafter's q_u is masked with u's row and renormalised. Masking p and not q
   would accept kept children too rarely: q(x) counts mass on tokens that can never be
   kept (tests/engine/test_structured_exactness.py breaks this rule on purpose and fails).

Jump-forward: where the grammar forces the next characters, the tokens spelling them are
a chain drafted for free (`forced_proposal`), with a drafter's tree below it where the
drafter proposes from tokens alone (`Drafter.drafts_ahead`: n-gram and datastore). A token
the grammar alone allows has p = 1 after masking and is always accepted; a forced string's
tokens are point-mass drafts, accepted as often as the target would spell the string that
way, and exact either way.
"""
from __future__ import annotations

import torch

from drafters.base import DraftDistributions, Proposal
from spec.faults import NO_TOKEN_ALLOWED, RequestFault
from spec.plan import SeqPlan
from tree.token_tree import TokenTree
from verifier.sampling.grammar import Matcher, allowed_tokens, allows, sole_tokens

MAX_FORCED = 16      # forced tokens per step: each is a verify row (and a KV slot reserved ahead)


def forced_proposal(root: int, forced: list[int], below: TokenTree | None = None) -> Proposal:
    """The grammar's forced tokens as a chain below the request's last token, and a drafter's
    tree `below` its last one (rooted at that token; its nodes point masses)."""
    chain = TokenTree.chain(root, forced)
    return Proposal(chain if below is None else chain.grafted(len(forced), below))


def constrain_plan(plan: SeqPlan) -> None:
    """A constrained request's masks, one per row it samples from; its tree pruned to them."""
    matcher = plan.request.grammar
    if plan.proposal is None:
        plan.masks = matcher.mask()
        if not plan.masks.any():
            raise RequestFault(NO_TOKEN_ALLOWED)
    else:
        plan.proposal, plan.masks = constrain(plan.proposal, matcher)
    plan.sole = sole_tokens(plan.masks)


def constrain(proposal: Proposal, matcher: Matcher) -> tuple[Proposal, torch.Tensor]:
    """The proposal without the nodes the grammar forbids, and the bitmask of each kept node
    (int32 [kept nodes, W]); a sampling drafter's q rows masked and renormalised."""
    masks = matcher.tree_masks(proposal.tree)
    if not masks[0].any():      # the state the request is in allows nothing: it fails alone
        raise RequestFault(NO_TOKEN_ALLOWED)
    keep = kept_nodes(proposal.tree, masks)
    tree, old = proposal.tree.pruned(keep) if not all(keep) else (proposal.tree, list(range(len(keep))))
    masks = masks if len(old) == len(keep) else masks[old]
    # A kept node that allows nothing after the stop token: the request ends there and what
    # acceptance samples after it is never emitted, but its p must stay a distribution. One
    # that allows nothing after another token is a dead end of the grammar (a character no
    # token spells): its row stays empty, and the request fails there if acceptance reaches it.
    ended = torch.tensor([t in matcher.stop_ids for t in tree.tokens], dtype=torch.bool)
    masks[(masks == 0).all(-1) & ended] = -1
    draft = proposal.draft
    if draft is not None:
        draft = DraftDistributions(masked_q(draft.probs[old], masks), draft.mode)
    return Proposal(tree, draft), masks


def kept_nodes(tree: TokenTree, masks: torch.Tensor) -> list[bool]:
    """Per node: its whole path lies in the grammar (each token allowed by its parent's row)."""
    keep = [True] * tree.num_nodes
    for i in range(1, tree.num_nodes):
        keep[i] = keep[tree.parents[i]] and allows(masks, tree.parents[i], tree.tokens[i])
    return keep


def masked_q(probs: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """q [N, V] restricted to each row's allowed tokens and renormalised (a row with no
    allowed mass stays zero: its children were all pruned)."""
    q = probs * allowed_tokens(masks.to(probs.device), probs.shape[-1])
    return q / q.sum(-1, keepdim=True).clamp_min(torch.finfo(q.dtype).tiny)
