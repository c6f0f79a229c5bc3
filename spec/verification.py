"""The target's side of a step: one forward over every plan's new tokens (`forward`: prefill
chunks, plain decode tokens and whole trees in one ragged batch; a forward that raises is run
again without the requests that fail alone), and the commit of what was accepted (`commit`: a
tree's root and accepted path moved into consecutive KV slots).
"""
from __future__ import annotations

import logging

from spec.plan import SeqPlan
from spec.request import Request
from verifier.attention.kv_cache import slot_of
from verifier.batch import ForwardBatch, ForwardOutput, SeqInput
from verifier.block_manager import BlockManager
from verifier.sampling.grammar import few_allowed
from verifier.target import TargetModel

log = logging.getLogger("tercel.engine")


class Verification:
    def __init__(self, target: TargetModel, blocks: BlockManager, capture_layers: tuple[int, ...]):
        """`capture_layers`: the target layers whose hidden states the drafter reads."""
        self.target, self.blocks, self.capture_layers = target, blocks, capture_layers

    def forward(self, plans: list[SeqPlan]) -> ForwardOutput | None:
        """One target forward over every plan's new tokens (prefill chunks, plain decode tokens,
        whole trees), ragged and flattened in plan order: plan rows first_row .. + num_rows.
        Plans that failed earlier in the step are left out (None: no plan left). A forward
        that raises is run again without the plans that fail alone (`_isolate`)."""
        live = [p for p in plans if p.fault is None]
        try:
            return self._run(live)
        except Exception:   # noqa: BLE001 - attributed below, or raised again
            log.exception("target forward over %d sequences failed; looking for the request at fault", len(live))
            self._isolate(live)
        return self._run([p for p in live if p.fault is None])

    def _run(self, plans: list[SeqPlan]) -> ForwardOutput | None:
        if not plans:
            return None
        row = 0
        for plan in plans:
            plan.first_row, row = row, row + plan.num_rows
        fwd = self.target.forward(ForwardBatch([self._seq_input(p) for p in plans],
                                               capture_layers=self.capture_layers))
        for i, plan in enumerate(plans):
            plan.logits = fwd.seq_logits(i)    # a view of fwd.logits: [len(sample_indices), V]
        return fwd

    def _isolate(self, plans: list[SeqPlan]) -> None:
        """Fault each plan whose forward fails alone. Rewriting a plan's KV slots writes the
        same values, so a plan that passes alone is unchanged. When every plan fails, the fault
        is the request's only if a scratch forward still passes; otherwise it is the engine's
        and is raised (the server fails every request and reports itself unhealthy)."""
        failed = []
        for plan in plans:
            try:
                self._run([plan])
            except Exception as e:   # noqa: BLE001 - this plan's own failure
                failed.append((plan, e))
        if len(failed) == len(plans) and not self.probe():
            raise failed[0][1]
        for plan, e in failed:
            plan.fault = e

    def probe(self) -> bool:
        """Whether a one-token forward on scratch blocks passes (False also when no block is free)."""
        if self.blocks.blocks_needed(None, 1) > self.blocks.num_free_blocks:
            return False
        try:
            with self.blocks.scratch(-1, 1) as table:
                self.target.forward(ForwardBatch([SeqInput([0], 0, table, logits_indices=[0])]))
        except Exception:   # noqa: BLE001 - the answer is no
            log.exception("probe forward failed")
            return False
        return True

    def _seq_input(self, plan: SeqPlan) -> SeqInput:
        req, start = plan.request, plan.ctx_len
        table = self.blocks.block_table(req.seq_id)
        if plan.proposal is not None:
            tree = plan.proposal.tree       # root at slot `start`, node j at start + j
            return SeqInput(list(tree.tokens), start, table, positions=tree.positions(start),
                            mask=tree.ancestor_mask(), logits_indices=plan.logit_rows,
                            logits_tokens=self._few_allowed(plan, plan.logit_rows), adapter=req.adapter)
        # Logits of the last token only; none for a chunk with more of the prompt after it, or
        # where the grammar allows one token. The last token is a sampled row either way.
        n = plan.seq.num_new_tokens
        sampled = not plan.mid_prefill and plan.logit_rows
        return SeqInput(req.token_ids[start:start + n], start, table, logits_indices=None if sampled else [],
                        sampled_from=None if plan.mid_prefill else n - 1,
                        logits_tokens=self._few_allowed(plan, [0]) if sampled else None, adapter=req.adapter)

    def _few_allowed(self, plan: SeqPlan, rows: list[int]) -> tuple | None:
        """Per logits row of a constrained plan, the tokens its mask allows if they are few."""
        return None if plan.masks is None else few_allowed(plan.masks, rows, self.target.config.vocab_size)

    def commit(self, plans: list[SeqPlan]) -> None:
        """Advance each request's computed tokens. A tree keeps the KV of its root and accepted
        path, moved into consecutive slots; its rejected slots are truncated in emit, after the
        publish (or freed with the request if it finishes)."""
        for plan in plans:
            if plan.fault is not None:
                continue
            if plan.proposal is not None:
                self._commit_kv(plan.request, plan.accepted)
            else:
                plan.request.num_computed_tokens += plan.seq.num_new_tokens

    def _commit_kv(self, req: Request, accepted: tuple[int, ...]) -> None:
        """Accepted node j (verified at slot ctx + j) moves to slot ctx + depth; the rest is dropped."""
        ctx, table, bs = req.num_computed_tokens, self.blocks.block_table(req.seq_id), self.blocks.block_size
        moves = [(slot_of(table, ctx + j, bs), slot_of(table, ctx + d, bs))
                 for d, j in enumerate(accepted, start=1) if j != d]
        if moves:
            self.target.copy_slots([m[0] for m in moves], [m[1] for m in moves])
        req.num_computed_tokens = ctx + 1 + len(accepted)   # the root and the accepted path
