"""The attention backend contract.

A backend does two things per decoder layer: store the new tokens' K/V at their
physical slots, then attend each new token to its sequence's cached prefix (all of
it, or its last `window` positions in a sliding-window layer) plus the new tokens its
mask allows. `plan()` runs once per forward and turns the
batch's plain ints into whatever index tensors the backend wants, so per-layer work is
tensor ops only.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from verifier.batch import ForwardBatch


class AttentionBackend(ABC):
    name: str = "?"

    @abstractmethod
    def plan(self, batch: ForwardBatch, block_size: int, device: torch.device,
             window: int | None = None) -> Any:
        """Build per-forward metadata from the batch (called once, before layer 0). `window`:
        the sliding window some layers will attend within (Gemma), or None."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: Any,
                scale: float, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] for the T new tokens (sequence order);
        k_cache/v_cache: [num_blocks, block_size, KVH, D] of this layer.
        Writes k/v into the cache, returns attention output [T, H, D]. `window` (the one given
        to plan): a query at position p sees only keys at positions > p - window. `softcap`:
        scores become softcap * tanh(scores / softcap) before the mask (Gemma 2)."""
