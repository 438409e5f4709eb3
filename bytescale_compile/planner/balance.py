"""Balance scheduler (paper Algorithm 2): balance time, not tokens.

Sequences are sorted longest first and cut into buckets of about equal FLOPs. Each sequence then goes
to the ranks that have the least work so far: a long one to its D(s) least-loaded ranks together,
a short one into the open packed micro-batch of the least-loaded rank. Ranks that drew short work get
more micro-batches, so all finish together (§5 "Redefine micro-batch"). With pp_size = 1 buckets are
taken in order, so ranks run sequences of the same length level at the same time (DP-Balance); with
pipelines they are taken round-robin so every pipeline gets a mix (PP-Balance).

`delta` is the paper's threshold δ: a short sequence may go to a rank up to δ seconds busier than
the least-loaded one when that rank's open micro-batch still has room, so balance within δ buys
fewer, fuller micro-batches.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

import numpy as np

from .common import PlanBuilder
from .hdp import ranks_needed
from .plan import Plan

if TYPE_CHECKING:
    from .cost_model import CostModel

__all__ = ["plan_balance", "flop_buckets"]

_DELTA_CANDIDATES = 4


def flop_buckets(flops: np.ndarray, order: np.ndarray, num_buckets: int) -> list[np.ndarray]:
    """Split `order` (longest first) into contiguous buckets of about equal total FLOPs."""
    if order.size == 0:
        return []
    cumulative = np.cumsum(flops[order])
    edges = np.searchsorted(cumulative, cumulative[-1] * np.arange(1, num_buckets) / num_buckets, side="right")
    return [b for b in np.split(order, edges) if b.size]


def _interleave(buckets: list[np.ndarray]) -> np.ndarray:
    """PP-Balance: one sequence from each bucket in turn."""
    longest = max(b.size for b in buckets)
    grid = np.full((len(buckets), longest), -1, dtype=np.int64)
    for row, b in enumerate(buckets):
        grid[row, : b.size] = b
    flat = grid.T.ravel()
    return flat[flat >= 0]


class _Ranks:
    """Per-rank busy time (a heap) and the open packed micro-batch of each rank."""

    def __init__(self, builder: PlanBuilder, world_size: int, capacity: int) -> None:
        self.builder, self.capacity = builder, capacity
        self.heap = [(0.0, r) for r in range(world_size)]
        self.open: list[list[int]] = [[] for _ in range(world_size)]
        self.open_tokens = [0] * world_size

    def close(self, rank: int) -> None:
        if self.open[rank]:
            self.builder.add([rank], self.open[rank])
            self.open[rank], self.open_tokens[rank] = [], 0

    def add_shared(self, seq: int, group_size: int, ratio: float) -> None:
        group = [heapq.heappop(self.heap) for _ in range(group_size)]
        start = max(t for t, _ in group)
        for _, r in group:
            self.close(r)
        self.builder.add(sorted(r for _, r in group), [seq], ratio)
        end = start + self.builder.micro_batches[-1].est_time
        for _, r in group:
            heapq.heappush(self.heap, (end, r))

    def add_packed(self, seq: int, tokens: int, seconds: float, delta: float) -> None:
        least = heapq.heappop(self.heap)
        chosen, others = least, []
        if self.open_tokens[least[1]] + tokens > self.capacity:
            while self.heap and len(others) < _DELTA_CANDIDATES and self.heap[0][0] <= least[0] + delta:
                candidate = heapq.heappop(self.heap)
                if self.open_tokens[candidate[1]] + tokens <= self.capacity:
                    chosen, others = candidate, [*others, least]
                    break
                others.append(candidate)
        for item in others:
            heapq.heappush(self.heap, item)
        t, r = chosen
        if self.open_tokens[r] + tokens > self.capacity:
            self.close(r)
        self.open[r].append(seq)
        self.open_tokens[r] += tokens
        heapq.heappush(self.heap, (t + seconds, r))


def plan_balance(lens: np.ndarray, world_size: int, capacity: int, cost_model: CostModel, pp_size: int = 1,
                 delta: float | None = None, num_buckets: int = 16) -> Plan:
    layers = max(1, cost_model.layers // pp_size)
    ranks, ratio = ranks_needed(lens, world_size, capacity, cost_model, layers, offload=True)
    builder = PlanBuilder("balance", lens, world_size, capacity, cost_model, pp_size, layers)
    flops = cost_model.flops(lens) if lens.size else np.zeros(0)
    order = np.argsort(-lens, kind="stable")
    buckets = flop_buckets(flops, order, num_buckets)
    sequence = (np.concatenate(buckets) if pp_size == 1 else _interleave(buckets)) if buckets else order
    if delta is None:
        delta = 0.01 * float(builder.seq_time.sum()) / world_size
    state = _Ranks(builder, world_size, capacity)
    seq_time, lens_list, ranks_list, ratio_list = builder.seq_time.tolist(), lens.tolist(), ranks.tolist(), ratio.tolist()
    for i in sequence.tolist():
        if ranks_list[i] > 0:
            state.add_shared(i, ranks_list[i], ratio_list[i])
        else:
            state.add_packed(i, lens_list[i], seq_time[i], delta)
    for r in range(world_size):
        state.close(r)
    return builder.build(delta=delta, buckets=len(buckets), balance="dp" if pp_size == 1 else "pp")
