"""The quantized CPU runner: a target's weights in the GGUF's own blocks (or quantized at load),
on Tercel's kernels (`verifier/runner.py` gives the contract it keeps).

At load: the decoder's linears are read from the file one at a time and packed for their own
kernels (`verifier/quantized/quantize.py`), the kernels timed on the first layer and the fastest
kept (`KernelPlan`; a later load of the file reads it back, `verifier/quantized/plan_memo.py`),
attention's parallel threshold timed
(`verifier/quantized/attention_tuning.py`), and the layer loop built as one native call where it
compiles (`verifier/quantized/cpu_loop.py`). No dense copy of a weight is made.

Per forward each sequence splits at its first sampled token: the tokens before it (prompt
rows) run first, their attention on the prompt path (AMX tiles where the CPU has them); the
sampled ones (a prompt's last token, decode steps, tree nodes) after them, in the native loop.
Every matmul runs on the weights' own row-invariant kernels, so a prompt's KV is the same however
it is chunked (`verifier/quantized/cpu_forward.py`).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from verifier.attention.kv_cache import KVCache
from verifier.batch import ForwardBatch, ForwardOutput, SeqInput, flatten
from verifier.memory import tensor_bytes
from verifier.model.lora import PROJECTIONS, LoraSet, adapter_rows
from verifier.model.moe import SparseMoeBlock
from verifier.quantized.attention_tuning import AttentionTimings
from verifier.quantized.attention_tuning import tune as tune_attention
from verifier.quantized.cpu_forward import cpu_heads, cpu_layers, forward_rows, layer_kind, own_matmul, row_plan
from verifier.quantized.cpu_loop import native_layers
from verifier.quantized.matmul_paths import CHOICE_ROWS, KernelPlan, KernelTimings
from verifier.quantized.qlinear import QuantEmbedding, QuantLinear
from verifier.quantized.plan_memo import recall
from verifier.quantized.quantize import block_params, kernel_sources, quantize_model, tune
from verifier.runner import RunnerSettings


class QuantizedRunner:
    """`plan` and `timings`: the decoder matmuls' paths and what they measured;
    `attention_timings`; `layers`, `heads`: the layers' and attention's views for the C kernels;
    `native`: the layer loop in one C++ call (None where it does not build, or for layers it
    does not serve)."""

    @staticmethod
    def dtypes(device: torch.device, dtype: torch.dtype | None) -> tuple[torch.dtype, torch.dtype]:
        # The residual stream stays fp32 and the kernels take bf16 inputs. The KV cache is bf16, as
        # vLLM's is for a bf16 model: v is a bf16 matmul output already, and decode attention is
        # bound by reading the cache (docs/quantization.md).
        return dtype or torch.float32, torch.bfloat16

    @staticmethod
    def unloaded_params(model_dir: Path, model_type: str) -> frozenset[str]:
        """The parameters served from the file's own blocks (`quantize_model` reads them): never
        allocated dense."""
        return block_params(model_dir, model_type)

    def __init__(self, net: nn.Module, settings: RunnerSettings):
        s = settings
        if s.backend not in (None, "torch"):
            raise ValueError(f"quantization {s.quantization!r} attends with Tercel's CPU kernels, not {s.backend!r}")
        self.net = net
        self.plan: KernelPlan
        self.timings: KernelTimings
        first = net.model.layers[0].mlp
        moe = first.moe.top_k if isinstance(first, SparseMoeBlock) else None     # before it is quantized

        rows, key = s.kernel_rows or CHOICE_ROWS, {"quantization": s.quantization}

        def choose(layer: list[QuantLinear], scan: QuantLinear) -> KernelPlan:
            self.plan, self.timings = tune(layer, scan, rows, key, s.cache_dir, s.retime, s.tune_threads, moe,
                                           s.model_dir)
            return self.plan
        known = None if s.retime else recall(s.model_dir, key, rows, kernel_sources(), s.cache_dir, s.tune_threads)
        if known is not None:
            self.plan, self.timings = known
        self.decoder, _ = quantize_model(net, net.cfg, s.quantization, s.model_dir, choose, known and known[0])
        self.layers = cpu_layers(net)
        self.heads = cpu_heads(net)
        self.attention_timings: AttentionTimings = tune_attention(self.heads, s.cache_dir, s.retime, s.tune_threads)
        self.native = native_layers(net.cfg, self.heads, self.layers, net.model.norm, net.lm_head)
        self.lora: LoraSet | None = None
        self._sites: dict[int, tuple[int, str]] = {}      # id(QuantLinear) -> (layer, projection)
        self._native_lora = -1                            # the LoraSet version the native loop's tables are

    def attach_lora(self, lora: LoraSet) -> None:
        """Serve `lora`'s adapters: each projection's own kernel, then its adapted rows' products
        (csrc/lora.c), in the native loop (its tables pushed when the adapters change) and in the
        Python layers alike."""
        self._sites = {id(lin): (i, name) for i, layer in enumerate(self.layers)
                       for name, lin in zip(PROJECTIONS, (layer.qkv, layer.o, layer.gate_up, layer.down))}
        self.lora = lora

    def _adapted(self, lin: QuantLinear, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        return self.lora.add_c(*self._sites[id(lin)], x, own_matmul(lin, x, bias))

    def memory_parts(self) -> tuple[int, int, int]:
        """Bytes held: (the decoder's packed projections, the embedding and head tables with the
        head's scan, everything else: norms, biases, routers, rotary tables)."""
        net, head = self.net, self.net.lm_head
        decoder = {id(lin) for lin in self.decoder} | {id(head.scan)}
        tables = head.scan.nbytes() + tensor_bytes([*net.model.embed_tokens.buffers(), *head.table.buffers()])
        routers, rest = 0, []
        for m in net.modules():
            if isinstance(m, QuantLinear):
                routers += 0 if id(m) in decoder else m.nbytes()          # with its bias
            elif not isinstance(m, QuantEmbedding):
                rest += [*m.parameters(recurse=False), *m.buffers(recurse=False)]
        return sum(lin.nbytes() for lin in self.decoder), tables, routers + tensor_bytes(rest)

    @contextmanager
    def one_layer_per_kind(self) -> Iterator[None]:
        """Forwards inside run the first layer of each kind (`layer_kind`), then the final norm and
        the head: every kernel on every shape a whole forward runs, in a fraction of its time, for a
        check of the kernels' bits (the thread governor's, spec/preparation.py). Their KV goes to
        the first layers' slots."""
        firsts: dict[tuple, object] = {}
        for layer in self.layers:
            firsts.setdefault(layer_kind(layer), layer)
        whole = self.layers, self.native
        self.layers = list(firsts.values())
        if self.native is not None:
            self.native = native_layers(self.net.cfg, self.heads, self.layers, self.net.model.norm, self.net.lm_head)
        try:
            yield
        finally:
            self.layers, self.native = whole

    def forward(self, batch: ForwardBatch, kv: KVCache, chunk_invariant: bool = True) -> ForwardOutput:
        """The prompt rows' forward, then the sampled rows', outputs in batch order. Every row runs
        on row-invariant kernels: `chunk_invariant` changes nothing here."""
        halves = [split_at_first_sample(s) for s in batch.seqs]
        parts = []
        for side in (0, 1):                                  # prompt rows first: the rest attends to them
            idx = [i for i, h in enumerate(halves) if h[side] is not None]
            if idx:
                sub = ForwardBatch([halves[i][side] for i in idx], batch.capture_layers)
                parts.append((side, idx, self.forward_rows(sub, kv, own=side == 1)))
        if len(parts) == 1 and all(h[parts[0][0]] is s for h, s in zip(halves, batch.seqs)):
            return parts[0][2]                # nothing was split: the output is already in order
        return _merge(batch, halves, parts)

    def forward_rows(self, batch: ForwardBatch, kv: KVCache, own: bool) -> ForwardOutput:
        """Every row of the batch as sampled rows (`own`: in the native loop where it is built) or
        as prompt rows (the layers in Python, attention on the prompt path)."""
        ids, _, rows, offsets = flatten(batch)
        cfg = self.net.cfg
        plan = row_plan(batch.seqs, kv.block_size, cfg.num_heads // cfg.num_kv_heads, prompt=not own)
        tokens = [t for s in batch.seqs for t in (s.logits_tokens or [None] * len(s.sample_indices))]
        with adapter_rows(self.lora, batch, torch.device("cpu")):
            adapted = self.lora is not None and self.lora.active
            if adapted and self.native is not None and self._native_lora != self.lora.version:
                self.native.set_lora([self.lora.table(i, p) for i in range(len(self.layers)) for p in PROJECTIONS])
                self._native_lora = self.lora.version
            logits, taps = forward_rows(self.net, self.heads, self.layers, torch.tensor(ids), plan,
                                        kv, torch.tensor(rows, dtype=torch.long), batch.capture_layers, own,
                                        self.native, tokens if any(t is not None for t in tokens) else None,
                                        self._adapted if adapted else None,
                                        self.lora.row_slots if adapted else None)
        return ForwardOutput(logits, offsets, taps)


def split_at_first_sample(seq: SeqInput) -> tuple[SeqInput | None, SeqInput | None]:
    """(the new tokens before the first sampled one, the rest): a prompt chunk's unsampled
    tokens and its last token; a decode step or a tree is all rest (so is a masked input)."""
    first = seq.first_sampled
    if first < 1 or seq.mask is not None:
        return None, seq
    if first == seq.num_new:
        return seq, None
    pos = seq.positions
    head = SeqInput(seq.token_ids[:first], seq.ctx_len, seq.block_table, pos and pos[:first], logits_indices=[],
                    adapter=seq.adapter)
    tail = SeqInput(seq.token_ids[first:], seq.ctx_len + first, seq.block_table, pos and pos[first:],
                    logits_indices=[i - first for i in seq.sample_indices], logits_tokens=seq.logits_tokens,
                    adapter=seq.adapter)
    return head, tail


def _merge(batch: ForwardBatch, halves: list[tuple[SeqInput | None, SeqInput | None]],
           parts: list[tuple[int, list[int], ForwardOutput]]) -> ForwardOutput:
    """The prompt-row and sampled-row forwards' outputs (`parts`: side, batch indices, output,
    prompt side first) in batch order; a sequence's prompt rows precede its sampled rows."""
    logits: list[list[torch.Tensor]] = [[] for _ in batch.seqs]
    hidden: list[list[dict[int, torch.Tensor]]] = [[] for _ in batch.seqs]
    for side, idx, out in parts:
        row = 0
        for j, i in enumerate(idx):
            rows = halves[i][side].num_new
            logits[i].append(out.seq_logits(j))
            hidden[i].append({layer: h[row:row + rows] for layer, h in out.hidden.items()})
            row += rows
    offsets = [0]
    for parts_i in logits:
        offsets.append(offsets[-1] + sum(p.shape[0] for p in parts_i))
    taps = {layer: torch.cat([h[layer] for seq in hidden for h in seq]) for layer in batch.capture_layers}
    return ForwardOutput(torch.cat([p for parts_i in logits for p in parts_i]), offsets, taps)
