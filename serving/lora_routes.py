"""LoRA adapters over HTTP, in vLLM's shapes: `tercel serve --lora-modules name=PATH ...` serves each
adapter under its own model name (a request's `"model"` picks it; `/v1/models` lists it with its
`parent`, the base), and with `--allow-runtime-lora --lora-root DIR`, `POST /v1/load_lora_adapter`
({"lora_name", "lora_path"}) and `POST /v1/unload_lora_adapter` ({"lora_name"}) change them while
serving. A runtime path must lie under the root once `..` and links are resolved. Unloading fails
the requests running or waiting under the adapter, each alone (finish_reason "error").
"""
from __future__ import annotations

from pathlib import Path

from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from serving.bridge import EngineBridge
from serving.errors import unknown_model
from serving.flags import LoraServing
from serving.protocol import APIError, bad
from serving.utility_routes import ServedModels


class LoadLora(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLora(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)


class LoraRoutes:
    def __init__(self, bridge: EngineBridge, served: ServedModels, serving: LoraServing):
        self.bridge, self.served, self.root = bridge, served, serving.root

    async def load(self, body: LoadLora):
        name = body.lora_name
        if name in self.served:
            raise bad("lora_name", f"the name {name!r} is already served")
        path = self._under_root(body.lora_path)
        try:
            await self.bridge.call(lambda engine: engine.load_lora(name, str(path)))
        except ValueError as e:
            raise bad("lora_path", str(e)) from None
        self.served.adapters[name] = str(path)
        self.bridge.metrics.lora_changes.labels(change="load").inc()
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, body: UnloadLora):
        name = body.lora_name
        if self.served.adapter(name) is None:
            raise unknown_model(name, self.served.first)
        await self.bridge.call(lambda engine: engine.unload_lora(name))
        del self.served.adapters[name]
        self.bridge.metrics.lora_changes.labels(change="unload").inc()
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    def _under_root(self, given: str) -> Path:
        """`given` (relative to the root, or absolute) resolved: a 400 unless it lies under the root."""
        root = self.root.resolve()
        path = (root / given).resolve()
        if not path.is_relative_to(root):
            raise APIError(400, f"lora_path {given!r} is outside the server's --lora-root", param="lora_path")
        return path
