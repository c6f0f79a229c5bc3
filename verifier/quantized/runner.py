"""The quantized CPU runner: a target's weights in the GGUF's own blocks (or quantized at load),
on Tercel's kernels (`verifier/runner.py` gives the contract it keeps).

At load: the decoder's linears are quantized and packed (`verifier/quantized/quantize.py`), their matmul
paths timed on this machine and the fastest kept per kind of row (`KernelPlan`), attention's
parallel threshold timed (`verifier/quantized/attention_tuning.py`), and the layer loop built as one
native call where it compiles (`verifier/quantized/cpu_loop.py`).

Per forward each sequence splits at its first sampled token: the tokens before it (prompt
rows) run first, on the plan's bulk path in whole tiles, so a prompt's KV is the same however
it is chunked; the sampled ones (a prompt's last token, decode steps, tree nodes) after them,
on the weights' own row-invariant kernels (`verifier/quantized/cpu_forward.py`).
"""
from __future__ import annotations

import torch
from torch import nn

from verifier.attention.kv_cache import KVCache
from verifier.batch import ForwardBatch, ForwardOutput, SeqInput
from verifier.quantized.attention_tuning import AttentionTimings
from verifier.quantized.attention_tuning import tune as tune_attention
from verifier.quantized.cpu_forward import cpu_heads, cpu_layers, forward_rows, row_plan
from verifier.quantized.cpu_loop import native_layers
from verifier.quantized.matmul_paths import KernelPlan, KernelTimings, engine_rows
from verifier.quantized.quantize import quantize_model, timed_linears, tune
from verifier.runner import RunnerSettings, flatten


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

    def __init__(self, net: nn.Module, settings: RunnerSettings):
        s = settings
        if s.backend not in (None, "torch"):
            raise ValueError(f"quantization {s.quantization!r} attends with Tercel's CPU kernels, not {s.backend!r}")
        self.net = net
        decoder = quantize_model(net, net.cfg, s.quantization, s.model_dir)
        self.plan: KernelPlan
        self.timings: KernelTimings
        self.plan, self.timings = tune(decoder, net.lm_head, s.kernel_rows or engine_rows(512),
                                       {"quantization": s.quantization}, s.cache_dir,
                                       s.retime, timed_linears(net), s.tune_threads)
        self.layers = cpu_layers(net)
        self.heads = cpu_heads(net)
        self.attention_timings: AttentionTimings = tune_attention(self.heads, s.cache_dir, s.retime, s.tune_threads)
        self.native = native_layers(net.cfg, self.heads, self.layers, net.model.norm, net.lm_head)

    def forward(self, batch: ForwardBatch, kv: KVCache, chunk_invariant: bool = True) -> ForwardOutput:
        """The prompt rows' forward, then the sampled rows', outputs in batch order.
        `chunk_invariant` False: a sequence with fewer prompt rows than the plan's `own_below`
        runs whole on the own kernels (faster; its KV then depends on its chunking)."""
        whole_below = 1 if chunk_invariant else self.plan.own_below
        halves = [split_at_first_sample(s, whole_below) for s in batch.seqs]
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
        """Every row of the batch on one path: the own kernels (`own`) or the plan's bulk path."""
        ids, _, rows, offsets = flatten(batch)
        cfg = self.net.cfg
        plan = row_plan(batch.seqs, kv.block_size, cfg.num_heads // cfg.num_kv_heads, prompt=not own)
        tokens = [t for s in batch.seqs for t in (s.logits_tokens or [None] * len(s.sample_indices))]
        logits, taps = forward_rows(self.net, self.heads, self.layers, torch.tensor(ids), plan,
                                    kv, torch.tensor(rows, dtype=torch.long), batch.capture_layers, own,
                                    self.native, tokens if any(t is not None for t in tokens) else None)
        return ForwardOutput(logits, offsets, taps)


def split_at_first_sample(seq: SeqInput, whole_below: int = 1) -> tuple[SeqInput | None, SeqInput | None]:
    """(the new tokens before the first sampled one, the rest): a prompt chunk's unsampled
    tokens and its last token; a decode step or a tree is all rest (so is a masked input, and
    one with fewer than `whole_below` tokens before its first sampled one)."""
    first = seq.first_sampled
    if first < whole_below or seq.mask is not None:
        return None, seq
    if first == seq.num_new:
        return seq, None
    pos = seq.positions
    head = SeqInput(seq.token_ids[:first], seq.ctx_len, seq.block_table, pos and pos[:first], logits_indices=[])
    tail = SeqInput(seq.token_ids[first:], seq.ctx_len + first, seq.block_table, pos and pos[first:],
                    logits_indices=[i - first for i in seq.sample_indices], logits_tokens=seq.logits_tokens)
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
