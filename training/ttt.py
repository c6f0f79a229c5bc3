"""EAGLE-3 training-time test: unroll k draft steps and score each against the target.

Batch tensors are [B, T] (padded). At step s, index t holds the chain that started from
the target's hidden state at t:
- input: hidden = fc(aux[t]) at s = 0, else the head's own output of step s-1 at t;
  token = x[t+1+s] (teacher forcing on tokens, the head's own features, as in the paper);
- position t + s; attention to the step-0 keys at indices <= t (the real context) and to
  the keys of steps 1..s at index t (the chain's own earlier draft tokens);
- target: the target's distribution over the draft vocabulary at t+1+s (it predicts
  token t+2+s). Counted where that token is an assistant token, is not padding, and the
  target's full-vocabulary argmax there lies inside the draft vocabulary.
The loss is the cross-entropy to the target distribution, weighted `decay**s` per step.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from drafters.eagle3.head import Eagle3Head


@dataclass
class Batch:
    input_ids: torch.Tensor   # [B, T] long (0 in padding)
    valid: torch.Tensor       # [B, T] bool: not padding
    loss_mask: torch.Tensor   # [B, T] bool: assistant tokens
    aux: torch.Tensor         # [B, T, 3·Ht]
    final: torch.Tensor       # [B, T, Ht] target hidden after the final norm
    argmax: torch.Tensor      # [B, T] target full-vocabulary argmax

    def to(self, device: torch.device) -> "Batch":
        return Batch(*(getattr(self, f.name).to(device) for f in fields(self)))


@dataclass
class StepStats:
    loss: torch.Tensor        # weighted sum over steps (scalar, differentiable)
    step_loss: list[float]
    step_acc: list[float]     # draft argmax == target argmax where counted
    counted: list[int]        # positions counted per step


def shift(x: torch.Tensor, s: int, fill=0) -> torch.Tensor:
    """y[:, t] = x[:, t + s], padded with `fill` past the end (dim 1)."""
    if s == 0:
        return x
    pad = torch.full_like(x[:, :s], fill)
    return torch.cat([x[:, s:], pad], dim=1)


def ttt_forward(head: Eagle3Head, batch: Batch, target_lm_draft: torch.Tensor,
                steps: int = 7, decay: float = 0.8) -> StepStats:
    """target_lm_draft [Vd, Ht]: the target's LM-head rows of the draft vocabulary."""
    cfg = head.cfg
    B, T = batch.input_ids.shape
    with torch.no_grad():
        target_logits = batch.final.float() @ target_lm_draft.T             # [B, T, Vd]
        target_p = target_logits.softmax(-1)
        target_top = target_logits.argmax(-1)
        # Index j counts when token j+1 is a real assistant token and the target's argmax at j
        # (its prediction of token j+1) is in the draft vocabulary.
        countable = shift(batch.loss_mask & batch.valid, 1, False) & head.t2d[batch.argmax]
    hid = head.fuse(batch.aux.float())                                      # [B, T, H]
    pos = torch.arange(T, device=hid.device)
    causal = pos[None, :] <= pos[:, None]                                   # [T, T] key <= query
    key_ok = causal[None] & batch.valid[:, None, :]                         # [B, T, T]
    # Steps >= 1 only matter where a later label is counted: from index `crop` on (prompts are
    # long and carry no loss), which saves their share of six of the seven steps.
    any_counted = countable.any(0).nonzero()
    crop = max(0, int(any_counted[0]) - steps) if len(any_counted) else 0
    keys: list[tuple[torch.Tensor, torch.Tensor]] = []
    total = hid.sum() * 0.0        # stays in the graph when a batch has nothing to count
    step_loss, step_acc, counted = [], [], []
    for s in range(steps):
        c = 0 if s == 0 else crop                                           # first query index
        if s == 1:
            hid = hid[:, crop:]
        n_q = T - c
        emb = head.embed(shift(batch.input_ids, 1 + s)[:, c:])
        q, k, v, res = head.project(emb.reshape(B * n_q, -1), hid.reshape(B * n_q, -1),
                                    (pos[c:] + s).repeat(B))
        q = q.view(B, n_q, cfg.num_heads, cfg.head_dim).transpose(1, 2)     # [B, nh, n_q, D]
        k = k.view(B, n_q, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)  # [B, kvh, n_q, D]
        v = v.view(B, n_q, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        rep = cfg.num_heads // cfg.num_kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        keys.append((k, v))
        attn = _ttt_attention(q, keys, key_ok[:, c:], cfg.head_dim ** -0.5)
        out = head.finish(res, attn.transpose(1, 2).reshape(B * n_q, -1)).view(B, n_q, -1)
        logits = head.draft_logits(out.reshape(B * n_q, -1)).view(B, n_q, -1)
        mask = shift(countable, 1 + s, False)[:, c:]
        n = int(mask.sum())
        if n:
            ce = -(shift(target_p, 1 + s)[:, c:] * logits.log_softmax(-1)).sum(-1)
            loss_s = ce[mask].mean()
            total = total + decay ** s * loss_s
            acc = (logits.argmax(-1) == shift(target_top, 1 + s)[:, c:])[mask].float().mean()
            step_loss.append(float(loss_s.detach()))
            step_acc.append(float(acc))
        else:
            step_loss.append(float("nan"))
            step_acc.append(float("nan"))
        counted.append(n)
        hid = out
    return StepStats(total, step_loss, step_acc, counted)


def _ttt_attention(q, keys, key_ok, scale):
    """q [B, nh, n_q, D]; keys[0]: step-0 keys over all T indices (the causal context);
    keys[1:]: the chain's own earlier steps, indexed like q (one diagonal key each);
    key_ok [B, n_q, T]."""
    k0, v0 = keys[0]
    scores = [(q @ k0.transpose(-1, -2)) * scale]                           # [B, nh, n_q, T]
    scores[0] = scores[0].masked_fill(~key_ok[:, None], float("-inf"))
    for k, _ in keys[1:]:
        scores.append(((q * k).sum(-1) * scale)[..., None])                 # [B, nh, n_q, 1]
    w = torch.cat(scores, dim=-1).softmax(-1)
    T = k0.shape[2]
    out = w[..., :T] @ v0
    for j, (_, v) in enumerate(keys[1:]):
        out = out + w[..., T + j:T + j + 1] * v
    return out
