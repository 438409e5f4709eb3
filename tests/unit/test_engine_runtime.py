"""The `Runtime` in one process: its arguments checked when it is built, and the warning when measured steps
are far from what the cost model predicts."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import bytescale_compile as bsc
from bytescale_compile.engine.runtime import CostModelWarning, default_cost_model, prediction_off
from bytescale_compile.models.llama import tiny


def _steps_warnings(runtime: bsc.Runtime, steps: int) -> list[list[str]]:
    """The `CostModelWarning` messages each of `steps` steps gave."""
    g = torch.Generator().manual_seed(0)
    given = []
    for _ in range(steps):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            stats = runtime.step([torch.randint(0, 128, (n,), generator=g) for n in (40, 24, 9)])
        given.append([str(w.message) for w in caught if issubclass(w.category, CostModelWarning)])
    assert runtime.predict(stats).time > 0
    return given


def test_runtime_warns_once_when_the_default_cost_model_is_far_off():
    """No cost model given: the analytic one for an H100 predicts microseconds for steps a CPU takes ms over."""
    torch.manual_seed(0)
    model = tiny()
    runtime = bsc.Runtime(model, torch.optim.SGD(model.parameters(), lr=0.1), capacity=128)
    given = _steps_warnings(runtime, 4)
    assert [len(g) for g in given] == [0, 0, 1, 0], given
    assert re.search(
        r"steps 2-3 took .* s, [0-9.e+]+x slower than the .* s that cost model 'analytic:.*' "
        r"\(hardware 'h100'\) predicts.*`bytescale-compile profile",
        given[2][0],
    ), given[2][0]


def test_runtime_warns_when_the_cost_model_predicts_far_slower_steps():
    torch.manual_seed(0)
    model = bsc.optimize(tiny())
    analytic = default_cost_model(model)
    slow = analytic.replace(
        alpha1=analytic.alpha1 * 1e10,
        beta1=analytic.beta1 * 1e10,
        gamma=analytic.gamma * 1e10,
        source="too-slow",
    )
    runtime = bsc.Runtime(model, torch.optim.SGD(model.parameters(), lr=0.1), cost_model=slow, capacity=128)
    given = _steps_warnings(runtime, 3)
    assert [len(g) for g in given] == [0, 0, 1] and "x faster than" in given[2][0] and "'too-slow'" in given[2][0]


@pytest.mark.parametrize(
    "measured,predicted,off",
    [(1.0, 0.6, False), (1.0, 1.9, False), (1.0, 0.49, True), (1.0, 2.1, True), (1e-3, 1e3, True), (1.0, 0.0, False)],
)
def test_prediction_off_beyond_twice_either_way(measured, predicted, off):
    assert prediction_off(measured, predicted) is off


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"capacity": 0}, "capacity must be an int >= 1"),
        ({"context_length": -1}, "context_length must be an int >= 1"),
        ({"max_grad_norm": 0}, "max_grad_norm must be None or a number > 0"),
        ({"strategy": "fast"}, "strategy must be one of"),
    ],
)
def test_runtime_checks_its_arguments_when_built(kwargs, match):
    model = tiny()
    with pytest.raises(ValueError, match=match):
        bsc.Runtime(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
