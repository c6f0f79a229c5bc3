"""LoRA adapters on a CUDA GPU (`make test-gpu`): the Triton products (verifier/model/lora_triton.py)
in bf16 against torch's, and the engine serving a mixed batch (two adapters and the base) with
each request's tokens those it gets alone, plain and under n-gram speculation.
"""
import pytest
import torch

from conftest import make_tiny_model
from lora_cases import ATTN_MLP, PROMPTS, make_adapter
from spec import LLM, SamplingParams
from spec.adaptive import AdaptiveConfig
from verifier.model.lora import PROJECTIONS, LoraSet
from verifier.target import load_config

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
NAMES = ["a", None, "b", "a"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("gpu_lora_base"), None)


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_lora_adapters")
    return {"a": str(make_adapter(tiny, root / "a", ATTN_MLP, seed=1)),
            "b": str(make_adapter(tiny, root / "b", ["q_proj", "v_proj", "down_proj"], r=4, seed=2))}


@pytest.mark.parametrize("projection", PROJECTIONS)
def test_the_kernels_add_the_torch_products_in_bf16(tiny, adapters, projection):
    lora = LoraSet(load_config(tiny), max_loras=2)
    for name, path in adapters.items():
        lora.load(name, path)
    layer = 0
    d_in = lora._adapters[1].pairs[(layer, projection)][0].a.shape[1]
    out = max(s.off + s.bt.shape[1] for s in lora._adapters[1].pairs[(layer, projection)])
    x = torch.randn(9, d_in, device="cuda").bfloat16()
    y = torch.randn(9, out, device="cuda").bfloat16()
    slots = [1, 0, 2] * 3
    with lora.rows(slots, torch.device("cuda")):
        ours, theirs = lora.add_triton(layer, projection, x, y.clone()), lora.add(layer, projection, x, y.clone())
    torch.testing.assert_close(ours, theirs, atol=0.02, rtol=0.01)
    with lora.rows(slots[:1], torch.device("cuda")):
        assert torch.equal(lora.add_triton(layer, projection, x[:1], y[:1].clone()), ours[:1])


@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_a_mixed_batch_gives_each_request_its_tokens_alone(tiny, adapters, drafter):
    llm = LLM(model=str(tiny), device="cuda", lora_modules=adapters, num_kv_blocks=128, drafter=drafter,
              adaptive=AdaptiveConfig(enabled=False))
    assert type(llm.engine.target.runner.backend).__name__ == "TritonBackend"
    prompts = [p * 3 for p in PROMPTS]
    mixed = [o.token_ids for o in llm.generate(prompts, GREEDY, lora=NAMES)]
    alone = [llm.generate([p], GREEDY, lora=n)[0].token_ids for p, n in zip(prompts, NAMES)]
    assert mixed == alone
    assert llm.engine.blocks.num_used_blocks == 0
