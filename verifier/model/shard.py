"""Tensor parallelism: which slice of each Llama weight one rank holds (Megatron-style).

Over N ranks (`TensorShard.size`), rank r holds:

| weight | split | rank r's part |
|---|---|---|
| q_proj, k_proj, v_proj (+ bias) | column-parallel, by head | query heads r*H/N .. (r+1)*H/N, KV heads r*KVH/N .. |
| gate_proj, up_proj | column-parallel | intermediate columns r*I/N .. (r+1)*I/N |
| o_proj, down_proj | row-parallel (input columns) | the same heads / columns; partial sums all-reduced |
| embed_tokens, lm_head | vocabulary-parallel | token ids r*V/N .. (r+1)*V/N |
| the norms | replicated | all of it |

Query head h reads KV head h // (H/KVH), so a rank's query heads read only its own KV heads
and its KV cache holds KVH/N heads. The collectives live in `verifier/model/parallel_layers.py`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from verifier.checks import positive_int
from verifier.model.config import ModelConfig

# HF weight-name part -> the dimension split across ranks (0: output rows, 1: input columns)
FUSED_CHECKPOINTS = ("phi3",)    # model types whose files store qkv_proj and gate_up_proj fused
_SPLIT_DIM = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0,
              "o_proj": 1, "down_proj": 1, "embed_tokens": 0, "lm_head": 0}


@dataclass(frozen=True)
class WeightSlice:
    """Rows (dim 0) or columns (dim 1) start .. stop of a checkpoint tensor."""
    dim: int
    start: int
    stop: int


@dataclass(frozen=True)
class TensorShard:
    rank: int = 0            # this process's rank; rank 0 runs the engine
    size: int = 1            # tensor_parallel_size: ranks sharing every layer

    def __post_init__(self):
        positive_int("tensor_parallel_size", self.size)
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.size:
            raise ValueError(f"rank must be an int in [0, {self.size}), got {self.rank!r}")

    def check(self, cfg: ModelConfig) -> None:
        """ValueError unless every split dimension divides evenly by the number of ranks, and the
        checkpoint stores its projections apart (a Phi-3 file's fused qkv_proj and gate_up_proj
        would need slicing per part, which `slice_of` does not do), and has no experts (Mixtral,
        Qwen3-MoE: `slice_of` splits no expert or router)."""
        if self.size > 1 and cfg.model_type in FUSED_CHECKPOINTS:
            raise ValueError(f"tensor parallelism does not split {cfg.model_type} checkpoints yet (their q/k/v and "
                             f"gate/up projections are stored fused); use tensor_parallel_size=1")
        if self.size > 1 and cfg.moe is not None:
            raise ValueError(f"tensor parallelism does not split {cfg.model_type} checkpoints yet (mixture-of-experts "
                             f"layers: {cfg.moe.num_experts} routed experts); use tensor_parallel_size=1")
        for name, n in (("num_attention_heads", cfg.num_heads), ("num_key_value_heads", cfg.num_kv_heads),
                        ("intermediate_size", cfg.intermediate_size), ("vocab_size", cfg.vocab_size)):
            if n % self.size:
                raise ValueError(f"tensor_parallel_size {self.size} must divide the model's {name} ({n}); "
                                 f"choose a size that divides it")

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The shapes this rank's modules have: heads, intermediate size and vocabulary / N."""
        self.check(cfg)
        n = self.size
        return replace(cfg, num_heads=cfg.num_heads // n, num_kv_heads=cfg.num_kv_heads // n,
                       intermediate_size=cfg.intermediate_size // n, vocab_size=cfg.vocab_size // n)

    def vocab_start(self, vocab_size: int) -> int:
        """The first token id of this rank's vocabulary slice (vocab_size: the full vocabulary)."""
        return self.rank * (vocab_size // self.size)

    def slice_of(self, name: str, shape: tuple[int, ...]) -> WeightSlice | None:
        """This rank's part of checkpoint tensor `name` (HF naming); None: replicated."""
        part = next((p for p in name.split(".") if p in _SPLIT_DIM), None)
        if part is None or self.size == 1:
            return None
        dim = _SPLIT_DIM[part]
        if dim >= len(shape):          # a 1-D bias of a row-parallel layer: not split
            return None
        step = shape[dim] // self.size
        return WeightSlice(dim, self.rank * step, (self.rank + 1) * step)


def check_tp_quantization(quantization: str, size: int) -> None:
    """The quantized CPU path (verifier/quantized/cpu_forward.py) is not sharded: TP runs dense weights."""
    if size > 1 and quantization not in ("auto", "none"):
        raise ValueError(f"quantization {quantization!r} is not sharded: tensor_parallel_size > 1 "
                         "runs dense weights; pass quantization='none' (or 'auto', which picks it)")
