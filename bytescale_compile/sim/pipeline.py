"""One pipeline (an HDP rank with pp_size > 1) run stage by stage under 1F1B.

Each stage runs its ops in `planner.pipeline_order.stage_order`: min(pp - s - 1, m) warm-up forwards,
then one forward and one backward in turn, then the remaining backwards; an unchained shared
micro-batch's forward also waits for the backward of the previous shared one. A forward on stage s
waits for the same micro-batch's forward on stage s - 1, a backward for its backward on stage s + 1;
each crossing pays its send (the micro-batch's boundary activations forward, their gradient backward:
`send[j][s]` seconds for micro-batch j between stages s and s + 1, or one number for all). Each
micro-batch's forward is a third of its time on the stage, its backward two thirds (backward costs
twice the forward, as in the cost model).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..planner.pipeline_order import stage_order

Sends = float | Sequence[Sequence[float]]
"""Seconds of one stage-to-stage send: one for all, or per micro-batch and stage boundary."""

__all__ = ["PipelineRun", "one_f_one_b", "first_order_bubble"]


@dataclass(frozen=True)
class PipelineRun:
    makespan: float
    """Seconds from the first forward on stage 0 to the last backward on stage 0."""
    bubble_rate: float
    """Idle fraction of the stages' time: 1 - work / (pp x makespan)."""


def _send_table(send: Sends, m: int, pp: int) -> Sequence[Sequence[float]]:
    if isinstance(send, (int, float)):
        return [[float(send)] * max(pp - 1, 0)] * m
    if len(send) != m or any(len(row) != pp - 1 for row in send):
        raise ValueError(f"send must hold {m} rows (one per micro-batch) of {pp - 1} seconds (one per stage boundary)")
    return send


def one_f_one_b(
    times: Sequence[float],
    pp: int,
    send: Sends = 0.0,
    shared: Sequence[bool] | None = None,
    chained: Sequence[bool] | None = None,
) -> PipelineRun:
    """Run micro-batches of `times` (seconds over all stages, in order) through `pp` stages, each stage in
    `stage_order` (`shared`, `chained`: its flags per micro-batch; default none shared)."""
    if pp < 1:
        raise ValueError(f"pp must be >= 1, got {pp}")
    m = len(times)
    if m == 0:
        return PipelineRun(0.0, 0.0)
    for name, flags in (("shared", shared), ("chained", chained)):
        if flags is not None and len(flags) != m:
            raise ValueError(f"{name} must hold one flag per micro-batch ({m}), got {len(flags)}")
    sends = _send_table(send, m, pp)
    fwd = [t / (3 * pp) for t in times]
    bwd = [2 * t / (3 * pp) for t in times]
    orders = [stage_order(s, pp, shared or [False] * m, chained) for s in range(pp)]
    done: dict[tuple[str, int, int], float] = {}
    head, clock = [0] * pp, [0.0] * pp
    progress = True
    while progress:
        progress = False
        for s in range(pp):
            while head[s] < len(orders[s]):
                kind, j = orders[s][head[s]]
                dep = ("F", j, s - 1) if kind == "F" else ("B", j, s + 1)
                has_dep = (kind == "F" and s > 0) or (kind == "B" and s < pp - 1)
                if has_dep and dep not in done:
                    break
                ready = done[dep] + sends[j][s - 1 if kind == "F" else s] if has_dep else 0.0
                clock[s] = max(clock[s], ready) + (fwd[j] if kind == "F" else bwd[j])
                done[kind, j, s] = clock[s]
                head[s] += 1
                progress = True
    makespan = max(clock)
    return PipelineRun(makespan, 1.0 - sum(times) / (pp * makespan) if makespan > 0 else 0.0)


def first_order_bubble(times: Sequence[float], pp: int) -> PipelineRun:
    """The simulator's first-order model: each micro-batch occupies the pipeline for time / pp, plus a
    drain of (pp - 1) / pp of the longest."""
    if not times:
        return PipelineRun(0.0, 0.0)
    makespan = sum(times) / pp + (pp - 1) / pp * max(times)
    return PipelineRun(makespan, 1.0 - sum(times) / (pp * makespan))
