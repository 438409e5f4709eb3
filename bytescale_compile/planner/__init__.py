"""The HDP planner: cost models, plans and the three strategies behind one entry point."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .balance import plan_balance
from .common import check_lengths
from .cost_model import CostModel, Hardware, ModelShape
from .hdp import plan_naive
from .plan import MicroBatch, Plan, PlanError
from .static import plan_static

__all__ = ["plan", "CostModel", "Hardware", "ModelShape", "Plan", "MicroBatch", "PlanError", "STRATEGIES"]

STRATEGIES = ("balance", "naive", "static")


def plan(lengths: Sequence[int] | np.ndarray, world_size: int, capacity: int, cost_model: CostModel,
         strategy: str = "balance", pp_size: int = 1, context_length: int | None = None,
         offload: bool = True) -> Plan:
    """Plan one global batch of sequence `lengths` over `world_size` HDP ranks of `capacity` tokens.

    `offload` applies to "naive" (the ablation without offloading); "balance" always offloads and
    "static" never does. `context_length` is the static mesh's row length (default: longest sequence).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    for name, value in (("world_size", world_size), ("capacity", capacity), ("pp_size", pp_size)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    lens = check_lengths(lengths)
    if strategy == "static":
        return plan_static(lens, world_size, capacity, cost_model, pp_size, context_length)
    if strategy == "naive":
        return plan_naive(lens, world_size, capacity, cost_model, pp_size, offload)
    return plan_balance(lens, world_size, capacity, cost_model, pp_size)
