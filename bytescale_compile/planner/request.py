"""One way to plan: `plan()` dispatches one global batch to its strategy's planner, and a `PlanRequest` says
everything about how a run plans its steps, `.plan(lengths)` planning one batch with it. The Runtime and the Ray
scheduler both build a request from the run's settings, so the two cannot plan differently."""

from __future__ import annotations

import gc
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from ..strategies import AUTO, BALANCE, NAIVE, RUNTIME_STRATEGIES, STATIC
from .auto import StepTime, plan_auto
from .balance import plan_balance
from .checks import check_arguments
from .cost_model import CostModel
from .naive import plan_naive
from .plan import Plan
from .split import DEFAULT_SP, check_sp, validate_splits
from .static import plan_static
from .unsharded import plan_unsharded

__all__ = ["PlanRequest", "plan"]


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


def _check_step_time(strategy: str, step_time: StepTime | None, shard_blockers: Sequence[str]) -> None:
    """ "auto" ranks its candidates by `step_time`, which the planner cannot import (it sits below the simulator);
    a model that cannot be sharded has one plan and needs none."""
    if strategy == AUTO and step_time is None and not shard_blockers:
        raise ValueError(
            f"strategy {AUTO!r} ranks its candidates by simulated step time: pass "
            f"step_time=bytescale_compile.sim.simulator.step_time (or another StepTime)"
        )


def plan(
    lengths: Sequence[int] | np.ndarray,
    *,
    world_size: int,
    capacity: int,
    cost_model: CostModel,
    strategy: str = BALANCE,
    pp_size: int = 1,
    context_length: int | None = None,
    offload: bool = True,
    shard_blockers: Sequence[str] = (),
    step_time: StepTime | None = None,
    sp: str = DEFAULT_SP,
) -> Plan:
    """Plan one global batch of sequence `lengths` over `world_size` HDP ranks of `capacity` tokens.

    `offload` applies to "naive" (the ablation without offloading); "balance" always offloads and
    "static" never does. "auto" (`AUTO`) plans balance with and without offloading, and static,
    ranks each by `step_time(plan, cost_model)`, which it needs (the caller's simulator, `sim.simulator.step_time`:
    the planner sits below the simulator), and returns the fastest, with `Plan.auto` saying which won and by
    how much.
    `context_length` is the static mesh's row length (default: longest sequence), for "auto"'s static too.
    `shard_blockers` say why the model cannot run a sequence over several ranks (an attention the ring
    cannot run): every sequence is then its own micro-batch on one rank (`unsharded.py`), and one longer
    than `capacity` raises `PlanError` with those reasons.
    `sp` is how each shared micro-batch splits its D(s) ranks u × r (`split.choose_split`): "ring" (u = 1),
    "ulysses" (the largest u allowed) or "auto" (the default: the cost model's cheapest).
    """
    lens = check_arguments(lengths, strategy, world_size, capacity, pp_size)
    check_sp(sp)
    _check_step_time(strategy, step_time, shard_blockers)
    with _no_cyclic_gc():
        if shard_blockers:  # one plan for every strategy: "auto" has nothing to choose, and a plan
            named = BALANCE if strategy == AUTO else strategy  # names a planner strategy
            return plan_unsharded(
                lens,
                world_size=world_size,
                capacity=capacity,
                cost_model=cost_model,
                strategy=named,
                pp_size=pp_size,
                shard_blockers=tuple(shard_blockers),
            )
        if strategy == STATIC:
            return plan_static(
                lens,
                world_size=world_size,
                capacity=capacity,
                cost_model=cost_model,
                pp_size=pp_size,
                context_length=context_length,
                sp=sp,
            )
        if strategy == NAIVE:
            return plan_naive(
                lens,
                world_size=world_size,
                capacity=capacity,
                cost_model=cost_model,
                pp_size=pp_size,
                offload=offload,
                sp=sp,
            )
        if strategy == AUTO:
            assert step_time is not None  # _check_step_time
            return plan_auto(
                lens,
                world_size=world_size,
                capacity=capacity,
                cost_model=cost_model,
                step_time=step_time,
                pp_size=pp_size,
                context_length=context_length,
                sp=sp,
            )
        return plan_balance(
            lens, world_size=world_size, capacity=capacity, cost_model=cost_model, pp_size=pp_size, sp=sp
        )


@dataclass(frozen=True)
class PlanRequest:
    """How a run plans each step: everything but the batch's lengths, which are per call.

    `shard_blockers` say why the model cannot run a sequence over several ranks (empty: it can); `step_time`
    ranks "auto"'s candidates (`sim.simulator.step_time`: the planner sits below the simulator), needed for
    "auto" only. `offload` applies to "naive" (the ablation without offloading); "balance" always offloads and
    "static" never does."""

    world_size: int
    """HDP ranks."""
    capacity: int
    """Tokens per rank, C."""
    cost_model: CostModel
    strategy: str = BALANCE
    pp_size: int = 1
    context_length: int | None = None
    """The static mesh's row length (default: each batch's longest sequence), for "auto"'s static too."""
    offload: bool = True
    sp: str = DEFAULT_SP
    shard_blockers: tuple[str, ...] = ()
    step_time: StepTime | None = None

    def __post_init__(self) -> None:
        if self.strategy not in RUNTIME_STRATEGIES:
            raise ValueError(f"strategy must be one of {RUNTIME_STRATEGIES}, got {self.strategy!r}")
        check_sp(self.sp)
        if isinstance(self.shard_blockers, str) or not all(isinstance(b, str) for b in self.shard_blockers):
            raise TypeError(f"shard_blockers must be a tuple of strings, got {self.shard_blockers!r}")
        object.__setattr__(self, "shard_blockers", tuple(self.shard_blockers))
        _check_step_time(self.strategy, self.step_time, self.shard_blockers)

    def plan(self, lengths: Sequence[int] | np.ndarray) -> Plan:
        """The plan of one global batch of sequence `lengths`, validated (every Ulysses degree divides each TP
        device's heads) before any rank communicates."""
        result = plan(
            lengths,
            world_size=self.world_size,
            capacity=self.capacity,
            cost_model=self.cost_model,
            strategy=self.strategy,
            pp_size=self.pp_size,
            context_length=self.context_length,
            offload=self.offload,
            shard_blockers=self.shard_blockers,
            step_time=self.step_time,
            sp=self.sp,
        )
        validate_splits(result, self.cost_model)
        return result
