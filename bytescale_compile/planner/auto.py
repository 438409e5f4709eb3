"""strategy="auto": plan every candidate, time each with the caller's simulator, keep the fastest.

Candidates are balance with and without offloading, and static. Balance at other δ (0 and 5x the
default) was a candidate too, but over 20 seeds of Byted-like and GitHub-like 32M-token batches at
1024 ranks and 4 pipeline setups it never shortened the chosen step by more than 0.004%, while it
doubled `auto`'s planning time (benchmarks/history/planner.md). Static is among them whenever its mesh can hold the batch, so under its own cost model
`auto` is never slower than static; the plan's `auto` (`AutoChoice`) says which candidate won, every
candidate's simulated step time, and the winner's speedup over static (None where static cannot plan
the batch) and over the runner-up.

The candidates share one `SharedWork`: balance's sort, FLOP buckets and per-sequence work are computed
once for both offload settings, a plan is timed once, and where offloading changes no sequence's
D(s) or r, balance without it is the very plan balance with it built. Plans and step times are those
of each candidate planned alone (tests/test_planner.py pins this).

The step time is a `StepTime` the caller passes in (`sim.simulator.step_time`): the simulator sits above
the planner, which never imports it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..strategies import BALANCE, STATIC
from .balance import BalanceInputs, balance_inputs, balance_ranks, schedule_balance
from .plan import AutoChoice, Plan, PlanError
from .split import DEFAULT_SP
from .static import plan_static

if TYPE_CHECKING:
    from .cost_model import CostModel

__all__ = ["Candidate", "CANDIDATES", "SharedWork", "StepTime", "plan_auto"]

StepTime = Callable[[Plan, "CostModel"], float]
"""Seconds one step of a plan takes under a cost model: how "auto" ranks its candidates."""


class SharedWork:
    """What one `plan_auto` call's candidates have in common, computed once: balance's offload-independent
    inputs (`BalanceInputs`), and each balance plan with the D(s) and r it was scheduled from, as a candidate
    whose D(s) and r equal an earlier one's would be scheduled the same."""

    def __init__(
        self,
        lens: np.ndarray,
        world_size: int,
        capacity: int,
        cost_model: CostModel,
        pp_size: int,
        sp: str = DEFAULT_SP,
    ) -> None:
        self._batch = (lens, world_size, capacity, cost_model, pp_size)
        self.sp = sp
        self._inputs: BalanceInputs | None = None
        self._balance: list[tuple[np.ndarray, np.ndarray, Plan]] = []

    def balance(self, offload: bool) -> Plan:
        """Balance's plan with or without offloading. Where no sequence's D(s) or r changes with
        `offload` (none needs offloading, say), both settings get one plan, whose `offload` names the first."""
        if self._inputs is None:
            self._inputs = balance_inputs(*self._batch, sp=self.sp)
        ranks, ratio = balance_ranks(self._inputs, offload)
        for built_ranks, built_ratio, built in self._balance:
            if np.array_equal(ranks, built_ranks) and np.array_equal(ratio, built_ratio):
                return built
        built = schedule_balance(self._inputs, ranks, ratio, offload)
        self._balance.append((ranks, ratio, built))
        return built


@dataclass(frozen=True)
class Candidate:
    """One plan `auto` considers: a name for the report and how to build it, as
    `build(lens, world_size=, capacity=, cost_model=, pp_size=, context_length=, sp=, shared=None)`; `shared`
    (one `SharedWork` per batch) lets it reuse what other candidates computed, None plans from scratch."""

    name: str
    build: Callable[..., Plan]


def _balance(offload: bool) -> Callable[..., Plan]:
    def build(
        lens: np.ndarray,
        *,
        world_size: int,
        capacity: int,
        cost_model: CostModel,
        pp_size: int = 1,
        context_length: int | None = None,
        sp: str = DEFAULT_SP,
        shared: SharedWork | None = None,
    ) -> Plan:
        if shared is None:
            shared = SharedWork(lens, world_size, capacity, cost_model, pp_size, sp)
        return shared.balance(offload)

    return build


def _static(
    lens: np.ndarray,
    *,
    world_size: int,
    capacity: int,
    cost_model: CostModel,
    pp_size: int = 1,
    context_length: int | None = None,
    sp: str = DEFAULT_SP,
    shared: SharedWork | None = None,
) -> Plan:
    return plan_static(
        lens,
        world_size=world_size,
        capacity=capacity,
        cost_model=cost_model,
        pp_size=pp_size,
        context_length=context_length,
        sp=sp,
    )


CANDIDATES = (
    Candidate(BALANCE, _balance(True)),
    Candidate("balance-nooffload", _balance(False)),
    Candidate(STATIC, _static),
)


def plan_auto(
    lens: np.ndarray,
    *,
    world_size: int,
    capacity: int,
    cost_model: CostModel,
    step_time: StepTime,
    pp_size: int = 1,
    context_length: int | None = None,
    sp: str = DEFAULT_SP,
) -> Plan:
    """The candidate plan with the shortest `step_time`, each plan timed once however many candidates it
    stands for. A candidate that cannot plan the batch (balance without offloading and a sequence only
    offloading fits) is left out; if none can, the first one's PlanError is raised."""
    shared = SharedWork(lens, world_size, capacity, cost_model, pp_size, sp)
    steps: dict[str, float] = {}
    plans: dict[str, Plan] = {}
    errors: list[PlanError] = []
    for candidate in CANDIDATES:
        try:
            built = candidate.build(
                lens,
                world_size=world_size,
                capacity=capacity,
                cost_model=cost_model,
                pp_size=pp_size,
                context_length=context_length,
                sp=sp,
                shared=shared,
            )
        except PlanError as e:
            errors.append(e)
            continue
        same = next((name for name, other in plans.items() if other is built), None)
        steps[candidate.name] = steps[same] if same is not None else step_time(built, cost_model)
        plans[candidate.name] = built
    if not plans:
        raise errors[0]
    ranked = sorted(steps, key=steps.__getitem__)
    best = plans[ranked[0]]
    runner_up = steps[ranked[1]] if len(ranked) > 1 else steps[ranked[0]]
    best.auto = AutoChoice(
        chosen=ranked[0],
        step_time=steps,
        speedup_over_static=steps[STATIC] / steps[ranked[0]] if STATIC in steps else None,
        speedup_over_runner_up=runner_up / steps[ranked[0]],
    )
    return best
