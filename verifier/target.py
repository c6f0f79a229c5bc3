"""The target model as the engine sees it: weights, tokenizer, KV pools, one `forward`."""
from __future__ import annotations

import json
from contextlib import AbstractContextManager
from math import prod
from pathlib import Path

import torch
from torch import nn

from verifier.attention.kv_cache import KVCache
from verifier.batch import ForwardBatch, ForwardOutput
from verifier.cpu.cache import cache_root
from verifier.graphs.config import GraphConfig
from verifier.memory import MemoryReport, check_fits, resident_bytes
from verifier.model.config import ModelConfig
from verifier.model.gguf_quant import INDEX_FILE
from verifier.model.gemma import GemmaForCausalLM
from verifier.model.llama import LlamaForCausalLM, uninitialized
from verifier.model.loader import resolve_model_dir
from verifier.model.lora import LoraSet
from verifier.model.lora_adapter import check_lora_base
from verifier.model.shard import TensorShard, check_tp_quantization
from verifier.model.tokenizer import NullTokenizer, Tokenizer
from verifier.model.weights import load_checkpoint, load_tensor, materialize
from verifier.quantized.quantize import auto_quantization, check_quantization
from verifier.quantized.runner import QuantizedRunner
from verifier.runner import DenseRunner, RunnerSettings


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_config(model_dir: Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    try:
        return ModelConfig.from_hf(json.loads(path.read_text()))
    except json.JSONDecodeError as e:
        raise ValueError(f"malformed {path}: {e}") from e


def generation_eos_ids(model_dir: Path) -> tuple[int, ...]:
    """The eos ids of the checkpoint's generation_config.json: Llama 3 and Phi-3 list their
    end-of-turn tokens there, not in config.json. () without the file."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return ()
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except json.JSONDecodeError as e:
        raise ValueError(f"malformed {path}: {e}") from e
    return tuple(int(i) for i in (eos if isinstance(eos, list) else [] if eos is None else [eos]))


def load_tokenizer(model_dir: Path) -> Tokenizer | NullTokenizer:
    if not (Path(model_dir) / "tokenizer.json").is_file():
        return NullTokenizer()
    try:
        return Tokenizer(model_dir)
    except Exception as e:
        raise ValueError(f"no usable tokenizer files in {model_dir}: {e}") from e


def weight_bytes(model_dir: Path, quantized: bool, dtype: torch.dtype) -> int:
    """About what the weights will take: a GGUF's own bytes where served quantized (its packed
    layouts are within a tenth of them), its values in `dtype` where dequantized; a safetensors
    checkpoint's file sizes."""
    index = Path(model_dir) / INDEX_FILE
    meta = json.loads(index.read_text()) if index.is_file() else {}
    if "all" not in meta:
        return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    if quantized:
        return sum(t["nbytes"] for t in meta["all"])
    return sum(prod(t["shape"]) for t in meta["all"]) * dtype.itemsize


