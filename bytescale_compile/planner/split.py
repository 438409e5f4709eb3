"""Per shared micro-batch, the u × r split of its D(s) ranks: Ulysses degree u, ring degree r = D(s) / u.

Groups of u consecutive ranks of the micro-batch's rank list run DeepSpeed-Ulysses (an all-to-all turns
token shards into head shards, attention runs on H/u heads of the virtual rank's tokens, a second
all-to-all brings the output back), and the r groups run the zigzag ring among them. `choose_split` picks u
by the cost model (`split_time`), among the u that divide D(s) and the query heads and whose groups stay
inside one node (`allowed_ulysses`); `sp` forces ("ring": u = 1, "ulysses": the largest allowed u) or frees
("auto": the least predicted time) the choice. The simulator times a plan's splits with the same
`split_time`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..strategies import DEFAULT_SP, SP_AUTO, SP_MODES, SP_RING, SP_ULYSSES
from .plan import local_tokens, split_tokens

if TYPE_CHECKING:
    from .cost_model import CostModel
    from .hardware import Hardware
    from .plan import Plan

__all__ = [
    "DEFAULT_SP",
    "SP_AUTO",
    "SP_MODES",
    "SP_RING",
    "SP_ULYSSES",
    "allowed_ulysses",
    "check_sp",
    "choose_split",
    "split_time",
    "validate_splits",
]


def check_sp(sp: str) -> str:
    if sp not in SP_MODES:
        raise ValueError(f"sp must be one of {SP_MODES}, got {sp!r}")
    return sp


def allowed_ulysses(cost_model: CostModel, ranks: Sequence[int]) -> list[int]:
    """The Ulysses degrees a micro-batch on `ranks` may take, ascending: u divides D(s) = len(ranks) and the
    query heads of each device (`CostModel.device_heads`: under tensor parallelism a device's shard of them),
    and each group of u consecutive ranks sits on one node (`Topology.ranks_per_node`; without a topology any
    group does). Only u = 1 for a micro-batch of one rank, for a cost model that does not know the heads, and
    for hybrid models (their mixer layers' halo and state exchange follows the ring's layout)."""
    d, device = len(ranks), cost_model.device_heads
    if d < 2 or device is None or cost_model.model.mixer_layers:
        return [1]
    heads = device[0]
    topology = cost_model.hardware.topology
    allowed = []
    for u in range(1, d + 1):
        if d % u or heads % u:
            continue
        if u > 1 and topology is not None:
            per_node = topology.ranks_per_node
            if any(len({r // per_node for r in ranks[g : g + u]}) > 1 for g in range(0, d, u)):
                continue
        allowed.append(u)
    return allowed


def split_time(
    cost_model: CostModel,
    lens: np.ndarray,
    ranks: Sequence[int],
    ratio: float,
    ulysses: int,
    work: float | None = None,
    ring_bandwidth: float | None = None,
) -> float:
    """Seconds of one micro-batch of sequences `lens` on `ranks` split u × r (u = `ulysses`):

        max(compute, ring, offload) + all-to-all

    compute: the sequences' work (`work`, else `CostModel.seq_time` summed) / D(s), balanced exactly under
    Ulysses (whole sequences on H/u heads) and by the zigzag among the r groups, plus the ring's own compute
    (`split_ring_compute_time`); ring: the r-ring's K/V of the rank's heads (`split_ring_bytes`) at
    `ring_bandwidth` (default: the u rings' own, `Hardware.split_ring_bandwidth`) plus r - 1 latencies per
    transfer, hidden behind the compute as the plain ring's is; offload: the copies of ratio r, also hidden;
    all-to-all: `CostModel.ulysses_time` of the rank's token shard at `Hardware.all_to_all_bandwidth`, blocking.
    At u = 1 this is `common.micro_batch_time` with the ring's bandwidth taken from `ranks`."""
    d, u = len(ranks), ulysses
    r = d // u
    cm, hw = cost_model, cost_model.hardware
    total = float(cm.seq_time(lens).sum()) if work is None else work
    compute = total / d
    offload = float(cm.offload_time(lens, ratio).sum()) / d if ratio > 0 else 0.0
    if d == 1:
        return max(compute, offload)
    ranks = tuple(ranks)
    virtual = local_tokens(lens, r)
    compute += float(cm.split_ring_compute_time(virtual, u, r))
    ring = 0.0
    if r > 1:
        bandwidth = _bandwidths(hw, ranks, u)[0] if ring_bandwidth is None else ring_bandwidth
        ring = float(cm.split_ring_bytes(virtual, u, r)) / bandwidth + float(cm.ring_latency(r))
    a2a = 0.0
    if u > 1:
        a2a = float(cm.ulysses_time(split_tokens(lens, d, u), u, _bandwidths(hw, ranks, u)[1]))
    return max(compute, ring, offload) + a2a


@functools.lru_cache(maxsize=4096)
def _bandwidths(hardware: Hardware, ranks: tuple[int, ...], ulysses: int) -> tuple[float, float]:
    """(ring, all-to-all) bytes/s per rank of a u × r split over `ranks`: the placers ask for the same group
    sizes over and over, and the all-to-all's links take O(D(s)·u) hops to add up."""
    return hardware.split_ring_bandwidth(ranks, ulysses), hardware.all_to_all_bandwidth(ranks, ulysses)


def validate_splits(plan: Plan, cost_model: CostModel) -> None:
    """`plan.validate()` with the heads of one device (`CostModel.device_heads`), which every micro-batch's
    Ulysses degree must divide."""
    heads = cost_model.device_heads
    plan.validate(heads=heads and heads[0], kv_heads=heads and heads[1])


def choose_split(
    cost_model: CostModel,
    lens: np.ndarray,
    ranks: Sequence[int],
    ratio: float,
    sp: str = SP_AUTO,
    work: float | None = None,
) -> tuple[int, float]:
    """(u, seconds) for a micro-batch of `lens` on `ranks`: under "auto" the allowed u (`allowed_ulysses`) with
    the least `split_time` (the smaller u on a tie), under "ulysses" the largest allowed u, under "ring" u = 1."""
    check_sp(sp)
    allowed = allowed_ulysses(cost_model, ranks) if sp != SP_RING else [1]
    if sp == SP_ULYSSES:
        allowed = allowed[-1:]
    best: tuple[int, float] | None = None
    for u in allowed:
        seconds = split_time(cost_model, lens, ranks, ratio, u, work)
        if best is None or seconds < best[1]:
            best = (u, seconds)
    assert best is not None
    return best
