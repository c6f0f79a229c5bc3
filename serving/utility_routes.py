"""The routes beside generation, in vLLM's and OpenAI's shapes: /tokenize and /detokenize
(the served tokenizer and chat template, nothing queued), /version, and /v1/models/{id} (the
names served: the base's and its LoRA adapters')."""
from __future__ import annotations

import importlib.metadata

from starlette.concurrency import run_in_threadpool

from serving.chat_prompt import ChatPrompt
from serving.errors import unknown_model
from serving.fields import check_template_kwargs
from serving.protocol import bad
from serving.schemas import DetokenizeRequest, TokenizeRequest
from serving.tools.request import Refused, chat_messages
from spec.stats import EngineLimits


def package_version() -> str:
    try:
        return importlib.metadata.version("tercel")
    except importlib.metadata.PackageNotFoundError:     # run from a source tree never installed
        return "unknown"


class UtilityRoutes:
    def __init__(self, served: ServedModels, limits: EngineLimits, tokenizer, chat: ChatPrompt):
        self.served, self.limits, self.tokenizer, self.chat = served, limits, tokenizer, chat
        self._version = {"version": package_version()}

    async def version(self):
        return self._version

    async def model(self, model_id: str):
        card = next((c for c in self.served.cards() if c["id"] == model_id), None)
        if card is None:
            raise unknown_model(model_id, self.served.first)
        return card

    async def tokenize(self, body: TokenizeRequest):
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad("prompt", "give either 'prompt' (a text) or 'messages' (a conversation)")
        check_template_kwargs(body.chat_template_kwargs)
        ids = await run_in_threadpool(self._ids, body)      # a long text takes seconds
        return {"count": len(ids), "max_model_len": self.limits.max_model_len, "tokens": ids}

    def _ids(self, body: TokenizeRequest) -> list[int]:
        if body.prompt is not None:
            try:    # as /v1/completions encodes a text prompt, unless told to add no special tokens
                special = body.add_special_tokens is not False
                return self.tokenizer.encode(body.prompt, add_special_tokens=special) if body.prompt else []
            except ValueError as e:       # no tokenizer files
                raise bad("prompt", str(e)) from None
        try:
            messages = chat_messages(body.messages)
        except Refused as e:
            raise bad(e.param, str(e)) from None
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        try:
            return self.chat.ids(messages, tools, body.add_generation_prompt is not False, body.chat_template_kwargs)
        except ValueError as e:
            raise bad("messages", str(e)) from None

    async def detokenize(self, body: DetokenizeRequest):
        self._check_model(body.model)
        for i, token in enumerate(body.tokens):
            if token >= self.limits.vocab_size:
                raise bad(f"tokens[{i}]", f"'tokens[{i}]' is {token}; this model's vocabulary has "
                                          f"{self.limits.vocab_size} tokens")
        return {"prompt": await run_in_threadpool(self.tokenizer.decode, body.tokens)}

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served:
            raise unknown_model(model, self.served.first)


class ServedModels:
    """The names a request may send as "model": the base's (the first is reported), then each
    adapter's, which change at runtime (on the event loop, after the engine has taken the change)."""

    def __init__(self, base: tuple[str, ...], adapters: tuple[tuple[str, str], ...] = ()):
        self.base, self.adapters = base, dict(adapters)

    @property
    def first(self) -> str:
        return self.base[0]

    def __contains__(self, name: object) -> bool:
        return name in self.base or name in self.adapters

    def adapter(self, name: str | None) -> str | None:
        """`name` where it is an adapter's, else None (the base)."""
        return name if name in self.adapters and name not in self.base else None

    def cards(self) -> list[dict]:
        return [model_card(n) for n in self.base] + [model_card(n, self.first, p) for n, p in self.adapters.items()]


def model_card(name: str, parent: str | None = None, root: str | None = None) -> dict:
    """A model's entry in /v1/models; a LoRA adapter's names its base (`parent`) and its folder."""
    card = {"id": name, "object": "model", "created": 0, "owned_by": "tercel"}
    return card if parent is None else {**card, "parent": parent, "root": root}
