"""Gemma 2 and Gemma 3 (text) over the paged KV cache: `verifier.model.llama`'s modules with
Gemma's changes (`verifier/model/gemma_config.py`), module names as in HF's checkpoints.

One layer, T rows (norms are x * (1 + w), in fp32):

    x = x + post_attention_layernorm(attention(input_layernorm(x)))     sliding or full, scores capped
    x = x + post_feedforward_layernorm(down(gelu_tanh(gate) * up))      of pre_feedforward_layernorm(x)

The paged KV cache keeps every block of a sequence: its full-attention layers read them all.
A quantized target runs `verifier.quantized.gemma_cpu` instead of `GemmaForCausalLM.forward`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from verifier.attention.base import AttentionBackend
from verifier.attention.kv_cache import KVCache
from verifier.model.config import ModelConfig
from verifier.model.linear import Linear
from verifier.model.llama import MLP, Attention, RMSNorm, sharded
from verifier.model.rope import RotaryEmbedding
from verifier.model.shard import TensorShard


class GemmaRMSNorm(RMSNorm):
    """HF's Gemma2RMSNorm / Gemma3RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), all in fp32,
    then cast back (Llama's casts before multiplying by w)."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap), in HF's order of operations; x itself when cap is None."""
    return x if cap is None else torch.tanh(x / cap) * cap


class GemmaAttention(Attention):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg)
        g = cfg.gemma
        self.scale = g.scale
        self.window = g.layer_window(layer)
        self.softcap = g.attn_softcap
        if cfg.qk_norm:
            self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)


class GemmaMLP(MLP):
    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.sliding = cfg.gemma.sliding[layer]            # which RoPE table it reads (Gemma 3)
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.self_attn = GemmaAttention(cfg, layer)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.mlp = GemmaMLP(cfg)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, x, cos, sin, k_cache, v_cache, backend, meta):
        h = self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, backend, meta)
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class ScaledEmbedding(nn.Module):
    """ids -> embedding(ids) * scale: Gemma's input embedding, for a drafter that borrows it."""

    def __init__(self, embed: nn.Module, scale: torch.Tensor):
        super().__init__()
        self.embed, self.scale = embed, scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids) * self.scale


class GemmaForCausalLM(nn.Module):
    """The interface of `verifier.model.llama.LlamaForCausalLM` (cfg, scale, model, lm_head, rotary,
    init_rotary, forward, input_embedding), for Gemma 2 and Gemma 3 text checkpoints."""

    def __init__(self, cfg: ModelConfig, shard: TensorShard | None = None):
        super().__init__()
        if sharded(shard) is not None:
            raise ValueError(f"tensor parallelism does not split {cfg.model_type} models yet "
                             "(their extra norms and windows are not sharded); use tensor_parallel_size=1")
        self.cfg = cfg
        self.scale = cfg.gemma.scale                       # attention's softmax scale
        self.model = GemmaModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary: RotaryEmbedding | None = None         # full-attention layers
        self.local_rotary: RotaryEmbedding | None = None   # sliding layers (Gemma 3's own base)
        self.embed_scale: torch.Tensor | None = None

    def init_rotary(self, device, dtype):
        c = self.cfg
        self.rotary = RotaryEmbedding(c.rope, c.head_dim, c.max_position, device, dtype)
        local = c.gemma.local_rope
        self.local_rotary = self.rotary if local == c.rope else \
            RotaryEmbedding(local, c.head_dim, c.max_position, device, dtype)
        # HF: a float32 tensor of sqrt(hidden) cast to the weights' dtype (bf16 rounds it)
        self.embed_scale = torch.tensor(c.hidden_size ** 0.5).to(device=device, dtype=dtype)

    def input_embedding(self) -> nn.Module:
        return ScaledEmbedding(self.model.embed_tokens, self.embed_scale)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, logits_rows: torch.Tensor,
                kv: KVCache, backend: AttentionBackend, meta,
                capture_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        ropes = {False: self.rotary.lookup(positions), True: self.local_rotary.lookup(positions)}  # [T, 1, D]
        x = self.model.embed_tokens(ids) * self.embed_scale                                          # [T, hidden]
        taps = {}
        for i, layer in enumerate(self.model.layers):
            if i in capture_layers:
                taps[i] = x
            x = layer(x, *ropes[layer.sliding], *kv.layer(i), backend, meta)
        if self.cfg.num_layers in capture_layers:
            taps[self.cfg.num_layers] = x
        x = self.model.norm(x[logits_rows])
        return soft_cap(self.lm_head(x), self.cfg.gemma.final_softcap).float(), taps


def planned_window(cfg: ModelConfig) -> int | None:
    """The window the attention backend plans for beside full attention (None: no layer slides)."""
    g = cfg.gemma
    return g.window if g is not None and any(g.sliding) else None
