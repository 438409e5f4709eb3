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
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..strategies import DEFAULT_SP, SP_AUTO, SP_MODES, SP_RING, SP_ULYSSES
from .plan import local_tokens, zigzag_tokens

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
    "SplitTerms",
    "aligned_bandwidths",
    "split_bandwidths",
    "group_seconds",
    "sequence_seconds",
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
    for u in range(1, min(d, heads) + 1):
        if d % u or heads % u:
            continue
        if u > 1 and topology is not None:
            per_node = topology.ranks_per_node
            if any(len({r // per_node for r in ranks[g : g + u]}) > 1 for g in range(0, d, u)):
                continue
        allowed.append(u)
    return allowed


@dataclass(frozen=True)
class SplitTerms:
    """The terms of `group_seconds` for one cost model and Ulysses degree u, each linear in tokens or steps: read
    off the cost model's own methods (`split_ring_bytes`, `ring_latency`, `split_ring_compute_time`,
    `ulysses_bytes`, `ulysses_latency`), so that planner, lower bound and simulator evaluate one expression on
    floats or arrays alike."""

    ring_bytes_per_token: float
    """Ring bytes per step and virtual-rank token."""
    ring_bytes_per_step: float
    """Ring bytes per step whatever the tokens (a hybrid's mixer states)."""
    step_latency: float
    """Seconds of message latency per ring step."""
    ring_latency: float
    """Seconds of message latency once per micro-batch that has a ring (a hybrid's mixer batches)."""
    ring_compute: float
    """Seconds of the ring's own compute per step and token of a device's heads (`ring_overhead` x layers)."""
    a2a_bytes_per_token: float
    """All-to-all bytes per token of the rank's shard."""
    a2a_latency: float

    @classmethod
    def of(cls, cost_model: CostModel, ulysses: int) -> SplitTerms:
        cm, u = cost_model, ulysses
        empty = float(cm.split_ring_bytes(0.0, u, 2))
        step = float(cm.ring_latency(3) - cm.ring_latency(2))
        return cls(
            ring_bytes_per_token=float(cm.split_ring_bytes(1.0, u, 2)) - empty,
            ring_bytes_per_step=empty,
            step_latency=step,
            ring_latency=float(cm.ring_latency(2)) - step,
            ring_compute=float(cm.split_ring_compute_time(float(u), u, 2)),
            a2a_bytes_per_token=float(cm.ulysses_bytes(1.0, u)),
            a2a_latency=float(cm.ulysses_latency(u)),
        )


def group_seconds(
    terms: SplitTerms,
    *,
    work,
    virtual,
    a2a_tokens,
    offload,
    group_size,
    ulysses: int,
    ring_bandwidth,
    a2a_bandwidth,
):
    """The one model of a group's time: seconds of a micro-batch of `work` seconds of sequences on `group_size`
    = D ranks split u × r (u = `ulysses`, r = D / u), on floats or elementwise on arrays:

        max(compute, ring, offload) + all-to-all

    compute: `work` / D, balanced exactly under Ulysses (whole sequences on H/u heads) and by the zigzag among
    the r groups, plus the ring's own compute over the `virtual` rank's tokens; ring: r - 1 steps of the K/V of
    the rank's heads at `ring_bandwidth` plus their latencies, hidden behind the compute; offload: the copies'
    seconds per rank, also hidden; all-to-all: the rank's `a2a_tokens` at `a2a_bandwidth`, blocking. The
    planner's estimates (`split_time`, `PlanBuilder.time_of`, `group_size.sequence_times`), the simulator's
    durations and the lower bound all come from here, so no plan of any schedule simulates below the bound."""
    t, u = terms, ulysses
    steps = group_size // u - 1
    compute = work / group_size + t.ring_compute * steps * virtual / u
    ring = steps * (t.ring_bytes_per_token * virtual + t.ring_bytes_per_step) / ring_bandwidth
    ring = ring + t.step_latency * steps + t.ring_latency * (steps > 0)
    a2a = t.a2a_bytes_per_token * a2a_tokens / a2a_bandwidth + t.a2a_latency * (u > 1)
    if isinstance(compute, float):
        return max(compute, ring, offload) + a2a
    return np.maximum(np.maximum(compute, ring), offload) + a2a


def sequence_seconds(terms: SplitTerms, *, length, work, offload, group_size, ulysses: int, bandwidths: tuple):
    """`group_seconds` of one sequence of `length` tokens, on ints or elementwise on arrays: its virtual rank
    holds the zigzag share of r = D / u ranks, and the all-to-all moves 1/u of it. `bandwidths` is (ring,
    all-to-all)."""
    virtual = zigzag_tokens(length, group_size // ulysses)
    return group_seconds(
        terms,
        work=work,
        virtual=virtual,
        a2a_tokens=-(-virtual // ulysses),
        offload=offload,
        group_size=group_size,
        ulysses=ulysses,
        ring_bandwidth=bandwidths[0],
        a2a_bandwidth=bandwidths[1],
    )


def split_time(
    cost_model: CostModel,
    lens: np.ndarray,
    ranks: Sequence[int],
    ratio: float,
    ulysses: int,
    work: float | None = None,
    ring_bandwidth: float | None = None,
    terms: SplitTerms | None = None,
) -> float:
    """Seconds of one micro-batch of sequences `lens` on `ranks` split u × r (u = `ulysses`): `group_seconds`
    of the sequences' work (`work`, else `CostModel.seq_time` summed), the zigzag share of the virtual rank, the
    token shard of the all-to-all and the offload copies of ratio r, with the ring at `ring_bandwidth` (default:
    the u rings' own, `Hardware.split_ring_bandwidth`) and the all-to-all at `Hardware.all_to_all_bandwidth`.
    `terms` is `SplitTerms.of(cost_model, ulysses)` where the caller keeps it."""
    d, u = len(ranks), ulysses
    cm = cost_model
    total = float(cm.seq_time(lens).sum()) if work is None else float(work)
    offload = float(cm.offload_time(lens, ratio).sum()) / d if ratio > 0 else 0.0
    if d == 1:
        return max(total, offload)
    ring_bw, a2a_bw = split_bandwidths(cm.hardware, tuple(ranks), u)
    virtual = local_tokens(lens, d // u)
    return float(
        group_seconds(
            terms or SplitTerms.of(cm, u),
            work=total,
            virtual=virtual,
            a2a_tokens=-(-virtual // u),
            offload=offload,
            group_size=d,
            ulysses=u,
            ring_bandwidth=ring_bw if ring_bandwidth is None else ring_bandwidth,
            a2a_bandwidth=a2a_bw,
        )
    )


@functools.lru_cache(maxsize=4096)
def split_bandwidths(hardware: Hardware, ranks: tuple[int, ...], ulysses: int) -> tuple[float, float]:
    """(ring, all-to-all) bytes/s per rank of a u × r split over `ranks`: the placers ask for the same group
    sizes over and over, and the all-to-all's links take O(D(s)·u) hops to add up."""
    return hardware.split_ring_bandwidth(ranks, ulysses), hardware.all_to_all_bandwidth(ranks, ulysses)


@functools.lru_cache(maxsize=4096)
def aligned_bandwidths(hardware: Hardware, group_size: int, ulysses: int) -> tuple[float, float]:
    """`split_bandwidths` of `group_size` adjacent ranks from a node's first one: what the planner charges a group
    before it knows its ranks, and the best any placement of that size gets (contention only slows it). Groups
    of u that tile whole switches (or sit inside one) meet on no link, so one group's all-to-all stands for all,
    and the rings' bandwidth has a closed form (`Topology.aligned_split_ring_bandwidth`)."""
    if group_size % ulysses:
        raise ValueError(f"a group of {group_size} ranks cannot split into Ulysses groups of {ulysses}")
    topology = hardware.topology
    if topology is None:  # every rank its own link: no tuple of ranks to build
        return hardware.network_bandwidth, hardware.all_to_all_bandwidth((), ulysses)
    per_switch = topology.ranks_per_switch
    tiled = (per_switch % ulysses == 0 or ulysses % per_switch == 0) and topology.ranks_per_node % ulysses == 0
    if not tiled:
        return split_bandwidths(hardware, tuple(range(group_size)), ulysses)
    return (
        topology.aligned_split_ring_bandwidth(group_size, ulysses),
        hardware.all_to_all_bandwidth(tuple(range(ulysses)), ulysses),
    )


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
