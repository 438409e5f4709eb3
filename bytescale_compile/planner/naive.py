"""Naive HDP (paper Algorithm 1): D(s) ranks and offload ratio r per long sequence, best-fit packing
of the short ones to capacity C, then every rank gets about the same number of tokens.

Balancing tokens rather than time is what makes it naive: attention is quadratic, so ranks holding
slices of long sequences finish later than ranks holding packed short ones (§5).

With offloading, Eq. 2's D(s) is the fewest ranks that can *hold* a sequence: at full offload a 2M
sequence fits 16 ranks, which then compute for minutes while the rest of the step is long over. So
offloading lowers a sequence's ranks from D(s, 0) only while its micro-batch gets no slower: down to
the ranks whose compute share still hides under its time on D(s, 0) ranks (ring P2P or compute),
with the least r that fits it there (`naive_ranks`). Compute-bound sequences keep D(s, 0), as in the
paper's trace (a 312K sequence over 39 = 312K / 8K ranks); ring-bound ones shed the ranks whose
compute the ring was hiding. Offloading then never makes a micro-batch slower under the cost model.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

import numpy as np

from ..strategies import NAIVE
from .builder import PlanBuilder, best_fit_pack
from .equations import CEIL_RTOL
from .group_size import sequence_times
from .limits import eq2_reason, layers_per_stage, refuse
from .plan import Plan
from .split import DEFAULT_SP

if TYPE_CHECKING:
    from .cost_model import CostModel

__all__ = ["plan_naive", "ranks_needed", "naive_ranks"]


def ranks_needed(
    lens: np.ndarray, world_size: int, capacity: int, cost_model: CostModel, layers_per_rank: int, offload: bool
) -> tuple[np.ndarray, np.ndarray]:
    """D(s) and r of Eq. 2 for every sequence (D = 0: short, to be packed), after checking each fits."""
    ranks, ratio = cost_model.ranks_and_ratio(lens, capacity, layers_per_rank, offload)
    refuse(lens, ranks > world_size, eq2_reason(world_size, capacity, cost_model, layers_per_rank, offload))
    return ranks, ratio


def naive_ranks(
    lens: np.ndarray, world_size: int, capacity: int, cost_model: CostModel, layers_per_rank: int
) -> tuple[np.ndarray, np.ndarray]:
    """D and r of naive HDP with offloading: between Eq. 2's offloaded D(s, r*) and the D(s, 0) of no
    offloading, the fewest ranks on which the sequence is no slower than on D(s, 0), and the least r
    that fits it there. Its offload copies hide under its compute (r <= r* <= r_overlap)."""
    low, _ = ranks_needed(lens, world_size, capacity, cost_model, layers_per_rank, offload=True)
    high = np.minimum(cost_model.ranks_and_ratio(lens, capacity, layers_per_rank, offload=False)[0], world_size)
    high = np.maximum(high, low)
    work = cost_model.seq_time(lens)
    baseline = sequence_times(cost_model, lens, work, np.maximum(high, 1), 1)
    free = np.ceil(work / np.maximum(baseline, 1e-300) * (1 - CEIL_RTOL)).astype(np.int64)
    ranks = np.where(low > 0, np.clip(free, low, high), 0)
    ratio = np.clip(cost_model.ratio_for_ranks(lens, np.maximum(ranks, 1), capacity, layers_per_rank), 0.0, 1.0)
    return ranks, np.where(ranks > 0, ratio, 0.0)


def plan_naive(
    lens: np.ndarray,
    *,
    world_size: int,
    capacity: int,
    cost_model: CostModel,
    pp_size: int = 1,
    offload: bool = True,
    sp: str = DEFAULT_SP,
) -> Plan:
    """Algorithm 1: `offload=False` is the ablation that gives every long sequence its D(s, 0) ranks; `sp` how
    shared micro-batches split u x r."""
    layers = layers_per_stage(cost_model, pp_size)
    if offload and lens.size:
        ranks, ratio = naive_ranks(lens, world_size, capacity, cost_model, layers)
    else:
        ranks, ratio = ranks_needed(lens, world_size, capacity, cost_model, layers, offload)
    builder = PlanBuilder(NAIVE, lens, world_size, capacity, cost_model, pp_size, layers if offload else 0, sp=sp)
    long_ids = np.flatnonzero(ranks > 0)
    long_ids = long_ids[np.argsort(-ranks[long_ids], kind="stable")]
    bins = best_fit_pack(lens, np.flatnonzero(ranks == 0), capacity)
    tokens = [(0, r) for r in range(world_size)]  # heap of (tokens assigned, rank)
    for i in long_ids.tolist():
        d = int(ranks[i])
        group = [heapq.heappop(tokens) for _ in range(d)]
        share = int(lens[i]) // d
        builder.add(sorted(r for _, r in group), [i], float(ratio[i]))
        for t, r in group:
            heapq.heappush(tokens, (t + share, r))
    for packed in bins:
        t, r = heapq.heappop(tokens)
        builder.add([r], packed)
        heapq.heappush(tokens, (t + int(lens[packed].sum()), r))
    return builder.build(offload=offload)
