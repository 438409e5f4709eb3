"""What the planners build a plan with: best-fit packing, the time of a micro-batch, the group size past which a
sequence gets no faster, and `PlanBuilder`, which collects micro-batches in one global order."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from .plan import BalanceSettings, MicroBatch, Plan, StaticMesh, local_tokens, split_tokens
from .split import DEFAULT_SP, SP_RING, check_sp, choose_split

if TYPE_CHECKING:
    from .cost_model import CostModel

__all__ = [
    "best_fit_pack",
    "fastest_group",
    "fastest_time",
    "micro_batch_time",
    "PlanBuilder",
]


def best_fit_pack(lens: np.ndarray, ids: np.ndarray, capacity: int) -> list[list[int]]:
    """Best-fit decreasing: each sequence goes to the fullest bin it still fits (Alg. 1, lines 7-9), the
    first such bin on ties. Bins are kept sorted by one int, room x scale + bin index (the order of the
    pair, as scale exceeds every index): ints bisect faster than tuples."""
    order = ids[np.argsort(-lens[ids], kind="stable")]
    scale = order.size + 1
    bins: list[list[int]] = []
    room: list[int] = []
    for i, n in zip(order.tolist(), lens[order].tolist()):
        at = bisect.bisect_left(room, n * scale)
        if at < len(room):
            key = room.pop(at)
            bins[key % scale].append(i)
            bisect.insort(room, key - n * scale)
        else:
            bins.append([i])
            bisect.insort(room, (capacity - n) * scale + len(bins) - 1)
    return bins


def micro_batch_time(cost_model: CostModel, lens: np.ndarray, group_size: int, ratio: float) -> float:
    """Seconds for one micro-batch on each of its ranks: attention/MLP compute split evenly by zigzag (plus
    the ring's own compute), overlapped with the ring P2P and with the offload copies (DMA), whichever is longest."""
    compute = float(cost_model.seq_time(lens).sum()) / group_size
    ring = 0.0
    if group_size > 1:
        held = local_tokens(lens, group_size)
        compute += float(cost_model.ring_compute_time(held, group_size))
        ring = float(cost_model.ring_time(held, group_size))
    offload = float(cost_model.offload_time(lens, ratio).sum()) / group_size if ratio > 0 else 0.0
    return max(compute, ring, offload)


def fastest_group(cost_model: CostModel, lens: np.ndarray, work: np.ndarray, world_size: int) -> np.ndarray:
    """Group size past which a sequence gets no faster: per-rank compute falls as work/d while the
    ring's per-rank P2P grows toward its floor A (then (d-1)·T_local = s, at the bandwidth of the
    widest ring, which crosses the slowest links), so the two cross at d* = 1 + work / A."""
    widest = cost_model.hardware.ring_bandwidth(world_size)
    floor = np.maximum(cost_model.ring_bytes(lens, 2) / widest, 1e-12)
    return np.clip(1 + np.floor(work / floor), 1, np.minimum(world_size, lens)).astype(np.int64)


def fastest_time(
    cost_model: CostModel, lens: np.ndarray, work: np.ndarray, world_size: int, min_ranks: np.ndarray
) -> np.ndarray:
    """The least time each sequence can take on any allowed group size (compute split vs ring P2P)."""
    best = np.maximum(fastest_group(cost_model, lens, work, world_size), np.maximum(min_ranks, 1))
    times = []
    for d in (best, np.minimum(best + 1, np.minimum(world_size, lens))):
        ring = np.array(
            [
                float(cost_model.ring_time(np.array([n / g]), int(g))[0]) if g > 1 else 0.0
                for n, g in zip(lens.tolist(), d.tolist())
            ]
        )
        times.append(np.maximum(work / d, ring))
    return np.minimum(*times)


def _one_local_tokens(n: int, group_size: int) -> int:
    """`local_tokens` of one sequence: rank r holds zigzag chunks r and 2d-1-r, each n // 2d tokens plus
    one of the n % 2d left over for the first chunks, so the most is 2(n // 2d) plus 1 or 2."""
    base, extra = divmod(n, 2 * group_size)
    return 2 * base + (extra >= 1) + (extra >= group_size + 1)


class PlanBuilder:
    """Collects micro-batches in a global order; each rank runs its own in that order (deadlock-free)."""

    def __init__(
        self,
        strategy: str,
        lens: np.ndarray,
        world_size: int,
        capacity: int,
        cost_model: CostModel,
        pp_size: int = 1,
        layers_per_rank: int = 0,
        seq_time: np.ndarray | None = None,
        sp: str = DEFAULT_SP,
    ) -> None:
        """`seq_time` is `cost_model.seq_time(lens)` when the caller has it already (auto's candidates). `sp`
        ("ring", "ulysses", "auto") is how shared micro-batches split their ranks u × r (`split.choose_split`):
        under "ring" every one is a plain ring (u = 1) and times are `micro_batch_time`'s."""
        self.sp = check_sp(sp)
        self._split_times: dict[tuple[tuple[int, ...], int, float], float] = {}
        self.strategy, self.lens, self.world_size, self.capacity = strategy, lens, world_size, capacity
        self.cost_model, self.pp_size, self.layers_per_rank = cost_model, pp_size, layers_per_rank
        if seq_time is None:
            seq_time = cost_model.seq_time(lens) if lens.size else np.zeros(0)
        self.seq_time = seq_time
        self.micro_batches: list[MicroBatch] = []
        self._bandwidth: dict[int, float] = {}
        self._lens_list: list[int] = lens.tolist()
        self._seq_time_list: list[float] = self.seq_time.tolist()

    def time_of(self, sequences: Sequence[int], group_size: int, ratio: float) -> float:
        """Estimated seconds of a micro-batch; a packed one is the sum of its sequences' precomputed times,
        one sequence is computed in scalar arithmetic (the planner's hot path)."""
        if group_size == 1 and ratio == 0:
            return sum(self._seq_time_list[i] for i in sequences)
        if self.sp != SP_RING and group_size > 1:
            return self._split_time(sequences, group_size, ratio)
        if len(sequences) == 1:
            return self._one_sequence_time(sequences[0], group_size, ratio)
        return micro_batch_time(self.cost_model, self.lens[list(sequences)], group_size, ratio)

    def _split_time(self, sequences: Sequence[int], group_size: int, ratio: float) -> float:
        """The chosen split's time on `group_size` adjacent ranks from rank 0 (the placers ask before they know
        the ranks, as the ring's bandwidth does: `Hardware.ring_bandwidth`); cached per micro-batch shape."""
        key = (tuple(sequences), group_size, ratio)
        if key not in self._split_times:
            ids = list(sequences)
            work = sum(self._seq_time_list[i] for i in ids)
            _, seconds = choose_split(self.cost_model, self.lens[ids], range(group_size), ratio, self.sp, work)
            self._split_times[key] = seconds
        return self._split_times[key]

    def _one_sequence_time(self, seq: int, group_size: int, ratio: float) -> float:
        """`micro_batch_time` of one sequence, without numpy's per-call overhead."""
        cm, n, d = self.cost_model, self._lens_list[seq], group_size
        compute = self._seq_time_list[seq] / d
        act, comm = cm.memory, cm.comm
        offload = (
            cm.model.layers * (act.alpha2 * n + act.beta2) * ratio / cm.offload_bandwidth / d if ratio > 0 else 0.0
        )
        if d == 1:
            return max(compute, offload)
        if d not in self._bandwidth:
            self._bandwidth[d] = float(cm.hardware.ring_bandwidth(d))
        held = _one_local_tokens(n, d)
        ring_bytes = (
            cm.ring_layers * 3 * (d - 1) * held * comm.kv_bytes_per_token + 6 * (d - 1) * comm.mixer_state_bytes
        )
        ring = ring_bytes / self._bandwidth[d] + (cm.ring_layers * 3 * (d - 1) + 3 * cm.model.mixer_layers) * cm.latency
        return max(compute + cm.ring_layers * (d - 1) * held * cm.time.ring_overhead, ring, offload)

    def add(self, ranks: Sequence[int], sequences: Sequence[int], ratio: float = 0.0) -> MicroBatch:
        """A micro-batch of `sequences` on `ranks`; a shared one gets its u × r split (`choose_split`, on these
        ranks) unless `sp` is "ring"."""
        if len(ranks) > 1 and self.sp != SP_RING:
            return self._add_split(ranks, sequences, ratio)
        if len(ranks) == 1:
            tokens = sum(self._lens_list[i] for i in sequences)
        elif len(sequences) == 1:
            tokens = _one_local_tokens(self._lens_list[sequences[0]], len(ranks))
        else:
            tokens = local_tokens(self.lens[list(sequences)], len(ranks))
        mb = MicroBatch(
            id=len(self.micro_batches),
            ranks=tuple(map(int, ranks)),
            sequences=tuple(map(int, sequences)),
            offload_ratio=float(ratio),
            tokens_per_rank=tokens,
            est_time=self.time_of(sequences, len(ranks), ratio),
        )
        self.micro_batches.append(mb)
        return mb

    def _add_split(self, ranks: Sequence[int], sequences: Sequence[int], ratio: float) -> MicroBatch:
        ids, ranks = list(sequences), tuple(map(int, ranks))
        lens = self.lens[ids]
        work = sum(self._seq_time_list[i] for i in ids)
        ulysses, seconds = choose_split(self.cost_model, lens, ranks, ratio, self.sp, work)
        mb = MicroBatch(
            id=len(self.micro_batches),
            ranks=ranks,
            sequences=tuple(map(int, sequences)),
            offload_ratio=float(ratio),
            tokens_per_rank=split_tokens(lens, len(ranks), ulysses),
            est_time=seconds,
            ulysses=ulysses,
        )
        self.micro_batches.append(mb)
        return mb

    def build(
        self,
        schedule: list[list[int]] | None = None,
        *,
        offload: bool | None = None,
        balance: BalanceSettings | None = None,
        mesh: StaticMesh | None = None,
        shard_blockers: tuple[str, ...] = (),
    ) -> Plan:
        """The plan; `schedule` is each rank's order of micro-batch ids, by default creation order
        (which keeps shared micro-batches in one global order: deadlock-free). The keywords say how it was
        planned (`Plan`'s fields of the same names)."""
        if schedule is None:
            schedule = [[] for _ in range(self.world_size)]
            for mb in self.micro_batches:
                for r in mb.ranks:
                    schedule[r].append(mb.id)
        return Plan(
            strategy=self.strategy,
            world_size=self.world_size,
            capacity=self.capacity,
            pp_size=self.pp_size,
            sequences=self.lens.tolist(),
            micro_batches=self.micro_batches,
            schedule=schedule,
            layers_per_rank=self.layers_per_rank,
            sp=self.sp,
            offload=offload,
            balance=balance,
            mesh=mesh,
            shard_blockers=shard_blockers,
        )
