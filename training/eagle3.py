"""`train-drafter --kind eagle3`: train an EAGLE-3 head for a target.

examples -> draft vocabulary -> target features (cached) -> head (optionally started
from the target's last decoder layer and LM head) -> training-time-test loop -> head
saved in the EAGLE layout.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch
from tqdm import tqdm

from drafters.eagle3.config import Eagle3Config
from drafters.eagle3.format import load_head, save_head
from drafters.eagle3.head import Eagle3Head
from training import precision
from training.config import TrainConfig
from training.data import TokenizedExample
from training.features import Features, capture, fingerprint, load_cache, save_cache
from training.loop import StepResult, Trainer, make_accelerator, shard
from training.ttt import Batch, ttt_forward
from training.vocab import select_draft_vocab
from verifier.target import TargetModel

log = logging.getLogger("tercel.training")


def train_eagle3(cfg: TrainConfig, target, examples: list[TokenizedExample], rank: int = 0, world: int = 1) -> dict:
    """Every process sees every example (the draft vocabulary is theirs), captures the
    features of its shard and trains on them (`rank` of `world`, training/loop.py)."""
    tc = target.config
    eos = tuple(tc.eos_token_ids) + ((target.tokenizer.eos_token_id,)
                                     if getattr(target.tokenizer, "eos_token_id", None) is not None else ())
    draft_ids, coverage = select_draft_vocab(examples, cfg.draft_vocab, tc.vocab_size, always=eos)
    log.info("draft vocabulary: %d tokens cover %.1f%% of assistant tokens", cfg.draft_vocab, 100 * coverage)
    head_cfg = dataclasses.replace(Eagle3Config.for_target(tc, cfg.draft_vocab),
                                   lm_head_from_target=cfg.lm_head_from_target)
    feats = _features(cfg, target, shard(examples, rank, world), head_cfg.aux_layer_ids)
    head = _new_head(head_cfg, target, draft_ids, cfg.init_from_target, cfg.seed)
    lm_draft = target.net.lm_head.weight.detach()[draft_ids.to(target.device)].float()         # [Vd, Ht]
    params = [p for p in head.parameters() if p.requires_grad]

    def forward(batch_idx: list[int], autocast):
        batch = collate([feats[i] for i in batch_idx]).to(target.device)   # features wait on the CPU
        with autocast:
            return batch, ttt_forward(head, batch, lm_draft, steps=cfg.ttt_steps, decay=cfg.step_decay)

    probe = precision.probe_example([len(f) for f in feats])
    dtype = precision.choose(cfg.dtype, target.device,
                             lambda d: forward(probe, precision.autocast(target.device, d))[1].loss, params)
    accelerator = make_accelerator(dtype, cfg.grad_accum)

    def step(batch_idx: list[int]) -> StepResult:
        batch, stats = forward(batch_idx, accelerator.autocast())
        metrics = {f"acc{s}": a for s, a in enumerate(stats.step_acc[:4]) if a == a}
        return StepResult(stats.loss, int(batch.valid.sum()), metrics)

    def load_model(path: Path) -> None:
        saved = load_head(path, tc, target_head=lambda: target.net.lm_head.weight.detach())
        head.load_state_dict(saved.state_dict())

    lengths = [[len(ex.input_ids) for ex in shard(examples, r, world)] for r in range(world)]
    trainer = Trainer(cfg, accelerator, params, step, lengths,
                      save_model=lambda p: save_head(head, p, verifier=cfg.target), load_model=load_model)
    if cfg.resume:
        trainer.resume()
    state = trainer.run()
    out = Path(cfg.output)
    if accelerator.is_main_process:
        save_head(head, out, dtype=torch.float16, verifier=cfg.target)
    summary = {"kind": "eagle3", "target": cfg.target, "examples": len(examples),
               "feature_tokens": sum(map(len, feats)), "draft_vocab": cfg.draft_vocab,
               "draft_vocab_coverage": round(coverage, 4), "steps": state.step,
               "tokens_seen": state.tokens, "train_seconds": round(state.seconds, 1),
               "ttt_steps": cfg.ttt_steps, "lm_head_from_target": cfg.lm_head_from_target,
               "dtype": precision.label(dtype), "lr": cfg.lr, "batch_tokens": cfg.batch_tokens,
               "grad_accum": cfg.grad_accum, "processes": world}
    return summary


def _features(cfg: TrainConfig, target, examples, aux_layers) -> list[Features]:
    """The tapped hidden states of the target as it serves (`--quantization`): the head drafts
    from those, so it trains on them; `target` (dense) gives the head its initial weights."""
    served = target if cfg.quantization == "none" else _served(cfg, target.device)
    key = fingerprint(str(served.model_dir), tuple(aux_layers), examples, served.quantization)
    if cfg.feature_cache:
        cached = load_cache(cfg.feature_cache, key)
        if cached is not None:
            log.info("target features: %d examples from cache %s", len(cached), cfg.feature_cache)
            return cached
    total = sum(len(ex.input_ids) for ex in examples)
    start = time.perf_counter()
    with tqdm(total=total, desc="target features", unit="tok", dynamic_ncols=True, mininterval=2.0) as bar:
        feats = capture(served, examples, tuple(aux_layers), progress=bar.update)
    log.info("target features: %d tokens in %.0f s", total, time.perf_counter() - start)
    if cfg.feature_cache:
        save_cache(cfg.feature_cache, key, feats)
    return feats


def _served(cfg: TrainConfig, device: torch.device):
    """On the dense target's device: under a launcher each process's own GPU."""
    return TargetModel(cfg.target, quantization=cfg.quantization, device=str(device) if device.type == "cuda" else None)


def collate(feats: list[Features]) -> Batch:
    B, T = len(feats), max(len(f) for f in feats)
    ids = torch.zeros(B, T, dtype=torch.long)
    valid = torch.zeros(B, T, dtype=torch.bool)
    mask = torch.zeros(B, T, dtype=torch.bool)
    aux = torch.zeros(B, T, feats[0].aux.shape[1], dtype=feats[0].aux.dtype)
    final = torch.zeros(B, T, feats[0].final.shape[1], dtype=feats[0].final.dtype)
    argmax = torch.zeros(B, T, dtype=torch.long)
    for b, f in enumerate(feats):
        n = len(f)
        ids[b, :n], valid[b, :n], mask[b, :n] = f.input_ids, True, f.loss_mask
        aux[b, :n], final[b, :n], argmax[b, :n] = f.aux, f.final, f.argmax
    return Batch(ids, valid, mask, aux, final, argmax)


def _new_head(hc: Eagle3Config, target, draft_ids: torch.Tensor, from_target: bool, seed: int) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(hc).to(target.device)      # trains where the target runs
    for m in head.modules():
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.normal_(m.weight, std=0.02)
    head.set_vocab_map(draft_ids)
    if from_target:
        _init_from_target(head, target, draft_ids)     # the LM head among the rest
    if hc.lm_head_from_target:        # the target's rows, as the loader puts them back, kept as they are
        if not from_target:
            with torch.no_grad():
                head.lm_head.weight.copy_(target.net.lm_head.weight[draft_ids.to(target.device)])
        head.lm_head.weight.requires_grad_(False)
    head.use_target_embedding(_frozen_embedding(target))
    head.init_rotary()
    return head.train()


@torch.no_grad()
def _init_from_target(head: Eagle3Head, target, draft_ids: torch.Tensor) -> None:
    """Start close to 'the target's last layer applied to its high tap': fc passes the third
    tap through, the layer copies the target's last decoder layer (its q/k/v read the hidden
    half of the 2H input), and the LM head is the target's rows of the draft vocabulary, so
    training starts in the target's own feature space (not compared against a random start
    here; `--no-init-from-target` gives the random one)."""
    hc, net = head.cfg, target.net
    last = net.model.layers[-1]
    H = hc.hidden_size
    if hc.target_hidden_size == H:
        head.fc.weight.zero_()
        head.fc.weight[:, 2 * H:] = torch.eye(H)
    q, k, v = last.self_attn.qkv_proj.weight.split([hc.q_size, hc.kv_size, hc.kv_size])
    attn = head.midlayer.self_attn
    for proj, w in ((attn.q_proj, q), (attn.k_proj, k), (attn.v_proj, v)):
        proj.weight[:, H:] = w
    attn.o_proj.weight.copy_(last.self_attn.o_proj.weight)
    gate, up = last.mlp.gate_up_proj.weight.chunk(2)
    mlp = head.midlayer.mlp
    mlp.gate_proj.weight.copy_(gate)
    mlp.up_proj.weight.copy_(up)
    mlp.down_proj.weight.copy_(last.mlp.down_proj.weight)
    head.midlayer.hidden_norm.weight.copy_(last.input_layernorm.weight)
    head.midlayer.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight)
    head.norm.weight.copy_(net.model.norm.weight)
    head.lm_head.weight.copy_(net.lm_head.weight[draft_ids])


def _frozen_embedding(target) -> torch.nn.Embedding:
    return torch.nn.Embedding.from_pretrained(target.net.model.embed_tokens.weight.detach().float(), freeze=True)
