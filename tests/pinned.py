"""Choices the engine makes from timings taken at load, stated instead for tests: no test's
assertion may depend on the machine it runs on. The adaptive controller prices each draft node
with the forward's cost curve (spec/step_cost.py); a test that asserts drafting happened either
verifies whole trees or states a machine's curve, which the controller keeps as stated."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from spec.adaptive import AdaptiveConfig
from spec.step_cost import CostCurve

ONE_ROW_MS = 10.0     # only ratios matter: the controller compares tokens per millisecond


def per_row(extra: float) -> CostCurve:
    """A forward in which each row past the first costs `extra` of a one-row forward."""
    return CostCurve((1, 2), (ONE_ROW_MS, ONE_ROW_MS * (1 + extra)))     # linear past 2 rows


# An extra verify row's share of a one-row forward on the kinds of CPU this project runs on.
MACHINES = {
    "amx": per_row(0.07),       # an Intel Xeon with AMX: rows nearly free
    "avx512": per_row(0.45),    # an AMD Zen 4, AVX-512 without AMX
    "avx2": per_row(0.70),      # AVX2 only: a row is most of a step
}
DEARER_THAN_A_STEP = per_row(1.5)     # no machine's: no draft node can buy its row back


def stated(curve: CostCurve) -> AdaptiveConfig:
    """The controller on, pricing steps by `curve` and nothing it times."""
    return AdaptiveConfig(cost_curve=curve)


CHEAP_ROWS = stated(MACHINES["amx"])          # the controller on, where drafting pays
WHOLE_TREES = AdaptiveConfig(enabled=False)   # every proposal verified whole, whatever a row costs


@contextmanager
def untuned_dense_linears() -> Iterator[None]:
    """Dense CPU targets loaded meanwhile keep the untuned split of their matmuls (MKL below
    `verifier.model.linear.ONEDNN_MIN_ROWS` rows, oneDNN from there) instead of the row count this
    machine's timings chose (verifier/model/linear_tuning.py): a test that needs the model to write
    a given text must not owe it to which library a load picked."""
    import verifier.runner as runner
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner, "tune_linear", lambda *args, **kwargs: None)
        yield