class TargetModel:
    """Owns the Llama module, its KV cache and its attention backend.

    `quantization`: "none" (the checkpoint's weights, dense), "int4" or "int8" (CPU
    kernels, see `verifier.quantized.quantize`), or "auto" (int4 for a Q4 GGUF, else none).
    `kernel_rows`: the row counts at which the quantized matmul paths are timed (cached per
    machine; `retime_kernels` times them again) on `tune_threads` threads (the most its forwards
    run on; None: the current count, on which the rest loads). `shard`: this process's rank of a
    tensor-parallel target (`verifier/parallel.py` starts the ranks); its modules and KV cache
    hold one slice (`verifier/model/shard.py`), dense weights only.

    What the engine calls (the target interface; `verifier/parallel.py:ParallelTarget` sends
    each of them to every rank): `allocate_kv`, `kv_bytes_per_block`, `forward`, `copy_slots`,
    `close`; drafters also read `config`, `tokenizer`, `device`, `dtype`, `kv` and
    `input_embedding()`."""

    def __init__(self, model: str, device: str | None = None, dtype: torch.dtype | None = None,
                 backend: str | None = None, load_tokenizer_files: bool = True,
                 quantization: str = "none", kernel_rows: tuple[int, ...] | None = None,
                 retime_kernels: bool = False, shard: TensorShard | None = None, tune_threads: int | None = None):
        self.model_dir = resolve_model_dir(model)
        self.config = load_config(self.model_dir)
        self.device = torch.device(device) if device else default_device()
        self.shard = shard or TensorShard()
        check_tp_quantization(quantization, self.shard.size)
        if quantization == "auto":
            quantization = "none" if self.shard.size > 1 else auto_quantization(self.model_dir, self.device)
        check_quantization(quantization, self.device)
        self.quantization = quantization
        runner = DenseRunner if quantization == "none" else QuantizedRunner       # the one choice
        self.dtype, self.kv_dtype = runner.dtypes(self.device, dtype)
        if self.device.type == "cpu":
            check_fits(f"model {model!r}", weight_bytes(self.model_dir, runner is QuantizedRunner, self.dtype))
        self.tokenizer = load_tokenizer(self.model_dir) if load_tokenizer_files else None
        with torch.device("meta"), uninitialized():
            net = (GemmaForCausalLM if self.config.gemma else LlamaForCausalLM)(self.config, self.shard)
        unloaded = runner.unloaded_params(self.model_dir, self.config.model_type)
        tied = frozenset({"lm_head.weight"} if self.config.tie_word_embeddings else ())    # the embedding's, below
        materialize(net, self.device, self.dtype, unloaded | tied)
        if self.config.tie_word_embeddings:
            net.lm_head.weight = net.model.embed_tokens.weight
        load_checkpoint(net, self.model_dir, self.shard, unloaded)
        net.init_rotary(self.device, self.dtype)
        self.net = net.eval()
        self.runner: DenseRunner | QuantizedRunner = runner(net, RunnerSettings(
            self.model_dir, quantization, self.device, backend, kernel_rows, cache_root() / "kernels", retime_kernels,
            tune_threads))
        self.kv: KVCache | None = None
        self._full_embedding: nn.Module | None = None

    def memory(self) -> MemoryReport:
        """What this target holds (under TP: this rank's), measured now."""
        kv = 0 if self.kv is None else self.kv.k.nbytes + self.kv.v.nbytes
        return MemoryReport(*self.runner.memory_parts(), kv, resident_bytes())

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        c = self.net.cfg            # this rank's KV heads: num_kv_heads / tensor_parallel_size
        self.kv = KVCache(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim,
                          self.kv_dtype, self.device)

    def kv_bytes_per_block(self, block_size: int) -> int:
        """On this device: under TP, one rank's KV heads."""
        c = self.net.cfg
        return KVCache.bytes_per_block(c.num_layers, block_size, c.num_kv_heads, c.head_dim, self.kv_dtype)

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """The KV commit of accepted tree nodes (`KVCache.copy_slots`), in every layer."""
        self.kv.copy_slots(src, dst)

    def input_embedding(self) -> nn.Module:
        """The whole token embedding (ids -> [T, hidden]) for a drafter that borrows it (EAGLE-3).
        Under TP the target's own is one rank's slice that all-reduces, which a drafter running on
        rank 0 alone cannot call: rank 0 then loads the whole table once, on first use."""
        if self.config.gemma is not None:
            return self.net.input_embedding()          # scaled by sqrt(hidden), as HF's module is
        if self.shard.size == 1:
            return self.net.model.embed_tokens
        if self._full_embedding is None:
            table = load_tensor(self.model_dir, "model.embed_tokens.weight").to(self.device, self.dtype)
            self._full_embedding = nn.Embedding.from_pretrained(table, freeze=True)
        return self._full_embedding

    def output_table(self) -> torch.Tensor:
        """The dense output head [vocab, hidden] fp32 as the checkpoint holds it (the embedding when
        tied), for an EAGLE-3 head that borrows its rows: the same numbers under any quantization."""
        try:
            table = load_tensor(self.model_dir, "lm_head.weight")
        except KeyError:
            table = load_tensor(self.model_dir, "model.embed_tokens.weight")
        return table.float()

    def enable_lora(self, max_loras: int, max_rank: int, dtype: torch.dtype = torch.float32) -> LoraSet:
        """Serve LoRA adapters on this target (`verifier.model.lora`), their weights held in
        `dtype`: load them into the set this returns; a forward's rows take theirs from
        `SeqInput.adapter`."""
        if self.shard.size > 1:
            raise ValueError("LoRA adapters are not served on a tensor-parallel target")
        check_lora_base(self.config)
        lora = LoraSet(self.config, max_loras, max_rank, dtype)
        self.runner.attach_lora(lora)
        return lora

    def graphs_refused(self, config: GraphConfig, lora: bool = False) -> str | None:
        """Why this target's steps stay eager under `config` (with LoRA adapters served where
        `lora`), or None where decode and verify steps run from fixed buffers (captured as CUDA
        graphs on CUDA; `verifier/graphs/`)."""
        if not config.enabled:
            return "CUDA graphs are off"
        if lora:
            return "LoRA adapters are served (their rows' slots are read on the host)"
        if self.device.type != "cuda" and not config.cpu_proof:
            return "a CPU target (graphs are CUDA's)"
        if not isinstance(self.runner, DenseRunner) or self.runner.backend.name != "triton":
            return "fixed-buffer steps need dense weights on the triton attention backend"
        if self.shard.size > 1:
            return "not under tensor parallelism"
        if self.config.moe is not None:
            return "a mixture of experts routes rows by counts read on the host"
        return None

    def graph_bytes_estimate(self, config: GraphConfig) -> int:
        """About what the graphs' memory pool will hold: the largest bucket's activations (every
        intermediate of a layer live at once, and the logits in the model's dtype and fp32), twice
        over. The GPU check reports the measured figure beside it."""
        c = self.config
        per_row = (5 * c.hidden_size + 2 * (c.q_size + c.kv_size) + 3 * c.intermediate_size) * self.dtype.itemsize \
            + c.vocab_size * (self.dtype.itemsize + 4)
        return 2 * config.max_rows * per_row

    def use_graphs(self, config: GraphConfig, max_model_len: int, scratch: list[int], taps: tuple[int, ...]) -> int:
        """Run decode and verify steps from fixed buffers, padded to `config`'s row buckets with
        padding rows on the `scratch` KV blocks (a whole bucket's worth, never a request's), and
        capture them as CUDA graphs on CUDA for forwards asking for `taps`. Returns the graphs'
        bytes. Only where `graphs_refused` gives None."""
        if (why := self.graphs_refused(config)) is not None:
            raise ValueError(f"steps stay eager here: {why}")
        return self.runner.use_static_step(config, self.kv, -(-max_model_len // self.kv.block_size), scratch, taps,
                                           capture=self.device.type == "cuda")

    def close(self) -> None:
        """Release what outlives the object (nothing on one rank; the worker ranks under TP)."""

    def one_layer_per_kind(self) -> AbstractContextManager:
        """Forwards inside run one layer of each kind where the runner can (`Runner.one_layer_per_kind`)."""
        return self.runner.one_layer_per_kind()

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, chunk_invariant: bool = True) -> ForwardOutput:
        """One forward over every sequence of the batch, on the runner chosen at load (the
        contract: `verifier/runner.py`). `chunk_invariant` False: a draft model's forward, whose
        prompt chunks need not give the same KV however they are chunked."""
        return self.runner.forward(batch, self.kv, chunk_invariant)
