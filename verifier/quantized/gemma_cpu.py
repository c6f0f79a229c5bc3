"""The forward of a quantized CPU Gemma target: `verifier.quantized.cpu_forward`'s C kernels and
matmuls with Gemma's changes, every step row by row (a row's bits never depend on its batch).
One layer, T rows:

    h = rms_norm(x += y) * (1 + w_in)           fp32 [T, H] residual -> bf16 [T, H]
    o = attention(qkv_proj(h))                  the layer's RoPE table, window and score cap
    y = rms_norm(o_proj(o)) * (1 + w_post)      bf16, statistics in fp32
    h = rms_norm(x += y) * (1 + w_pre_ff)
    y = rms_norm(down_proj(gelu_tanh(gate) * up)) * (1 + w_post_ff)

A sliding layer's rows keep the last `window` keys of their key lists (`windowed`). Norm weights
are held with 1 added: fp32 1 + w is HF's (1.0 + w.float()). The native loop (`verifier.quantized.cpu_loop`)
does not run Gemma: this loop in Python does.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from verifier.attention.kv_cache import KVCache
from verifier.cpu import cpu_ops
from verifier.model.llama import norm_qk
from verifier.quantized.qlinear import QuantLinear


@dataclass(frozen=True)
class GemmaCpuLayer:
    """One Gemma decoder layer's pieces, looked up once."""
    in_norm: torch.Tensor            # fp32 [H], 1 + w
    post_attn_norm: torch.Tensor
    pre_ff_norm: torch.Tensor
    post_ff_norm: torch.Tensor
    eps: float
    qkv: QuantLinear
    o: QuantLinear
    gate_up: QuantLinear
    down: QuantLinear
    window: int | None               # a sliding layer's window, None for full attention
    q_norm: nn.Module | None = None  # Gemma 3's per-head norms of q and k
    k_norm: nn.Module | None = None
    heads: cpu_ops.Heads | None = None   # its own RoPE table (Gemma 3's sliding layers), None: the model's
    out_norm: torch.Tensor | None = None  # on the last layer: the model's final norm, 1 + w


def _plus_one(norm: nn.Module) -> torch.Tensor:
    return (1.0 + norm.weight.detach().float()).contiguous()


def _heads(net, rotary) -> cpu_ops.Heads:
    c = net.cfg
    return cpu_ops.heads(c.num_heads, c.num_kv_heads, c.head_dim, net.scale, rotary.cos, rotary.sin_signed,
                         c.gemma.attn_softcap or 0.0)


def gemma_heads(net) -> cpu_ops.Heads:
    """The full-attention layers' heads (the ones `verifier.quantized.attention_tuning` times)."""
    return _heads(net, net.rotary)


def gemma_cpu_layers(net) -> list[GemmaCpuLayer]:
    local = None if net.local_rotary is net.rotary else _heads(net, net.local_rotary)
    layers = [GemmaCpuLayer(_plus_one(l.input_layernorm), _plus_one(l.post_attention_layernorm),
                            _plus_one(l.pre_feedforward_layernorm), _plus_one(l.post_feedforward_layernorm),
                            l.input_layernorm.eps, l.self_attn.qkv_proj, l.self_attn.o_proj, l.mlp.gate_up_proj,
                            l.mlp.down_proj, l.self_attn.window, l.self_attn.q_norm, l.self_attn.k_norm,
                            local if l.sliding else None)
              for l in net.model.layers]
    layers[-1] = replace(layers[-1], out_norm=_plus_one(net.model.norm))     # made once, not per forward
    return layers


def windowed(plan: cpu_ops.Rows, window: int) -> cpu_ops.Rows:
    """The same rows, each keeping the last `window` keys of its list. A row's list holds the
    positions 0..p in order (the cached prefix, then its own earlier tokens or its tree
    ancestors), so these are the keys at positions > p - window, as HF's sliding mask has it."""
    t = plan.rows
    lists = torch.frombuffer(plan.keep, dtype=torch.int64)          # [6 T + keys]: see row_plan
    count, start = lists[2 * t:3 * t], lists[3 * t:4 * t]
    kept = count.clamp(max=window)
    cut = torch.cat([kept, start + count - kept])                   # [2 T]: counts, then starts
    rows = cpu_ops.Rows(t, plan.units, min(plan.longest, window), plan.pos, plan.slot, cut.data_ptr(),
                        cut.data_ptr() + 8 * t, plan.keys, plan.unit_first, plan.unit_width, plan.tiles)
    rows.keep = (plan, cut)
    return rows


