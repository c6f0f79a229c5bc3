"""verifier.linear.Linear picks a CPU matmul path by row count; every path must agree with
F.linear, follow weight updates, and leave autograd working."""
import pytest
import torch
import torch.nn.functional as F

from verifier.linear import ONEDNN_MIN_ROWS, Linear, onednn_available


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
