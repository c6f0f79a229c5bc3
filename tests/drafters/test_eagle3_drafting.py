"""How the EAGLE-3 head drafts on the CPU (drafters/eagle3/draft_layers.py): its layers in int8
on the engine's kernel, q/k/v and gate/up stacked; a few query rows attended in fp32 without
SDPA. The products must be the layers' and the attention's; exactness itself is the identity
tests' (a draft is a point mass the target verifies)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from drafters.eagle3.draft_layers import Int8DraftLinear, draft_form
from drafters.eagle3.head import FEW_ROWS, attend
from pinned import WHOLE_TREES
from spec import LLM, SamplingParams
from verifier.cpu import cpu_ops
from verifier.model.linear import Linear, onednn_bf16

int8_kernel = pytest.mark.skipif(not (cpu_ops.available() and cpu_ops.q4_isa() > 0),
                                 reason="the int8 kernel (csrc/q8_matmul.c) is not built here")


@int8_kernel
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_stacked_int8_layers_give_each_layers_product(rows):
    """One call of three stacked layers gives each layer's output, to int8 groups' precision."""
    torch.manual_seed(rows)
    layers = [Linear(128, n, bias=False) for n in (96, 32, 32)]
    stacked, x = Int8DraftLinear(*layers), torch.randn(rows, 128)
    with torch.no_grad():
        got = stacked(x)
        want = [F.linear(x.double(), m.weight.double()).float() for m in layers]
    assert [g.shape for g in got] == [w.shape for w in want] and got[0].dtype == torch.float32
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0.03, atol=0.03 * float(w.abs().max()))
    lone = Int8DraftLinear(layers[0])(x)
    assert isinstance(lone, torch.Tensor) and torch.equal(lone, got[0])     # rows stack; bits per row kept


@int8_kernel
def test_stacked_layers_refuse_a_bias_or_unequal_inputs():
    with pytest.raises(ValueError, match="one input and no bias"):
        Int8DraftLinear(Linear(64, 32, bias=True))
    with pytest.raises(ValueError, match="one input and no bias"):
        Int8DraftLinear(Linear(64, 32, bias=False), Linear(32, 32, bias=False))


@pytest.mark.parametrize("rows,keys", [(1, 40), (3, 7), (FEW_ROWS, 70), (FEW_ROWS + 1, 70)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_of_a_few_rows_is_sdpas(rows, keys, dtype):
    """Grouped heads (9 query heads on 3 kv heads) and a tree mask: the fp32 path of a few rows
    and SDPA (beyond FEW_ROWS) give the same attention."""
    torch.manual_seed(rows * keys)
    q, k, v = torch.randn(rows, 9, 16), torch.randn(keys, 3, 16), torch.randn(keys, 3, 16)
    mask = torch.rand(rows, keys) > 0.3
    mask[:, 0] = True                                  # every row sees at least one key
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          attn_mask=mask, enable_gqa=True).transpose(0, 1).reshape(rows, -1)
    got = attend(q.to(dtype), k.to(dtype), v.to(dtype), mask)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(attend(q, k, v, None), attend(q, k, v, torch.ones(rows, keys, dtype=torch.bool)))


def test_the_drafter_holds_the_head_in_its_machines_form(tiny_llama_dir, tiny_eagle_head):
    """int8 where the kernel is built (six stacked layers, no `Linear` left), bf16 on oneDNN
    where only that multiplies bf16; drafts flow (whole trees: where rows are dear the cost model
    would verify none in 12 tokens) and T=0 output is plain decoding's."""
    kw = dict(max_model_len=128, num_kv_blocks=16)
    prompt, params = [[1, 2, 3, 4, 5, 6]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(str(tiny_llama_dir), drafter=f"eagle3:{tiny_eagle_head}", adaptive=WHOLE_TREES, **kw)
    head, form = llm.engine.drafter.head, draft_form(torch.device("cpu"))
    if form == "int8":
        assert not [m for m in head.modules() if isinstance(m, Linear)]
        assert len([m for m in head.modules() if isinstance(m, Int8DraftLinear)]) == 6
        assert head.dtype == torch.float32
    elif form == "bf16":
        assert {m.bf16_any_rows for m in head.modules() if isinstance(m, Linear)} == {True}
        assert head.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="draft form"):
        head.for_drafting("fp8")
    out = llm.generate(prompt, params)[0]
    ref = LLM(str(tiny_llama_dir), **kw).generate(prompt, params)[0]
    assert out.token_ids == ref.token_ids and out.stats.draft_tokens > 0


