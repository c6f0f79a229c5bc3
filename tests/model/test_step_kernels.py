"""How many operators a decode step launches per layer on the dense CPU path, counted with
torch.profiler (issue 63: each is a kernel launch from Python on a GPU without graphs; the
figure is in docs/performance.md, "A GPU step without host overhead"). Views and metadata-only
operators launch nothing and are not counted. The count must not grow unnoticed: an operator
planted in every layer fails the test."""
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from conftest import make_tiny_model
from verifier.batch import ForwardBatch, SeqInput
from verifier.model.linear import ONEDNN_MIN_ROWS, Linear
from verifier.model.llama import MLP
from verifier.target import TargetModel

# No work of their own: a view, a shape's bookkeeping, an allocation.
METADATA = {"aten::slice", "aten::t", "aten::view", "aten::transpose", "aten::unsqueeze", "aten::reshape",
            "aten::select", "aten::chunk", "aten::split", "aten::detach_", "aten::detach", "aten::lift_fresh",
            "aten::empty", "aten::empty_like", "aten::as_strided", "aten::expand", "aten::alias",
            "aten::_unsafe_view", "aten::permute"}
PER_LAYER_LIMIT = 26      # measured when written (docs/performance.md); lower it when an operator goes


def launched(events) -> list[str]:
    """The outermost operators that do work (an operator inside another is the outer one's)."""
    def outermost(e) -> bool:
        p = e.cpu_parent
        while p is not None:
            if p.name.startswith("aten::"):
                return False
            p = p.cpu_parent
        return True
    return [e.name for e in events if e.name.startswith("aten::") and e.name not in METADATA and outermost(e)
            and not (e.name in ("aten::contiguous", "aten::to") and not e.cpu_children)]   # already so: no copy


def decode_ops(tmp_path, layers: int) -> list[str]:
    d = make_tiny_model(tmp_path / f"l{layers}", None, vocab_size=64, hidden_size=32, intermediate_size=64,
                        num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=layers, seed=3)
    target = TargetModel(str(d), device="cpu", backend="torch")
    for m in target.net.modules():      # MKL's one-row path: where oneDNN takes over is timed at load
        if isinstance(m, Linear):
            m.onednn_from = ONEDNN_MIN_ROWS
    target.allocate_kv(8, 8)
    target.forward(ForwardBatch([SeqInput(list(range(3, 12)), 0, [0, 1])]))
    step = ForwardBatch([SeqInput([5], 9, [0, 1])])
    target.forward(step)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        target.forward(step)
    return launched(prof.events())


def per_layer(tmp_path) -> float:
    return (len(decode_ops(tmp_path, 4)) - len(decode_ops(tmp_path, 2))) / 2


def test_a_decode_step_launches_few_operators_per_layer(tmp_path):
    assert per_layer(tmp_path) <= PER_LAYER_LIMIT


def test_an_operator_planted_in_every_layer_is_counted(tmp_path, monkeypatch):
    plain = MLP.forward
    monkeypatch.setattr(MLP, "forward", lambda self, x: plain(self, x) * 1.0)
    assert per_layer(tmp_path) > PER_LAYER_LIMIT
