"""The LoRA adapters a target serves, and their products added to its projections row by row.

Each adapter holds a slot (1 .. max_loras; 0 is the base). A forward's rows each take a slot
(`SeqInput.adapter`); the runner sets them for the forward (`rows`), and every projection's
output then gets, on the rows of each adapter that adapts it, (x A^T) B^T added in fp32 (QLoRA's
way on a quantized base: the delta beside the quantized kernel's output). Rows of the base, and
projections an adapter leaves alone, keep their bits.

Three ways to the same rule: a quantized target calls the C kernel (`add_c`, csrc/lora.c: every
adapter's rows in one call, from its native layer loop or its Python layers); a dense target's
projections call, through forward hooks, the Triton kernels on the Triton backend (`add_triton`,
lora_triton.py: two launches per projection, the weights stacked on the device once per change)
and `add` (torch) on the others.

A row's delta must not depend on the rows beside it (T=0 speculation against plain decoding, a
prompt in any chunking): the C kernel computes each row alone in one fixed order, and `add` runs
its products on tiles of a fixed row count (`row_tiles`), so a row alone and the same row among
others take the same kernel.
"""
from __future__ import annotations

import secrets
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import ContextManager, Iterator

import torch
from torch import nn

from verifier.batch import ForwardBatch
from verifier.cpu import cpu_ops
from verifier.model.config import ModelConfig
from verifier.model.lora_adapter import LoraAdapter, load_adapter
from verifier.model.row_tiles import in_row_tiles

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")     # a layer's, in forward order
LORA_TILE = 16          # rows per product: the rank is small, a decode row pays for 15 padded ones
DEFAULT_MAX_LORAS, DEFAULT_MAX_RANK = 4, 64