@int8_kernel
@pytest.mark.parametrize("norm_output", [False, True])
@pytest.mark.parametrize("rows,ctx", [(1, 0), (3, 37), (FEW_ROWS, 5)])
def test_the_native_layer_computes_the_heads_layer(tiny_llama_dir, rows, ctx, norm_output):
    """csrc/draft_layer.c against the same int8 head's torch ops (project, attend, finish): the
    same outputs and the same keys and values written, under a tree mask, with either output form."""
    from conftest import random_eagle_head
    from verifier.target import TargetModel
    target = TargetModel(str(tiny_llama_dir))
    head = random_eagle_head(target.config)
    head.cfg = dataclasses.replace(head.cfg, norm_output=norm_output)
    head.init_rotary()
    head.use_target_embedding(target.net.model.embed_tokens)
    head.for_drafting("int8")
    assert head.native is not None
    c, g = head.cfg, torch.Generator().manual_seed(rows + ctx)
    kc, vc = (torch.randn(ctx + 1, c.num_kv_heads, c.head_dim, generator=g) for _ in range(2))
    emb, hid = torch.randn(rows, c.hidden_size, generator=g), torch.randn(rows, c.hidden_size, generator=g)
    positions = torch.arange(ctx, ctx + rows)
    ntmp = rows + 2
    mask = torch.rand(rows, ntmp, generator=g) > 0.5
    mask[:, -rows:] = torch.eye(rows, dtype=torch.bool)        # each row sees itself
    outs, kvs = [], []
    for native in (head.native, None):
        head.native = native
        kt, vt = (torch.randn(ntmp, c.num_kv_heads, c.head_dim, generator=torch.Generator().manual_seed(9)) for _ in range(2))
        with torch.no_grad():
            outs.append(head.layer(emb, hid, positions, (kc, vc, ctx), (kt, vt), ntmp, mask))
        kvs.append((kt, vt))
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=2e-2 * float(outs[1].abs().max()))
    for a, b in zip(*kvs):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)


@int8_kernel
@pytest.mark.skipif(not onednn_bf16(), reason="oneDNN does not multiply bf16 here")
def test_the_bench_times_each_projection_of_the_head_in_both_forms():
    """bench/eagle_draft.py --cold-layers: every projection of the head, bf16 and int8, a time each."""
    from bench.eagle_draft import LAYER_SHAPES, cold_layers
    rows = cold_layers(repeats=2)
    assert set(rows) == set(LAYER_SHAPES)
    assert all(set(r) == {"bf16", "int8"} and min(r.values()) > 0 for r in rows.values())


@int8_kernel
def test_a_position_past_the_rope_tables_is_refused_as_torch_would(tiny_llama_dir):
    from conftest import random_eagle_head
    from verifier.target import TargetModel
    target = TargetModel(str(tiny_llama_dir))
    head = random_eagle_head(target.config)
    head.init_rotary()
    head.use_target_embedding(target.net.model.embed_tokens)
    head.for_drafting("int8")
    c, far = head.cfg, len(head.rotary.cos)
    kv = torch.zeros(4, c.num_kv_heads, c.head_dim)
    x = torch.zeros(1, c.hidden_size)
    with pytest.raises(IndexError, match="past the rope tables"):
        head.layer(x, x, torch.tensor([far]), (kv, kv, 0), (kv, kv), 1, torch.ones(1, 1, dtype=torch.bool))
