"""The chi-square exactness tests' model, prompt and exact laws (tests/engine/*_exactness.py, and
the LoRA law in tests/model/test_lora.py): a tiny random Llama with a 32-token vocabulary (V), a
second one to draft with, the prompt [y, x, t, z, y, x], and the exact joint law of the first
three tokens from HF transformers' logits: under PARAMS (the `exact_joint` fixture) or under any
sampling parameters, logit controls included (`exact_joint_for`). The fixtures are imported by
the modules that use them."""
from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_model
from spec import SamplingParams
from verifier.sampling.sampler import target_probs, transform_logits

V = 32
N_SAMPLES = 10_000
PARAMS = dict(temperature=0.9, top_k=12, top_p=0.9, max_tokens=3, ignore_eos=True)
EOS = 2                       # the tiny model's eos_token_id


@pytest.fixture(scope="module")
def tiny_vocab_dir(tmp_path_factory):
    # Larger weights than the defaults give peaked, model-like distributions.
    return make_tiny_model(tmp_path_factory.mktemp("v32"), None, vocab_size=V, hidden_size=32,
                           intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, seed=3)


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory):
    """A different random model with the same vocabulary: q differs from p, so rejections
    and residual sampling happen often."""
    return make_tiny_model(tmp_path_factory.mktemp("v32draft"), None, vocab_size=V, hidden_size=32,
                           intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, seed=4)


@pytest.fixture(scope="module")
def prompt(tiny_vocab_dir) -> list[int]:
    return make_prompt(tiny_vocab_dir)


def make_prompt(model_dir) -> list[int]:
    """A prompt [y, x, t, z, y, x] whose likeliest next token is t: the n-gram drafter then
    proposes (t, z) after the repeated (y, x), and the model often accepts it."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    y, x, t, z = torch.randint(0, V, (4, 4096), generator=g)
    cand = torch.stack([y, x, t, z, y, x], 1)
    with torch.no_grad():
        probs = torch.softmax(hf(cand).logits[:, -1], -1)
    p_t = probs.gather(1, t[:, None])[:, 0]
    best = int(torch.where(probs.argmax(-1) == t, p_t, torch.zeros_like(p_t)).argmax())
    assert probs[best].argmax() == t[best]
    return cand[best].tolist()


@pytest.fixture(scope="module")
def exact_joint(tiny_vocab_dir, prompt) -> torch.Tensor:
    """P(t1, t2, t3) flattened to V**3, from HF logits of every 2-token continuation."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_vocab_dir), dtype=torch.float32).eval()
    t1, t2 = torch.meshgrid(torch.arange(V), torch.arange(V), indexing="ij")
    ids = torch.cat([torch.tensor(prompt).expand(V * V, -1), t1.reshape(-1, 1), t2.reshape(-1, 1)], 1)
    with torch.no_grad():
        logits = hf(ids).logits
    params = SamplingParams(**PARAMS)
    p1 = target_probs(logits[0, -3][None], params)[0]                       # [V]
    p2 = target_probs(logits[::V, -2], params)                              # [V(t1), V]
    p3 = target_probs(logits[:, -1], params).view(V, V, V)                  # [t1, t2, t3]
    return (p1[:, None, None] * p2[:, :, None] * p3).reshape(-1)


def exact_joint_for(model_dir, prompt, params: SamplingParams, hf=None) -> torch.Tensor:
    """P(t1, t2, t3) flattened to V**3 under `params` (logit_bias and min_tokens too): each row's
    transform sees the output before it (`hf`: the model whose law it is, default model_dir's)."""
    from transformers import AutoModelForCausalLM
    hf = hf or AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    t1, t2 = torch.meshgrid(torch.arange(V), torch.arange(V), indexing="ij")
    ids = torch.cat([torch.tensor(prompt).expand(V * V, -1), t1.reshape(-1, 1), t2.reshape(-1, 1)], 1)
    with torch.no_grad():
        logits = hf(ids).logits
    finishing = params.finishing_ids({EOS})

    def probs(x: torch.Tensor, output: list[int]) -> torch.Tensor:
        return target_probs(transform_logits(x, params, prompt, output, finishing)[None], params)[0]
    p1 = probs(logits[0, -3], [])
    p2 = torch.stack([probs(logits[a * V, -2], [a]) for a in range(V)])
    p3 = torch.stack([probs(logits[i, -1], [i // V, i % V]) for i in range(V * V)]).view(V, V, V)
    return (p1[:, None, None] * p2[:, :, None] * p3).reshape(-1)
