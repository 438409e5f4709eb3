"""What the simulator predicts for a step's plan, apart from running it: the `StepPrediction` a step's measured
figures are held against, and the one check the `Runtime` makes with it.

A step measures; predicting it takes a simulation of its plan (`sim/simulator.py`), which at thousands of ranks
costs more host time than planning. So predictions are made on request, for the steps that are logged (the
trainer's metrics line, `Runtime.predict`), once per step: `StepDiagnostics` keeps the last one it made.

The Runtime's own check: after its first measured steps (steps 2 and 3: the first compiles), rank 0 holds their
wall time against the prediction for their plans and warns once, naming the cost model, when they differ by more
than `PREDICTION_TOLERANCE` either way: plans balanced by a cost model that far off may be poor. Those two steps
are the only ones the Runtime predicts itself, on rank 0 alone.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

from ..planner import CostModel, Plan
from ..sim.simulator import busy_times, p2p_bytes, simulate, ulysses_bytes

__all__ = [
    "COMPARED_STEPS",
    "PREDICTION_TOLERANCE",
    "CostModelWarning",
    "StepDiagnostics",
    "StepPrediction",
    "predict",
    "prediction_off",
]


class CostModelWarning(UserWarning):
    """Measured step times are far from the cost model's predictions: the plans it balances may be poor."""


PREDICTION_TOLERANCE = 2.0
"""Measured and predicted step time may differ by this factor either way before the runtime warns."""
COMPARED_STEPS = (2, 3)
"""Which of a Runtime's steps are held against the prediction: the first compiles the model."""


@dataclass(frozen=True)
class StepPrediction:
    """The simulator's figures for one plan under one cost model, each beside the measured one of the same name."""

    time: float
    """Seconds of the step."""
    busy_spread: float
    """max / min seconds in micro-batches over the ranks that have some."""
    p2p_bytes: float
    """Ring and Ulysses all-to-all bytes all ranks send, forward and backward."""
    bubbles: list[float] | None
    """Pipelines: each pipeline's 1F1B bubble rate, stage by stage; None without."""

    @classmethod
    def unpredicted(cls) -> StepPrediction:
        """The figures of a step nobody logs (a rank that writes no metrics): NaN, so no simulation runs."""
        return cls(time=math.nan, busy_spread=math.nan, p2p_bytes=math.nan, bubbles=None)


def predict(plan: Plan, cost_model: CostModel) -> StepPrediction:
    """One simulation of `plan` under `cost_model`, and the figures read from it."""
    timeline = simulate(plan, cost_model)
    busy = busy_times(timeline)
    busy = busy[busy > 0]
    return StepPrediction(
        time=timeline.step_time,
        busy_spread=float(busy.max() / busy.min()) if busy.size else 1.0,
        p2p_bytes=p2p_bytes(plan, cost_model) + ulysses_bytes(plan, cost_model),
        bubbles=timeline.bubbles,
    )


def prediction_off(measured: float, predicted: float, tolerance: float = PREDICTION_TOLERANCE) -> bool:
    """Measured and predicted seconds differ by more than `tolerance` either way (never without a prediction)."""
    if measured <= 0 or predicted <= 0:
        return False
    return max(measured / predicted, predicted / measured) > tolerance


class StepDiagnostics:
    """A Runtime's predictions: `predict` for a step that is logged (the last one kept, so a step asked twice is
    simulated once), and `check` of its `COMPARED_STEPS` against their measured time, on rank 0 (`warns`)."""

    def __init__(self, *, warns: bool) -> None:
        self.warns = warns
        self._last: tuple[Plan, CostModel, StepPrediction] | None = None
        self._checked = 0
        """Steps `check` has seen: the first `COMPARED_STEPS[-1]` count."""
        self._compared: list[tuple[int, float, float]] = []
        """(step, measured seconds, predicted seconds) of the compared steps so far."""

    def predict(self, plan: Plan, cost_model: CostModel) -> StepPrediction:
        """The prediction for `plan` under `cost_model` (the same objects as last time: the one made then)."""
        last = self._last
        if last is not None and last[0] is plan and last[1] is cost_model:
            return last[2]
        prediction = predict(plan, cost_model)
        self._last = (plan, cost_model, prediction)
        return prediction

    def check(self, *, step: int, seconds: float, plan: Plan, cost_model: CostModel) -> None:
        """Count a measured step; on the last of `COMPARED_STEPS`, warn when they together took more than
        `PREDICTION_TOLERANCE` times their predicted time, or less than its inverse. Predicts those steps only,
        and only where it `warns`."""
        if self._checked >= COMPARED_STEPS[-1]:
            return
        self._checked += 1
        if not self.warns or self._checked not in COMPARED_STEPS:
            return
        self._compared.append((step, seconds, self.predict(plan, cost_model).time))
        if self._checked < COMPARED_STEPS[-1]:
            return
        measured, predicted = sum(c[1] for c in self._compared), sum(c[2] for c in self._compared)
        if prediction_off(measured, predicted):
            steps = f"steps {self._compared[0][0]}-{self._compared[-1][0]}"
            warnings.warn(_prediction_message(steps, measured, predicted, cost_model), CostModelWarning, stacklevel=3)


def _prediction_message(steps: str, measured: float, predicted: float, cost_model: CostModel) -> str:
    how = f"{measured / predicted:.3g}x slower" if measured > predicted else f"{predicted / measured:.3g}x faster"
    return (
        f"{steps} took {measured:.3g} s, {how} than the {predicted:.3g} s that cost model "
        f"{cost_model.source!r} (hardware {cost_model.hardware.name!r}) predicts: plans balanced by it may be "
        f"poor. The trainer refits it in the job (calibrate, its default without --cost-model); elsewhere fit "
        f"one on this machine with `bytescale-compile profile MODEL --out cost.json` (MODEL: a Hugging Face "
        f"config directory or MODULE:FACTORY) and pass Runtime(cost_model=CostModel.load('cost.json'))"
    )
