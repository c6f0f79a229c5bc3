"""A request's way into the engine: checked against what this engine can run, then built (its
token ids, seed, detokenizer, LoRA slot and prefix-cache root, speculation cap, compiled grammar)
into a `Request`; or a ValueError naming the problem, with no state left behind.
"""
from __future__ import annotations

import torch

from drafters.config import SpecConfig
from spec.adapters import Adapters
from spec.detokenizer import IncrementalDetokenizer
from spec.request import Request, Submission
from spec.stats import EngineLimits
from verifier.model.tokenizer import prompt_ids
from verifier.sampling.grammar import GrammarBackend
from verifier.sampling.sampler import make_generator
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

    def request(self, request_id: str, sub: Submission) -> Request:
        """The request `sub` describes, checked and built."""
        params = sub.params
        adapter = self.adapters.slot(sub.lora)
        ids = sub.prompt_token_ids if sub.prompt_token_ids is not None else self.tokenize(sub.prompt)
        self.limits.validate(ids, params)
        if sub.prediction is not None:
            self.limits.validate_prediction(ids, params, sub.prediction)
        seed = params.seed if params.seed is not None else int(
            torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        req = Request(request_id, ids, params,
                      IncrementalDetokenizer.of(self.tokenizer, params, params.finishing_ids(self.eos_ids)),
                      prompt=sub.prompt, generator=make_generator(seed, self.target.device))
        req.speculate = sub.speculate
        req.adapter, req.cache_root = adapter, self.adapters.cache_root(adapter)
        req.speculation = self._cap_speculation(sub.speculation)
        req.prediction = sub.prediction if sub.speculate else None    # it only speeds a reply up: off means off
        if params.structured is not None:
            req.grammar = self.grammars.matcher(params.structured) if sub.grammar is None \
                else self.grammars.matcher_of(sub.grammar)
        return req

    def _cap_speculation(self, spec: SpecConfig | None) -> SpecConfig | None:
        if spec is None:
            return None
        over = self.limits.speculation.first_above(spec.num_speculative_tokens, spec.topk, spec.max_nodes)
        if over:
            raise ValueError("speculation {} {} exceeds the server's limit {}".format(*over))
        return spec
