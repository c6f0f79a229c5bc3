"""A request's way into the engine: checked against what this engine can run, then built (its
token ids, seed, detokenizer, LoRA slot and prefix-cache root, speculation cap, compiled grammar)
into a `Request`; or a ValueError naming the problem, with no state left behind.
"""
from __future__ import annotations

import torch

from drafters.base import Prediction
from drafters.config import SpecConfig
from spec.adapters import Adapters
from spec.detokenizer import IncrementalDetokenizer
from spec.request import Request
from spec.stats import EngineLimits
from verifier.model.tokenizer import prompt_ids
from verifier.sampling.grammar import GrammarBackend
from verifier.sampling.sampler import make_generator
from verifier.sampling.sampling_params import SamplingParams
from verifier.target import TargetModel


class Intake:
    def __init__(self, tokenizer, eos_ids: frozenset[int], limits: EngineLimits, adapters: Adapters,
                 grammars: GrammarBackend, seed: int, target: TargetModel):
        """`limits`: what a request may ask of this engine (fixed once it is loaded); `seed`: the
        first of the seeds drawn for requests that bring none; `target`: its device holds each
        request's generator."""
        self.tokenizer, self.eos_ids, self.limits, self.adapters = tokenizer, eos_ids, limits, adapters
        self.grammars, self.target = grammars, target
        self._seed_rng = torch.Generator().manual_seed(seed)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return prompt_ids(self.tokenizer, prompt)

    def request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                prompt_token_ids: list[int] | None, speculate: bool, speculation: SpecConfig | None,
                grammar, prediction: Prediction | None, lora: str | None) -> Request:
        """The request `LLMEngine.add_request` describes, checked and built."""
        adapter = self.adapters.slot(lora)
        ids = prompt_token_ids if prompt_token_ids is not None else self.tokenize(prompt)
        self.limits.validate(ids, params)
        if prediction is not None:
            self.limits.validate_prediction(ids, params, prediction)
        seed = params.seed if params.seed is not None else int(
            torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        req = Request(request_id, ids, params,
                      IncrementalDetokenizer.of(self.tokenizer, params, params.finishing_ids(self.eos_ids)),
                      prompt=prompt if isinstance(prompt, str) else None,
                      generator=make_generator(seed, self.target.device))
        req.speculate = speculate
        req.adapter, req.cache_root = adapter, self.adapters.cache_root(adapter)
        req.speculation = self._cap_speculation(speculation)
        req.prediction = prediction if speculate else None    # it only speeds a reply up: off means off
        if params.structured is not None:
            req.grammar = self.grammars.matcher(params.structured) if grammar is None \
                else self.grammars.matcher_of(grammar)
        return req

    def _cap_speculation(self, spec: SpecConfig | None) -> SpecConfig | None:
        if spec is None:
            return None
        over = self.limits.speculation.first_above(spec.num_speculative_tokens, spec.topk, spec.max_nodes)
        if over:
            raise ValueError("speculation {} {} exceeds the server's limit {}".format(*over))
        return spec
