"""The EAGLE-3 drafter: a trained head drafts a dynamic token tree from the target's features.

Per request the drafter keeps the head's own KV cache (one entry per target position
t, computed from the pair (target hidden at t, token t+1)) and the target hidden states
it has not consumed yet. Each step:
1. catch up: every new target position (prefill chunks, the last accepted path) becomes a
   head KV entry; the last one (the pair ending in the tree root) gives the root's output;
2. expand an EAGLE-2 dynamic tree (`tree.builders.dynamic_tree`): each round runs the head
   on the chosen frontier nodes; a node at depth d sits at position root - 1 + d and
   attends to the context entries plus its own ancestors. Draft-tree KV is temporary: the
   accepted tokens re-enter next step from the target's real hidden states.
Proposals are deterministic (top-k), so acceptance uses point masses: exact at any
temperature. Prefix-cached positions never pass through the target, so the head simply
has no entries for them (slightly lower acceptance, never a wrong output).

LoRA: requests under a served adapter are drafted by the base's head, unless the drafter was
given a head of the adapter's own (`load_lora`: a head trained on the adapted model's states,
tapping the same target layers; `EngineConfig.draft_lora_modules`). A request keeps one head.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from drafters.base import DraftRequest, Drafter, Proposal, TargetHidden
from drafters.config import SpecConfig
from drafters.eagle3.draft_layers import draft_form
from drafters.eagle3.format import load_head
from drafters.eagle3.head import Eagle3Head
from drafters.registry import register_drafter
from tree.builders import DynamicTreeConfig, dynamic_tree
from tree.token_tree import TokenTree
from verifier.model.loader import ALIASES, resolve_model_dir

CATCH_UP_CHUNK = 512
SHIPPED_HEADS = Path(__file__).parent / "heads"      # one folder per model alias it was trained for


@dataclass
class _SeqState:
    k: torch.Tensor                       # [capacity, kvh, D] head keys (rotated)
    v: torch.Tensor
    length: int = 0                       # head KV entries in use
    next_pos: int = 0                     # target position of the next pair to consume
    pending: list[TargetHidden] = field(default_factory=list)
    root_out: torch.Tensor | None = None  # head output of the newest pair [H]
    root_pos: int = -1                    # target position of that pair
    head: Eagle3Head | None = None        # the head drafting it (its adapter's or the base's)


class Eagle3Drafter(Drafter):
    name = "eagle3"
    drafts_per_node = True      # a tree level costs the head a pass over its weights

    def __init__(self, head: Eagle3Head, load: Callable[[Path], Eagle3Head] | None = None):
        """`load`: a head folder -> its head, ready as this one (for adapters' own heads)."""
        self.head, self._load = head, load
        self.capture_layers = tuple(head.cfg.aux_layer_ids)
        self.state: dict[int, _SeqState] = {}
        self.heads: dict[str, Eagle3Head] = {}     # a served adapter's own head, by its name

    # ---- LoRA ---------------------------------------------------------------------------
    def load_lora(self, name: str, path: str, *limits) -> None:
        """Draft requests under the served adapter `name` with the head at `path` (a head trained on
        the adapted model; `limits`, the LoRA ones, do not apply to a head). ValueError where it taps
        other target layers or keeps another KV shape than this drafter's head."""
        if self._load is None:
            raise ValueError("this EAGLE-3 drafter was built from a head in memory: it cannot load another")
        head = self._load(Path(path))
        c, own = head.cfg, self.head.cfg
        if tuple(c.aux_layer_ids) != self.capture_layers or (c.num_kv_heads, c.head_dim) != (own.num_kv_heads,
                                                                                              own.head_dim):
            raise ValueError(f"EAGLE-3 head {path} for adapter {name!r}: taps layers {list(c.aux_layer_ids)} with "
                             f"{c.num_kv_heads} x {c.head_dim} KV heads; the drafter's head taps "
                             f"{list(self.capture_layers)} with {own.num_kv_heads} x {own.head_dim}")
        self.heads[name] = head

    def unload_lora(self, name: str) -> None:
        self.heads.pop(name, None)

    # ---- state --------------------------------------------------------------------------
    def observe(self, states: list[TargetHidden]) -> None:
        for s in states:
            st = self.state.get(s.seq_id)
            if st is None:
                st = self.state[s.seq_id] = self._new_state(s.start)
            st.pending.append(s)

    def release(self, seq_id: int) -> None:
        self.state.pop(seq_id, None)

    def _new_state(self, start: int) -> _SeqState:
        c, h = self.head.cfg, self.head
        empty = torch.empty(256, c.num_kv_heads, c.head_dim, dtype=h.dtype, device=h.norm.weight.device)
        return _SeqState(empty, torch.empty_like(empty), next_pos=start)

    # ---- propose ------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, reqs: list[DraftRequest]) -> list[Proposal]:
        return [self._propose_one(r) for r in reqs]

    def _propose_one(self, r: DraftRequest) -> Proposal:
        st = self.state.get(r.seq_id)
        root_tok = r.token_ids[-1]
        if st is None:
            return Proposal(TokenTree.chain(root_tok, []))
        if st.head is None:
            st.head = self.heads.get(r.adapter, self.head)
        self._catch_up(st, r.token_ids)
        if st.root_out is None or st.root_pos != len(r.token_ids) - 2:
            return Proposal(TokenTree.chain(root_tok, []))   # the target has not caught up yet
        # n nodes reach depth n at most: a smaller cap (the cost model's) saves the deeper levels
        cfg = DynamicTreeConfig(depth=min(r.max_depth, r.max_nodes), topk=r.topk, budget=r.max_nodes)
        tree, _ = dynamic_tree(root_tok, _Expander(st.head, st, cfg.topk), cfg)
        return Proposal(tree)

    def _catch_up(self, st: _SeqState, token_ids: list[int]) -> None:
        """Turn pending target states into head KV entries, CATCH_UP_CHUNK rows at a time."""
        if not st.pending:
            return
        parts = []
        for s in st.pending:
            if s.start > st.next_pos:        # a gap (never expected): the head skips those positions
                st.next_pos = s.start
            skip = st.next_pos - s.start      # rows already consumed
            if skip < len(s.hidden):
                parts.append(s.hidden[skip:])
                st.next_pos = s.start + len(s.hidden)
        st.pending.clear()
        if not parts:
            return
        aux = torch.cat(parts)
        first = st.next_pos - len(aux)
        for a in range(0, len(aux), CATCH_UP_CHUNK):
            self._run_context(st, aux[a:a + CATCH_UP_CHUNK], first + a, token_ids)

    def _run_context(self, st: _SeqState, aux: torch.Tensor, start: int, token_ids: list[int]) -> None:
        head, m = st.head, len(aux)
        dev = aux.device
        positions = torch.arange(start, start + m, device=dev)
        nxt = torch.tensor(token_ids[start + 1:start + 1 + m], device=dev)   # token t+1 for pair t
        _ensure_capacity(st, st.length + m)
        causal = torch.ones(m, m, dtype=torch.bool, device=dev).tril()
        out = head.layer(head.embed(nxt), head.fuse(aux.to(head.dtype)), positions, (st.k, st.v, st.length),
                         (st.k[st.length:], st.v[st.length:]), m, causal)
        st.length += m
        st.root_out, st.root_pos = out[-1], start + m - 1


class _Expander:
    """`dynamic_tree`'s expand callback for one request: runs the head on frontier paths."""

    def __init__(self, head: Eagle3Head, st: _SeqState, topk: int):
        self.head, self.st, self.topk = head, st, topk
        self.nodes: dict[tuple[int, ...], int] = {}        # path -> slot in the tree's KV
        self.outs: dict[tuple[int, ...], torch.Tensor] = {(): st.root_out}
        c = head.cfg
        self.k = st.k.new_empty(8, c.num_kv_heads, c.head_dim)      # the tree's KV, grown as needed
        self.v = torch.empty_like(self.k)

    def __call__(self, paths: list[list[int]]) -> list[tuple[list[int], list[float]]]:
        keys = [tuple(p) for p in paths]
        new = [p for p in keys if p and p not in self.nodes]
        if new:
            self._run(new)
        rows = torch.stack([self.outs[p] for p in keys])
        logp = self.head.draft_logits(rows).float().log_softmax(-1)
        vals, idx = logp.topk(min(self.topk, logp.shape[-1]), dim=-1)
        ids = idx + self.head.d2t[idx]
        return [(i.tolist(), v.tolist()) for i, v in zip(ids, vals)]

    def _run(self, paths: list[tuple[int, ...]]) -> None:
        head, st = self.head, self.st
        dev = st.k.device
        parents = torch.stack([self.outs[p[:-1]] for p in paths])
        toks = torch.tensor([p[-1] for p in paths], device=dev)
        positions = torch.tensor([st.root_pos + len(p) for p in paths], device=dev)
        n_tmp, n = len(self.nodes), len(paths)
        if n_tmp + n > len(self.k):
            grown = max(n_tmp + n, 2 * len(self.k))
            self.k, self.v = (torch.cat([t, t.new_empty(grown - len(t), *t.shape[1:])]) for t in (self.k, self.v))
        mask = torch.zeros(n, n_tmp + n, dtype=torch.bool, device=dev)
        for i, p in enumerate(paths):
            for d in range(1, len(p)):
                mask[i, self.nodes[p[:d]]] = True
            mask[i, n_tmp + i] = True
        out = head.layer(head.embed(toks), parents, positions, (st.k, st.v, st.length), (self.k, self.v),
                         n_tmp + n, mask)
        for i, p in enumerate(paths):
            self.nodes[p] = n_tmp + i
            self.outs[p] = out[i]


def _ensure_capacity(st: _SeqState, need: int) -> None:
    if need <= len(st.k):
        return
    cap = max(need, 2 * len(st.k))
    for name in ("k", "v"):
        old = getattr(st, name)
        grown = old.new_empty(cap, *old.shape[1:])
        grown[:st.length] = old[:st.length]
        setattr(st, name, grown)


def shipped_head(model_dir: Path) -> Path:
    """The head shipped for the target in `model_dir` (one of the model aliases); else a ValueError."""
    for alias in ALIASES:
        head = SHIPPED_HEADS / alias
        if (head / "config.json").is_file() and _same_dir(_alias_dir(alias), model_dir):
            return head
    raise ValueError(f"no EAGLE-3 head is shipped for the target {model_dir} (only for "
                     f"{', '.join(a for a in ALIASES if (SHIPPED_HEADS / a).is_dir()) or 'none'}); "
                     "pass eagle3:PATH (train one with `train-drafter --kind eagle3`)")


def _alias_dir(alias: str) -> Path | None:
    try:
        return resolve_model_dir(alias)
    except ValueError:                   # the alias's package is not installed
        return None


def _same_dir(a: Path | None, b: Path) -> bool:
    return a is not None and a.resolve() == Path(b).resolve()


# Shallow and wide by default: each tree level costs the head a pass over its weights, and the
# shipped head (3 training-time-test steps) is accepted at depth 3 on about 1% of MT-bench steps
# (docs/eagle3.md). A deeper head asks for more with --gamma / speculation=SpecConfig(...).
DEFAULT_TREE = SpecConfig(num_speculative_tokens=2, topk=2, budget=4)


@register_drafter("eagle3", default_speculation=DEFAULT_TREE)
def build_eagle3(arg: str, target, speculation) -> Eagle3Drafter:
    load = _head_loader(target)
    return Eagle3Drafter(load(Path(arg) if arg else shipped_head(target.model_dir)), load)


def _head_loader(target) -> Callable[[Path], Eagle3Head]:
    """A head folder -> its head, drafting on `target`'s device in the form fitting it."""
    # On the CPU the head drafts on its weights in int8 (or bf16): a draft level reads all of
    # them from memory, so its time follows their bytes (docs/eagle3.md).
    form = draft_form(target.device)
    dtype = torch.bfloat16 if form == "bf16" else torch.float32 if form else target.dtype

    def load(path: Path) -> Eagle3Head:
        head = load_head(path, target.config, device=target.device, dtype=dtype, target_head=target.output_table)
        if form:
            head.for_drafting(form)
        head.use_target_embedding(target.input_embedding())   # whole, also under TP (rank 0 drafts)
        return head
    return load
