"""strategy="auto": plan every candidate, simulate each on the cost model, keep the fastest.

Candidates are balance with and without offloading, and static. Balance at other δ (0 and 5x the
default) was a candidate too, but over 20 seeds of Byted-like and GitHub-like 32M-token batches at
1024 ranks and 4 pipeline setups it never shortened the chosen step by more than 0.004%, while it
doubled `auto`'s planning time (benchmarks/RESULTS.md, issue 15). Static is among them whenever its mesh can hold the batch, so under its own cost model
`auto` is never slower than static; the plan's `meta["auto"]` says which candidate won, every
candidate's simulated step time, and the winner's speedup over static (None where static cannot plan
the batch) and over the runner-up.

The candidates share one `SharedWork`: balance's sort, FLOP buckets and per-sequence work are computed
once for both offload settings, a plan is simulated once, and where offloading changes no sequence's
D(s) or r, balance without it is the very plan balance with it built. Plans and step times are those
of each candidate planned alone (tests/test_planner.py pins this).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .balance import BalanceInputs, balance_inputs, balance_ranks, schedule_balance
from .plan import Plan, PlanError
from .static import plan_static

if TYPE_CHECKING:
    from .cost_model import CostModel

__all__ = ["AUTO", "Candidate", "CANDIDATES", "SharedWork", "plan_auto"]

AUTO = "auto"


class SharedWork:
    """What one `plan_auto` call's candidates have in common, computed once: balance's offload-independent
    inputs (`BalanceInputs`); each balance plan with the D(s) and r it was scheduled from, as a candidate
    whose D(s) and r equal an earlier one's would be scheduled the same; and each plan's simulated step."""

    def __init__(self, lens: np.ndarray, world_size: int, capacity: int, cost_model: CostModel, pp_size: int) -> None:
        self._batch = (lens, world_size, capacity, cost_model, pp_size)
        self._inputs: BalanceInputs | None = None
        self._balance: list[tuple[np.ndarray, np.ndarray, Plan]] = []
        self._steps: list[tuple[Plan, float]] = []

    def balance(self, offload: bool) -> Plan:
        """Balance's plan with or without offloading. Where no sequence's D(s) or r changes with
        `offload` (none needs offloading, say), both settings get one plan, whose meta names the first."""
        if self._inputs is None:
            self._inputs = balance_inputs(*self._batch)
        ranks, ratio = balance_ranks(self._inputs, offload)
        for built_ranks, built_ratio, built in self._balance:
            if np.array_equal(ranks, built_ranks) and np.array_equal(ratio, built_ratio):
                return built
        built = schedule_balance(self._inputs, ranks, ratio, offload)
        self._balance.append((ranks, ratio, built))
        return built

    def step_time(self, candidate: Plan) -> float:
        """The simulated step of `candidate`, simulated once however many candidates it stands for."""
        from ..sim.simulator import step_time  # the simulator imports the planner

        for seen, step in self._steps:
            if seen is candidate:
                return step
        step = step_time(candidate, self._batch[3])
        self._steps.append((candidate, step))
        return step


@dataclass(frozen=True)
class Candidate:
    """One plan `auto` considers: a name for the report and how to build it, as
    `build(lens, world_size, capacity, cost_model, pp_size, context_length, shared=None)`; `shared`
    (one `SharedWork` per batch) lets it reuse what other candidates computed, None plans from scratch."""

    name: str
    build: Callable[..., Plan]


def _balance(offload: bool) -> Callable[..., Plan]:
    def build(lens: np.ndarray, world_size: int, capacity: int, cost_model: CostModel, pp_size: int,
              context_length: int | None, shared: SharedWork | None = None) -> Plan:
        if shared is None:
            shared = SharedWork(lens, world_size, capacity, cost_model, pp_size)
        return shared.balance(offload)
    return build


def _static(lens: np.ndarray, world_size: int, capacity: int, cost_model: CostModel, pp_size: int,
            context_length: int | None, shared: SharedWork | None = None) -> Plan:
    return plan_static(lens, world_size, capacity, cost_model, pp_size, context_length)


CANDIDATES = (
    Candidate("balance", _balance(True)),
    Candidate("balance-nooffload", _balance(False)),
    Candidate("static", _static),
)


def plan_auto(lens: np.ndarray, world_size: int, capacity: int, cost_model: CostModel, pp_size: int = 1,
              context_length: int | None = None) -> Plan:
    """The candidate plan with the shortest simulated step. A candidate that cannot plan the batch
    (balance without offloading and a sequence only offloading fits) is left out; if none can, the
    first one's PlanError is raised."""
    shared = SharedWork(lens, world_size, capacity, cost_model, pp_size)
    steps: dict[str, float] = {}
    plans: dict[str, Plan] = {}
    errors: list[PlanError] = []
    for candidate in CANDIDATES:
        try:
            plans[candidate.name] = candidate.build(lens, world_size, capacity, cost_model, pp_size, context_length,
                                                    shared)
        except PlanError as e:
            errors.append(e)
            continue
        steps[candidate.name] = shared.step_time(plans[candidate.name])
    if not plans:
        raise errors[0]
    ranked = sorted(steps, key=steps.__getitem__)
    best = plans[ranked[0]]
    runner_up = steps[ranked[1]] if len(ranked) > 1 else steps[ranked[0]]
    best.meta["auto"] = {
        "chosen": ranked[0],
        "step_time": steps,
        "speedup_over_static": steps["static"] / steps[ranked[0]] if "static" in steps else None,
        "speedup_over_runner_up": runner_up / steps[ranked[0]],
    }
    return best