@torch.inference_mode()
def gemma_forward_rows(net, heads: cpu_ops.Heads, layers: list[GemmaCpuLayer], ids: torch.Tensor,
                       plan: cpu_ops.Rows, kv: KVCache, logits_rows: torch.Tensor,
                       capture_layers: tuple[int, ...] = (), own: bool = True, native=None,
                       logits_tokens: list[torch.Tensor | None] | None = None):
    """`verifier.quantized.cpu_forward.forward_rows` for Gemma (`native` is never set for it)."""
    c = net.cfg
    x = net.model.embed_tokens(ids) * net.embed_scale                # fp32 [T, H] residual, in place
    taps = _layers(c, layers, heads, plan, kv, x, capture_layers, _own)
    if c.num_layers in capture_layers:
        taps[c.num_layers] = x
    if logits_rows.shape[0] == 0:
        return torch.empty(0, c.vocab_size), taps
    normed = cpu_ops.rms_norm_rows(x, logits_rows, layers[-1].out_norm, net.model.norm.eps)
    logits = net.lm_head(normed, logits_tokens)
    if c.gemma.final_softcap:
        cpu_ops.soft_cap(logits, c.gemma.final_softcap)
    return logits, taps


def _layers(c, layers: list[GemmaCpuLayer], heads: cpu_ops.Heads, plan: cpu_ops.Rows, kv: KVCache,
            x: torch.Tensor, capture_layers: tuple[int, ...], mm) -> dict[int, torch.Tensor]:
    """Every layer over x fp32 [T, H] in place, up to the last residual add -> taps below the last."""
    t, bf16 = x.shape[0], torch.bfloat16
    h = torch.empty(t, c.hidden_size, dtype=bf16)                      # normed input of each matmul block
    y = torch.empty(t, c.hidden_size, dtype=bf16)                      # a block's normed output
    q = torch.empty(t, c.num_heads, c.head_dim)                         # rotated queries
    o = torch.empty(t, c.q_size, dtype=bf16)                            # attention output
    a = torch.empty(t, c.intermediate_size, dtype=bf16)                 # gelu_tanh(gate) * up
    cut, taps = {}, {}
    for i, layer in enumerate(layers):
        cpu_ops.add_rms_norm(x, y if i else None, layer.in_norm, layer.eps, h)
        if i in capture_layers:
            taps[i] = x.clone()
        if layer.window is not None and layer.window not in cut:
            cut[layer.window] = windowed(plan, layer.window)             # once per forward
        rows = plan if layer.window is None else cut[layer.window]
        hd = _layer_heads(layer, heads)
        k_cache, v_cache = kv.layer(i)
        cpu_ops.prefetch_kv(hd, rows, k_cache, v_cache)
        qkv = mm(layer.qkv, h)
        if layer.q_norm is not None:     # each head's norm reads its own values only (fp32 statistics)
            per_head = qkv.view(t, -1, c.head_dim)
            qkv = norm_qk(per_head, layer.q_norm, layer.k_norm, c.num_heads, c.num_kv_heads).view(qkv.shape)
        cpu_ops.attention(hd, rows, qkv, None, q, k_cache, v_cache, o)
        _norm_into(mm(layer.o, o), layer.post_attn_norm, layer.eps, y)
        cpu_ops.add_rms_norm(x, y, layer.pre_ff_norm, layer.eps, h)
        cpu_ops.gelu_tanh_mul(mm(layer.gate_up, h), a)
        _norm_into(mm(layer.down, a), layer.post_ff_norm, layer.eps, y)
    cpu_ops.add_rms_norm(x, y, layers[-1].in_norm, 0.0, None)           # the last residual add (out None: no norm)
    return taps


def _layer_heads(layer: GemmaCpuLayer, heads: cpu_ops.Heads) -> cpu_ops.Heads:
    if layer.heads is None:
        return heads
    layer.heads.parallel_from = heads.parallel_from     # the threads' threshold, timed on the model's heads
    return layer.heads


def _norm_into(v: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    """out bf16 [T, H] = rms_norm(v) * w for a block's output v bf16 [T, H], in fp32 row by row."""
    cpu_ops.add_rms_norm(v.float(), None, w, eps, out)


def _own(lin: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    return lin.run_own(x)              # Gemma's projections have no bias (refused at load)
