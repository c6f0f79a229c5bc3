"""Sampling's random generators live on the device of the tensors they sample.

torch refuses a generator on another device than the probabilities, so a CPU generator for
CUDA logits would fail every T > 0 request there. These run on the CPU: the first gives the
engine a stand-in target device and checks where each request's generator is made; the
second checks every multinomial draw (plain sampling, rejection sampling, the draft model)
of a speculative run."""
from __future__ import annotations

import torch

import spec.intake
from drafters.config import SpecConfig
from spec import LLM, SamplingParams, Submission


def test_each_request_generator_is_made_on_the_target_device(tiny_llama_dir, monkeypatch):
    llm = LLM(str(tiny_llama_dir), max_model_len=128, num_kv_blocks=16)
    stand_in = torch.device("cuda", 3)          # never touched: the generator is a spy's
    made = []

    def spy(seed, device):
        made.append(torch.device(device))
        return torch.Generator().manual_seed(seed)

    monkeypatch.setattr(spec.intake, "make_generator", spy)
    monkeypatch.setattr(llm.engine.target, "device", stand_in)
    llm.engine.add_request("a", Submission([1, 2, 3], SamplingParams(temperature=1.0, max_tokens=2, seed=7)))
    llm.engine.add_request("b", Submission([1, 2, 3], SamplingParams(temperature=1.0, max_tokens=2)))
    assert made == [stand_in, stand_in]


def test_every_draw_uses_a_generator_on_the_probabilities_device(tiny_llama_dir, monkeypatch):
    llm = LLM(str(tiny_llama_dir), max_model_len=256, num_kv_blocks=64, max_num_seqs=4,
              drafter=f"small:{tiny_llama_dir}", speculation=SpecConfig(num_speculative_tokens=3, topk=2))
    draws = []
    multinomial = torch.multinomial

    def checked(probs, num_samples, *args, generator=None, **kwargs):
        draws.append((probs.device, None if generator is None else generator.device))
        return multinomial(probs, num_samples, *args, generator=generator, **kwargs)

    monkeypatch.setattr(torch, "multinomial", checked)
    outs = llm.generate(["a b c d", "e f g"], SamplingParams(temperature=0.8, max_tokens=12, seed=3))
    assert all(o.token_ids for o in outs)
    assert len(draws) > 10
    assert all(gen == dev for dev, gen in draws), draws
