"""strategy="auto": plan every candidate, simulate each on the cost model, keep the fastest.

Candidates are balance with and without offloading, and static. Balance at other δ (0 and 5x the
default) was a candidate too, but over 20 seeds of Byted-like and GitHub-like 32M-token batches at
1024 ranks and 4 pipeline setups it never shortened the chosen step by more than 0.004%, while it
doubled `auto`'s planning time (benchmarks/RESULTS.md, issue 15). Static is among them whenever its mesh can hold the batch, so under its own cost model
`auto` is never slower than static; the plan's `meta["auto"]` says which candidate won, every
candidate's simulated step time, and the winner's speedup over static (None where static cannot plan
the batch) and over the runner-up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .balance import plan_balance
from .plan import Plan, PlanError
from .static import plan_static

if TYPE_CHECKING:
    from .cost_model import CostModel

__all__ = ["AUTO", "Candidate", "CANDIDATES", "plan_auto"]

AUTO = "auto"


@dataclass(frozen=True)
class Candidate:
    """One plan `auto` considers: a name for the report and how to build it."""

    name: str
    build: Callable[[np.ndarray, int, int, CostModel, int, int | None], Plan]


def _balance(offload: bool) -> Callable[..., Plan]:
    def build(lens: np.ndarray, world_size: int, capacity: int, cost_model: CostModel, pp_size: int,
              context_length: int | None) -> Plan:
        return plan_balance(lens, world_size, capacity, cost_model, pp_size, offload=offload)
    return build


def _static(lens: np.ndarray, world_size: int, capacity: int, cost_model: CostModel, pp_size: int,
            context_length: int | None) -> Plan:
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
    from ..sim.simulator import step_time  # the simulator imports the planner

    steps: dict[str, float] = {}
    plans: dict[str, Plan] = {}
    errors: list[PlanError] = []
    for candidate in CANDIDATES:
        try:
            plans[candidate.name] = candidate.build(lens, world_size, capacity, cost_model, pp_size, context_length)
        except PlanError as e:
            errors.append(e)
            continue
        steps[candidate.name] = step_time(plans[candidate.name], cost_model)
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
