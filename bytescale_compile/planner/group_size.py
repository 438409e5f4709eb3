"""How many ranks a long sequence gets, and how they split u × r: chosen together, by the one model of a
group's time (`split.group_seconds`).

A ring alone stops paying at the crossover where its P2P outlasts the compute it splits (every rank sends
about the whole sequence's K/V per layer, however many share it). A u × r split sends 1/u of those bytes
around a ring of D/u, and pays a blocking all-to-all inside each node instead, so a split group can be far
larger than the ring's crossover and still get faster. So the planner searches group sizes D >= D(s) and the
Ulysses degrees u allowed on them (`ulysses_degrees`: u divides the heads of a device and a node's ranks,
and the model has no mixer layers) together:

- `fastest_groups`: per sequence, the (D, u) of least predicted time. The planners' search
  (`exhaustive=False`) evaluates, per u, the group sizes where the time can turn: D(s), the switch and node
  boundaries where the ring's bandwidth drops, the crossover of compute and ring at each link class (a
  quadratic once the ring's per-step latency counts), and the widest group. The lower bound
  (`exhaustive=True`) evaluates every multiple of u, so no plan simulates below it.
- `least_groups`: per heavy sequence, the fewest ranks (any u) on which it ends within a target time, the
  balanced step: balance spreads the sequences that would otherwise set the step.

Groups are timed as `group_size` adjacent ranks from a node's first one (`split.aligned_bandwidths`): the
planner sizes a group before it picks its ranks, and balance's heavy groups, placed first, come out adjacent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..strategies import SP_RING
from .split import SplitTerms, aligned_bandwidths, sequence_seconds

if TYPE_CHECKING:
    from .cost_model import CostModel

__all__ = ["GroupChoice", "fastest_groups", "least_groups", "sequence_times", "ulysses_degrees"]


@dataclass(frozen=True)
class GroupChoice:
    """Per sequence: its group size D, Ulysses degree u (r = D / u) and predicted seconds there."""

    ranks: np.ndarray
    ulysses: np.ndarray
    seconds: np.ndarray


def ulysses_degrees(cost_model: CostModel, sp: str) -> list[int]:
    """The Ulysses degrees a group of adjacent ranks may take, ascending: u divides the query heads of a device
    and, with a topology, a node's ranks (each group of u inside one node); only 1 under `sp="ring"`, for a model
    whose heads are unknown, and for hybrid models (`split.allowed_ulysses` has the same rules for given ranks)."""
    device = cost_model.device_heads
    if sp == SP_RING or device is None or cost_model.model.mixer_layers:
        return [1]
    topology = cost_model.hardware.topology
    per_node = topology.ranks_per_node if topology is not None else device[0]
    return [u for u in range(1, device[0] + 1) if device[0] % u == 0 and per_node % u == 0]


def _bandwidth_arrays(cost_model: CostModel, group_size: np.ndarray, ulysses: int) -> tuple[np.ndarray, np.ndarray]:
    """`aligned_bandwidths` of every group size in `group_size`, looked up once per distinct size."""
    sizes, inverse = np.unique(group_size, return_inverse=True)
    pairs = np.array(
        [aligned_bandwidths(cost_model.hardware, int(d), ulysses) for d in sizes.tolist()], np.float64
    ).reshape(-1, 2)
    return pairs[inverse, 0].reshape(group_size.shape), pairs[inverse, 1].reshape(group_size.shape)


def sequence_times(
    cost_model: CostModel, lens: np.ndarray, work: np.ndarray, group_size: np.ndarray, ulysses: int, ratio=0.0
) -> np.ndarray:
    """`split.split_time` of one sequence each (vectorised, broadcast): `lens` with `work` seconds on
    `group_size` adjacent ranks split `ulysses` × r, offloading `ratio`. A group of one runs `work` alone."""
    lens, d = np.broadcast_arrays(np.asarray(lens, np.int64), np.asarray(group_size, np.int64))
    work = np.broadcast_to(np.asarray(work, np.float64), d.shape)
    ratio = np.broadcast_to(np.asarray(ratio, np.float64), d.shape)
    offload = np.where(ratio > 0, cost_model.offload_time(lens, ratio) / np.maximum(d, 1), 0.0)
    seconds = sequence_seconds(
        SplitTerms.of(cost_model, ulysses),
        length=lens,
        work=work,
        offload=offload,
        group_size=d,
        ulysses=ulysses,
        bandwidths=_bandwidth_arrays(cost_model, d, ulysses),
    )
    return np.where(d == 1, np.maximum(work, offload), seconds)


def _link_classes(cost_model: CostModel) -> tuple[list[float], list[int]]:
    """The distinct per-rank ring bandwidths a group may meet, and the group sizes past which it meets the
    next (a switch's ranks, a node's)."""
    hardware = cost_model.hardware
    topology = hardware.topology
    if topology is None:
        return [hardware.network_bandwidth], []
    return (
        sorted({topology.rank_link, topology.rank_uplink, topology.rank_rail}),
        sorted({topology.ranks_per_switch, topology.ranks_per_node}),
    )


def _crossovers(cost_model: CostModel, lens: np.ndarray, work: np.ndarray, ulysses: int, bandwidth: float):
    """Group sizes (not rounded) where compute meets the ring, at `bandwidth`: with r = D / u, compute
    W / (u r) + R (r - 1) / r against ring P (r - 1) / r + L (r - 1) (P: the K/V bytes of the sequence per ring
    step at the bandwidth, R: the ring's compute, L: a ring step's latency and fixed bytes) meet where
    L r^2 + (Q - L) r - (Q + W / u) = 0, Q = P - R."""
    u, terms = ulysses, SplitTerms.of(cost_model, ulysses)
    step = terms.ring_bytes_per_step / bandwidth + terms.step_latency
    q = terms.ring_bytes_per_token * lens / bandwidth - terms.ring_compute * lens / u
    c = q + work / u
    with np.errstate(divide="ignore", invalid="ignore"):
        if step > 0:
            r = (-(q - step) + np.sqrt((q - step) ** 2 + 4 * step * c)) / (2 * step)
        else:
            r = np.where(q > 0, c / q, np.inf)
    return np.nan_to_num(r, nan=np.inf) * u


def fastest_groups(
    cost_model: CostModel,
    lens: np.ndarray,
    work: np.ndarray,
    world_size: int,
    min_ranks: np.ndarray,
    *,
    sp: str,
    exhaustive: bool = False,
) -> GroupChoice:
    """Per sequence, the group size D >= max(`min_ranks`, 1) and Ulysses degree u (`ulysses_degrees`) of least
    predicted time, at most `world_size` ranks and one token per rank; the smaller D, then u, on a tie. The
    planners evaluate the turning points of each u's time (`exhaustive=False`), the lower bound every size."""
    lens = np.asarray(lens, np.int64)
    lo = np.maximum(np.asarray(min_ranks, np.int64), 1)
    hi = np.minimum(world_size, lens)
    best = GroupChoice(lo.copy(), np.ones_like(lo), np.full(lens.shape, np.inf))
    if lens.size == 0:
        return best
    classes, edges = _link_classes(cost_model)
    for u in ulysses_degrees(cost_model, sp):
        lo_u, hi_u = -(-np.maximum(lo, u) // u) * u, hi // u * u
        if u == 1:
            lo_u = lo
        if u > hi.max():
            break
        if exhaustive:
            d = u * np.arange(max(1, int(lo_u.min()) // u), int(hi_u.max()) // u + 1)[None, :]
        else:
            points = [lo_u, hi_u] + [np.full(lens.shape, e + k) for e in edges for k in (0, 1)]
            points += [_crossovers(cost_model, lens, work, u, bw) for bw in classes]
            d = np.concatenate(
                [np.floor(p / u)[:, None] * u for p in points] + [np.ceil(p / u)[:, None] * u for p in points[2:]],
                axis=1,
            )
            d = np.nan_to_num(d, nan=0.0, posinf=2.0 * world_size)
            d = np.clip(d, lo_u[:, None], np.maximum(hi_u, lo_u)[:, None]).astype(np.int64)
        d = np.broadcast_to(d, (lens.size, d.shape[1]))
        seconds = sequence_times(cost_model, lens[:, None], work[:, None], d, u)
        seconds = np.where((d >= lo_u[:, None]) & (d <= hi_u[:, None]) & (d >= 1), seconds, np.inf)
        column = np.lexsort((d, seconds), axis=1)[:, 0] if d.shape[1] > 1 else np.zeros(lens.size, np.int64)
        rows = np.arange(lens.size)
        t, size = seconds[rows, column], d[rows, column]
        better = t < best.seconds
        best = GroupChoice(
            np.where(better, size, best.ranks), np.where(better, u, best.ulysses), np.where(better, t, best.seconds)
        )
    return best


def least_groups(
    cost_model: CostModel,
    lens: np.ndarray,
    work: np.ndarray,
    min_ranks: np.ndarray,
    target: float,
    fastest: GroupChoice,
    *,
    world_size: int,
    sp: str,
) -> np.ndarray:
    """Per sequence, the fewest ranks, at least `min_ranks`, on which some allowed u × r ends it within
    `target` seconds: per u the first multiples of u past work / target. Where none does, its `fastest` group
    (`fastest_groups`)."""
    lens = np.asarray(lens, np.int64)
    hi = np.minimum(world_size, lens)
    wanted = np.maximum(np.ceil(work / target - 1e-9).astype(np.int64), np.maximum(min_ranks, 1))
    none = np.iinfo(np.int64).max
    chosen = np.where(fastest.seconds <= target, fastest.ranks, none)
    for u in ulysses_degrees(cost_model, sp):
        first = -(-wanted // u) * u
        for step in range(3):
            d = first + step * u
            fits = (d <= hi) & (d <= lens)
            seconds = sequence_times(cost_model, lens, work, np.where(fits, d, u), u)
            chosen = np.where(fits & (seconds <= target) & (d < chosen), d, chosen)
    return np.where(chosen == none, fastest.ranks, chosen)
