"""The forward of a quantized CPU target: the fused C kernels (`verifier.cpu_ops`) around
the quantized matmuls.

A row's results must not depend on what shares its forward or on how its prompt was
chunked: otherwise T=0 speculation and plain decoding drift apart at near-ties, which
bf16 activations make common. The C kernels compute norms, RoPE and attention row by row
in a fixed order; the matmuls are the weight's own int4/int8 kernel for sampled rows
(decode steps, tree nodes, a prompt's last token: `own=True`) and the plan's dense path in
fixed tiles for the rest of a prompt (`own=False`, see `verifier.kernels`). One layer, T rows:

    h   = rms_norm(x += y)                   fp32 [T, H] residual -> bf16 [T, H]
    qkv = qkv_proj(h)                         bf16 [T, (NH + 2 NKV) D]
    q   = rope(q); cache[slots] = rope(k), v  fp32 [T, NH, D]
    o   = attention(q, cache)                 bf16 [T, NH D]
    h   = rms_norm(x += o_proj(o))
    y   = down_proj(silu(gate) * up)          from gate_up_proj(h), bf16 [T, 2 I]

"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from verifier import cpu_ops
from verifier.batch import SeqInput
from verifier.kv_cache import KVCache, slots_for


@dataclass(frozen=True)
class RowPlan:
    """The sequences of one forward as the C kernels read them (int64 unless noted); rows
    are laid out sequence after sequence."""
    num_seqs: int
    positions: torch.Tensor    # [T] RoPE position of each row
    slots: torch.Tensor        # [T] KV slot each row's k and v are written to
    row0: torch.Tensor         # [B] first row of each sequence
    num_new: torch.Tensor      # [B] rows of each sequence
    ctx: torch.Tensor          # [B] cached tokens each sequence attends to first
    table0: torch.Tensor       # [B] where each block table starts in `tables`
    tables: torch.Tensor       # int32 [sum of table lengths]
    mask0: torch.Tensor        # [B] where each [num_new, num_new] mask starts in `masks`; -1: causal
    masks: torch.Tensor        # uint8 [sum of mask sizes, or 1]


def row_plan(seqs: list[SeqInput], block_size: int) -> RowPlan:
    positions, slots, row0, table0, tables, mask0, masks = [], [], [], [], [], [], []
    for s in seqs:
        row0.append(len(positions))
        positions += s.positions if s.positions is not None else range(s.ctx_len, s.kv_len)
        slots += slots_for(s.block_table, s.ctx_len, s.kv_len, block_size)
        table0.append(len(tables))
        tables += s.block_table[:-(-s.kv_len // block_size)]
        if s.mask is None:
            mask0.append(-1)
        else:
            mask0.append(len(masks))
            masks += s.mask.to(torch.uint8).flatten().tolist()
    i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return RowPlan(len(seqs), i64(positions), i64(slots), i64(row0), i64([s.num_new for s in seqs]),
                     i64([s.ctx_len for s in seqs]), i64(table0), torch.tensor(tables, dtype=torch.int32),
                     i64(mask0), torch.tensor(masks or [0], dtype=torch.uint8))


@torch.inference_mode()
def forward_rows(net, ids: torch.Tensor, plan: RowPlan, kv: KVCache, logits_rows: torch.Tensor,
                 capture_layers: tuple[int, ...] = (), own: bool = True) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """ids [T] -> (logits [len(logits_rows), V] fp32, taps: layer -> [T, H] fp32), as
    `LlamaForCausalLM.forward` returns them."""
    mm = _own if own else _planned
    c = net.cfg
    rot = net.rotary
    x = net.model.embed_tokens(ids)                                    # fp32 [T, H], updated in place
    y, taps = None, {}
    for i, layer in enumerate(net.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        h = cpu_ops.add_rms_norm(x, y, layer.input_layernorm.weight, layer.input_layernorm.eps)
        if i in capture_layers:
            taps[i] = x.clone()
        k_cache, v_cache = kv.layer(i)
        qkv = mm(attn.qkv_proj, h, bias=False)
        q = cpu_ops.rope_store(qkv, attn.qkv_proj.bias, rot.cos, rot.sin_signed, plan.positions, plan.slots,
                               c.num_heads, c.num_kv_heads, k_cache, v_cache)
        o = cpu_ops.attend(q, k_cache, v_cache, plan, kv.block_size, attn.scale)
        norm = layer.post_attention_layernorm
        h = cpu_ops.add_rms_norm(x, mm(attn.o_proj, o), norm.weight, norm.eps)
        y = mm(mlp.down_proj, cpu_ops.silu_mul(mm(mlp.gate_up_proj, h)))
    cpu_ops.add_rms_norm(x, y, net.model.norm.weight, 0.0, out=False)   # the last residual add
    if c.num_layers in capture_layers:
        taps[c.num_layers] = x
    return net.lm_head(net.model.norm(x[logits_rows])), taps


def _own(lin, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
    """The weight's own row-invariant kernel -> bf16 (qkv's bias is added in rope_store)."""
    y = lin.run(lin.kind, x)
    return y if lin.bias is None or not bias else (y + lin.bias).to(torch.bfloat16)


def _planned(lin, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
    """The plan's prefill path, in tiles -> bf16."""
    y = lin.run_planned(x)
    return y if lin.bias is None or not bias else (y + lin.bias).to(torch.bfloat16)
