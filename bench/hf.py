"""HF transformers baselines: `generate`, and assisted generation with prompt lookup.

The model is read from the same files Tercel serves (the converted fp32 directory of an
alias or GGUF, or the HF directory given), so both run identical weights. TTFT is the
time until `generate` hands its first new token to a streamer.
"""
from __future__ import annotations

import time

import torch
from transformers import AutoModelForCausalLM

from bench.runner import Turn
from verifier.model.loader import resolve_model_dir


class _FirstToken:
    """A transformers streamer recording when the first generated token arrives (the first
    `put` is the prompt)."""

    def __init__(self):
        self.calls, self.first = 0, None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


class HFModel:
    """One loaded HF model shared by the two baselines."""

    def __init__(self, model: str):
        path = resolve_model_dir(model)
        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        self.eos = self.model.generation_config.eos_token_id
        if isinstance(self.eos, list):
            self.eos = self.eos[0]


class HFGenerator:
    def __init__(self, hf: HFModel, tokenizer, max_tokens: int, ignore_eos: bool,
                 lookup_tokens: int | None = None):
        self.hf, self.tokenizer = hf, tokenizer
        self.max_tokens, self.ignore_eos, self.lookup_tokens = max_tokens, ignore_eos, lookup_tokens

    def generate(self, prompt_ids: list[int], temperature: float, seed: int) -> Turn:
        torch.manual_seed(seed)
        ids = torch.tensor([prompt_ids])
        streamer = _FirstToken()
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 \
            else dict(do_sample=False, temperature=None, top_k=None, top_p=None)
        extra = {"prompt_lookup_num_tokens": self.lookup_tokens} if self.lookup_tokens else {}
        start = time.perf_counter()
        with torch.no_grad():
            out = self.hf.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=self.max_tokens,
                                         min_new_tokens=self.max_tokens if self.ignore_eos else None,
                                         pad_token_id=self.hf.eos, streamer=streamer, **sampling, **extra)
        new = out[0, len(prompt_ids):].tolist()
        ttft = (streamer.first or time.perf_counter()) - start
        return Turn(new, self.tokenizer.decode(new, skip_special_tokens=True), ttft)

    def timing(self) -> tuple[int, float, float]:
        return 0, 0.0, 0.0

    def close(self) -> None:
        pass
