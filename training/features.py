"""Target features for drafter training, computed once and cached on disk (fp16).

Per token t of an example the target gives:
- `aux [T, 3·Ht]`: the hidden states entering the three tapped layers (the head's input);
- `final [T, Ht]`: the last hidden state after the final norm. Target logits over the
  draft vocabulary are `final @ lm_head[draft ids].T`, recomputed in training: storing
  them would take a vocabulary-sized row per token;
- `argmax [T]`: the target's full-vocabulary prediction for token t+1 (positions whose
  argmax is outside the draft vocabulary are masked, as the public recipe does).

The features come from Tercel's own target forward (prefill over paged KV blocks) in the
quantization it serves (`train-drafter --quantization`, auto as `LLM` loads it: int4 for the
default model on the CPU), and the labels from its own head, so training sees the numbers
drafting will read (until 2026-12-05 they came from the dense fp32 model, whose taps differ
from the int4 model's by 0.7-2% relative; a head trained on either drafted alike:
docs/eagle3.md). A cache directory holds `meta.json` and `shard-NNNNN.safetensors`; it is
reused when target, quantization, taps and examples match.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from training.data import TokenizedExample
from verifier.batch import ForwardBatch, SeqInput

log = logging.getLogger("tercel.training")
SHARD_TOKENS = 1 << 17


@dataclass
class Features:
    """One example's tensors (CPU)."""
    input_ids: torch.Tensor    # [T] long
    loss_mask: torch.Tensor    # [T] bool: assistant tokens
    aux: torch.Tensor          # [T, 3·Ht] fp16
    final: torch.Tensor        # [T, Ht] fp16
    argmax: torch.Tensor       # [T] long

    def __len__(self) -> int:
        return len(self.input_ids)


def fingerprint(target_dir: str, aux_layers: tuple[int, ...], examples: list[TokenizedExample],
                quantization: str = "none") -> str:
    h = hashlib.sha256(json.dumps([str(target_dir), list(aux_layers)] +
                                  ([] if quantization == "none" else [quantization])).encode())
    for ex in examples:
        h.update(ex.id.encode())
        h.update(torch.tensor(ex.input_ids, dtype=torch.int32).numpy().tobytes())
    return h.hexdigest()[:16]


@torch.inference_mode()
def capture(target, examples: list[TokenizedExample], aux_layers: tuple[int, ...],
            batch_tokens: int = 2048, progress=None) -> list[Features]:
    """Run the target over every example; returns features in example order."""
    n_layers = target.config.num_layers
    capture_layers = tuple(sorted(set(aux_layers) | {n_layers}))
    bs = 16
    groups = list(_groups(examples, batch_tokens))
    blocks_needed = max(sum(-(-len(ex.input_ids) // bs) for ex in g) for g in groups)
    if target.kv is None or target.kv.num_blocks < blocks_needed or target.kv.block_size != bs:
        target.allocate_kv(blocks_needed, bs)
    out: list[Features] = []
    for group in groups:
        seqs, next_block = [], 0
        for ex in group:
            nblk = -(-len(ex.input_ids) // bs)
            seqs.append(SeqInput(list(ex.input_ids), 0, list(range(next_block, next_block + nblk)),
                                 logits_indices=[]))
            next_block += nblk
        fwd = target.forward(ForwardBatch(seqs, capture_layers=capture_layers))
        aux = torch.cat([fwd.hidden[i] for i in aux_layers], dim=-1)            # [sum T, 3Ht]
        final = target.net.model.norm(fwd.hidden[n_layers])                    # [sum T, Ht]
        argmax = _argmax_logits(target.net.lm_head, final)
        start = 0
        for ex in group:
            end = start + len(ex.input_ids)
            out.append(Features(torch.tensor(ex.input_ids), torch.tensor(ex.loss_mask, dtype=torch.bool),
                                aux[start:end].to("cpu", torch.float16, copy=True),    # waits on the CPU
                                final[start:end].to("cpu", torch.float16, copy=True),
                                argmax[start:end].to("cpu", copy=True)))
            start = end
        if progress is not None:
            progress(sum(len(ex.input_ids) for ex in group))
    return out


def _groups(examples: list[TokenizedExample], batch_tokens: int):
    group, tokens = [], 0
    for ex in examples:
        if group and tokens + len(ex.input_ids) > batch_tokens:
            yield group
            group, tokens = [], 0
        group.append(ex)
        tokens += len(ex.input_ids)
    if group:
        yield group


def _argmax_logits(head: torch.nn.Module, x: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """The target's prediction per row of x, by its own head (a quantized target's is its scan
    and exact rescoring, as it serves); [T, V] logits in row chunks: the full matrix for a
    2k-token batch would be 400 MB."""
    def logits(rows):
        return rows @ head.weight.T if isinstance(head, torch.nn.Linear) else head(rows)
    return torch.cat([logits(x[i:i + chunk]).argmax(-1) for i in range(0, len(x), chunk)])


# ---- the disk cache ------------------------------------------------------------------------
def save_cache(path: str | Path, key: str, feats: list[Features]) -> None:
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    shards, cur, tokens = [], [], 0
    for f in feats:
        cur.append(f)
        tokens += len(f)
        if tokens >= SHARD_TOKENS:
            shards.append(cur)
            cur, tokens = [], 0
    if cur:
        shards.append(cur)
    for i, shard in enumerate(shards):
        lengths = torch.tensor([len(f) for f in shard])
        save_file({"lengths": lengths,
                   **{name: torch.cat([getattr(f, name) for f in shard])
                      for name in ("input_ids", "loss_mask", "aux", "final", "argmax")}},
                  str(root / f"shard-{i:05d}.safetensors"))
    (root / "meta.json").write_text(json.dumps({"key": key, "examples": len(feats),
                                                "tokens": sum(map(len, feats)), "shards": len(shards)}))


def load_cache(path: str | Path, key: str) -> list[Features] | None:
    """The cached features if the directory holds features for exactly this key, else None."""
    root = Path(path)
    meta_path = root / "meta.json"
    if not meta_path.is_file():
        return None
    meta = json.loads(meta_path.read_text())
    if meta.get("key") != key:
        log.info("feature cache %s was made for other data or another target; recomputing", root)
        return None
    feats = []
    for i in range(meta["shards"]):
        t = load_file(str(root / f"shard-{i:05d}.safetensors"))
        bounds = [0] + torch.cumsum(t["lengths"], 0).tolist()
        for a, b in zip(bounds, bounds[1:]):
            feats.append(Features(t["input_ids"][a:b], t["loss_mask"][a:b], t["aux"][a:b],
                                  t["final"][a:b], t["argmax"][a:b]))
    return feats
