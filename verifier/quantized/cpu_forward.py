"""The forward of a quantized CPU target: the fused C kernels (`verifier.cpu.cpu_ops`) around
the quantized matmuls.

A row's results must not depend on what shares its forward or on how its prompt was
chunked: otherwise T=0 speculation and plain decoding drift apart at near-ties, which
bf16 activations make common. The C kernels compute norms, RoPE and attention row by row
in a fixed order; the matmuls are the weight's own int4/int8 kernel for every row, sampled
(decode steps, tree nodes, a prompt's last token: `own=True`, in the native loop where it is
built) or not (the rest of a prompt, `own=False`, see `verifier.quantized.matmul_paths`). One layer, T rows:

    h   = rms_norm(x += y)                   fp32 [T, H] residual -> bf16 [T, H]
    qkv = qkv_proj(h)                         bf16 [T, (NH + 2 NKV) D]
    q   = rope(q); cache[slots] = rope(k), v  fp32 [T, NH, D]  } one C call
    o   = attention(q, cache)                 bf16 [T, NH D]    }
    h   = rms_norm(x += o_proj(o))
    y   = down_proj(silu(gate) * up)          from gate_up_proj(h), bf16 [T, 2 I]

A mixture-of-experts layer computes y with `verifier.model.moe.cpu_moe` instead, on the same matmuls.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass, fields
from typing import Callable

import torch

from verifier.attention.kv_cache import KVCache
from verifier.batch import SeqInput
from verifier.cpu import cpu_ops
from verifier.model.llama import norm_qk
from verifier.model.moe import SparseMoeBlock, cpu_moe
from verifier.quantized.cpu_loop import NativeLayers
from verifier.quantized.gemma_cpu import GemmaCpuLayer, gemma_cpu_layers, gemma_forward_rows, gemma_heads
from verifier.quantized.qlinear import QuantLinear


def row_plan(seqs: list[SeqInput], block_size: int, group: int, prompt: bool = False) -> cpu_ops.Rows:
    """The rows of one forward as the C kernels read them, built once for all its layers;
    rows are laid out sequence after sequence. `group`: query heads per KV head. A causal
    sequence's rows share one key list (each row reads a prefix of it); a tree's nodes each
    get their own (the prefix, then the node's ancestors). `prompt`: the rows are prompt rows
    (before each sequence's first sampled one), whose attention may run on AMX tiles
    (csrc/attention_tiles.h). Plain arrays, not tensors: this runs once per forward, and a
    small torch.tensor costs about 5 us."""
    b, rows, num_keys = len(seqs), 0, 0
    info = array("q", bytes(40 * b))            # [5, B]: first row, new tokens, cached, table, mask
    tables, masks, positions = array("i"), array("B"), []
    for j, s in enumerate(seqs):
        info[j], info[b + j], info[2 * b + j], info[3 * b + j] = rows, s.num_new, s.ctx_len, len(tables)
        positions += s.positions if s.positions is not None else range(s.ctx_len, s.kv_len)
        tables.extend(s.block_table[:-(-s.kv_len // block_size)])
        if s.mask is None:
            info[4 * b + j] = -1
            num_keys += s.kv_len
        else:
            info[4 * b + j] = len(masks)
            masks.frombytes(s.mask.to(torch.uint8).numpy().tobytes())
            num_keys += s.num_new * s.kv_len
        rows += s.num_new
    out = array("q", positions)                 # [6, T] then the key lists (see cpu_ops.row_lists)
    out.frombytes(bytes(8 * (5 * rows + num_keys)))
    units = cpu_ops.row_lists(info, tables, masks or array("B", b"\0"), block_size, cpu_ops.rows_per_unit(group),
                              out, rows)
    pos, slot, count, start, first, width, keys = (out.buffer_info()[0] + 8 * rows * i for i in range(7))
    plan = cpu_ops.Rows(rows, units, max(s.kv_len for s in seqs), pos, slot, count, start, keys, first, width,
                        int(prompt))
    plan.keep = out
    return plan


@dataclass(frozen=True)
class CpuLayer:
    """One decoder layer's pieces, looked up once (a module attribute lookup costs about a
    microsecond, and a step makes hundreds)."""
    in_norm: torch.Tensor          # fp32 [H]
    in_eps: float
    post_norm: torch.Tensor
    post_eps: float
    qkv: QuantLinear
    o: QuantLinear
    gate_up: QuantLinear | None             # None in a mixture-of-experts layer
    down: QuantLinear | None
    q_norm: torch.nn.Module | None = None   # Qwen3's per-head norms of q and k, else None
    k_norm: torch.nn.Module | None = None
    moe: SparseMoeBlock | None = None       # Mixtral's and Qwen3-MoE's experts, in place of the MLP


def cpu_heads(net) -> cpu_ops.Heads:
    c = net.cfg
    if c.gemma is not None:             # Gemma's loop: verifier/quantized/gemma_cpu.py
        return gemma_heads(net)
    return cpu_ops.heads(c.num_heads, c.num_kv_heads, c.head_dim, net.scale, net.rotary.cos, net.rotary.sin_signed)


def cpu_layers(net) -> list[CpuLayer]:
    if net.cfg.gemma is not None:
        return gemma_cpu_layers(net)
    return [CpuLayer(l.input_layernorm.weight, l.input_layernorm.eps, l.post_attention_layernorm.weight,
                     l.post_attention_layernorm.eps, l.self_attn.qkv_proj, l.self_attn.o_proj,
                     getattr(l.mlp, "gate_up_proj", None), getattr(l.mlp, "down_proj", None),
                     l.self_attn.q_norm, l.self_attn.k_norm, l.mlp if isinstance(l.mlp, SparseMoeBlock) else None)
            for l in net.model.layers]


def layer_kind(layer: CpuLayer | GemmaCpuLayer) -> tuple:
    """What a layer's kernels split their work by: its linears' layouts, its tensors' shapes, its
    other fields' values (eps, a Gemma window), never a weight's values. Layers of one kind run
    the same kernels on the same shapes."""
    def part(v):
        if isinstance(v, QuantLinear):
            return v.layout()
        if isinstance(v, torch.Tensor):
            return tuple(v.shape), v.dtype
        if isinstance(v, torch.nn.Module):         # q/k norms, experts: their linears' layouts
            return type(v).__name__, tuple(m.layout() for m in v.modules() if isinstance(m, QuantLinear))
        return v if v is None or isinstance(v, (int, float, str)) else type(v).__name__
    return tuple(part(getattr(layer, f.name)) for f in fields(layer))


@torch.inference_mode()
def forward_rows(net, heads: cpu_ops.Heads, layers: list[CpuLayer], ids: torch.Tensor, plan: cpu_ops.Rows,
                 kv: KVCache,
                 logits_rows: torch.Tensor, capture_layers: tuple[int, ...] = (),
                 own: bool = True, native: NativeLayers | None = None,
                 logits_tokens: list[torch.Tensor | None] | None = None,
                 mm: Callable | None = None,
                 lora_slots: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """ids [T] -> (logits [len(logits_rows), V] fp32, taps: layer -> [T, H] fp32), as
    `LlamaForCausalLM.forward` returns them. With `native` (`verifier.quantized.cpu_loop`), sampled
    rows (`own`) run the layers, and where it holds the head the final norm and the head, in one
    C++ call: the same kernels in the same order. `logits_tokens` (per logits row, int64 ids or
    None): rows whose logits are needed at those tokens only (exact, the rest -inf). LoRA
    adapters: the native loop adds their rows' products itself (`lora_slots`, its tables set);
    the Python layers take `mm` (lin, x, bias) -> bf16 in place of `own_matmul`, which adds them."""
    c = net.cfg
    if c.gemma is not None:
        return gemma_forward_rows(net, heads, layers, ids, plan, kv, logits_rows, capture_layers, own, native,
                                  logits_tokens)
    x = net.model.embed_tokens(ids)                                     # fp32 [T, H] residual, in place
    logits = None
    if own and native is not None:
        logits, taps = native.run(plan, x, kv, capture_layers, logits_rows, logits_tokens, lora_slots)
    else:
        taps = _layers(c, layers, heads, plan, kv, x, capture_layers, mm or own_matmul)
    if c.num_layers in capture_layers:
        taps[c.num_layers] = x
    if logits is not None:                # the native loop ran the final norm and the head too
        return logits, taps
    if logits_rows.shape[0] == 0:
        return torch.empty(0, c.vocab_size), taps
    normed = cpu_ops.rms_norm_rows(x, logits_rows, net.model.norm.weight, net.model.norm.eps)
    return net.lm_head(normed, logits_tokens), taps


def _layers(c, layers: list[CpuLayer], heads: cpu_ops.Heads, plan: cpu_ops.Rows, kv: KVCache, x: torch.Tensor,
            capture_layers: tuple[int, ...], mm) -> dict[int, torch.Tensor]:
    """Every layer over x fp32 [T, H] in place, up to the last residual add -> taps below the last."""
    t, bf16 = x.shape[0], torch.bfloat16
    h = torch.empty(t, c.hidden_size, dtype=bf16)                      # normed input of each matmul block
    q = torch.empty(t, c.num_heads, c.head_dim)                         # rotated queries
    o = torch.empty(t, c.q_size, dtype=bf16)                            # attention output
    a = torch.empty(t, c.intermediate_size, dtype=bf16)                 # silu(gate) * up
    y, taps = None, {}
    for i, layer in enumerate(layers):
        cpu_ops.add_rms_norm(x, y, layer.in_norm, layer.in_eps, h)     # x += previous MLP output
        if i in capture_layers:
            taps[i] = x.clone()
        k_cache, v_cache = kv.layer(i)
        cpu_ops.prefetch_kv(heads, plan, k_cache, v_cache)
        if layer.q_norm is None:
            cpu_ops.attention(heads, plan, mm(layer.qkv, h, bias=False), layer.qkv.bias, q, k_cache, v_cache, o)
        else:                          # the bias, then the per-head norms, then the C kernel's RoPE
            qkv = _qk_normed(c, layer, mm(layer.qkv, h))
            cpu_ops.attention(heads, plan, qkv, None, q, k_cache, v_cache, o)
        cpu_ops.add_rms_norm(x, mm(layer.o, o), layer.post_norm, layer.post_eps, h)
        y = _mlp(layer, h, a, mm)
    cpu_ops.add_rms_norm(x, y, layers[-1].post_norm, 0.0, None)   # the last residual add (out None: no norm)
    return taps


def _mlp(layer: CpuLayer, h: torch.Tensor, a: torch.Tensor, mm) -> torch.Tensor:
    """bf16 [T, H]: the layer's MLP, or its experts, over h (`a`: the MLP's buffer for silu(gate) * up)."""
    if layer.moe is not None:
        return cpu_moe(layer.moe, h, mm)
    cpu_ops.silu_mul(mm(layer.gate_up, h), a)
    return mm(layer.down, a)


def _qk_normed(c, layer: CpuLayer, qkv: torch.Tensor) -> torch.Tensor:
    """bf16 [T, (NH + 2 NKV) D] with each q and k head RMS-normed (fp32 statistics, row by row:
    a head's result depends on its own values only)."""
    heads = qkv.view(qkv.shape[0], -1, c.head_dim)
    return norm_qk(heads, layer.q_norm, layer.k_norm, c.num_heads, c.num_kv_heads).view(qkv.shape)


def own_matmul(lin: QuantLinear, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
    """The weight's own row-invariant kernel -> bf16 (qkv's bias is added in rope_store)."""
    y = lin.run_own(x)
    return y if lin.bias is None or not bias else (y + lin.bias).to(torch.bfloat16)
