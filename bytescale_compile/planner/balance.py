"""Balance scheduler (paper Algorithm 2): balance time, not tokens.

Sequences are sorted longest first and cut into buckets of about equal FLOPs. Each sequence then goes
to the ranks that have the least work so far: a long one to its D(s) least-loaded ranks together,
a short one into the open packed micro-batch of the least-loaded rank. Ranks that drew short work get
more micro-batches, so all finish together (§5 "Redefine micro-batch"). Buckets are taken in order, so
ranks run sequences of the same length level at the same time (DP-Balance), and with pipelines each
pipeline takes micro-batches of one or two adjacent length levels, the ones with shorter micro-batches
more of them (PP-Balance, Insight 1): a 1F1B pipeline's fill and drain are set by its longest
micro-batches, so mixing levels in one pipeline costs bubble time (`sim/pipeline.py`). PP-balance
also counts each pipeline's fill and drain in its load, and caps a micro-batch at 1/(4 pp) of the
balanced time, spreading long sequences over more ranks (`_longest_micro_batch`).

D(s) is the fewest ranks that can *hold* a sequence; a sequence whose work on D(s) ranks exceeds the
balanced per-rank time (total work / ranks) would alone set the step time, so it gets
ceil(work / balanced time) ranks instead (with r = 0 once its tokens fit) — but never more than make
it faster: past `fastest_group` the ring's P2P outlasts the compute it splits. When a shared
sequence would still end past that balanced time (few long sequences: three on four ranks, say),
its group widens onto ranks that are idle by its start anyway, while that shortens it.

`delta` is the paper's threshold δ: a short sequence may go to a rank up to δ seconds busier than
the least-loaded one when that rank's open micro-batch still has room, so balance within δ buys
fewer, fuller micro-batches.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .common import PlanBuilder, fastest_group
from .hdp import ranks_needed
from .plan import Plan

if TYPE_CHECKING:
    from .cost_model import CostModel

__all__ = ["DEFAULT_DELTA", "BalanceInputs", "balance_inputs", "balance_ranks", "plan_balance", "schedule_balance",
           "flop_buckets"]

_DELTA_CANDIDATES = 4
DEFAULT_DELTA = 0.01
"""δ as a fraction of the balanced per-rank time (total work / ranks)."""
MICRO_BATCHES_PER_STAGE = 4
"""With pipelines, sequences are spread until each pipeline has at least this many micro-batches per stage."""


def flop_buckets(flops: np.ndarray, order: np.ndarray, num_buckets: int) -> list[np.ndarray]:
    """Split `order` (longest first) into contiguous buckets of about equal total FLOPs."""
    if order.size == 0:
        return []
    cumulative = np.cumsum(flops[order])
    edges = np.searchsorted(cumulative, cumulative[-1] * np.arange(1, num_buckets) / num_buckets, side="right")
    return [b for b in np.split(order, edges) if b.size]


@dataclass
class _Packed:
    """A packed micro-batch being filled: its sequences, tokens, and (for a gap) the seconds left."""

    rank: int
    sequences: list[int] = field(default_factory=list)
    tokens: int = 0
    room: float = 0.0
    seconds: float = 0.0


class _Ranks:
    """Per-rank busy time (a heap), each rank's micro-batches in order, and the idle gaps to backfill.

    A shared micro-batch starts when its busiest rank is free; the others would idle until then. Each
    such gap becomes a packed micro-batch placed just before the shared one, and later (shorter)
    sequences fill it first: work that costs the step nothing.

    With pipelines (pp > 1) a rank's load is its busy time plus its 1F1B fill and drain, (pp - 1) times
    its longest micro-batch (`drain`): a rank that runs a long micro-batch takes less other work.
    """

    def __init__(self, builder: PlanBuilder, world_size: int, capacity: int, pp_size: int = 1) -> None:
        self.builder, self.capacity, self.stretch = builder, capacity, float(pp_size - 1)
        self.heap = [(0.0, r) for r in range(world_size)]
        self.drain = [0.0] * world_size
        self.entries: list[list[int | _Packed]] = [[] for _ in range(world_size)]
        self.open = [_Packed(r) for r in range(world_size)]
        self.gaps: list[tuple[float, int, _Packed]] = []  # sorted by seconds left
        self._gap_ids = 0

    def _grow_drain(self, rank: int, seconds: float) -> float:
        """How much a micro-batch of `seconds` on `rank` adds to its fill and drain (0 without pipelines)."""
        grown = self.stretch * seconds - self.drain[rank]
        if grown <= 0.0:
            return 0.0
        self.drain[rank] += grown
        return grown

    def close(self, rank: int) -> None:
        packed = self.open[rank]
        if packed.sequences:
            self.entries[rank].append(packed)
            self.open[rank] = _Packed(rank)

    def add_shared(self, seq: int, group_size: int, widest: int, ratio: float, target: float) -> None:
        """Run `seq` on its `group_size` least-loaded ranks. When it would end past `target` (the balanced
        step time), widen the group (up to `widest`) onto ranks idle by the time it starts anyway, as long
        as that makes it finish sooner: few, long sequences then split like a static mesh would."""
        group = self._pop_group(group_size)
        start = max(t for t, _ in group)
        best = self.builder.time_of([seq], len(group), ratio)
        while start + best > target and len(group) < widest and self.heap and self.heap[0][0] <= start:
            wider = len(group) + 1
            wider_ratio = 0.0 if self.builder.lens[seq] <= wider * self.capacity else ratio
            seconds = self.builder.time_of([seq], wider, wider_ratio)
            if seconds >= best:
                break
            group.append(self._pop_clock())
            best, ratio = seconds, wider_ratio
        mb = self.builder.add(sorted(r for _, r in group), [seq], ratio)
        end, entries, heap = start + mb.est_time, self.entries, self.heap
        for t, r in group:
            self.close(r)
            if start - t > 0:
                gap = _Packed(r, room=start - t)
                entries[r].append(gap)
                bisect.insort(self.gaps, (gap.room, self._next_gap_id(), gap))
            entries[r].append(mb.id)
            load = end + self.drain[r] + self._grow_drain(r, mb.est_time) if self.stretch else end
            heapq.heappush(heap, (load, r))

    def _pop_clock(self) -> tuple[float, int]:
        """The least-loaded rank and when it is free (its load less its fill and drain)."""
        load, r = heapq.heappop(self.heap)
        return load - self.drain[r], r

    def _pop_group(self, size: int) -> list[tuple[float, int]]:
        """`_pop_clock` `size` times, in one loop: long sequences without offloading take hundreds of ranks."""
        heap, drain, pop = self.heap, self.drain, heapq.heappop
        group = []
        for _ in range(size):
            load, r = pop(heap)
            group.append((load - drain[r], r))
        return group

    def _next_gap_id(self) -> int:
        self._gap_ids += 1
        return self._gap_ids

    def _fill_gap(self, seq: int, tokens: int, seconds: float) -> bool:
        """Put the sequence in the tightest idle gap it fits (time and tokens)."""
        at = bisect.bisect_left(self.gaps, (seconds, -1))
        for i in range(at, min(at + _DELTA_CANDIDATES, len(self.gaps))):
            room, _, gap = self.gaps[i]
            if gap.tokens + tokens <= self.capacity:
                del self.gaps[i]
                gap.sequences.append(seq)
                gap.tokens += tokens
                gap.room = room - seconds
                bisect.insort(self.gaps, (gap.room, self._next_gap_id(), gap))
                return True
        return False

    def add_packed(self, seq: int, tokens: int, seconds: float, delta: float) -> None:
        if self._fill_gap(seq, tokens, seconds):
            return
        least = heapq.heappop(self.heap)
        chosen, others = least, []
        if self.open[least[1]].tokens + tokens > self.capacity:
            while self.heap and len(others) < _DELTA_CANDIDATES and self.heap[0][0] <= least[0] + delta:
                candidate = heapq.heappop(self.heap)
                if self.open[candidate[1]].tokens + tokens <= self.capacity:
                    chosen, others = candidate, [*others, least]
                    break
                others.append(candidate)
        for item in others:
            heapq.heappush(self.heap, item)
        t, r = chosen
        if self.open[r].tokens + tokens > self.capacity:
            self.close(r)
        packed = self.open[r]
        packed.sequences.append(seq)
        packed.tokens += tokens
        packed.seconds += seconds
        heapq.heappush(self.heap, (t + seconds + self._grow_drain(r, packed.seconds), r))

    def schedule(self) -> list[list[int]]:
        """Every rank's micro-batch ids in execution order; packed ones get their ids here."""
        order = []
        for r, entries in enumerate(self.entries):
            self.close(r)
            ids = []
            for e in entries:
                if isinstance(e, int):
                    ids.append(e)
                elif e.sequences:
                    ids.append(self.builder.add([r], e.sequences).id)
            order.append(ids)
        return order


