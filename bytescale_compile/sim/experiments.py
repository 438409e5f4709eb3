"""One global batch, planned and simulated per strategy: what the CLI and the benchmarks report."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..planner import DEFAULT_SP, STRATEGY_SPECS, CostModel, Plan, plan
from .simulator import busy_times, simulate, step_time, throughput
from .timeline import Timeline

__all__ = ["Outcome", "run_strategy"]


@dataclass
class Outcome:
    name: str
    plan: Plan
    timeline: Timeline
    plan_seconds: float
    step_time: float
    tokens_per_second: float
    busy_spread: float
    """max/min per-rank busy time (ranks with no work left out)."""


def run_strategy(
    name: str,
    lens: np.ndarray,
    world_size: int,
    capacity: int,
    cost_model: CostModel,
    context_length: int | None = None,
    pp_size: int = 1,
    sp: str = DEFAULT_SP,
) -> Outcome:
    """Plan `lens` with strategy `name` (and `sp`, how shared micro-batches split u × r) and simulate it."""
    if name not in STRATEGY_SPECS:
        raise ValueError(f"strategy must be one of {list(STRATEGY_SPECS)}, got {name!r}")
    strategy, offload = STRATEGY_SPECS[name]
    start = time.perf_counter()
    result = plan(
        lens,
        world_size=world_size,
        capacity=capacity,
        cost_model=cost_model,
        strategy=strategy,
        pp_size=pp_size,
        context_length=context_length,
        offload=offload,
        step_time=step_time,
        sp=sp,
    )
    seconds = time.perf_counter() - start
    timeline = simulate(result, cost_model)
    timeline.strategy = name  # "naive" and "naive-nooffload" share a planner but not a label
    busy = busy_times(timeline)
    busy = busy[busy > 0]
    spread = float(busy.max() / busy.min()) if busy.size else 1.0
    return Outcome(name, result, timeline, seconds, timeline.step_time, throughput(result, timeline), spread)
