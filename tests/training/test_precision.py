"""`train-drafter --dtype auto`: the training dtype chosen by timing a probe step in each."""
import pytest
import torch

from training import precision


class FakeClock:
    """perf_counter that advances only when a probe step runs: cost[dtype] seconds a step."""
    def __init__(self, cost):
        self.now, self.cost = 0.0, cost

    def __call__(self):
        return self.now


def _probe(clock, weight, seen):
    def step(dtype):
        seen.append(dtype)
        with precision.autocast("cpu", dtype):
            y = (torch.ones(2, 4) @ weight).sum()
        clock.now += clock.cost[dtype]
        return y
    return step


@pytest.mark.parametrize("cost,expected", [({torch.float32: 3.0, torch.bfloat16: 1.0}, torch.bfloat16),
                                           ({torch.float32: 1.0, torch.bfloat16: 8.0}, torch.float32)])
def test_auto_keeps_the_dtype_whose_probe_step_ran_faster(monkeypatch, cost, expected):
    clock, weight, seen = FakeClock(cost), torch.nn.Parameter(torch.ones(4, 3)), []
    monkeypatch.setattr(precision.time, "perf_counter", clock)
    assert precision.choose("auto", "cpu", _probe(clock, weight, seen), [weight], repeats=2) == expected
    assert seen.count(torch.float32) == seen.count(torch.bfloat16) == 3       # a warm-up and two timed
    assert weight.grad is None                                              # the probe leaves no gradient


def test_a_named_dtype_or_cuda_takes_no_probe():
    def step(dtype):
        raise AssertionError("no probe expected")
    assert precision.choose("fp32", "cpu", step, []) == torch.float32
    assert precision.choose("bf16", "cpu", step, []) == torch.bfloat16
    assert precision.choose("auto", "cuda:0", step, []) == torch.bfloat16


def test_autocast_runs_matmuls_in_bf16_only_when_asked():
    a = torch.ones(2, 2)
    with precision.autocast(torch.device("cpu"), torch.bfloat16):
        assert (a @ a).dtype == torch.bfloat16
    with precision.autocast("cpu", torch.float32):
        assert (a @ a).dtype == torch.float32


def test_the_probe_is_the_example_nearest_its_length():
    assert precision.probe_example([100, 2000, 480, 700]) == [2]