def _spread_heavy(lens: np.ndarray, ranks: np.ndarray, ratio: np.ndarray, work: np.ndarray, world_size: int,
                  capacity: int, fastest: np.ndarray, longest: float) -> tuple[np.ndarray, np.ndarray]:
    """Give sequences heavier than `longest` (the longest micro-batch a rank should run) enough ranks to
    finish within it, but no more than make them faster (the ring's P2P floor, `fastest`)."""
    if lens.size == 0:
        return ranks, ratio
    wanted = np.minimum(np.ceil(work / longest - 1e-9).astype(np.int64), fastest)
    heavy = wanted > np.maximum(ranks, 1)
    ranks = np.where(heavy, wanted, ranks)
    ratio = np.where(heavy & (lens <= ranks * capacity), 0.0, ratio)
    return ranks, ratio


def _longest_micro_batch(balanced: float, pp_size: int) -> float:
    """The longest micro-batch a rank should run: the balanced per-rank time without pipelines. A
    pipeline's fill and drain last (pp - 1)/pp of its longest micro-batch, so with pp > 1 the cap is
    1/(MICRO_BATCHES_PER_STAGE x pp) of it: at most (pp - 1)/(4 pp + pp - 1) of the step is bubble
    (Insight 1: more, shorter micro-batches per pipeline)."""
    return balanced if pp_size == 1 else balanced / (MICRO_BATCHES_PER_STAGE * pp_size)


