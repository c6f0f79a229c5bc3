"""The native decode loop (verifier/quantized/cpu_loop.py, csrc/decode_loop.cpp) computes what the
Python loop of verifier/quantized/cpu_forward.py computes, bit for bit: logits (through the final norm
and the head, which it runs too where the head's table is int8), tapped hidden states and the
KV it writes, for decode rows, tree nodes and a prompt's last token in one forward."""
from __future__ import annotations

import pytest
import torch

from quant_cases import assert_loops_agree
from verifier.batch import ForwardBatch, SeqInput
from verifier.quantized.cpu_loop import native_layers
from verifier.target import TargetModel

BLOCK = 16


def _tree(n: int) -> torch.Tensor:
    """A root, two children of it, the rest in a chain under the second child."""
    mask = torch.eye(n, dtype=torch.bool)
    mask[:, 0] = True
    for j in range(3, n):
        mask[j, 2:j] = True
    return mask


def _batch(ctx: dict[str, int], capture: tuple[int, ...]) -> ForwardBatch:
    return ForwardBatch([SeqInput([7], ctx["a"], [0, 1, 2, 3]),
                         SeqInput(list(range(20, 26)), ctx["b"], [4, 5, 6, 7], mask=_tree(6),
                                  logits_indices=list(range(6))),
                         SeqInput(list(range(300, 320)), 0, [8, 9])], capture_layers=capture)


def _run_both(target: TargetModel, capture: tuple[int, ...]):
    """The same forward through each loop: (logits, taps, the KV pools after it) per loop."""
    ctx = {"a": 40, "b": 30}
    target.forward(ForwardBatch([SeqInput(list(range(100, 140)), 0, [0, 1, 2, 3]),
                                 SeqInput(list(range(500, 530)), 0, [4, 5, 6, 7])]))
    native, results = target.runner.native, []
    assert native is not None, "the native loop did not build on this machine"
    for loop in (native, None):
        target.runner.native = loop
        out = target.forward(_batch(ctx, capture))
        results.append((out.logits.clone(), {k: v.clone() for k, v in out.hidden.items()},
                        target.kv.k.clone(), target.kv.v.clone()))
    target.runner.native = native
    return results


def test_the_native_loop_is_bitwise_the_python_loop_on_the_int4_gguf(smollm2_dir):
    """SmolLM2 on its Q4_1 blocks: a decode row, a 6-node tree and a 20-token prompt in one
    forward, with layers 0, 7 and the last tapped (as EAGLE-3 taps them)."""
    target = TargetModel(str(smollm2_dir), quantization="int4")
    target.allocate_kv(16, BLOCK)
    assert target.runner.native.has_head          # its Q8_0 head and final norm run natively too
    assert_loops_agree(_run_both(target, (0, 7, target.config.num_layers)))


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_the_native_loop_is_bitwise_the_python_loop_on_a_checkpoint_quantized_at_load(tiny_llama_dir, mode):
    """A tiny HF checkpoint quantized at load: int4 groups and int8 channels (the int8
    kernel's path through the loop), taps below and at the last layer."""
    target = TargetModel(str(tiny_llama_dir), quantization=mode)
    target.allocate_kv(16, BLOCK)
    assert_loops_agree(_run_both(target, (1, target.config.num_layers)))


def test_a_layer_with_a_bias_outside_qkv_stays_on_the_python_loop(tiny_llama_dir):
    """The loop adds no bias after o, gate_up or down (no Llama-family model has one), so a
    model that has one is not handed to it."""
    target = TargetModel(str(tiny_llama_dir), quantization="int4")
    layer = target.runner.layers[0]
    layer.down.bias = torch.nn.Parameter(torch.zeros(layer.down.out_features), requires_grad=False)
    assert native_layers(target.config, target.runner.heads, target.runner.layers) is None


