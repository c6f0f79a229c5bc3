"""Small-model drafter: a Llama-family checkpoint with the target's tokenizer and its own
paged KV cache.

Per step, for all speculating requests at once:
1. catch up: run the tokens the draft cache lacks (the accepted path and the root) as one
   chunk per request; its last logits are the depth-1 draft distribution;
2. chain mode (topk = 1): draft one token per round, feeding it back (`depth` forwards
   in all). Greedy requests take the argmax (a point mass); sampled requests draw from
   the draft distribution with the request's temperature/top-k/top-p, reported to
   acceptance as q;
3. tree mode (topk > 1): EAGLE-2-style dynamic expansion (tree.builders.dynamic_tree);
   each round re-runs the partial tree below the root under its ancestor mask.
   Top-k children are deterministic, so acceptance treats them as point masses.
Draft KV of accepted chain tokens is kept; everything else is recomputed next step.

LoRA: a request under a served adapter is drafted by the base draft model, unless the drafter was
given its own adapter for that name (`load_lora`; `EngineConfig.draft_lora_modules`). The target's
verify keeps the output the adapted model's either way; the draft's adapter only raises acceptance.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from drafters.base import DraftDistributions, DraftRequest, Drafter, PrefillChunk, Proposal
from drafters.config import SpecConfig
from drafters.registry import register_drafter
from tree.builders import DynamicTreeConfig, dynamic_tree
from tree.token_tree import TokenTree
from verifier.batch import ForwardBatch, SeqInput
from verifier.block_manager import BlockManager, BlockManagerConfig
from verifier.model.loader import resolve_model_dir
from verifier.model.lora import LoraSet
from verifier.quantized.quantize import auto_quantization
from verifier.sampling.sampler import target_probs, transform_logits
from verifier.target import TargetModel


CATCH_UP_CHUNK = 512   # tokens per draft forward when catching up a long gap


@dataclass
class _SeqState:
    computed: int = 0                                   # leading tokens with KV in the draft cache
    drafted: list[int] = field(default_factory=list)    # chain tokens written after `computed`


class SmallModelDrafter(Drafter):
    name = "small"
    drafts_per_node = True

    def __init__(self, path: str, target: TargetModel, speculation, deterministic: bool = False):
        if not path:
            raise ValueError("the small drafter needs a model: 'small:PATH'")
        # The draft runs on its file's own blocks where it has them (a GGUF's int4), whatever the
        # target's precision: a proposal need only be cheap, the target's verify keeps the output.
        quantization = auto_quantization(resolve_model_dir(path), target.device)
        self.model = TargetModel(path, device=str(target.device), quantization=quantization,
                                 dtype=target.dtype if quantization == "none" else None)
        _check_same_tokenizer(self.model, target, path)
        self.spec = speculation
        self.deterministic = deterministic or speculation.topk > 1
        bs = target.kv.block_size
        self.model.allocate_kv(target.kv.num_blocks, bs)
        self.blocks = BlockManager(BlockManagerConfig(target.kv.num_blocks, bs, enable_prefix_cache=False))
        self.state: dict[int, _SeqState] = {}
        self.lora: LoraSet | None = None      # the draft model's own adapters, by the served adapters' names

    # ---- LoRA -----------------------------------------------------------------------------
    def load_lora(self, name: str, path: str, max_loras: int, max_rank: int, dtype: torch.dtype) -> None:
        """Draft requests under the served adapter `name` with the draft model's adapter at `path`."""
        if self.lora is None:
            self.lora = self.model.enable_lora(max_loras, max_rank, dtype)
        self.lora.load(name, path)

    def unload_lora(self, name: str) -> None:
        if self.lora is not None and name in self.lora.slots:
            self.lora.unload(name)

    def _slot(self, adapter: str | None) -> int:
        """The draft model's slot for requests under `adapter` (0: the base)."""
        return self.lora.slots.get(adapter, 0) if self.lora is not None and adapter else 0

    # ---- bookkeeping ----------------------------------------------------------------------
    def _table(self, req: DraftRequest, extra: int) -> list[int]:
        st = self.state.setdefault(req.seq_id, _SeqState())
        if st.computed > len(req.token_ids) - 1:   # the request was preempted and restarted
            st.computed, st.drafted = 0, []
        need = len(req.token_ids) + extra
        if not self.blocks.has(req.seq_id):
            self.blocks.allocate(req.seq_id, req.token_ids[:1])
        self.blocks.ensure_slots(req.seq_id, need)
        return self.blocks.block_table(req.seq_id)

    def _reuse_drafted(self, req: DraftRequest) -> None:
        """Accepted chain tokens already have draft KV: skip them in the catch-up."""
        st = self.state[req.seq_id]
        keep = 0
        for tok, actual in zip(st.drafted, req.token_ids[st.computed:len(req.token_ids) - 1]):
            if tok != actual:
                break
            keep += 1
        st.computed += keep
        st.drafted = []

    def prefill(self, chunks: list[PrefillChunk]) -> None:
        """Run the target's prompt chunks through the draft model too (same chunking)."""
        seqs = []
        for c in chunks:
            st = self.state.setdefault(c.seq_id, _SeqState())
            if st.computed != c.start:        # out of step (e.g. a prefix-cache hit): catch up later
                continue
            if not self.blocks.has(c.seq_id):
                self.blocks.allocate(c.seq_id, c.token_ids[:1])
            self.blocks.ensure_slots(c.seq_id, c.end)
            seqs.append(SeqInput(c.token_ids[c.start:c.end], c.start, self.blocks.block_table(c.seq_id),
                                 logits_indices=[], adapter=self._slot(c.adapter)))
            st.computed = c.end
        if seqs:
            self.model.forward(ForwardBatch(seqs), chunk_invariant=False)

    def release(self, seq_id: int) -> None:
        self.state.pop(seq_id, None)
        if self.blocks.has(seq_id):
            self.blocks.free(seq_id)

    # ---- propose --------------------------------------------------------------------------
    def propose(self, reqs: list[DraftRequest]) -> list[Proposal]:
        tables = [self._table(r, r.max_nodes + 1) for r in reqs]
        for r in reqs:
            self._reuse_drafted(r)
        first = self._catch_up(reqs, tables)                       # [B, V] logits at the roots
        trees = [i for i, r in enumerate(reqs) if self.deterministic and r.topk > 1]
        chains = [i for i in range(len(reqs)) if i not in trees]
        out: list[Proposal | None] = [None] * len(reqs)
        for i in trees:
            out[i] = self._tree(reqs[i], tables[i], first[i])
        if chains:
            for i, prop in zip(chains, self._chains([reqs[i] for i in chains], [tables[i] for i in chains],
                                                    first[chains])):
                out[i] = prop
        return out

    def _catch_up(self, reqs, tables) -> torch.Tensor:
        """Bring every request's draft KV up to its root; returns the roots' logits [B, V].
        Long gaps (a prefix-cache hit, a restart after preemption) go in CATCH_UP_CHUNK pieces."""
        for r, table in zip(reqs, tables):
            st = self.state[r.seq_id]
            while len(r.token_ids) - st.computed > CATCH_UP_CHUNK:
                end = st.computed + CATCH_UP_CHUNK
                self.model.forward(ForwardBatch([SeqInput(r.token_ids[st.computed:end], st.computed, table,
                                                          logits_indices=[], adapter=self._slot(r.adapter))]),
                                   chunk_invariant=False)
                st.computed = end
        seqs = []
        for r, table in zip(reqs, tables):
            st = self.state[r.seq_id]
            seqs.append(SeqInput(r.token_ids[st.computed:], st.computed, table, adapter=self._slot(r.adapter)))
            st.computed = len(r.token_ids)
        return self.model.forward(ForwardBatch(seqs), chunk_invariant=False).logits

    def _chains(self, reqs, tables, logits) -> list[Proposal]:
        depth = max(r.max_depth for r in reqs)
        drafted = [[] for _ in reqs]
        qrows = [[] for _ in reqs]
        for d in range(depth):
            live = [i for i, r in enumerate(reqs) if d < r.max_depth]
            for row, i in enumerate(live):
                tok, q = self._pick(reqs[i], logits[row], drafted[i])
                drafted[i].append(tok)
                qrows[i].append(q)
            if d + 1 == depth or not any(d + 1 < reqs[i].max_depth for i in live):
                break
            live = [i for i in live if d + 1 < reqs[i].max_depth]
            seqs = [SeqInput([drafted[i][-1]], len(reqs[i].token_ids) + d, tables[i],
                             adapter=self._slot(reqs[i].adapter)) for i in live]
            logits = self.model.forward(ForwardBatch(seqs)).logits
        props = []
        for r, toks, qs in zip(reqs, drafted, qrows):
            self.state[r.seq_id].drafted = toks[:-1]    # the last one has no KV yet
            tree = TokenTree.chain(r.token_ids[-1], toks)
            props.append(Proposal(tree, None if qs[0] is None else _chain_q(qs)))
        return props

    def _pick(self, req: DraftRequest, logits: torch.Tensor, path: list[int]) -> tuple[int, torch.Tensor | None]:
        """The next chain token after `path` (drafted so far) and the q it was drawn from: the
        target's transform (bias, min_tokens, penalties over the output and the path), so q
        leans where p does."""
        if req.params.has_logit_transform:
            output = req.token_ids[req.num_prompt:] + path
            logits = transform_logits(logits, req.params, req.token_ids[:req.num_prompt], output, req.held_back)
        if self.deterministic or req.params.greedy:
            return int(logits.argmax()), None
        q = target_probs(logits[None], req.params)[0]
        return int(torch.multinomial(q, 1, generator=req.generator)), q

    def _tree(self, req: DraftRequest, table: list[int], root_logits: torch.Tensor) -> Proposal:
        base = len(req.token_ids)            # the root's KV is now cached at base - 1
        cfg = DynamicTreeConfig(depth=req.max_depth, topk=req.topk, budget=req.max_nodes)

        def expand(paths: list[list[int]]) -> list[tuple[list[int], list[float]]]:
            if paths == [[]]:
                return [_topk(root_logits, cfg.topk)]
            tree = TokenTree.from_paths(req.token_ids[-1], paths)
            nodes = tree.tokens[1:]
            fwd = self.model.forward(ForwardBatch([SeqInput(
                list(nodes), base, table, positions=[base - 1 + d for d in tree.depths[1:]],
                mask=tree.ancestor_mask()[1:, 1:], logits_indices=list(range(len(nodes))),
                adapter=self._slot(req.adapter))]))
            out = []
            for p in paths:
                node = _find(tree, p)
                out.append(_topk(fwd.logits[node - 1], cfg.topk))
            return out

        tree, _ = dynamic_tree(req.token_ids[-1], expand, cfg)
        return Proposal(tree)


