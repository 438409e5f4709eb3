"""The HDP planner: cost models, plans and the three strategies behind one entry point."""

from __future__ import annotations

import gc
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from ..strategies import AUTO, BALANCE, NAIVE, RUNTIME_STRATEGIES, STATIC, STRATEGIES, STRATEGY_SPECS
from .auto import StepTime, plan_auto
from .balance import plan_balance
from .common import check_arguments
from .cost_model import CostModel, Hardware, ModelShape
from .hdp import plan_naive
from .limits import LengthLimit, length_limit
from .plan import MicroBatch, Plan, PlanError
from .split import DEFAULT_SP, SP_MODES, check_sp, choose_split, validate_splits
from .static import plan_static
from .topology import Topology
from .unsharded import plan_unsharded

__all__ = [
    "plan",
    "length_limit",
    "AUTO",
    "BALANCE",
    "NAIVE",
    "STATIC",
    "CostModel",
    "Hardware",
    "LengthLimit",
    "ModelShape",
    "Plan",
    "MicroBatch",
    "PlanError",
    "RUNTIME_STRATEGIES",
    "DEFAULT_SP",
    "SP_MODES",
    "choose_split",
    "validate_splits",
    "STRATEGIES",
    "STRATEGY_SPECS",
    "StepTime",
    "Topology",
]


@contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """Planning allocates ~10^4 acyclic objects; each allocation burst can trigger a full collection that
    walks every object of the process (10^5-10^6 with torch and sympy loaded: 150-200 ms, 4x the plan).
    Reference counting frees a plan's objects, so the cyclic collector is paused while planning."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def plan(
    lengths: Sequence[int] | np.ndarray,
    world_size: int,
    capacity: int,
    cost_model: CostModel,
    strategy: str = BALANCE,
    pp_size: int = 1,
    context_length: int | None = None,
    offload: bool = True,
    shard_blocker: str | None = None,
    step_time: StepTime | None = None,
    sp: str = DEFAULT_SP,
) -> Plan:
    """Plan one global batch of sequence `lengths` over `world_size` HDP ranks of `capacity` tokens.

    `offload` applies to "naive" (the ablation without offloading); "balance" always offloads and
    "static" never does. "auto" (`AUTO`) plans balance with and without offloading, and static,
    ranks each by `step_time(plan, cost_model)`, which it needs (the caller's simulator, `sim.simulator.step_time`:
    the planner sits below the simulator), and returns the fastest, with `meta["auto"]` saying which won and by
    how much.
    `context_length` is the static mesh's row length (default: longest sequence), for "auto"'s static too.
    `shard_blocker` says why the model cannot run a sequence over several ranks (an attention the ring
    cannot run): every sequence is then its own micro-batch on one rank (`unsharded.py`), and one longer
    than `capacity` raises `PlanError` with that reason.
    `sp` is how each shared micro-batch splits its D(s) ranks u × r (`split.choose_split`): "ring" (u = 1,
    the default), "ulysses" (the largest u allowed) or "auto" (the cost model's cheapest).
    """
    lens = check_arguments(lengths, strategy, world_size, capacity, pp_size)
    check_sp(sp)
    with _no_cyclic_gc():
        if shard_blocker is not None:  # one plan for every strategy: "auto" has nothing to choose, and a plan
            named = BALANCE if strategy == AUTO else strategy  # names a planner strategy
            return plan_unsharded(lens, world_size, capacity, cost_model, named, pp_size, shard_blocker)
        if strategy == STATIC:
            return plan_static(lens, world_size, capacity, cost_model, pp_size, context_length, sp)
        if strategy == NAIVE:
            return plan_naive(lens, world_size, capacity, cost_model, pp_size, offload, sp)
        if strategy == AUTO:
            if step_time is None:
                raise ValueError(
                    f"strategy {AUTO!r} ranks its candidates by simulated step time: pass "
                    f"step_time=bytescale_compile.sim.simulator.step_time (or another StepTime)"
                )
            return plan_auto(lens, world_size, capacity, cost_model, step_time, pp_size, context_length, sp)
        return plan_balance(lens, world_size, capacity, cost_model, pp_size, sp=sp)
