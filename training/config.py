"""`train-drafter` options: one frozen dataclass, checked once."""
from __future__ import annotations

from dataclasses import dataclass

from spec.config import QUANTIZATION_CHOICES
from verifier.checks import positive_ints
from verifier.model.loader import DEFAULT_MODEL


@dataclass(frozen=True)
class TrainConfig:
    kind: str                          # eagle3 | small
    data: tuple[str, ...]              # JSONL files or directories of them
    output: str                        # the trained drafter (and checkpoints/) go here
    target: str = DEFAULT_MODEL
    quantization: str = "auto"         # the target as it serves: regeneration, features and evaluation
                                       # run it (auto: as LLM loads it; int4 for GGUF Q4 on the CPU)
    # data
    limit_per_source: int | None = None  # seeded sample of at most this many conversations per source
    max_len: int = 1024                # tokens per conversation after templating
    regenerate: bool = False           # replace replies by the target's own (self-distillation)
    regenerate_only: bool = False      # write the regenerated replies and stop (a CPU's part, a GPU trains)
    regen_max_tokens: int = 256
    regen_temperature: float = 0.0
    regen_batch: int = 32              # replies generated at once (a GPU takes more)
    feature_cache: str | None = None   # directory for cached target features (eagle3)
    # model
    draft_vocab: int = 4096            # eagle3: rows of the head's LM head
    ttt_steps: int = 7                 # eagle3: draft steps unrolled in training (the paper's 7)
    step_decay: float = 0.8            # eagle3: loss weight of step s is decay**s
    init_from_target: bool = True      # eagle3: start the head from the target's last layer and LM head
    lm_head_from_target: bool = False  # eagle3: LM head = the target's draft-vocabulary rows, frozen, not saved
    small_layers: int = 4              # small: decoder layers of the distilled model
    # optimisation
    epochs: int = 1
    max_tokens: int | None = None      # stop after this many trained tokens (all epochs together)
    batch_tokens: int = 4096           # padded tokens per micro-batch
    grad_accum: int = 1                # micro-batches per optimiser step (per process)
    lr: float = 5e-4
    warmup: float = 0.03               # share of steps with a linear warm-up
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    dtype: str = "auto"                # fp32 | bf16 | auto: the faster here (training/precision.py)
    checkpoint_every: int = 100        # optimiser steps
    resume: bool = False
    seed: int = 0
    # evaluation
    eval_data: str | None = None       # held-out JSONL (or directory): mean accepted length
    eval_prompts: int = 20
    eval_tokens: int = 64
    threads: int | None = None

    def __post_init__(self):
        if self.kind not in ("eagle3", "small"):
            raise ValueError(f"--kind must be eagle3 or small, got {self.kind!r}")
        if not self.data:
            raise ValueError("give at least one --data file or directory")
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, "
                             f"got {self.quantization!r}")
        if self.dtype not in ("fp32", "bf16", "auto"):
            raise ValueError(f"--dtype must be fp32, bf16 or auto, got {self.dtype!r}")
        positive_ints(self, ("max_len", "draft_vocab", "ttt_steps", "epochs", "batch_tokens", "grad_accum",
                             "checkpoint_every",
                             "eval_prompts", "eval_tokens", "small_layers", "regen_max_tokens", "regen_batch"),
                      flag=True)
        if not 0 <= self.warmup < 1:
            raise ValueError(f"--warmup is a share of the steps in [0, 1), got {self.warmup}")
        if self.lr <= 0 or self.grad_clip <= 0 or not 0 < self.step_decay <= 1:
            raise ValueError("--lr and --grad-clip must be > 0 and --step-decay in (0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {self.max_tokens}")
