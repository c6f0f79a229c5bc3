"""The target model as the engine sees it: weights, tokenizer, KV pools, one `forward`."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from verifier.attention import get_backend
from verifier.attention_tuning import AttentionTimings
from verifier.attention_tuning import tune as tune_attention
from verifier.batch import ForwardBatch, ForwardOutput, SeqInput
from verifier.cpu_forward import cpu_heads, cpu_layers, forward_rows, row_plan
from verifier.cpu_loop import native_layers
from verifier.config import ModelConfig
from verifier.gemma import GemmaForCausalLM, planned_window
from verifier.kernels import KernelPlan, KernelTimings, engine_rows
from verifier.kv_cache import KVCache
from verifier.linear_tuning import tune as tune_linear
from verifier.loader import cache_root, resolve_model_dir
from verifier.model import LlamaForCausalLM, uninitialized
from verifier.quantize import auto_quantization, check_quantization, quantize_model, timed_linears, tune
from verifier.shard import TensorShard, check_tp_quantization
from verifier.tokenizer import NullTokenizer, Tokenizer
from verifier.weights import load_safetensors, load_tensor


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    # bf16 matmuls measured much slower than fp32 on these CPUs (figures: docs/performance.md,
    # "bf16 against fp32"); on CUDA bf16 is the norm.
    return torch.bfloat16 if device.type == "cuda" else torch.float32


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


class TargetModel:
    """Owns the Llama module, its KV cache and its attention backend.

    `quantization`: "none" (the checkpoint's weights, dense), "int4" or "int8" (CPU
    kernels, see `verifier.quantize`), or "auto" (int4 for a Q4 GGUF, else none).
    `kernel_rows`: the row counts at which the quantized matmul paths are timed (cached per
    machine; `retime_kernels` times them again) on `tune_threads` threads (the most its forwards
    run on; None: the current count, on which the rest loads). `shard`: this process's rank of a
    tensor-parallel target (`verifier/parallel.py` starts the ranks); its modules and KV cache
    hold one slice (`verifier/shard.py`), dense weights only.

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
        # Quantized kernels take bf16 inputs and the residual stream stays fp32. Their KV cache is
        # bf16, as vLLM's is for a bf16 model: v is a bf16 matmul output already, and decode
        # attention is bound by reading the cache (see docs/quantization.md).
        self.dtype = dtype or (torch.float32 if quantization != "none" else default_dtype(self.device))
        self.kv_dtype = torch.bfloat16 if quantization != "none" else self.dtype
        self.tokenizer = load_tokenizer(self.model_dir) if load_tokenizer_files else None
        with torch.device("meta"), uninitialized():
            net = (GemmaForCausalLM if self.config.gemma else LlamaForCausalLM)(self.config, self.shard)
        net = net.to_empty(device=self.device).to(self.dtype)
        if self.config.tie_word_embeddings:
            net.lm_head.weight = net.model.embed_tokens.weight
        load_safetensors(net, self.model_dir, self.shard)
        net.init_rotary(self.device, self.dtype)
        self.kernel_plan: KernelPlan | None = None
        self.kernel_timings: KernelTimings | None = None
        if quantization != "none":
            decoder = quantize_model(net, self.config, quantization, self.model_dir)
            self.kernel_plan, self.kernel_timings = tune(
                decoder, net.lm_head, kernel_rows or engine_rows(512),
                {"model": str(self.model_dir), "quantization": quantization}, cache_root() / "kernels",
                retime_kernels, timed_linears(net), tune_threads)
        self.net = net.eval()
        # dense fp32 on the CPU: where MKL gives way to oneDNN, timed on this machine
        self.linear_timings = tune_linear(net, cache_root() / "kernels", retime_kernels, tune_threads) \
            if quantization == "none" and self.device.type == "cpu" else None
        self._cpu_layers = cpu_layers(net) if quantization != "none" else []
        self._cpu_heads = cpu_heads(net) if quantization != "none" else None
        self.attention_timings: AttentionTimings | None = None
        if self._cpu_heads is not None:
            self.attention_timings = tune_attention(self._cpu_heads, cache_root() / "kernels", retime_kernels,
                                                    tune_threads)
        # sampled rows run the layers in one C++ call where it builds (verifier/cpu_loop.py)
        self._cpu_native = native_layers(self.config, self._cpu_heads, self._cpu_layers, net.model.norm,
                                         net.lm_head) if self._cpu_layers else None
        if quantization != "none" and backend not in (None, "torch"):
            raise ValueError(f"quantization {quantization!r} attends with Tercel's CPU kernels, not {backend!r}")
        self.backend = get_backend(backend or ("triton" if self.device.type == "cuda" else "torch"))
        self.kv: KVCache | None = None
        self._full_embedding: nn.Module | None = None

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

    def close(self) -> None:
        """Release what outlives the object (nothing on one rank; the worker ranks under TP)."""

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, chunk_invariant: bool = True) -> ForwardOutput:
        """One forward over every sequence of the batch. On a quantized target each sequence
        splits at its first sampled token: the tokens before it (prompt rows) run first, on
        the plan's dense path in tiles; the sampled ones (a prompt's last token, decode
        steps, tree nodes) after them, on the weights' own kernels (`verifier.cpu_forward`).
        Outputs come back in batch order. `chunk_invariant` False (a draft model, whose
        proposals need only be cheap): a sequence with fewer prompt rows than the plan's
        `own_below` runs whole on the own kernels, so its KV depends on how it was chunked."""
        if self.kernel_plan is None:
            return self._forward_modules(batch)
        whole_below = 1 if chunk_invariant else self.kernel_plan.own_below
        halves = [split_at_first_sample(s, whole_below) for s in batch.seqs]
        parts = []
        for side in (0, 1):                                  # prompt rows first: the rest attends to them
            idx = [i for i, h in enumerate(halves) if h[side] is not None]
            if idx:
                sub = ForwardBatch([halves[i][side] for i in idx], batch.capture_layers)
                parts.append((side, idx, self._forward_rows(sub, own=side == 1)))
        if len(parts) == 1 and all(h[parts[0][0]] is s for h, s in zip(halves, batch.seqs)):
            return parts[0][2]                # nothing was split: the output is already in order
        return _merge(batch, halves, parts)

    def _forward_modules(self, batch: ForwardBatch) -> ForwardOutput:
        ids, positions, rows, offsets = _flatten(batch)
        dev = self.device
        meta = self.backend.plan(batch, self.kv.block_size, dev, planned_window(self.config))
        logits, taps = self.net(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev),
                                torch.tensor(rows, dtype=torch.long, device=dev), self.kv, self.backend, meta,
                                batch.capture_layers)
        return ForwardOutput(logits, offsets, taps)

    def _forward_rows(self, batch: ForwardBatch, own: bool) -> ForwardOutput:
        ids, _, rows, offsets = _flatten(batch)
        cfg = self.net.cfg
        plan = row_plan(batch.seqs, self.kv.block_size, cfg.num_heads // cfg.num_kv_heads)
        tokens = [t for s in batch.seqs for t in (s.logits_tokens or [None] * len(s.sample_indices))]
        logits, taps = forward_rows(self.net, self._cpu_heads, self._cpu_layers, torch.tensor(ids), plan,
                                    self.kv, torch.tensor(rows, dtype=torch.long), batch.capture_layers, own,
                                    self._cpu_native, tokens if any(t is not None for t in tokens) else None)
        return ForwardOutput(logits, offsets, taps)


def split_at_first_sample(seq: SeqInput, whole_below: int = 1) -> tuple[SeqInput | None, SeqInput | None]:
    """(the new tokens before the first sampled one, the rest): a prompt chunk's unsampled
    tokens and its last token; a decode step or a tree is all rest (so is a masked input, and
    one with fewer than `whole_below` tokens before its first sampled one)."""
    first = seq.first_sampled
    if first < whole_below or seq.mask is not None:
        return None, seq
    if first == seq.num_new:
        return seq, None
    pos = seq.positions
    head = SeqInput(seq.token_ids[:first], seq.ctx_len, seq.block_table, pos and pos[:first], logits_indices=[])
    tail = SeqInput(seq.token_ids[first:], seq.ctx_len + first, seq.block_table, pos and pos[first:],
                    logits_indices=[i - first for i in seq.sample_indices], logits_tokens=seq.logits_tokens)
    return head, tail


def _flatten(batch: ForwardBatch):
    ids, positions, rows, offsets, t = [], [], [], [0], 0
    for s in batch.seqs:
        ids += s.token_ids
        positions += s.positions if s.positions is not None else list(range(s.ctx_len, s.kv_len))
        rows += [t + i for i in s.sample_indices]
        offsets.append(len(rows))
        t += s.num_new
    return ids, positions, rows, offsets


def _merge(batch: ForwardBatch, halves: list[tuple[SeqInput | None, SeqInput | None]],
           parts: list[tuple[int, list[int], ForwardOutput]]) -> ForwardOutput:
    """The prompt-row and sampled-row forwards' outputs (`parts`: side, batch indices, output,
    prompt side first) in batch order; a sequence's prompt rows precede its sampled rows."""
    logits: list[list[torch.Tensor]] = [[] for _ in batch.seqs]
    hidden: list[list[dict[int, torch.Tensor]]] = [[] for _ in batch.seqs]
    for side, idx, out in parts:
        row = 0
        for j, i in enumerate(idx):
            rows = halves[i][side].num_new
            logits[i].append(out.seq_logits(j))
            hidden[i].append({layer: h[row:row + rows] for layer, h in out.hidden.items()})
            row += rows
    offsets = [0]
    for parts_i in logits:
        offsets.append(offsets[-1] + sum(p.shape[0] for p in parts_i))
    taps = {layer: torch.cat([h[layer] for seq in hidden for h in seq]) for layer in batch.capture_layers}
    return ForwardOutput(torch.cat([p for parts_i in logits for p in parts_i]), offsets, taps)
