"""verifier.model.linear.Linear picks a CPU matmul path by row count, from the count timed at load
(verifier.model.linear_tuning); every path must agree with F.linear, follow weight updates, and leave
autograd working."""
import pytest
import torch
import torch.nn.functional as F

from verifier.model.linear import ONEDNN_MIN_ROWS, Linear, onednn_available, onednn_bf16


@pytest.mark.parametrize("rows", [1, 2, ONEDNN_MIN_ROWS, 8, 37])
@pytest.mark.parametrize("bias", [False, True])
def test_every_row_count_matches_f_linear(rows, bias):
    torch.manual_seed(rows)
    layer = Linear(96, 40, bias=bias)
    x = torch.randn(rows, 96)
    with torch.no_grad():
        got = layer(x)
    want = F.linear(x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())
    assert got.shape == (rows, 40) and got.is_contiguous()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not onednn_available(), reason="oneDNN not built into this torch")
def test_packed_weight_follows_in_place_updates_and_state_dict_loads():
    torch.manual_seed(0)
    layer = Linear(32, 16, bias=False)
    x = torch.randn(ONEDNN_MIN_ROWS + 2, 32)
    with torch.no_grad():
        layer(x)                                   # packs the current weight
        layer.weight.mul_(3)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight))
        layer.load_state_dict({"weight": torch.randn(16, 32)})
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight))


def test_gradients_flow_when_training():
    torch.manual_seed(0)
    layer = Linear(24, 8)
    x = torch.randn(ONEDNN_MIN_ROWS + 5, 24, requires_grad=True)
    layer(x).square().sum().backward()
    ref = Linear(24, 8)
    ref.load_state_dict(layer.state_dict())
    x2 = x.detach().clone().requires_grad_()
    F.linear(x2, ref.weight, ref.bias).square().sum().backward()
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad)
    torch.testing.assert_close(x.grad, x2.grad)


def test_choose_takes_onednn_from_the_first_count_where_it_wins_at_every_larger_one():
    from verifier.model.linear_tuning import choose
    mkl = {1: 10.0, 2: 11.0, 3: 14.0, 4: 18.0}
    assert choose(mkl, {1: 12.0, 2: 13.0, 3: 12.0, 4: 12.0}) == 3          # MKL for thin inputs (an EPYC)
    assert choose(mkl, {1: 7.0, 2: 7.5, 3: 8.0, 4: 9.0}) == 1              # oneDNN everywhere (a Xeon)
    assert choose(mkl, {1: 9.0, 2: 12.0, 3: 13.0, 4: 17.0}) == 3           # a win at 1 row, then a loss
    assert choose(mkl, {1: 11.0, 2: 12.0, 3: 15.0, 4: 19.0}) == 5          # MKL at every count timed


@pytest.mark.skipif(not onednn_available(), reason="oneDNN not built into this torch")
def test_tune_sets_every_linear_and_caches_per_machine(tmp_path, monkeypatch, neighbours):
    from verifier.model import linear_tuning
    net = torch.nn.Sequential(Linear(64, 128), Linear(128, 64, bias=False))
    first = linear_tuning.tune(net, tmp_path)
    assert sorted(first.mkl_ms) == sorted(first.onednn_ms) == list(linear_tuning.ROWS)
    assert all(lin.onednn_from == first.onednn_from for lin in net)
    assert len(list(tmp_path.glob("linear-*.json"))) == 1
    monkeypatch.setattr(linear_tuning, "measure", lambda *a, **k: pytest.fail("timed again despite the cache"))
    assert linear_tuning.tune(net, tmp_path) == first


@pytest.mark.skipif(not onednn_available(), reason="oneDNN not built into this torch")
def test_the_tuned_count_decides_the_path(monkeypatch):
    import verifier.model.linear as linear
    calls = []
    real = linear.onednn_linear
    monkeypatch.setattr(linear, "onednn_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    layer = Linear(32, 16)
    x = torch.randn(1, 32)
    with torch.no_grad():
        layer.onednn_from = 2
        layer(x)
        layer.onednn_from = 1
        got = layer(x)
    assert calls == [1]
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias))


@pytest.mark.skipif(not onednn_bf16(), reason="oneDNN does not multiply bf16 on this CPU")
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_a_drafting_layer_takes_onednn_for_bf16_rows_and_matches_f_linear(rows, monkeypatch):
    """`bf16_any_rows` (an EAGLE-3 head drafting on the CPU): bf16 rows on oneDNN at any count,
    the same products as F.linear to bf16's precision; a target's layer never takes it."""
    torch.manual_seed(rows)
    layer = Linear(96, 40, bias=False).to(torch.bfloat16)
    x = torch.randn(rows, 96).to(torch.bfloat16)
    calls = []
    import verifier.model.linear as linear
    real = linear.onednn_linear
    monkeypatch.setattr(linear, "onednn_linear", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        plain = layer(x)
        assert not calls
        layer.bf16_any_rows = True
        got = layer(x)
    assert calls and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), F.linear(x.double(), layer.weight.double()).float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, plain, rtol=2e-2, atol=2e-2)
