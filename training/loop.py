"""The optimisation loop shared by both drafter kinds, on accelerate.

AdamW with linear warm-up and cosine decay, gradient clipping, a token budget, gradient
accumulation (`--grad-accum` micro-batches of `--batch-tokens` per optimiser step),
checkpoints every N steps (the model, accelerate's state: optimiser and random generators,
the schedule's position in the data) and resume from the newest one, a progress bar with the
loss and per-step accuracies.

Data parallel under a launcher (`accelerate launch --multi_gpu --num_processes N $(which
train-drafter) ...`, or torchrun on CPUs): each process trains on its shard of the examples
(example i goes to process i mod N, `shard`), every optimiser step averages the gradients over
the processes, and all run the same number of steps (the smallest shard's). The model is not wrapped for
DistributedDataParallel: the EAGLE-3 loop calls the head's parts, not its forward.
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
from accelerate import Accelerator
from accelerate.state import AcceleratorState
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
    def __init__(self, cfg: TrainConfig, accelerator, params: list[torch.nn.Parameter],
                 step_fn: Callable[[list[int]], StepResult], shard_lengths: Sequence[Sequence[int]],
                 save_model: Callable[[Path], None], load_model: Callable[[Path], None]):
        """`shard_lengths`: every process's examples' lengths (this process's at its index);
        `step_fn` takes indices into this process's shard."""
        self.cfg, self.acc, self.params, self.step_fn = cfg, accelerator, params, step_fn
        self.lengths = list(shard_lengths[accelerator.process_index])
        self.save_model, self.load_model = save_model, load_model
        self.opt = accelerator.prepare(torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95),
                                                         weight_decay=cfg.weight_decay))
        # optimiser steps per epoch: every process runs as many as the smallest shard allows
        self.per_epoch = max(1, min(len(plan_batches(lengths, cfg.batch_tokens, cfg.seed, 0))
                                    for lengths in shard_lengths) // cfg.grad_accum)
        total = self.per_epoch * cfg.epochs
        if cfg.max_tokens:
            avg = max(1, sum(map(sum, shard_lengths)) // max(1, self.per_epoch))
            total = min(total, max(1, math.ceil(cfg.max_tokens / avg)))
        self.total_steps = total
        self.warmup_steps = max(1, int(cfg.warmup * total))
        self.state = LoopState()
        self.ckpt_dir = Path(cfg.output) / "checkpoints"

    # ---- checkpoints ---------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        """Every process writes its part (accelerate's state: the optimiser, each process's
        random generators); the main process the model and the loop state, then renames."""
        acc, path = self.acc, self.ckpt_dir / f"step-{self.state.step:07d}"
        tmp = path.with_suffix(".tmp")
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        acc.save_state(str(tmp / "accelerate"))
        if acc.is_main_process:
            self.save_model(tmp)
            torch.save({"state": self.state.__dict__, "total_steps": self.total_steps}, tmp / "trainer_state.pt")
            shutil.rmtree(path, ignore_errors=True)
            tmp.rename(path)           # a checkpoint is either complete or absent
            for old in sorted(self.ckpt_dir.glob("step-*"))[:-KEEP_CHECKPOINTS]:
                shutil.rmtree(old, ignore_errors=True)
        acc.wait_for_everyone()
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
        if (path / "accelerate").is_dir():
            self.acc.load_state(str(path / "accelerate"))
        else:                          # a checkpoint from before the loop ran on accelerate
            self.opt.load_state_dict(saved["optimizer"])
        self.state = LoopState(**saved["state"])
        log.info("resumed from %s (step %d, %d tokens)", path, self.state.step, self.state.tokens)
        return True

    # ---- the loop ------------------------------------------------------------------------
    def run(self) -> LoopState:
        cfg, st, accum = self.cfg, self.state, self.cfg.grad_accum
        bar = tqdm(total=self.total_steps, initial=st.step, desc=f"train {cfg.kind}", unit="step",
                   dynamic_ncols=True, mininterval=2.0, disable=not self.acc.is_main_process)
        start = time.perf_counter() - st.seconds
        while st.step < self.total_steps and st.epoch < cfg.epochs:
            batches = plan_batches(self.lengths, cfg.batch_tokens, cfg.seed, st.epoch)[:self.per_epoch * accum]
            while st.batch_in_epoch < len(batches) and st.step < self.total_steps:
                self._one_step(batches[st.batch_in_epoch:st.batch_in_epoch + accum], bar)
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

    def _one_step(self, micro_batches: list[list[int]], bar) -> None:
        """One optimiser step over this process's micro-batches (accelerate scales each loss by
        the accumulation and steps the optimiser on the last), the gradients averaged over the
        processes; tokens count every process's."""
        acc, st = self.acc, self.state
        lr = lr_at(st.step, self.total_steps, self.warmup_steps, self.cfg.lr)
        for group in self.opt.param_groups:
            group["lr"] = lr
        tokens, losses = 0, []
        for micro in micro_batches:
            with acc.accumulate():
                result = self.step_fn(micro)
                acc.backward(result.loss)
                if acc.sync_gradients:
                    self._average_gradients()
                    acc.clip_grad_norm_(self.params, self.cfg.grad_clip)
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)
            tokens += result.tokens
            losses.append(float(result.loss.detach()))
        st.step += 1
        st.batch_in_epoch += len(micro_batches)
        st.tokens += int(acc.reduce(torch.tensor(tokens, device=acc.device), "sum"))
        loss = sum(losses) / len(losses)
        rate = f" {st.tokens / st.seconds:.0f} tok/s" if st.seconds > 0 else ""     # tqdm adds the time left
        bar.set_postfix_str(f"loss={loss:.3f} " + " ".join(
            f"{k}={v:.2f}" for k, v in result.metrics.items()) + f" lr={lr:.1e}" + rate, refresh=False)
        bar.update(1)
        if acc.is_main_process and (st.step % 10 == 0 or st.step == 1):
            log.info("step %d/%d loss %.4f %s tokens %d", st.step, self.total_steps, loss,
                     json.dumps({k: round(v, 3) for k, v in result.metrics.items()}), st.tokens)

    def _average_gradients(self) -> None:
        if self.acc.num_processes == 1:
            return
        for p in self.params:
            if p.grad is not None:
                p.grad.copy_(self.acc.reduce(p.grad, "mean"))


def shard(items: Sequence, rank: int, world: int) -> list:
    """Process `rank`'s share of `items` (every world-th from its index)."""
    return list(items[rank::world])


def make_accelerator(dtype: torch.dtype, grad_accum: int, cpu: bool | None = None):
    """The run's Accelerator: bf16 autocast or none, `grad_accum` micro-batches per step, on the
    device the launcher gives this process (`cpu`, or no GPU: the CPU)."""
    # accelerate keeps its precision per process: a process that trains twice (tests, the API) resets it
    AcceleratorState._reset_state()
    return Accelerator(cpu=not torch.cuda.is_available() if cpu is None else cpu,
                       gradient_accumulation_steps=grad_accum,
                       mixed_precision="bf16" if dtype == torch.bfloat16 else "no")
