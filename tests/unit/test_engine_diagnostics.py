"""Step diagnostics (engine/diagnostics.py): the simulator's figures for a plan, made once per step, and the
Runtime's one check of its first measured steps against them."""

from __future__ import annotations

import warnings

import pytest

from bytescale_compile.engine import diagnostics
from bytescale_compile.engine.diagnostics import CostModelWarning, StepDiagnostics, predict
from bytescale_compile.planner import CostModel, plan
from bytescale_compile.planner.model_shape import ModelShape
from bytescale_compile.sim.simulator import busy_times, p2p_bytes, simulate, step_time, ulysses_bytes

SHAPE = ModelShape("tiny", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=128)
COST_MODEL = CostModel.analytic(SHAPE)
LENGTHS = [5, 300, 37, 12, 90]


def _plan(lengths: list[int] = LENGTHS, pp_size: int = 1):
    return plan(lengths, world_size=4, capacity=128 * pp_size, cost_model=COST_MODEL, pp_size=pp_size)


@pytest.mark.parametrize("pp_size", [1, 2])
def test_a_prediction_is_the_simulators_timeline_read_once(pp_size):
    planned = _plan(pp_size=pp_size)
    timeline = simulate(planned, COST_MODEL)
    busy = busy_times(timeline)
    busy = busy[busy > 0]
    predicted = predict(planned, COST_MODEL)
    assert predicted.time == timeline.step_time == step_time(planned, COST_MODEL)
    assert predicted.busy_spread == float(busy.max() / busy.min())
    assert predicted.p2p_bytes == p2p_bytes(planned, COST_MODEL) + ulysses_bytes(planned, COST_MODEL) > 0
    assert predicted.bubbles == timeline.bubbles and (predicted.bubbles is None) == (pp_size == 1)


def test_a_step_asked_twice_is_simulated_once(monkeypatch):
    calls = []
    monkeypatch.setattr(diagnostics, "simulate", lambda *a: calls.append(a) or simulate(*a))
    planned, other = _plan(), _plan(LENGTHS[:3])
    steps = StepDiagnostics(warns=True)
    first = steps.predict(planned, COST_MODEL)
    assert steps.predict(planned, COST_MODEL) is first and len(calls) == 1
    steps.predict(other, COST_MODEL)
    assert len(calls) == 2


def _warnings(steps: StepDiagnostics, seconds: list[float], planned) -> list[list[str]]:
    given = []
    for step, measured in enumerate(seconds, start=1):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            steps.check(step=step, seconds=measured, plan=planned, cost_model=COST_MODEL)
        given.append([str(w.message) for w in caught if issubclass(w.category, CostModelWarning)])
    return given


def test_steps_two_and_three_far_from_the_prediction_warn_once_on_rank_zero_only(monkeypatch):
    planned = _plan()
    predicted = predict(planned, COST_MODEL).time
    slow = [100.0, 10 * predicted, 10 * predicted, 10 * predicted, 10 * predicted]
    given = _warnings(StepDiagnostics(warns=True), slow, planned)
    assert [len(g) for g in given] == [0, 0, 1, 0, 0]
    assert given[2][0].startswith(f"steps 2-3 took {20 * predicted:.3g} s, 10x slower than the {2 * predicted:.3g} s")
    calls = []
    monkeypatch.setattr(diagnostics, "simulate", lambda *a: calls.append(a) or simulate(*a))
    quiet = _warnings(StepDiagnostics(warns=False), slow, planned)
    assert quiet == [[]] * 5 and not calls, "other ranks predict nothing"


def test_steps_near_the_prediction_give_no_warning_and_later_steps_are_not_predicted(monkeypatch):
    planned = _plan()
    predicted = predict(planned, COST_MODEL).time
    calls = []
    monkeypatch.setattr(diagnostics, "simulate", lambda *a: calls.append(a) or simulate(*a))
    steps = StepDiagnostics(warns=True)
    assert _warnings(steps, [50.0, 1.5 * predicted, 0.6 * predicted, 100.0], planned) == [[]] * 4
    assert len(calls) == 1, "steps 2 and 3 ran the same plan: one simulation; step 4 none"