class LoraSet:
    """The adapters loaded for one target (by name, each in a slot) and the current forward's
    rows: which slot each takes."""

    def __init__(self, cfg: ModelConfig, max_loras: int = DEFAULT_MAX_LORAS, max_rank: int = DEFAULT_MAX_RANK,
                 dtype: torch.dtype = torch.float32):
        """`dtype`: the adapters' weights as held, torch.float32 or torch.bfloat16 (half the bytes
        a step streams per adapter; products and sums stay fp32)."""
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {max_loras} and {max_rank}")
        self.cfg, self.max_loras, self.max_rank, self.dtype = cfg, max_loras, max_rank, dtype
        self.slots: dict[str, int] = {}
        self._adapters: dict[int, LoraAdapter] = {}
        self._tags: dict[int, bytes] = {}       # slot -> this load's own bytes (prefix-cache namespace)
        self.row_slots: torch.Tensor | None = None      # this forward's slot per row (None: outside one)
        self._device = torch.device("cpu")
        self._groups: list[tuple[LoraAdapter, torch.Tensor]] | None = None  # its rows per adapter, for `add`
        self.version = 0                # bumped by every load and unload (the C tables follow it)
        self._tables: dict[tuple[int, str], cpu_ops.LoraTable] = {}
        self._tables_version = -1
        self._stacks: dict = {}         # (layer, projection) -> lora_triton.LoraStack on the device
        self._stacks_version = -1
        self._device_slots: torch.Tensor | None = None      # row_slots on the device, for the kernels

    def load(self, name: str, path: str | Path) -> int:
        """Load the adapter at `path` as `name`; its slot. ValueError (nothing loaded) where the
        name is taken, every slot is, or the adapter does not fit (`load_adapter`)."""
        if not name or name in self.slots:
            raise ValueError(f"LoRA adapter name {name!r} is {'empty' if not name else 'already loaded'}")
        free = next((s for s in range(1, self.max_loras + 1) if s not in self._adapters), None)
        if free is None:
            raise ValueError(f"cannot load LoRA adapter {name!r}: all {self.max_loras} slots (max_loras) are taken")
        self._adapters[free] = load_adapter(name, path, self.cfg, self.max_rank, self.dtype)
        self._tags[free] = secrets.token_bytes(16)
        self.slots[name] = free
        self.version += 1
        return free

    def unload(self, name: str) -> None:
        slot = self.slot(name)
        del self._adapters[slot], self._tags[slot], self.slots[name]
        self.version += 1

    def tag(self, slot: int) -> bytes:
        """Bytes of this load of the adapter in `slot`: a prompt's KV under it is cached apart
        from the base's and every other adapter's, and from an earlier load under its name."""
        return self._tags[slot]

    def slot(self, name: str | None) -> int:
        """The slot of adapter `name` (None: the base, 0); ValueError for a name not loaded."""
        if name is None:
            return 0
        if name not in self.slots:
            known = ", ".join(sorted(self.slots)) or "none"
            raise ValueError(f"unknown LoRA adapter {name!r} (loaded: {known})")
        return self.slots[name]

    def adapter(self, name: str) -> LoraAdapter:
        return self._adapters[self.slot(name)]

    @contextmanager
    def rows(self, slots: list[int], device: torch.device) -> Iterator[None]:
        """Within: the forward's row i takes slot slots[i] (some slot not 0)."""
        self.row_slots, self._device, self._groups = torch.tensor(slots, dtype=torch.int64), device, None
        self._device_slots = None
        try:
            yield
        finally:
            self.row_slots = None

    @property
    def active(self) -> bool:
        """Whether a forward with rows under an adapter is running."""
        return self.row_slots is not None

    def _row_groups(self) -> list[tuple[LoraAdapter, torch.Tensor]]:
        """The current forward's rows per adapter (for `add`; the C kernel reads `row_slots`)."""
        if self._groups is None:
            by_slot: dict[int, list[int]] = {}
            for i, s in enumerate(self.row_slots.tolist()):
                if s:
                    by_slot.setdefault(s, []).append(i)
            self._groups = [(self._adapters[s], torch.tensor(rows, device=self._device))
                            for s, rows in by_slot.items()]
        return self._groups

    def table(self, layer: int, projection: str) -> cpu_ops.LoraTable | None:
        """The C kernel's table of this projection's segments under every slot (csrc/lora.c),
        or None where no loaded adapter adapts it."""
        if self._tables_version != self.version:
            self._tables, self._tables_version = self._build_tables(), self.version
        return self._tables.get((layer, projection))

    def _build_tables(self) -> dict[tuple[int, str], cpu_ops.LoraTable]:
        keys = {k for adapter in self._adapters.values() for k in adapter.pairs}
        slots = range(1, self.max_loras + 1)
        return {k: cpu_ops.lora_table([[(s.off, s.a, s.bt) for s in (self._adapters[slot].pairs.get(k, ())
                                                                        if slot in self._adapters else ())]
                                       for slot in slots], self.dtype) for k in keys}

    def add_c(self, layer: int, projection: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """As `add`, on bf16 x and y, by the C kernel (csrc/lora.c): one call for every adapter's rows."""
        table = self.table(layer, projection)
        if table is not None:
            cpu_ops.lora_add(table, self.row_slots, x, y)
        return y

    def add_triton(self, layer: int, projection: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """As `add`, by the Triton kernels (lora_triton.py) on x's device."""
        # lazy: triton is Linux-only; importing the kernels fixes TRITON_INTERPRET (the tests set it first)
        from verifier.model import lora_triton
        if self._stacks_version != self.version:
            self._stacks = lora_triton.build_stacks(self._adapters, self.max_loras, self._device, self.dtype)
            self._stacks_version = self.version
        stack = self._stacks.get((layer, projection))
        if stack is not None:
            if self._device_slots is None:
                self._device_slots = self.row_slots.to(self._device)
            lora_triton.lora_add(stack, self._device_slots, x.contiguous(), y)
        return y

    def add(self, layer: int, projection: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (the projection's output over x [T, in]) with each adapted row's delta added, in place."""
        for adapter, rows in self._row_groups():
            segments = adapter.pairs.get((layer, projection))
            if segments is None:
                continue
            xs, delta = x.index_select(0, rows).float(), torch.zeros(len(rows), y.shape[1], device=y.device)
            for s in segments:
                a, bt = s.a.to(x.device, torch.float32), s.bt.to(x.device, torch.float32)
                delta[:, s.off:s.off + bt.shape[1]] = in_row_tiles(lambda t: (t @ a.t()) @ bt, xs, LORA_TILE)
            y.index_copy_(0, rows, (y.index_select(0, rows).float() + delta).to(y.dtype))
        return y


def adapter_rows(lora: LoraSet | None, batch: ForwardBatch, device: torch.device) -> ContextManager:
    """Within: `lora`'s rows are the batch's new tokens, each under its sequence's adapter (a
    no-op where no sequence has one)."""
    if lora is None or not any(s.adapter for s in batch.seqs):
        return nullcontext()
    return lora.rows([s.adapter for s in batch.seqs for _ in range(s.num_new)], device)


def projections(layers) -> list[tuple[int, str, nn.Module]]:
    """(layer, Tercel projection, module) of every decoder layer's four projections."""
    return [(i, name, module) for i, layer in enumerate(layers)
            for name, module in zip(PROJECTIONS, (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                  layer.mlp.gate_up_proj, layer.mlp.down_proj))]


def hook_dense(net: nn.Module, lora: LoraSet, triton: bool = False) -> None:
    """The dense model's projections add `lora`'s deltas to their outputs (forward hooks that
    return at once while no row of the forward is under an adapter): by the Triton kernels where
    `triton`, else by torch."""
    add = lora.add_triton if triton else lora.add
    for layer, name, module in projections(net.model.layers):
        module.register_forward_hook(_delta_hook(lora, add, layer, name))


def _delta_hook(lora: LoraSet, add, layer: int, name: str):
    def hook(module, inputs, out):
        return add(layer, name, inputs[0], out) if lora.active else None
    return hook
