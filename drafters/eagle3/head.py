"""The EAGLE-3 head: one decoder layer that drafts from the target's own hidden states.

Shapes (H = head width, Ht = target width, Vd = draft vocabulary):
- `fuse(aux [T, 3·Ht]) -> g [T, H]`: the three tapped target layers through `fc`.
- `project(emb [T, H], hid [T, H], positions)`: attention inputs from
  cat(input_layernorm(emb), hidden_norm(hid)) [T, 2H] -> q [T, nh, D], k/v [T, kvh, D].
- `finish(residual [T, H], attn [T, nh·D]) -> out [T, H]`: o_proj, residual, MLP, giving
  the layer output h; `out` is h, or norm(h) when `cfg.norm_output`.
- `draft_logits(out) -> [T, Vd]`: lm_head(norm(h)) either way; draft id i is target id
  `i + d2t[i]`.

`out` is the hidden state the next draft step consumes: h before the final norm (EAGLE-3),
or norm(h) with `norm_output` (EAGLE-3.1 / speculators, which feed the post-norm state back
to damp the magnitude drift over steps). The first step never sees it: it consumes fc(aux).
The pair at position t is (target hidden at t, embedding of token t+1); it predicts token
t+2. Draft step k of the same chain sits at position t+k.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from drafters.eagle3.config import Eagle3Config
from verifier.model.linear import Linear
from verifier.model.llama import RMSNorm
from verifier.model.rope import RotaryEmbedding, apply_rotary


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.q_proj = Linear(2 * cfg.hidden_size, cfg.q_size, bias=False)
        self.k_proj = Linear(2 * cfg.hidden_size, cfg.kv_size, bias=False)
        self.v_proj = Linear(2 * cfg.hidden_size, cfg.kv_size, bias=False)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=False)


class Eagle3MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Eagle3MLP(cfg)


class Eagle3Head(nn.Module):
    def __init__(self, cfg: Eagle3Config, with_embedding: bool = False):
        super().__init__()
        self.cfg = cfg
        self.fc = Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        # Heads usually borrow the target's embedding (`use_target_embedding`); a checkpoint
        # that carries its own `embed_tokens` gets a module of its own.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if with_embedding else None
        self._borrowed: tuple[nn.Embedding, ...] = ()     # a tuple: not a registered submodule
        self.rotary: RotaryEmbedding | None = None

    # ---- set-up ----------------------------------------------------------------------
    def use_target_embedding(self, embed: nn.Module) -> None:
        """`embed`: the target's nn.Embedding, or its QuantEmbedding on a quantized target."""
        if self.embed_tokens is None:
            shape = (embed.num_embeddings, embed.embedding_dim)
            if shape != (self.cfg.vocab_size, self.cfg.hidden_size):
                raise ValueError(f"target embedding {shape} does not fit the head "
                                 f"(vocab {self.cfg.vocab_size}, hidden {self.cfg.hidden_size})")
            self._borrowed = (embed,)

    def for_drafting(self) -> None:
        """bf16 layers on oneDNN at any row count (`Linear.bf16_any_rows`): the drafter's own
        set-up on a CPU that multiplies bf16 (`verifier.model.linear.onednn_bf16`)."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.bf16_any_rows = True

    def init_rotary(self, device=None, dtype=torch.float32) -> None:
        c = self.cfg
        self.rotary = RotaryEmbedding(c.rope, c.head_dim, c.max_position, device or self.fc.weight.device, dtype)

    def set_vocab_map(self, draft_to_target: torch.Tensor) -> None:
        """draft_to_target [Vd]: the target id of each draft id, ascending."""
        ids = draft_to_target.to(torch.long)
        self.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    @property
    def draft_to_target(self) -> torch.Tensor:
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    # ---- the pieces of one draft step --------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        table = self.embed_tokens if self.embed_tokens is not None else next(iter(self._borrowed), None)
        if table is None:
            raise RuntimeError("EAGLE-3 head has no embedding: call use_target_embedding(target embed)")
        return table(ids).to(self.fc.weight.dtype)      # the target's table may be held in another dtype

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        return self.fc(aux)

    def project(self, emb: torch.Tensor, hid: torch.Tensor, positions: torch.Tensor):
        """-> q [T, nh, D], k [T, kvh, D], v [T, kvh, D], residual [T, H]."""
        c, layer = self.cfg, self.midlayer
        normed = layer.hidden_norm(hid)
        residual = normed if c.norm_before_residual else hid
        x = torch.cat([layer.input_layernorm(emb), normed], dim=-1)        # [T, 2H]
        attn = layer.self_attn
        cos, sin = self.rotary.lookup(positions)
        q = apply_rotary(attn.q_proj(x).view(-1, c.num_heads, c.head_dim), cos, sin)
        k = apply_rotary(attn.k_proj(x).view(-1, c.num_kv_heads, c.head_dim), cos, sin)
        v = attn.v_proj(x).view(-1, c.num_kv_heads, c.head_dim)
        return q, k, v, residual

    def finish(self, residual: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        layer = self.midlayer
        x = residual + layer.self_attn.o_proj(attn_out)
        h = x + layer.mlp(layer.post_attention_layernorm(x))
        # Normed here, once, so every caller (drafter, training unroll) carries the same state.
        return self.norm(h) if self.cfg.norm_output else h

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(out if self.cfg.norm_output else self.norm(out))   # out is norm(h) already


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [T, nh, D], k/v [S, kvh, D], mask bool [T, S] (None: all) -> [T, nh·D]."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    return o.transpose(0, 1).reshape(q.shape[0], -1)
