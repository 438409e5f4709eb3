"""The plan for a model whose attention the ring cannot run: one sequence per micro-batch, one rank each.

Such a model's attention runs as the model wrote it, which is right for one sequence per row and nothing
else: over a rank's zigzag chunks it would see only part of its sequence, and over a packed row it might
see the other sequences (a causal mask that ignores the packing). So every sequence is its own
micro-batch, sequences go longest first to the least-loaded rank (by the cost model's time), and one
longer than a rank's capacity cannot be planned.
"""

from __future__ import annotations

import heapq

import numpy as np

from .builder import PlanBuilder
from .cost_model import CostModel
from .limits import refuse, unsharded_reason
from .plan import Plan

__all__ = ["plan_unsharded"]


def plan_unsharded(
    lens: np.ndarray,
    *,
    world_size: int,
    capacity: int,
    cost_model: CostModel,
    strategy: str,
    pp_size: int = 1,
    shard_blockers: tuple[str, ...],
) -> Plan:
    """`shard_blockers` (not empty) say why the model cannot be sharded: the plan records them, and a sequence
    longer than `capacity` is refused naming them."""
    refuse(lens, lens > capacity, unsharded_reason(capacity, shard_blockers))
    builder = PlanBuilder(strategy, lens, world_size, capacity, cost_model, pp_size)
    load = [(0.0, r) for r in range(world_size)]
    for i in np.argsort(-builder.seq_time, kind="stable").tolist():
        busy, r = heapq.heappop(load)
        heapq.heappush(load, (busy + builder.add([r], [i]).est_time, r))
    return builder.build(shard_blockers=shard_blockers)
