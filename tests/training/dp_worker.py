"""One process of tests/training/test_training.py's data-parallel check, run as a launcher runs it (RANK,
WORLD_SIZE, MASTER_ADDR/PORT in the environment, or none: one process). A least-squares toy
trained by training/loop.py:Trainer on this process's shard of 8 examples for one optimiser
step; writes the gradient the optimiser stepped on and the final weights to argv[1].

    python tests/training/dp_worker.py OUT GRAD_ACCUM BATCH_TOKENS
"""
import sys
from pathlib import Path

import torch

from training.config import TrainConfig
from training.loop import StepResult, Trainer, make_accelerator, shard

EXAMPLES, LENGTH = 8, 4            # every example LENGTH tokens long


def main(out: str, accum: int, batch_tokens: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(EXAMPLES, 3)
    y = x @ torch.tensor([1.0, -2.0, 0.5])
    w = torch.nn.Parameter(torch.zeros(3))
    acc = make_accelerator(torch.float32, accum, cpu=True)
    rank, world = acc.process_index, acc.num_processes
    mine = shard(list(range(EXAMPLES)), rank, world)

    def step(batch: list[int]) -> StepResult:
        idx = [mine[i] for i in batch]
        return StepResult(((x[idx] @ w - y[idx]) ** 2).mean(), LENGTH * len(idx), {})

    cfg = TrainConfig(kind="eagle3", data=("toy",), output=str(Path(out).parent / f"run-{rank}"), lr=0.1,
                      warmup=0.0, grad_clip=1e9, batch_tokens=batch_tokens, grad_accum=accum,
                      checkpoint_every=1000)
    lengths = [[LENGTH] * len(shard(range(EXAMPLES), r, world)) for r in range(world)]
    trainer = Trainer(cfg, acc, [w], step, lengths, save_model=lambda p: None, load_model=lambda p: None)
    grads = []
    acc.clip_grad_norm_ = lambda params, max_norm: grads.append(w.grad.clone())   # after the averaging
    state = trainer.run()
    torch.save({"grads": grads, "w": w.detach(), "steps": state.step, "tokens": state.tokens,
                "world": world}, out)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