@dataclass(frozen=True)
class BalanceInputs:
    """What balance derives from the batch before deciding any offload: the order it visits sequences
    in (FLOP buckets, longest first), their work, the balanced per-rank time, the ring's useful widths.
    `auto`'s candidates with and without offloading differ only in D(s) and r, so they share these."""

    lens: np.ndarray
    world_size: int
    capacity: int
    cost_model: CostModel
    pp_size: int
    layers: int
    seq_time: np.ndarray
    total_work: float
    sequence: np.ndarray
    buckets: int
    fastest: np.ndarray

    @property
    def balanced(self) -> float:
        """The balanced per-rank time: total work / ranks."""
        return self.total_work / self.world_size


def balance_inputs(lens: np.ndarray, world_size: int, capacity: int, cost_model: CostModel, pp_size: int = 1,
                   num_buckets: int = 16) -> BalanceInputs:
    """The offload-independent part of `plan_balance`, computed once for every offload setting."""
    seq_time = cost_model.seq_time(lens) if lens.size else np.zeros(0)
    flops = cost_model.flops(lens) if lens.size else np.zeros(0)
    order = np.argsort(-lens, kind="stable")
    buckets = flop_buckets(flops, order, num_buckets)
    fastest = fastest_group(cost_model, lens, seq_time, world_size) if lens.size else np.zeros(0, np.int64)
    return BalanceInputs(lens, world_size, capacity, cost_model, pp_size, max(1, cost_model.layers // pp_size),
                         seq_time, float(seq_time.sum()), np.concatenate(buckets) if buckets else order, len(buckets),
                         fastest)


def balance_ranks(inputs: BalanceInputs, offload: bool) -> tuple[np.ndarray, np.ndarray]:
    """Each sequence's ranks and offload ratio: D(s) and r of Eq. 2, then heavy sequences spread
    (`_spread_heavy`). Raises PlanError when a sequence does not fit the cluster."""
    i = inputs
    ranks, ratio = ranks_needed(i.lens, i.world_size, i.capacity, i.cost_model, i.layers, offload=offload)
    return _spread_heavy(i.lens, ranks, ratio, i.seq_time, i.world_size, i.capacity, i.fastest,
                         _longest_micro_batch(i.balanced, i.pp_size))


def schedule_balance(inputs: BalanceInputs, ranks: np.ndarray, ratio: np.ndarray, offload: bool,
                     delta: float | None = None) -> Plan:
    """Place every sequence, in bucket order, on its `ranks` with offload `ratio` (`balance_ranks`)."""
    i = inputs
    builder = PlanBuilder("balance", i.lens, i.world_size, i.capacity, i.cost_model, i.pp_size, i.layers, i.seq_time)
    if delta is None:
        delta = DEFAULT_DELTA * i.total_work / i.world_size
    state = _Ranks(builder, i.world_size, i.capacity, i.pp_size)
    seq_time, lens_list, ranks_list, ratio_list = i.seq_time.tolist(), i.lens.tolist(), ranks.tolist(), ratio.tolist()
    widest = np.maximum(i.fastest, ranks).tolist()
    for s in i.sequence.tolist():
        if ranks_list[s] > 0:
            state.add_shared(s, ranks_list[s], widest[s], ratio_list[s], i.balanced)
        else:
            state.add_packed(s, lens_list[s], seq_time[s], delta)
    return builder.build(state.schedule(), delta=delta, buckets=i.buckets, balance="dp" if i.pp_size == 1 else "pp",
                         offload=offload)


def plan_balance(lens: np.ndarray, world_size: int, capacity: int, cost_model: CostModel, pp_size: int = 1,
                 delta: float | None = None, num_buckets: int = 16, offload: bool = True) -> Plan:
    """`delta` defaults to 1% of the balanced per-rank time (`DEFAULT_DELTA`); `offload=False` is the
    ablation that gives every long sequence its D(s, 0) ranks."""
    inputs = balance_inputs(lens, world_size, capacity, cost_model, pp_size, num_buckets)
    return schedule_balance(inputs, *balance_ranks(inputs, offload), offload, delta)