def _find(tree: TokenTree, path: list[int]) -> int:
    node = 0
    for tok in path:
        node = tree.child_with_token(node, tok)
    return node


def _topk(logits: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
    lp = torch.log_softmax(logits.float(), dim=-1)
    vals, idx = lp.topk(k)
    return idx.tolist(), vals.tolist()


def _chain_q(rows: list[torch.Tensor]) -> DraftDistributions:
    # Row u is the distribution node u's child was drawn from; the leaf has none.
    probs = torch.stack(rows + [torch.zeros_like(rows[0])])
    return DraftDistributions(probs=probs, mode="iid")


def _check_same_tokenizer(draft: TargetModel, target: TargetModel, path: str) -> None:
    dv, tv = draft.tokenizer, target.tokenizer
    same = getattr(dv, "vocab", None) == getattr(tv, "vocab", None) and \
        draft.config.vocab_size == target.config.vocab_size
    if not same:
        raise ValueError(f"draft model {path} does not share the target's tokenizer "
                         f"(vocab {draft.config.vocab_size} vs {target.config.vocab_size}, or different tokens)")


# A chain of up to 8: the adaptive controller drafts each step what its acceptance pays for
# (`AdaptiveController.nodes_to_draft`), so the default is a cap, not a length.
@register_drafter("small", default_speculation=SpecConfig(num_speculative_tokens=8))
def _build(arg: str, target, speculation) -> SmallModelDrafter:
    return SmallModelDrafter(arg, target, speculation)
