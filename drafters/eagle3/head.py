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
from drafters.eagle3.draft_layers import DRAFT_FORMS, Int8DraftLinear, NativeLayer, to_bf16_any_rows
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
        self.fused: nn.Module | None = None       # q, k, v in one matmul (`for_drafting("int8")`)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.fused is not None:
            return self.fused(x)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


class Eagle3MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.fused: nn.Module | None = None       # gate and up in one matmul (`for_drafting("int8")`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.fused(x) if self.fused is not None else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(F.silu(gate) * up)


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
        self.native: NativeLayer | None = None           # the layer in one C call (`for_drafting("int8")`)

    # ---- set-up ----------------------------------------------------------------------
    def use_target_embedding(self, embed: nn.Module) -> None:
        """`embed`: the target's nn.Embedding, or its QuantEmbedding on a quantized target."""
        if self.embed_tokens is None:
            shape = (embed.num_embeddings, embed.embedding_dim)
            if shape != (self.cfg.vocab_size, self.cfg.hidden_size):
                raise ValueError(f"target embedding {shape} does not fit the head "
                                 f"(vocab {self.cfg.vocab_size}, hidden {self.cfg.hidden_size})")
            self._borrowed = (embed,)

    def for_drafting(self, form: str) -> None:
        """The drafter's own set-up of the layers (`drafters.eagle3.draft_layers`): "int8" (the
        engine's int8 kernel) or "bf16" (oneDNN at any row count). Training needs the `Linear`s."""
        if form not in DRAFT_FORMS:
            raise ValueError(f"draft form {form!r} is not one of {DRAFT_FORMS}")
        if form == "bf16":
            to_bf16_any_rows(self)
            return
        attn, mlp = self.midlayer.self_attn, self.midlayer.mlp
        attn.fused = Int8DraftLinear(attn.q_proj, attn.k_proj, attn.v_proj)
        mlp.fused = Int8DraftLinear(mlp.gate_proj, mlp.up_proj)
        del attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj
        self.fc, self.lm_head = Int8DraftLinear(self.fc), Int8DraftLinear(self.lm_head)
        attn.o_proj, mlp.down_proj = Int8DraftLinear(attn.o_proj), Int8DraftLinear(mlp.down_proj)
        self.native = NativeLayer.of(self)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the norms'; the layers may hold their weights in another form)."""
        return self.norm.weight.dtype

    def init_rotary(self, device=None, dtype=torch.float32) -> None:
        c = self.cfg
        self.rotary = RotaryEmbedding(c.rope, c.head_dim, c.max_position, device or self.norm.weight.device, dtype)

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
        return table(ids).to(self.dtype)      # the target's table may be held in another dtype

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
        q, k, v = attn.qkv(x)
        q = apply_rotary(q.view(-1, c.num_heads, c.head_dim), cos, sin)
        k = apply_rotary(k.view(-1, c.num_kv_heads, c.head_dim), cos, sin)
        v = v.view(-1, c.num_kv_heads, c.head_dim)
        return q, k, v, residual

    def finish(self, residual: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        layer = self.midlayer
        x = residual + layer.self_attn.o_proj(attn_out)
        h = x + layer.mlp(layer.post_attention_layernorm(x))
        # Normed here, once, so every caller (drafter, training unroll) carries the same state.
        return self.norm(h) if self.cfg.norm_output else h

    def layer(self, emb: torch.Tensor, hid: torch.Tensor, positions: torch.Tensor, ctx, tmp, ntmp: int,
              mask: torch.Tensor) -> torch.Tensor:
        """`project`, `attend` and `finish` over T rows -> out [T, H]. Keys: `ctx` = (K, V, n), its
        first n slots all seen; then `tmp` = (K, V), its first `ntmp` slots seen where mask bool
        [T, ntmp] says. The rows' own keys and values are written to tmp slots [ntmp - T, ntmp).
        A few rows take the native layer where there is one."""
        t = emb.shape[0]
        if self.native is not None and t <= FEW_ROWS:
            return self.native(emb, hid, positions, ctx, tmp, ntmp, mask)
        (kc, vc, n_ctx), (kt, vt) = ctx, tmp
        q, k, v, res = self.project(emb, hid, positions)
        kt[ntmp - t:ntmp], vt[ntmp - t:ntmp] = k, v
        keys, vals = torch.cat([kc[:n_ctx], kt[:ntmp]]), torch.cat([vc[:n_ctx], vt[:ntmp]])
        return self.finish(res, attend(q, keys, vals, torch.cat([mask.new_ones(t, n_ctx), mask], 1)))

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(out if self.cfg.norm_output else self.norm(out))   # out is norm(h) already


# Query rows up to which the layer runs natively (draft_layer.c attends row by row in one thread)
# and `attend` multiplies in fp32 itself on the CPU rather than call SDPA: a draft level's or a decode step's.
FEW_ROWS = 16


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [T, nh, D], k/v [S, kvh, D], mask bool [T, S] (None: all) -> [T, nh·D]."""
    if q.shape[0] <= FEW_ROWS and q.device.type == "cpu":
        return _attend_few(q, k, v, mask).to(q.dtype)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    return o.transpose(0, 1).reshape(q.shape[0], -1)


def _attend_few(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    # A draft level's 1-4 rows: SDPA's set-up costs more than the products (docs/eagle3.md),
    # and CPU bmm is fast in fp32 only. Each kv head's query heads go in one bmm.
    (t, nh, d), (s, kvh, _) = q.shape, k.shape
    g = nh // kvh
    qg = q.float().view(t, kvh, g, d).permute(1, 0, 2, 3).reshape(kvh, t * g, d)
    scores = torch.bmm(qg, k.float().permute(1, 2, 0)).mul_(d ** -0.5)          # [kvh, t·g, s]
    if mask is not None:
        scores = scores.view(kvh, t, g, s).masked_fill_(~mask[None, :, None, :], float("-inf")).view(kvh, t * g, s)
    o = torch.bmm(scores.softmax(-1), v.float().transpose(0, 1))                  # [kvh, t·g, d]
    return o.view(kvh, t, g, d).permute(1, 0, 2, 3).reshape(t, nh * d)
