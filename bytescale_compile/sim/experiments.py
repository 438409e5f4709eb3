"""One global batch, planned and simulated per strategy: what the CLI and the benchmarks report."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..planner import CostModel, Plan, plan
from .simulator import busy_times, simulate, throughput
from .timeline import Timeline

__all__ = ["STRATEGY_SPECS", "Outcome", "run_strategy", "parse_size"]

STRATEGY_SPECS: dict[str, tuple[str, bool]] = {
    "static": ("static", False),
    "naive-nooffload": ("naive", False),
    "naive": ("naive", True),
    "balance": ("balance", True),
    "auto": ("auto", True),
}
"""CLI name -> (planner strategy, offload). "naive-nooffload" is the paper's communication-only ablation;
"auto" the fastest of balance and static candidates under the simulator (`planner/auto.py`)."""


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


def run_strategy(name: str, lens: np.ndarray, world_size: int, capacity: int, cost_model: CostModel,
                 context_length: int | None = None, pp_size: int = 1) -> Outcome:
    if name not in STRATEGY_SPECS:
        raise ValueError(f"strategy must be one of {list(STRATEGY_SPECS)}, got {name!r}")
    strategy, offload = STRATEGY_SPECS[name]
    start = time.perf_counter()
    result = plan(lens, world_size, capacity, cost_model, strategy=strategy, pp_size=pp_size,
                  context_length=context_length, offload=offload)
    seconds = time.perf_counter() - start
    timeline = simulate(result, cost_model)
    timeline.strategy = name  # "naive" and "naive-nooffload" share a planner but not a label
    busy = busy_times(timeline)
    busy = busy[busy > 0]
    spread = float(busy.max() / busy.min()) if busy.size else 1.0
    return Outcome(name, result, timeline, seconds, timeline.step_time, throughput(result, timeline), spread)


def parse_size(text: str) -> int:
    """'32M' -> 33554432, '8K' -> 8192, '1000' -> 1000 (binary K/M/G, as context lengths are)."""
    units = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}
    text = text.strip().upper()
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError as e:
        raise ValueError(f"expected a size like 8K, 32M or 1000, got {text!r}") from e
