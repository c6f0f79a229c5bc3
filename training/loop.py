"""The optimisation loop shared by both drafter kinds.

AdamW with linear warm-up and cosine decay, gradient clipping, a token budget,
checkpoints every N steps (model, optimiser, schedule, position in the data) and resume
from the newest one, a progress bar with the loss and per-step accuracies.
"""
from __future__ import annotations

import json
import logging
import math
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from tqdm import tqdm

from training.config import TrainConfig

log = logging.getLogger("tercel.training")
KEEP_CHECKPOINTS = 2


@dataclass
class StepResult:
    loss: torch.Tensor            # differentiable scalar
    tokens: int                   # tokens this step trained on
    metrics: dict[str, float]     # shown on the progress bar


@dataclass
class LoopState:
    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    tokens: int = 0
    seconds: float = 0.0


def plan_batches(lengths: Sequence[int], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Example indices grouped by similar length (little padding), at most batch_tokens padded
    tokens per batch; the batch order is shuffled per epoch, reproducibly."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, cur, longest = [], [], 0
    for i in order:
        longest2 = max(longest, lengths[i])
        if cur and longest2 * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, longest2 = [], lengths[i]
        cur.append(i)
        longest = longest2
    if cur:
        batches.append(cur)
    random.Random(seed * 1000 + epoch).shuffle(batches)
    return batches


def lr_at(step: int, total: int, warmup_steps: int, base: float) -> float:
    if step < warmup_steps:
        return base * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total - warmup_steps)
    return base * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


class Trainer:
    def __init__(self, cfg: TrainConfig, params: list[torch.nn.Parameter],
                 step_fn: Callable[[list[int]], StepResult], lengths: Sequence[int],
                 save_model: Callable[[Path], None], load_model: Callable[[Path], None]):
        self.cfg, self.params, self.step_fn = cfg, params, step_fn
        self.lengths, self.save_model, self.load_model = list(lengths), save_model, load_model
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        per_epoch = len(plan_batches(self.lengths, cfg.batch_tokens, cfg.seed, 0))
        total = per_epoch * cfg.epochs
        if cfg.max_tokens:
            avg = max(1, sum(self.lengths) // max(1, per_epoch))
            total = min(total, max(1, math.ceil(cfg.max_tokens / avg)))
        self.total_steps = total
        self.warmup_steps = max(1, int(cfg.warmup * total))
        self.state = LoopState()
        self.ckpt_dir = Path(cfg.output) / "checkpoints"

    # ---- checkpoints ---------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        path = self.ckpt_dir / f"step-{self.state.step:07d}"
        tmp = path.with_suffix(".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self.save_model(tmp)
        torch.save({"optimizer": self.opt.state_dict(), "state": self.state.__dict__,
                    "total_steps": self.total_steps}, tmp / "trainer_state.pt")
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)           # a checkpoint is either complete or absent
        for old in sorted(self.ckpt_dir.glob("step-*"))[:-KEEP_CHECKPOINTS]:
            shutil.rmtree(old, ignore_errors=True)
        return path

    def latest_checkpoint(self) -> Path | None:
        done = [p for p in sorted(self.ckpt_dir.glob("step-*")) if (p / "trainer_state.pt").is_file()
                and p.suffix != ".tmp"]
        return done[-1] if done else None

    def resume(self) -> bool:
        path = self.latest_checkpoint()
        if path is None:
            log.warning("--resume: no checkpoint under %s; starting from step 0", self.ckpt_dir)
            return False
        self.load_model(path)
        saved = torch.load(path / "trainer_state.pt", weights_only=False)
        self.opt.load_state_dict(saved["optimizer"])
        self.state = LoopState(**saved["state"])
        log.info("resumed from %s (step %d, %d tokens)", path, self.state.step, self.state.tokens)
        return True

    # ---- the loop ------------------------------------------------------------------------
    def run(self) -> LoopState:
        cfg, st = self.cfg, self.state
        bar = tqdm(total=self.total_steps, initial=st.step, desc=f"train {cfg.kind}", unit="step",
                   dynamic_ncols=True, mininterval=2.0)
        start = time.perf_counter() - st.seconds
        while st.step < self.total_steps and st.epoch < cfg.epochs:
            batches = plan_batches(self.lengths, cfg.batch_tokens, cfg.seed, st.epoch)
            while st.batch_in_epoch < len(batches) and st.step < self.total_steps:
                self._one_step(batches[st.batch_in_epoch], bar)
                st.seconds = time.perf_counter() - start
                if st.step % cfg.checkpoint_every == 0:
                    self.save_checkpoint()
                if cfg.max_tokens and st.tokens >= cfg.max_tokens:
                    st.epoch = cfg.epochs          # the token budget is spent
                    break
            else:
                st.epoch += 1
                st.batch_in_epoch = 0
        bar.close()
        st.seconds = time.perf_counter() - start
        self.save_checkpoint()
        return st

    def _one_step(self, batch: list[int], bar) -> None:
        st = self.state
        lr = lr_at(st.step, self.total_steps, self.warmup_steps, self.cfg.lr)
        for group in self.opt.param_groups:
            group["lr"] = lr
        result = self.step_fn(batch)
        self.opt.zero_grad(set_to_none=True)
        result.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        self.opt.step()
        st.step += 1
        st.batch_in_epoch += 1
        st.tokens += result.tokens
        loss = float(result.loss.detach())
        rate = f" {st.tokens / st.seconds:.0f} tok/s" if st.seconds > 0 else ""     # tqdm adds the time left
        bar.set_postfix_str(f"loss={loss:.3f} " + " ".join(
            f"{k}={v:.2f}" for k, v in result.metrics.items()) + f" lr={lr:.1e}" + rate, refresh=False)
        bar.update(1)
        if st.step % 10 == 0 or st.step == 1:
            log.info("step %d/%d loss %.4f %s tokens %d", st.step, self.total_steps, loss,
                     json.dumps({k: round(v, 3) for k, v in result.metrics.items()}), st.tokens)
