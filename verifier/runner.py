"""What runs a target's forwards: `TargetModel` chooses one runner at load, the dense one
here or the quantized CPU one (`verifier/quantized/runner.py`), and hands every forward to it.

The contract the engine relies on, whichever runs (`Runner.forward`):
- Rows: a forward covers every sequence of the batch; each sequence's new tokens are written
  to their KV slots in every layer, attend to their context and, under a tree mask, to their
  ancestors; the logits come back for each sequence's `sample_indices` rows, in batch order
  (`ForwardOutput.seq_logits`), with the hidden states entering each of `capture_layers` for
  every new token (the taps an EAGLE-3 head reads).
- Row invariance: a row's logits, taps and KV depend on its own tokens and context, not on the
  rows sharing the call, nor on how a prompt was chunked (the T=0 identity of speculative and
  plain decoding rests on it; docs/design.md, "The exactness contract"). A caller that does
  not need the chunking part (a draft model, `chunk_invariant=False`) may get faster prompt
  chunks instead.
"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from verifier.attention import get_backend
from verifier.attention.kv_cache import KVCache
from verifier.batch import ForwardBatch, ForwardOutput, flatten
from verifier.graphs.config import GraphConfig
from verifier.graphs.cuda_graphs import StepGraphs
from verifier.graphs.static_step import StaticStep
from verifier.memory import tensor_bytes
from verifier.model.gemma import planned_window
from verifier.model.lora import LoraSet, adapter_rows, hook_dense
from verifier.model.linear_tuning import LinearTimings
from verifier.model.linear_tuning import tune as tune_linear


@dataclass(frozen=True)
class RunnerSettings:
    """What a runner is built with besides the model: `TargetModel`'s arguments."""
    model_dir: Path
    quantization: str                         # "none" for the dense runner
    device: torch.device
    backend: str | None                       # the attention backend asked (None: the device's)
    kernel_rows: tuple[int, ...] | None       # row counts the quantized paths are timed at
    cache_dir: Path                           # where timings are cached per machine
    retime: bool                              # time again instead of reading the cache
    tune_threads: int | None                  # the thread count timings are taken on


class Runner(Protocol):
    def memory_parts(self) -> tuple[int, int, int]:
        """Bytes held: (the decoder's projections, the embedding and head tables, everything else)."""

    def forward(self, batch: ForwardBatch, kv: KVCache, chunk_invariant: bool = True) -> ForwardOutput:
        """One forward over the batch (the contract in the module docstring)."""

    def one_layer_per_kind(self) -> AbstractContextManager:
        """Forwards inside may run one layer of each kind (every kernel on every shape), for checks
        of the kernels' bits; outside, the whole model."""


def default_dtype(device: torch.device) -> torch.dtype:
    # bf16 matmuls measured much slower than fp32 on these CPUs (figures: docs/performance.md,
    # "bf16 against fp32"); on CUDA bf16 is the norm.
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class DenseRunner:
    """The checkpoint's weights as they are: the model's modules over the attention backend
    (torch's on the CPU, Triton's on CUDA, or the one named). On the CPU, where MKL gives way to
    oneDNN by row count is timed on this machine at load (`verifier/model/linear_tuning.py`)."""

    @staticmethod
    def dtypes(device: torch.device, dtype: torch.dtype | None) -> tuple[torch.dtype, torch.dtype]:
        """(the modules' dtype, the KV cache's): the asked one or the device's default, for both."""
        dtype = dtype or default_dtype(device)
        return dtype, dtype

    @staticmethod
    def unloaded_params(model_dir: Path, model_type: str) -> frozenset[str]:
        """Parameters the target leaves unallocated for the runner to fill: none, all are dense."""
        return frozenset()

    def __init__(self, net: nn.Module, settings: RunnerSettings):
        self.net, self.device = net, settings.device
        self.backend = get_backend(settings.backend or ("triton" if self.device.type == "cuda" else "torch"))
        self.linear_timings: LinearTimings | None = None
        self.lora: LoraSet | None = None
        self.static: StaticStep | StepGraphs | None = None   # decode and verify steps from fixed buffers
        self.static_taps: tuple[int, ...] = ()
        if self.device.type == "cpu":
            self.linear_timings = tune_linear(net, settings.cache_dir, settings.retime, settings.tune_threads)

    def memory_parts(self) -> tuple[int, int, int]:
        """Bytes held: (the decoder's projections, the embedding and head, everything else)."""
        params = dict(self.net.named_parameters())
        tables = [t for n, t in params.items() if n.startswith(("model.embed_tokens.", "lm_head."))]
        weights = [t for n, t in params.items() if n.endswith("_proj.weight") or ".experts." in n]
        rest = [t for t in [*params.values(), *self.net.buffers()]
                if not any(t is u for u in tables + weights)]
        return tensor_bytes(weights), tensor_bytes(tables), tensor_bytes(rest)

    def forward(self, batch: ForwardBatch, kv: KVCache, chunk_invariant: bool = True) -> ForwardOutput:
        rows = self._static_rows(batch)
        if rows is not None:
            return self.static.forward(batch, rows)
        ids, positions, rows, offsets = flatten(batch)
        dev = self.device
        meta = self.backend.plan(batch, kv.block_size, dev, planned_window(self.net.cfg))
        with adapter_rows(self.lora, batch, dev):
            logits, taps = self.net(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev),
                                    torch.tensor(rows, dtype=torch.long, device=dev), kv, self.backend, meta,
                                    batch.capture_layers)
        return ForwardOutput(logits, offsets, taps)

    def use_static_step(self, config: GraphConfig, kv: KVCache, max_blocks_per_seq: int, scratch: list[int],
                        taps: tuple[int, ...], capture: bool) -> int:
        """Run decode and verify steps padded to row buckets from fixed buffers (`verifier/graphs/`),
        replayed as CUDA graphs where `capture`, for forwards asking for `taps`. Returns the
        graphs' memory in bytes (0 uncaptured). Other steps, and any under a LoRA adapter, stay eager."""
        if self.backend.name != "triton":
            raise ValueError(f"fixed-buffer steps run on the triton backend, not {self.backend.name!r}")
        step = StaticStep(self.net, self.backend, kv, config, max_blocks_per_seq, scratch)
        self.static, self.static_taps = (StepGraphs(step, taps) if capture else step), taps
        return self.static.bytes if capture else 0

    def _static_rows(self, batch: ForwardBatch) -> int | None:
        """The bucket a forward runs in from the fixed buffers, or None: eager."""
        if self.static is None or self.lora is not None or batch.capture_layers != self.static_taps:
            return None
        return self.static.rows_for(batch)

    def one_layer_per_kind(self) -> AbstractContextManager:
        """The whole model still: torch's modules split their work their own way, per layer."""
        return nullcontext()

    def attach_lora(self, lora: LoraSet) -> None:
        """Serve `lora`'s adapters: the projections add their rows' products (forward hooks), by
        the Triton kernels on the Triton backend."""
        hook_dense(self.net, lora, triton=self.backend.name == "triton")
        self.lora = lora

