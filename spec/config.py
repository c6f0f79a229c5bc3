"""Engine configuration: one frozen dataclass, validated once, passed down."""
from __future__ import annotations

from dataclasses import dataclass

from drafters.config import SpecConfig
from spec.adaptive import AdaptiveConfig
from spec.threads import ThreadConfig
from verifier.checks import positive_int
from verifier.graphs.config import GraphConfig
from verifier.model.loader import DEFAULT_MODEL
from verifier.model.lora import DEFAULT_MAX_LORAS, DEFAULT_MAX_RANK
from verifier.model.shard import check_tp_quantization
from verifier.quantized import MODES
from verifier.sampling.grammar_limits import GrammarLimits

QUANTIZATION_CHOICES = ("auto", *MODES, "none")


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL            # alias, .gguf file or HF directory
    max_num_seqs: int = 16                # requests decoding together (continuous batching)
    max_num_batched_tokens: int = 512     # new tokens per forward: bounds prefill chunks
    max_model_len: int | None = None      # None: the model's max positions, at most 8192
    block_size: int = 16                  # tokens per KV block
    num_kv_blocks: int | None = None      # None: as many as kv_cache_bytes holds
    kv_cache_bytes: int = 1 << 30         # KV pool size per device when num_kv_blocks is None
    enable_prefix_cache: bool = True      # share KV of identical full-block prompt prefixes
    seed: int = 0                         # seeds the generators of requests without a seed
    # CPU threads at most; None: as many as the affinity mask and the cgroup's CPU quota allow
    # (verifier/cpu/cpus.py), or torch's count where that is lower. Steps run on fewer while that
    # measures faster (spec/threads.py).
    num_threads: int | None = None
    thread_tuning: ThreadConfig = ThreadConfig()   # adaptive=False: always num_threads
    device: str | None = None             # None: cuda if available, else cpu
    attention_backend: str | None = None  # None: triton on cuda, torch on cpu
    # CPU weights: "int4" / "int8" kernels, "gguf" (each GGUF tensor on its own blocks), "none"
    # (dense, the checkpoint's dtype) or "auto": int4 for a Q4 GGUF, gguf for other quantized
    # GGUFs (K-quants, Q5_0, Q8_0), none otherwise and on CUDA (verifier/quantized/quantize.py)
    quantization: str = "auto"
    # Ranks (devices) sharing every layer of the target (verifier/parallel.py): NCCL on CUDA,
    # gloo on CPU. Above 1 the target runs dense weights: quantization "auto" picks "none".
    tensor_parallel_size: int = 1
    # On CUDA, decode and verify steps replay graphs captured at load per row bucket (verifier/graphs/);
    # GraphConfig(enabled=False) runs every step eagerly.
    graphs: GraphConfig = GraphConfig()
    drafter: str | None = None            # None: plain decoding; "ngram", "small:PATH", "tree:SPEC"
    speculation: "SpecConfig" = None      # None: the drafter's own default tree (SpecConfig() for most)
    adaptive: AdaptiveConfig = AdaptiveConfig()  # verify the draft nodes that pay (enabled=False: whole trees)
    # Constrained requests verify the tokens their grammar forces as a drafted chain, with or
    # without a drafter (spec/constraints.py); False samples them one step each.
    jump_forward: bool = True
    # What compiling a constraint may cost (size, depth, caches; a time limit runs it in a
    # child process): the server sets a time limit, the offline API compiles in-process.
    grammar: GrammarLimits = GrammarLimits()
    # What a request's logprobs are: "raw" (the forward's logits, as vLLM's default) or
    # "processed" (the distribution sampled from); verifier/sampling/logprobs.py
    logprobs_mode: str = "raw"
    # LoRA adapters served beside the base (PEFT folders): ((name, path), ...), or a dict of them;
    # a request names one to run under it (verifier/model/lora.py). At most max_loras at once,
    # each of rank at most max_lora_rank.
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_loras: int = DEFAULT_MAX_LORAS
    max_lora_rank: int = DEFAULT_MAX_RANK
    lora_dtype: str = "float32"           # the adapters' weights as held: "float32" or "bfloat16"
    # The drafter's own adapters, by the served adapter's name: its requests are drafted under
    # them (a `small:` drafter's LoRA adapter, an `eagle3` drafter's head trained on the adapted
    # model); other requests are drafted for the base.
    draft_lora_modules: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        for name in ("lora_modules", "draft_lora_modules"):
            if isinstance(getattr(self, name), dict):
                object.__setattr__(self, name, tuple((str(k), str(v)) for k, v in getattr(self, name).items()))
        served = {n for n, _ in self.lora_modules}
        for name, _ in self.draft_lora_modules:
            if name not in served:
                raise ValueError(f"draft_lora_modules names {name!r}, an adapter lora_modules does not serve")
        if self.draft_lora_modules and not self.drafter:
            raise ValueError("draft_lora_modules needs a drafter with a model of its own (small:PATH, eagle3)")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_bytes",
                     "tensor_parallel_size", "max_loras", "max_lora_rank"):
            positive_int(name, getattr(self, name))
        for name in ("max_model_len", "num_kv_blocks", "num_threads"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))
        if self.lora_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"lora_dtype must be 'float32' or 'bfloat16', got {self.lora_dtype!r}")
        if self.logprobs_mode not in ("raw", "processed"):
            raise ValueError(f"logprobs_mode must be 'raw' or 'processed', got {self.logprobs_mode!r}")
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, "
                             f"got {self.quantization!r}")
        check_tp_quantization(self.quantization, self.tensor_parallel_size)
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty string, got {self.model!r}")
        if self.speculation is not None and not isinstance(self.speculation, SpecConfig):
            raise ValueError(f"speculation must be a SpecConfig, got {type(self.speculation).__name__}")


