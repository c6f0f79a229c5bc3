"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3; Mixtral and Qwen3-MoE with the
experts of `verifier/model/moe.py` in place of the MLP) over the paged KV cache.

Module names follow the HF checkpoint names so the loader is a short mapping; the only
difference is the fused projections: `qkv_proj` = [q; k; v] and `gate_up_proj` =
[gate; up] (one matmul each instead of three and two).

A quantized target (`verifier.quantized.quantize`) swaps the projections for QuantLinears and runs
through `verifier.quantized.cpu_forward` instead of `LlamaForCausalLM.forward`.

With a `TensorShard` of size N > 1 (tensor parallelism) every module holds one rank's slice
(`verifier/model/shard.py`): `cfg` is then that rank's shapes (heads, intermediate size and vocabulary
/ N), o_proj and down_proj all-reduce their output, and the embedding and LM head are
vocabulary-parallel (`verifier/model/parallel_layers.py`). The residual stream stays whole on every
rank.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from verifier.attention.base import AttentionBackend
from verifier.attention.kv_cache import KVCache
from verifier.model.config import ModelConfig
from verifier.model.linear import Linear
from verifier.model.moe import SparseMoeBlock
from verifier.model.parallel_layers import RowParallelLinear, VocabParallelEmbedding, VocabParallelHead
from verifier.model.rope import RotaryEmbedding, apply_rotary
from verifier.model.row_tiles import in_row_tiles
from verifier.model.shard import TensorShard


_INITS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "xavier_uniform_",
          "xavier_normal_", "kaiming_uniform_", "kaiming_normal_")


@contextmanager
def uninitialized():
    """Modules built inside skip torch's random initialisation, for weights that are loaded
    next. On the meta device the init functions run through torch._refs, whose import of
    torch._dynamo imports triton: a slow import (figures: docs/performance.md, "Load and
    import times"), and leak warnings from its bindings at exit, on CPU runs that never use it."""
    saved = {name: getattr(nn.init, name) for name in _INITS}
    for name in _INITS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dim() == 2 and not torch.is_grad_enabled():
            return in_row_tiles(self._norm, x)         # a row's bits must not depend on the row count
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:   # one fused op instead of five
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Statistics in fp32 whatever the activation dtype (as HF does).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def head_norm(norm: RMSNorm, heads: torch.Tensor) -> torch.Tensor:
    """RMSNorm over each head of [T, N, D], as [T * N, D] rows."""
    return norm(heads.reshape(-1, heads.shape[-1])).view(heads.shape)


def norm_qk(qkv: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm, nh: int, nkv: int) -> torch.Tensor:
    """[T, NH + 2 NKV, D] with each q and k head RMS-normed (Qwen3's q_norm and k_norm), v as it was."""
    return torch.cat([head_norm(q_norm, qkv[:, :nh]), head_norm(k_norm, qkv[:, nh:nh + nkv]),
                      qkv[:, nh + nkv:]], dim=1).to(qkv.dtype)


def sharded(shard: TensorShard | None) -> TensorShard | None:
    """The shard when there are several ranks; None (the plain modules) for one."""
    return shard if shard is not None and shard.size > 1 else None


def row_linear(in_features: int, out_features: int, shard: TensorShard | None) -> Linear:
    """o_proj / down_proj: a plain Linear on one rank, all-reducing its output across several."""
    if sharded(shard) is None:
        return Linear(in_features, out_features, bias=False)
    return RowParallelLinear(in_features, out_features, shard)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: TensorShard | None = None):
        super().__init__()
        self.cfg = cfg              # under TP, this rank's heads: num_heads / N, num_kv_heads / N
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = row_linear(cfg.q_size, cfg.hidden_size, shard)
        self.scale = cfg.head_dim ** -0.5
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.window: int | None = None      # Gemma's sliding layers (verifier/model/gemma.py)
        self.softcap: float | None = None   # Gemma 2's score soft-capping

    def forward(self, x, cos, sin, k_cache, v_cache, backend: AttentionBackend, meta):
        c = self.cfg
        qkv = self.qkv_proj(x).view(-1, c.num_heads + 2 * c.num_kv_heads, c.head_dim)  # [T, H + 2 KVH, D]
        if self.q_norm is not None:
            qkv = norm_qk(qkv, self.q_norm, self.k_norm, c.num_heads, c.num_kv_heads)
        # q and k rotate together; the result takes the rotary tables' dtype
        qk = apply_rotary(qkv[:, :c.num_heads + c.num_kv_heads], cos, sin)            # [T, H + KVH, D]
        v = qkv[:, c.num_heads + c.num_kv_heads:].to(v_cache.dtype)                   # [T, KVH, D]
        o = backend.forward(qk[:, :c.num_heads], qk[:, c.num_heads:], v, k_cache, v_cache, meta,
                            self.scale, self.window, self.softcap)                     # [T, H, D]
        return self.o_proj(o.view(-1, c.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: TensorShard | None = None):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = row_linear(cfg.intermediate_size, cfg.hidden_size, shard)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: TensorShard | None = None, index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, shard)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        sparse = cfg.moe is not None and cfg.moe.sparse(index)        # not under TP: TensorShard.check
        self.mlp = SparseMoeBlock(cfg) if sparse else MLP(cfg, shard)

    def forward(self, x, cos, sin, k_cache, v_cache, backend, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, backend, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: TensorShard | None = None):
        """`cfg`: the full model's shapes (the shard slices them)."""
        super().__init__()
        shard = sharded(shard)
        local = cfg if shard is None else shard.local_config(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if shard is None else \
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, shard)
        self.layers = nn.ModuleList(DecoderLayer(local, shard, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """forward(ids [T], positions [T], ...) -> (logits [N, V] for `logits_rows`, taps)."""

    def __init__(self, cfg: ModelConfig, shard: TensorShard | None = None):
        super().__init__()
        shard = sharded(shard)
        # This rank's shapes: the full model's on one rank.
        self.cfg = cfg if shard is None else shard.local_config(cfg)
        self.scale = cfg.head_dim ** -0.5           # attention's softmax scale
        self.model = LlamaModel(cfg, shard)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if shard is None else \
            VocabParallelHead(cfg.hidden_size, cfg.vocab_size, shard)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary: RotaryEmbedding | None = None

    def init_rotary(self, device, dtype):
        c = self.cfg
        self.rotary = RotaryEmbedding(c.rope, c.head_dim, c.max_position, device, dtype)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, logits_rows: torch.Tensor,
                kv: KVCache, backend: AttentionBackend, meta,
                capture_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        cos, sin = self.rotary.lookup(positions)           # [T, 1, D]
        x = self.model.embed_tokens(ids)                   # [T, hidden]
        taps = {}
        for i, layer in enumerate(self.model.layers):
            if i in capture_layers:
                taps[i] = x          # whole on every rank under TP: the all-reduces keep it so
            x = layer(x, cos, sin, *kv.layer(i), backend, meta)
        if self.cfg.num_layers in capture_layers:
            taps[self.cfg.num_layers] = x                  # the last layer's output, before the norm
        # Only rows that are sampled go through the norm and the (large) LM head.
        x = self.model.norm(x[logits_rows])
        return self.lm_head(x).float(), taps
