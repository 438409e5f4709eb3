"""What the planners build a plan with: best-fit packing, the time of a micro-batch, and `PlanBuilder`, which
collects micro-batches in one global order."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from .plan import BalanceSettings, MicroBatch, Plan, StaticMesh, local_tokens, split_tokens, zigzag_tokens
from .split import (
    DEFAULT_SP,
    SP_RING,
    SP_ULYSSES,
    SplitTerms,
    aligned_bandwidths,
    allowed_ulysses,
    check_sp,
    choose_split,
    sequence_seconds,
    split_bandwidths,
    split_time,
)

if TYPE_CHECKING:
    from .cost_model import CostModel

__all__ = [
    "best_fit_pack",
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
    """Seconds for one micro-batch on each of its ranks as a plain ring over `group_size` adjacent ranks
    (`split.split_time` at u = 1): compute split evenly by zigzag (plus the ring's own compute), overlapped
    with the ring P2P and with the offload copies (DMA), whichever is longest."""
    return split_time(cost_model, lens, range(group_size), ratio, 1)


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
        self._terms: dict[int, SplitTerms] = {}
        self._aligned_degrees: dict[int, list[int]] = {}
        self._aligned_bandwidths: dict[tuple[int, int], tuple[float, float]] = {}
        self._lens_list: list[int] = lens.tolist()
        self._seq_time_list: list[float] = self.seq_time.tolist()

    def time_of(self, sequences: Sequence[int], group_size: int, ratio: float) -> float:
        """Estimated seconds of a micro-batch on `group_size` adjacent ranks (the placers ask before they know
        the ranks, as `aligned_bandwidths` does); a packed one is the sum of its sequences' precomputed times, one
        sequence is computed on floats (the planner's hot path), under "auto" at its best allowed split."""
        if group_size == 1 and ratio == 0:
            return sum(self._seq_time_list[i] for i in sequences)
        if len(sequences) == 1:
            seq = sequences[0]
            degrees = self._degrees(range(group_size), group_size)
            if len(degrees) == 1:
                return self._one_time(seq, group_size, ratio, 1, self._aligned(group_size, 1))
            return min(self._one_time(seq, group_size, ratio, u, self._aligned(group_size, u)) for u in degrees)
        if self.sp != SP_RING and group_size > 1:
            return self._split_time(sequences, group_size, ratio)
        return micro_batch_time(self.cost_model, self.lens[list(sequences)], group_size, ratio)

    def ring_time(self, seq: int, group_size: int, ratio: float) -> float:
        """Seconds of sequence `seq` as a plain ring over `group_size` ranks, adjacent or not (the ring's bandwidth
        of adjacent ones): what any ranks of that number get."""
        return self._one_time(seq, group_size, ratio, 1, self._aligned(group_size, 1))

    def _aligned(self, group_size: int, ulysses: int) -> tuple[float, float]:
        """`aligned_bandwidths`, kept per builder: hashing the hardware for its cache costs more than the lookup."""
        key = (group_size, ulysses)
        if key not in self._aligned_bandwidths:
            self._aligned_bandwidths[key] = aligned_bandwidths(self.cost_model.hardware, group_size, ulysses)
        return self._aligned_bandwidths[key]

    def _degrees(self, ranks: Sequence[int], group_size: int) -> list[int]:
        """The Ulysses degrees `sp` lets a micro-batch on `ranks` take (`choose_split`'s rule); cached per size
        for adjacent ranks (`ranks` a range)."""
        if self.sp == SP_RING or group_size == 1:
            return [1]
        if isinstance(ranks, range):
            if group_size not in self._aligned_degrees:
                self._aligned_degrees[group_size] = self._degrees(tuple(ranks), group_size)
            return self._aligned_degrees[group_size]
        allowed = allowed_ulysses(self.cost_model, ranks)
        return allowed[-1:] if self.sp == SP_ULYSSES else allowed

    def _split_time(self, sequences: Sequence[int], group_size: int, ratio: float) -> float:
        """The chosen split's time of several sequences on `group_size` adjacent ranks; cached per micro-batch
        shape."""
        key = (tuple(sequences), group_size, ratio)
        if key not in self._split_times:
            ids = list(sequences)
            work = sum(self._seq_time_list[i] for i in ids)
            _, seconds = choose_split(self.cost_model, self.lens[ids], range(group_size), ratio, self.sp, work)
            self._split_times[key] = seconds
        return self._split_times[key]

    def _one_time(
        self, seq: int, group_size: int, ratio: float, ulysses: int, bandwidths: tuple[float, float]
    ) -> float:
        """`split.split_time` of one sequence split `ulysses` × r with (ring, all-to-all) `bandwidths`, on floats."""
        cm, n, d = self.cost_model, self._lens_list[seq], group_size
        work = self._seq_time_list[seq]
        act = cm.memory
        offload = (
            cm.model.layers * (act.alpha2 * n + act.beta2) * ratio / cm.offload_bandwidth / d if ratio > 0 else 0.0
        )
        if d == 1:
            return max(work, offload)
        if ulysses not in self._terms:
            self._terms[ulysses] = SplitTerms.of(cm, ulysses)
        return sequence_seconds(
            self._terms[ulysses],
            length=n,
            work=work,
            offload=offload,
            group_size=d,
            ulysses=ulysses,
            bandwidths=bandwidths,
        )

    def add(self, ranks: Sequence[int], sequences: Sequence[int], ratio: float = 0.0) -> MicroBatch:
        """A micro-batch of `sequences` on `ranks`; a shared one gets its u × r split (`choose_split`, on these
        ranks) unless `sp` is "ring"."""
        if len(ranks) > 1 and self.sp != SP_RING:
            return self._add_split(ranks, sequences, ratio)
        if len(ranks) == 1:
            tokens = sum(self._lens_list[i] for i in sequences)
        elif len(sequences) == 1:
            tokens = zigzag_tokens(self._lens_list[sequences[0]], len(ranks))
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
        """A shared micro-batch at the split `choose_split` picks on these very ranks (one sequence on floats)."""
        ids, ranks = list(sequences), tuple(map(int, ranks))
        d = len(ranks)
        if len(ids) == 1:
            hardware = self.cost_model.hardware
            ulysses, seconds = min(
                (
                    (u, self._one_time(ids[0], d, ratio, u, split_bandwidths(hardware, ranks, u)))
                    for u in self._degrees(ranks, d)
                ),
                key=lambda pair: pair[1],
            )
            virtual = zigzag_tokens(self._lens_list[ids[0]], d // ulysses)
            tokens = -(-virtual // ulysses)
        else:
            lens = self.lens[ids]
            work = sum(self._seq_time_list[i] for i in ids)
            ulysses, seconds = choose_split(self.cost_model, lens, ranks, ratio, self.sp, work)
            tokens = split_tokens(lens, d, ulysses)
        mb = MicroBatch(
            id=len(self.micro_batches),
            ranks=ranks,
            sequences=tuple(map(int, sequences)),
            offload_ratio=float(ratio),
            tokens_per_rank=tokens,
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
