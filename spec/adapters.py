"""The LoRA adapters an engine serves, by name: loading (at start from `EngineConfig.lora_modules`,
later by `load`), the slot a request's rows run under, where its prompt's prefix-cache keys chain
from, which adapters running and waiting requests use, and a drafter's own adapters
(`EngineConfig.draft_lora_modules`). The weights and the products are the target's
(`verifier/model/lora.py`); failing an unloaded adapter's requests is the engine's.
"""
from __future__ import annotations

import logging

import torch

from spec.config import EngineConfig
from verifier.block_manager import ROOT_DIGEST, namespace_root
from verifier.model.lora import LoraSet

log = logging.getLogger("tercel.adapters")


class Adapters:
    def __init__(self, target, config: EngineConfig):
        self._target, self._config = target, config
        self.lora: LoraSet | None = None        # none until the first adapter is loaded
        self._drafter = None                    # the drafter holding adapters of its own, if any
        for name, path in config.lora_modules:
            self.load(name, path)

    def load_drafts(self, drafter) -> None:
        """Load `EngineConfig.draft_lora_modules` into the drafter (`load_lora`: a `small:` model's
        LoRA adapter, an EAGLE-3 head trained on the adapted model): a served adapter's requests
        are then drafted by its own; ValueError where the drafter has no model to adapt."""
        c = self._config
        if not c.draft_lora_modules:
            return
        if not hasattr(drafter, "load_lora"):
            raise ValueError(f"draft_lora_modules: the {drafter.name} drafter has no model of its own to adapt "
                             f"(small:PATH and eagle3 have)")
        for name, path in c.draft_lora_modules:
            drafter.load_lora(name, path, len(c.draft_lora_modules), c.max_lora_rank, getattr(torch, c.lora_dtype))
            log.info("the drafter's LoRA adapter for %r loaded from %s", name, path)
        self._drafter = drafter

    def load(self, name: str, path: str) -> None:
        """Serve the adapter at `path` as `name` from the next step; ValueError (nothing loaded)
        naming what does not fit."""
        if self.lora is None:
            c = self._config
            self.lora = self._target.enable_lora(c.max_loras, c.max_lora_rank, getattr(torch, c.lora_dtype))
        self.lora.load(name, path)
        log.info("LoRA adapter %r (rank %d) loaded from %s", name, self.lora.adapter(name).rank, path)

    def unload(self, name: str) -> None:
        self.lora.unload(name)
        if self._drafter is not None:               # an adapter loaded later under the name is another
            self._drafter.unload_lora(name)

    def name(self, slot: int) -> str | None:
        """The name of the adapter in `slot` (None: the base)."""
        return None if slot == 0 else next(n for n, s in self.lora.slots.items() if s == slot)

    def slot(self, name: str | None) -> int:
        """The slot of adapter `name` (0: None, the base); ValueError naming it if not loaded."""
        if name is not None and self.lora is None:
            raise ValueError(f"unknown LoRA adapter {name!r}: this engine serves none (lora_modules)")
        return 0 if name is None else self.lora.slot(name)

    def cache_root(self, slot: int) -> bytes:
        """Where the prefix-cache keys of a prompt under `slot` chain from: its own per load."""
        return ROOT_DIGEST if slot == 0 else namespace_root(self.lora.tag(slot))

    def stats(self, running, waiting) -> dict:
        """EngineStats' LoRA fields: the most served at once, the adapters `running` and
        `waiting` requests run under."""
        if self.lora is None:
            return {}
        names = {slot: name for name, slot in self.lora.slots.items()}
        used = [tuple(sorted({names[r.adapter] for r in reqs if r.adapter in names})) for reqs in (running, waiting)]
        return {"max_loras": self.lora.max_loras, "lora_running": used[0], "lora_waiting": used[1]}
