"""The offline API: `LLM(model=...).generate(prompts, params)` and `.chat(conversations, params)`.

Both take `predictions=` (OpenAI's Predicted Outputs): the reply each prompt is expected to get,
as text or a `Prediction` of token ids; one for every prompt, or a sequence with one per prompt
(None: none). A prediction is drafted, so it changes the speed and never the output.
"""
from __future__ import annotations

import itertools
from dataclasses import fields
from typing import Sequence

from drafters.base import Prediction
from spec.config import EngineConfig
from spec.engine import LLMEngine
from spec.profile import load_profile
from spec.request import RequestOutput, Submission
from verifier.sampling.sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, str]
Predicted = str | Prediction | None


class LLM:
    def __init__(self, model: str | None = None, profile: str | None = None,
                 profile_task: str | None = None, **kwargs):
        """`profile`: a `tercel bench grid --profile-out` file choosing the drafter and tree
        (its default choice, or `profile_task`'s); it excludes `drafter` and `speculation`."""
        if profile is not None:
            kwargs = {**kwargs, **_profile_options(profile, profile_task, kwargs)}
        known = {f.name for f in fields(EngineConfig)}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown LLM option(s): {', '.join(sorted(unknown))}")
        self.engine = LLMEngine(EngineConfig(**({"model": model} if model else {}), **kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the tensor-parallel worker processes, if any (also done at interpreter exit)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 predictions: Predicted | Sequence[Predicted] = None, *, speculate: bool = True,
                 lora: str | Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Run prompts (strings or token-id lists) to completion; outputs in input order.
        `speculate=False`: these requests decode plainly though the engine has a drafter.
        `lora`: the LoRA adapter (a name of `lora_modules`) they run under, or one per prompt
        (None: the base model)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run([(p, None) for p in prompts], params, predictions, speculate, lora)

    def chat(self, conversations: list[Message] | list[list[Message]],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             predictions: Predicted | Sequence[Predicted] = None,
             lora: str | Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Conversations go through the model's chat template with the assistant turn opened."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self._run([(None, self.apply_chat_template(c)) for c in conversations], params, predictions,
                         lora=lora)

    def apply_chat_template(self, messages: list[Message]) -> list[int]:
        if not messages:
            raise ValueError("a conversation needs at least one message")
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") \
                    or not isinstance(m.get("content"), str):
                raise ValueError(f"bad message {m!r}: need role system/user/assistant and string content")
        return chat_token_ids(self.tokenizer, messages)

    def _run(self, items: list[tuple[Prompt | None, list[int] | None]], params, predictions=None,
             speculate: bool = True, lora=None) -> list[RequestOutput]:
        params = params or SamplingParams()
        plist = [params] * len(items) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(items):
            raise ValueError(f"{len(plist)} SamplingParams for {len(items)} prompts")
        predicted = self._predictions(predictions, len(items))
        adapters = [lora] * len(items) if lora is None or isinstance(lora, str) else list(lora)
        if len(adapters) != len(items):
            raise ValueError(f"{len(adapters)} LoRA adapter names for {len(items)} prompts")
        engine, ids = self.engine, []
        try:
            for (prompt, tokens), p, pred, adapter in zip(items, plist, predicted, adapters):
                rid = f"gen-{next(self._ids)}"
                engine.add_request(rid, Submission(tokens, p, speculate, prediction=pred, lora=adapter, prompt=prompt))
                ids.append(rid)
        except Exception:
            for rid in ids:            # a bad prompt in the list: leave nothing queued
                engine.abort(rid)
            engine.step()
            raise
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[r] for r in ids]


    def _predictions(self, predictions, n: int) -> list[Prediction | None]:
        """One Prediction (or None) per prompt; text is tokenized as a reply's text."""
        if predictions is None or isinstance(predictions, (str, Prediction)):
            predictions = [predictions] * n
        plist = list(predictions)
        if len(plist) != n:
            raise ValueError(f"{len(plist)} predictions for {n} prompts")
        for p in plist:
            if p is not None and not isinstance(p, (str, Prediction)):
                raise ValueError(f"a prediction is a str, a Prediction or None, got {type(p).__name__}")
        return [Prediction.from_text(p, self.tokenizer) if isinstance(p, str) else p for p in plist]


def chat_token_ids(tokenizer, messages: list[Message]) -> list[int]:
    """The model's chat template over `messages`, the assistant turn opened, as token ids."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


def _profile_options(path: str, task: str | None, given: dict) -> dict:
    clash = sorted({"drafter", "speculation"} & set(given))
    if clash:
        raise ValueError(f"pass either profile or {' and '.join(clash)}, not both")
    choice = load_profile(path, task)
    return {"drafter": choice.drafter, "speculation": choice.speculation}
