"""Step simulator: run a Plan on the cost model's clock instead of on GPUs.

Each rank runs its schedule in order. A packed micro-batch starts when its rank is free; a shared one
when all its ranks are (ring attention keeps the group in lockstep), the early ones idling until then.
Its time is the planner's estimate: compute split by zigzag, overlapped with the ring P2P and the
offload copies. With pp_size > 1 each HDP rank is a pipeline of pp stages running 1F1B; it is
modelled to first order (each micro-batch occupies the pipeline for time/pp, plus a bubble of
(pp-1)/pp of its longest micro-batch). The step ends with one gradient all-reduce over all ranks.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from ..planner.common import fastest_time
from ..planner.plan import Plan, PlanError
from .timeline import Span, Timeline

if TYPE_CHECKING:
    from ..planner.cost_model import CostModel

__all__ = ["simulate", "busy_times", "lower_bound", "p2p_bytes", "throughput"]


def simulate(plan: Plan, cost_model: CostModel) -> Timeline:
    """The per-rank timeline of one training step under `plan`."""
    by_id = {m.id: m for m in plan.micro_batches}
    pp = plan.pp_size
    clock = [0.0] * plan.world_size
    head = [0] * plan.world_size
    arrived: dict[int, int] = {}
    spans: list[Span] = []
    todo = deque(range(plan.world_size))
    while todo:
        rank = todo.popleft()
        while head[rank] < len(plan.schedule[rank]):
            mb = by_id[plan.schedule[rank][head[rank]]]
            if not mb.shared:
                spans.append(Span(rank, clock[rank], clock[rank] + mb.est_time / pp, mb.id, "packed", mb.tokens_per_rank, 1))
                clock[rank] += mb.est_time / pp
                head[rank] += 1
                continue
            arrived[mb.id] = arrived.get(mb.id, 0) + 1
            if arrived[mb.id] == len(mb.ranks):
                start = max(clock[r] for r in mb.ranks)
                for r in mb.ranks:
                    spans.append(Span(r, start, start + mb.est_time / pp, mb.id, "shared", mb.tokens_per_rank, len(mb.ranks)))
                    clock[r] = start + mb.est_time / pp
                    head[r] += 1
                    if r != rank:
                        todo.append(r)
                continue
            break
    stuck = [r for r in range(plan.world_size) if head[r] < len(plan.schedule[r])]
    if stuck:
        raise PlanError(f"simulation deadlocked: ranks {stuck[:8]} wait on shared micro-batches that never assemble")
    if pp > 1:
        for r in range(plan.world_size):
            longest = max((by_id[i].est_time for i in plan.schedule[r]), default=0.0)
            clock[r] += (pp - 1) / pp * longest
    start = max(clock, default=0.0)
    sync = cost_model.allreduce_time() if plan.world_size > 1 else 0.0
    spans.extend(Span(r, start, start + sync, -1, "allreduce") for r in range(plan.world_size))
    return Timeline(plan.strategy, plan.world_size, spans)


def busy_times(timeline: Timeline) -> np.ndarray:
    """Seconds each rank spent in micro-batches (no idling, no all-reduce)."""
    busy = np.zeros(timeline.world_size)
    for s in timeline.spans:
        if s.kind in ("packed", "shared"):
            busy[s.rank] += s.end - s.start
    return busy


def lower_bound(lens: np.ndarray, world_size: int, capacity: int, cost_model: CostModel) -> float:
    """No plan is faster than max(total work / ranks, heaviest sequence's share).

    The share is the least time the heaviest sequences can take on any group size from D(s) up: its
    compute split d ways, but no less than the ring's P2P at that d (which grows with d). Plus the
    gradient all-reduce, which every plan pays after its last micro-batch.
    """
    if lens.size == 0:
        return 0.0
    work = cost_model.seq_time(lens)
    heaviest = np.argsort(-work)[:64]
    min_ranks, _ = cost_model.ranks_and_ratio(lens[heaviest], capacity)
    share = float(fastest_time(cost_model, lens[heaviest], work[heaviest], world_size, min_ranks).max())
    sync = cost_model.allreduce_time() if world_size > 1 else 0.0
    return max(float(work.sum()) / world_size, share) + sync


def p2p_bytes(plan: Plan, cost_model: CostModel) -> float:
    """Ring bytes all ranks send in the step (what `StepStats.p2p_bytes` measures)."""
    shared = [m for m in plan.micro_batches if len(m.ranks) > 1]
    return float(sum(len(m.ranks) * cost_model.ring_bytes(m.tokens_per_rank, len(m.ranks)) for m in shared))


def throughput(plan: Plan, timeline: Timeline) -> float:
    """Tokens per second of the simulated step."""
    return float(sum(plan.sequences)) / timeline.step_time if timeline.step_time else 0.0
