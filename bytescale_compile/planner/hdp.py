"""Naive HDP (paper Algorithm 1): D(s) ranks and offload ratio r per long sequence, best-fit packing
of the short ones to capacity C, then every rank gets about the same number of tokens.

Balancing tokens rather than time is what makes it naive: attention is quadratic, so ranks holding
slices of long sequences finish later than ranks holding packed short ones (§5).
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

import numpy as np

from .common import PlanBuilder, best_fit_pack
from .plan import Plan, PlanError

if TYPE_CHECKING:
    from .cost_model import CostModel

__all__ = ["plan_naive", "ranks_needed"]


def ranks_needed(lens: np.ndarray, world_size: int, capacity: int, cost_model: CostModel, layers_per_rank: int,
                 offload: bool) -> tuple[np.ndarray, np.ndarray]:
    """D(s) and r of Eq. 2 for every sequence (D = 0: short, to be packed), after checking each fits."""
    ranks, ratio = cost_model.ranks_and_ratio(lens, capacity, layers_per_rank, offload)
    over = np.flatnonzero(ranks > world_size)
    if over.size:
        longest = int(over[lens[over].argmax()])
        limit = cost_model.max_sequence(world_size, capacity, layers_per_rank, offload=offload)
        how = "with the offload ratios Eq. 2 allows" if offload else "without offloading"
        raise PlanError(f"sequence {longest} has {int(lens[longest])} tokens, more than the {limit} that {world_size} "
                        f"ranks of capacity {capacity} can hold {how}")
    return ranks, ratio


def plan_naive(lens: np.ndarray, world_size: int, capacity: int, cost_model: CostModel, pp_size: int = 1,
               offload: bool = True) -> Plan:
    layers = max(1, cost_model.layers // pp_size)
    ranks, ratio = ranks_needed(lens, world_size, capacity, cost_model, layers, offload)
    builder = PlanBuilder("naive", lens, world_size, capacity, cost_model, pp_size, layers if offload else 0)
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