def test_the_step_clocks_time_a_native_forward_only_while_on(smollm2_dir):
    """bench/step_profile.py reads matmul and attention time from the loop's own clocks: they
    add up within the call's time while on, and stay at zero while off."""
    from verifier.quantized.cpu_loop import step_clock
    target = TargetModel(str(smollm2_dir), quantization="int4")
    target.allocate_kv(16, BLOCK)
    prompt = ForwardBatch([SeqInput(list(range(100, 140)), 0, [0, 1, 2, 3])])
    step_clock(False)
    target.forward(prompt)                              # the prompt's last token runs natively
    assert step_clock(True) == {"matmul": 0.0, "attention": 0.0, "call": 0.0}
    target.forward(ForwardBatch([SeqInput([7], 40, [0, 1, 2, 3])]))
    clock = step_clock(False)
    assert 0 < clock["matmul"] and 0 < clock["attention"]
    assert clock["matmul"] + clock["attention"] <= clock["call"]


def test_rows_with_few_tokens_get_exact_logits_there_alone_in_both_loops(smollm2_dir):
    """Logits asked at a few tokens only (a grammar mask that allows few; `SeqInput.logits_tokens`):
    the native loop and the Python loop give the same bits; at those tokens the exact rescoring
    the full head gives its own 16 candidates, -inf elsewhere; the other rows as without them."""
    target = TargetModel(str(smollm2_dir), quantization="int4")
    target.allocate_kv(16, BLOCK)
    target.forward(ForwardBatch([SeqInput(list(range(100, 140)), 0, [0, 1, 2, 3]),
                                 SeqInput(list(range(500, 530)), 0, [4, 5, 6, 7])]))

    def tree(tokens):
        return ForwardBatch([SeqInput([7], 40, [0, 1, 2, 3]),
                             SeqInput(list(range(20, 26)), 30, [4, 5, 6, 7], mask=_tree(6),
                                      logits_indices=list(range(6)), logits_tokens=tokens)])
    full = target.forward(tree(None)).logits                     # rows: a's decode row, then the tree's 6
    picks = full[1:].topk(5, dim=-1).indices                     # tokens the full head rescored exactly
    tokens = (picks[0], None, torch.cat([picks[2], torch.tensor([3, 9000])]), None, None, picks[5][:1])
    native = target.runner.native
    outs = []
    for loop in (native, None):
        target.runner.native = loop
        outs.append(target.forward(tree(tokens)).logits)
    target.runner.native = native
    assert torch.equal(outs[0], outs[1])
    few = outs[0]
    for row, t in enumerate(tokens, start=1):
        if t is None:
            assert torch.equal(few[row], full[row])
            continue
        allowed = torch.zeros(few.shape[1], dtype=torch.bool)
        allowed[t] = True
        assert torch.equal(few[row, picks[row - 1][:len(t)]], full[row, picks[row - 1][:len(t)]])
        assert torch.isfinite(few[row, allowed]).all() and (few[row, ~allowed] == float("-inf")).all()
    assert torch.equal(few[0], full[0])


def test_row_costs_splits_a_verify_forward_and_leaves_the_pool_whole(smollm2_dir):
    """bench/row_costs.py times tree forwards on a sequence of its own: every row count gets
    every part, the wall time covers the clocked parts, and its blocks go back to the pool."""
    from bench.row_costs import PARTS, costs
    from spec import LLM
    llm = LLM(model=str(smollm2_dir), max_num_seqs=1)
    used = llm.engine.blocks.num_used_blocks
    ms = costs(llm, ctx=40, rows=[1, 3], rounds=1, calls=2)
    assert set(ms) == {1, 3} and all(set(ms[n]) == set(PARTS) for n in ms)
    assert all(ms[n]["matmul"] > 0 and ms[n]["attention"] > 0 for n in ms)
    assert all(ms[n]["matmul"] + ms[n]["attention"] < ms[n]["forward"] for n in ms)
    assert llm.engine.blocks.num_used_blocks == used


def test_the_verify_curve_times_every_size_and_leaves_the_pool_whole(smollm2_dir):
    """bench.speculative.verify_curve (its trees from bench/row_costs.py) times each size on
    a sequence of its own and gives its blocks back."""
    from bench.speculative import verify_curve
    from spec import LLM
    llm = LLM(model=str(smollm2_dir), max_num_seqs=1)
    used = llm.engine.blocks.num_used_blocks
    curve = verify_curve(llm, ctx=40, sizes=(1, 3), repeats=1)
    assert sorted(curve) == [1, 3] and min(curve.values()) > 0
    assert llm.engine.blocks.num_used_blocks == used
