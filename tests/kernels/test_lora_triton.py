"""The LoRA products' Triton kernels (verifier/model/lora_triton.py) on the CPU under
TRITON_INTERPRET=1: against the torch products, row by row bitwise alone and among others, and
the engine on the Triton backend serving adapters. bf16 and speed on a GPU: tests/gpu.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed, so its kernels cannot be tested")

from conftest import make_tiny_model  # noqa: E402
from lora_cases import ATTN_MLP, GREEDY, PROMPTS, make_adapter  # noqa: E402
from pinned import WHOLE_TREES  # noqa: E402
from spec import LLM  # noqa: E402
from verifier.model import lora_triton  # noqa: E402
from verifier.model.lora import PROJECTIONS, LoraSet  # noqa: E402
from verifier.target import load_config  # noqa: E402

assert not isinstance(lora_triton._shrink_kernel, lora_triton.triton.runtime.JITFunction), \
    "lora_triton was imported before TRITON_INTERPRET=1 was set"

SLOTS = [1, 0, 2, 1, 2, 0, 1]        # rows under adapter a, the base and adapter b, interleaved


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("lora_triton_base"), None)


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory) -> dict[str, str]:
    """Every projection at rank 8; q, v and down at rank 4 (rsLoRA): parts of a fused projection
    that one slot adapts and the other leaves alone, and ranks that differ per slot."""
    root = tmp_path_factory.mktemp("lora_triton_adapters")
    return {"a": str(make_adapter(tiny, root / "a", ATTN_MLP, seed=1)),
            "b": str(make_adapter(tiny, root / "b", ["q_proj", "v_proj", "down_proj"], r=4, seed=2,
                                  use_rslora=True))}


@pytest.fixture(scope="module")
def lora(tiny, adapters) -> LoraSet:
    lora = LoraSet(load_config(tiny), max_loras=3)
    for name, path in adapters.items():
        lora.load(name, path)
    return lora


def _outputs(lora: LoraSet, projection: str) -> tuple[int, int]:
    layer = next(l for l, p in lora._adapters[1].pairs if p == projection)
    segs = lora._adapters[1].pairs[(layer, projection)]
    return layer, max(s.off + s.bt.shape[1] for s in segs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("projection", PROJECTIONS)
def test_the_kernels_add_the_torch_products(lora, projection, dtype):
    """Rows of two adapters and of the base in one call: each row's output as torch's `add`
    gives it (fp32 products, summed in another order); base rows keep their bits."""
    layer, out = _outputs(lora, projection)
    d_in = lora._adapters[1].pairs[(layer, projection)][0].a.shape[1]
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(len(SLOTS), d_in, generator=g).to(dtype), torch.randn(len(SLOTS), out, generator=g).to(dtype)
    with lora.rows(SLOTS, torch.device("cpu")):
        ours, theirs = lora.add_triton(layer, projection, x, y.clone()), lora.add(layer, projection, x, y.clone())
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.02, rtol=0.01)
    torch.testing.assert_close(ours, theirs, **tol)
    base = [i for i, s in enumerate(SLOTS) if s == 0]
    assert torch.equal(ours[base], y[base]) and not torch.equal(ours, y)


def test_a_rows_delta_does_not_depend_on_the_rows_beside_it(lora):
    """Bitwise: a row's output alone, and among rows of other adapters in other orders."""
    layer, out = _outputs(lora, "qkv_proj")
    x = torch.randn(len(SLOTS), 64).bfloat16()

    def added(idx: list[int]) -> torch.Tensor:
        with lora.rows([SLOTS[i] for i in idx], torch.device("cpu")):
            return lora.add_triton(layer, "qkv_proj", x[idx], torch.zeros(len(idx), out, dtype=torch.bfloat16))
    whole = added(list(range(len(SLOTS))))
    assert torch.equal(added([3]), whole[3:4]) and torch.equal(added([4, 3, 2])[1], whole[3])


def test_an_unloaded_adapter_leaves_the_stacks(tiny, adapters):
    """The stacks follow loads and unloads: after `b` leaves, its rows' slot adds nothing."""
    lora = LoraSet(load_config(tiny), max_loras=2)
    lora.load("a", adapters["a"])
    lora.load("b", adapters["b"])
    layer, out = _outputs(lora, "down_proj")
    x = torch.randn(2, 128)

    def added() -> torch.Tensor:
        with lora.rows([1, 2], torch.device("cpu")):
            return lora.add_triton(layer, "down_proj", x, torch.zeros(2, out))
    before = added()
    lora.unload("b")
    after = added()
    assert torch.equal(after[0], before[0]) and before[1].abs().sum() > 0 and after[1].abs().sum() == 0


NAMES = ["a", None, "b", "a"]
KW = dict(quantization="none", num_kv_blocks=64, block_size=8, max_num_seqs=4)


def _tokens(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


def test_the_triton_backend_serves_adapters_as_the_torch_backend(tiny, adapters):
    """T=0, dense base: a mixed batch (two adapters and the base) on the Triton backend gives the
    torch backend's tokens; each adapter changes its rows."""
    on_torch = _tokens(LLM(model=str(tiny), lora_modules=adapters, **KW).generate(PROMPTS, GREEDY, lora=NAMES))
    llm = LLM(model=str(tiny), attention_backend="triton", lora_modules=adapters, **KW)
    assert _tokens(llm.generate(PROMPTS, GREEDY, lora=NAMES)) == on_torch
    base = _tokens(llm.generate(PROMPTS, GREEDY))
    assert base[1] == on_torch[1] and base[0] != on_torch[0] and base[2] != on_torch[2]


@pytest.mark.slow
def test_speculation_on_the_triton_backend_under_adapters(tiny, adapters):
    """T=0: n-gram drafts verified whole under adapters on the Triton backend give its plain tokens."""
    prompts = [p * 3 for p in PROMPTS]
    kw = dict(attention_backend="triton", lora_modules=adapters, **KW)
    plain = LLM(model=str(tiny), **kw).generate(prompts, GREEDY, lora=NAMES)
    drafted = LLM(model=str(tiny), drafter="ngram", adaptive=WHOLE_TREES, **kw).generate(prompts, GREEDY, lora=NAMES)
    assert _tokens(drafted) == _tokens(plain)
    assert sum(o.stats.accepted_tokens for o in drafted) > 0
