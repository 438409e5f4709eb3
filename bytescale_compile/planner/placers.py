"""Balance's two placers, each composed over one `RankLoads`: `DPPlacer` without pipelines, `ChainPlacer`
(PP-balance) with them. Both take the sequences in `Demands.order` and give every rank its micro-batch
ids in execution order (`schedule`)."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .builder import PlanBuilder
from .rank_load import Chain, Entry, EntryKind, RankLoads

__all__ = ["Demands", "Placer", "DPPlacer", "ChainPlacer", "Chain"]

_WIDEN_LOOKAHEAD = 2
"""Steps `DPPlacer` tries past the last size that ended a sequence sooner before it stops widening."""
_WIDEN_STEPS = 16
"""A widening step adds 1/16 of the group's ranks (at least one): O(log) sizes tried, each within 6% of the last."""
MALLEABLE_SHORT = 0.01
"""A short sequence over this fraction of the balanced time that would end past it is placed as a malleable job:
its seconds are the granularity of the step's tail."""
_WIDEN_AREA = 0.05
"""The most rank-seconds, as a fraction of a sequence's work, that widening may add to it."""


@dataclass(frozen=True)
class Demands:
    """What every sequence asks of a placer, as lists indexed by sequence (the placers' loops read them
    one sequence at a time, where numpy's per-item access is slow)."""

    order: list[int]
    """The order the sequences are placed in: FLOP buckets, longest first."""
    ranks: list[int]
    """Its group size: D(s), or more where spread; 0 for a short sequence, to be packed."""
    ratio: list[float]
    """Its offload ratio r on that group."""
    widest: list[int]
    """The most ranks it may widen onto: past that the ring's P2P outlasts the compute it splits."""
    tokens: list[int]
    seconds: list[float]
    """Its work on one rank (`CostModel.seq_time`)."""


class Placer(Protocol):
    def place(self, demands: Demands, delta: float) -> None:
        """Place every sequence; `delta` is the paper's δ (`RankLoads.pack`)."""

    def schedule(self) -> list[list[int]]:
        """Every rank's micro-batch ids in execution order."""


class DPPlacer:
    """DP-balance (no pipelines): each sequence, in order, to the ranks with the least work so far, a long
    one to its group of least-loaded ranks together, a short one into a gap or the open packed
    micro-batch of the least-loaded rank. A rank's load is when it is free."""

    def __init__(self, builder: PlanBuilder, world_size: int, capacity: int, target: float) -> None:
        """`target` is the balanced per-rank time (total work / ranks)."""
        self.builder, self.capacity, self.target, self.world_size = builder, capacity, target, world_size
        self.loads = RankLoads(builder, world_size, capacity)

    def place(self, demands: Demands, delta: float) -> None:
        """Each sequence, in order: a long one to its group, a short one into a gap, else into the open packed
        micro-batch of the least-loaded rank, unless it would end past the target there and is heavy enough to
        set the step's tail (`MALLEABLE_SHORT`): then it is a malleable job too, widened like a long one where
        that ends it sooner."""
        d, loads = demands, self.loads
        heavy = MALLEABLE_SHORT * self.target
        for s in d.order:
            if d.ranks[s] > 0:
                self.add_shared(s, d.ranks[s], d.widest[s], d.ratio[s])
            elif loads.fill_gap(s, d.tokens[s], d.seconds[s]):
                continue
            elif not (d.seconds[s] > heavy and loads.least_load() + d.seconds[s] > self.target and self._widened(s)):
                loads.pack(s, d.tokens[s], d.seconds[s], delta)

    def add_shared(self, seq: int, group_size: int, widest: int, ratio: float) -> None:
        """Run `seq` on its `group_size` least-loaded ranks. When it would end past the target (the
        balanced step time), widen the group (up to `widest`) onto the next least-loaded ranks, waiting for
        them if need be, to the size that ends it soonest: a malleable job's allotment (`_widen`)."""
        group = self.loads.pop_group(group_size)
        start = max(t for t, _ in group)
        seconds = self.builder.time_of([seq], len(group), ratio)
        if start + seconds > self.target and len(group) < widest:
            group, start, seconds, ratio = self._widen(seq, group, start, seconds, ratio, widest)
        self._run(seq, group, start, ratio)

    def _widened(self, seq: int) -> bool:
        """Run short `seq` over more than one rank where that ends it sooner than its least-loaded rank would.
        Its group is not searched beforehand (`BalanceInputs.groups`): `_widen`'s limit on rank-seconds stops a
        short sequence's group long before its ring outlasts the compute."""
        group = self.loads.pop_group(1)
        start, seconds = group[0][0], self.builder.seq_time[seq]
        group, start, seconds, ratio = self._widen(seq, group, start, seconds, 0.0, self.world_size)
        if len(group) == 1:
            self.loads.push(*group[0])
            return False
        self._run(seq, group, start, ratio)
        return True

    def _run(self, seq: int, group: list[tuple[float, int]], start: float, ratio: float) -> None:
        """Place `seq`'s micro-batch on `group` (when free, rank) from `start`."""
        loads = self.loads
        mb = self.builder.add(sorted(r for _, r in group), [seq], ratio)
        loads.join(Entry(EntryKind.SHARED, micro_batch=mb.id), group, start)
        end = start + mb.est_time
        for _, r in group:
            loads.push(end, r)

    def _widen(
        self, seq: int, group: list[tuple[float, int]], start: float, seconds: float, ratio: float, widest: int
    ) -> tuple[list[tuple[float, int]], float, float, float]:
        """The least-loaded ranks added to `group` that end `seq` soonest (group, start, seconds, ratio); the
        ranks tried but not kept go back to the heap. It adds one rank at a time to small groups and 1/`_WIDEN_STEPS`
        of the group to large ones (hundreds of idle ranks for few sequences), looks up to `_WIDEN_LOOKAHEAD` steps
        past the last gain, and stops where even the compute alone on the most ranks it may still try could not
        end sooner.
        A size whose ring no longer hides costs the other sequences ranks, and each rank pays the micro-batch's
        fixed cost, so none costs over `_WIDEN_AREA` more rank-seconds than the work and one fixed cost (waiting
        for a rank idles the others, which later short sequences backfill).
        The ranks come by load, not by node, so each size is timed as a plain ring (`PlanBuilder.ring_time`);
        the micro-batch then takes the best split its ranks allow."""
        loads, builder = self.loads, self.builder
        work, overhead = builder.seq_time[seq], builder.cost_model.micro_batch_overhead
        trial = list(group)
        kept, best = len(group), (start + seconds, start, seconds, ratio)
        area = max((1 + _WIDEN_AREA) * (work + overhead), len(group) * (seconds + overhead))
        widest = min(widest, int((area - work) / overhead) if overhead > 0 else widest)
        misses = 0
        while len(trial) < widest and misses < _WIDEN_LOOKAHEAD:
            step = min(max(1, len(trial) // _WIDEN_STEPS), widest - len(trial))
            most = min(widest, len(trial) + _WIDEN_LOOKAHEAD * step)
            if max(start, loads.least_load()) + work / most >= best[0]:
                break
            trial += loads.pop_group(step)
            size = len(trial)
            misses += 1
            wider_ratio = 0.0 if builder.lens[seq] <= size * self.capacity else ratio
            wider_start = max(start, trial[-1][0])
            wider = builder.ring_time(seq, size, wider_ratio)
            if wider_start + wider < best[0] and size * (wider + overhead) <= area:
                kept, best, misses = size, (wider_start + wider, wider_start, wider, wider_ratio), 0
        for free, r in trial[kept:]:
            loads.push(free, r)
        return trial[:kept], best[1], best[2], best[3]

    def schedule(self) -> list[list[int]]:
        return self.loads.schedule()


@dataclass
class _Segments:
    """Each rank's pipeline state while chains are placed, one array per field: a new chain picks its
    ranks from all of them at once (`np.argpartition`)."""

    clock: np.ndarray
    """When the rank is free."""
    overhead: np.ndarray
    """(pp - 1) x the longest micro-batch of each segment (between chains) so far, the current one included."""
    longest: np.ndarray
    """The longest micro-batch of the rank's current segment."""
    after_shared: np.ndarray
    """Whether the rank's last entry is a shared micro-batch."""

    @classmethod
    def idle(cls, world_size: int) -> _Segments:
        return cls(np.zeros(world_size), np.zeros(world_size), np.zeros(world_size), np.zeros(world_size, dtype=bool))


class _ChainHeaps:
    """Per group size (in the order first seen), a heap of chains by their members' load (clock +
    overhead). A chain is listed anew whenever it grows; older listings and closed chains are dropped
    when they come to the top."""

    def __init__(self) -> None:
        self._heaps: dict[int, list[tuple[float, int, Chain]]] = {}
        self._listings = itertools.count(1)

    def push(self, chain: Chain) -> None:
        chain.listing = next(self._listings)
        heapq.heappush(
            self._heaps.setdefault(chain.ranks.size, []), (chain.clock + chain.overhead, chain.listing, chain)
        )

    def least_loaded(self, smallest: int, widest: int) -> list[Chain]:
        """Of each group size from `smallest` to `widest`, the open chain whose members are least loaded: it
        ends a sequence soonest unless another ran shorter micro-batches so far, which, as sequences come
        longest first, is rare. At 1024 ranks there are hundreds of chains of two."""
        found = []
        for size, heap in self._heaps.items():
            if smallest <= size <= widest:
                while heap and (not heap[0][2].open or heap[0][1] != heap[0][2].listing):
                    heapq.heappop(heap)
                if heap:
                    found.append(heap[0][2])
        return found


class ChainPlacer:
    """PP-balance: keep a group of ranks together for consecutive shared sequences (a chain, as static's
    CP rows are), so their pipelines run them in plain 1F1B.

    Under `pipeline_order.stage_order` a shared micro-batch that does not follow the same group's previous
    one on all its pipelines waits for the backward of its pipeline's previous shared micro-batch: the
    pipeline drains and fills again, about (pp - 1) times the micro-batch's time over all stages. So a
    shared sequence goes either to an open chain (a group whose last micro-batch on every member is its own,
    of at least D(s) and at most `widest` ranks, where the sequence is no slower) or to its D(s)
    least-loaded ranks, starting a chain there, whichever ends it sooner counting that drain. Loads are each
    rank's busy time plus its pipeline's fill and drain, (pp - 1) times the longest micro-batch of each
    segment between chains. All shared sequences are placed before the packed ones, so packed
    micro-batches follow the chains, or fill the idle gaps before a chain's first micro-batch; the
    pipelines that drew short work take more of them (Insight 1).

    A chain's micro-batches are consecutive on each member and one entry object on all of them, so
    `schedule` reorders them the same way everywhere: the order of shared micro-batches stays one.
    """

    def __init__(self, builder: PlanBuilder, world_size: int, capacity: int, pp_size: int) -> None:
        self.builder, self.capacity, self.stretch = builder, capacity, float(pp_size - 1)
        self.loads = RankLoads(builder, world_size, capacity, self.stretch)
        self.segments = _Segments.idle(world_size)
        self.member_of: list[Chain | None] = [None] * world_size
        self.open_chains = _ChainHeaps()
        self.chains: list[Chain] = []
        """Every chain, in the order started."""

    def place(self, demands: Demands, delta: float) -> None:
        """Every shared sequence (the longest first) into a chain, then the packed ones after the chains
        or in the gaps before them."""
        d, loads = demands, self.loads
        for s in d.order:
            if d.ranks[s] > 0:
                self.add_shared(s, d.ranks[s], d.widest[s], d.ratio[s])
        seg = self.segments
        loads.set_loads(seg.clock + seg.overhead, self.stretch * seg.longest)
        for s in d.order:
            if (
                d.ranks[s] == 0
                and not loads.fill_gap(s, d.tokens[s], d.seconds[s])
                and not loads.split_gap(s, d.tokens[s], d.seconds[s])
            ):
                loads.pack(s, d.tokens[s], d.seconds[s], delta)

    def _grown_overhead(self, ranks: np.ndarray, seconds: float, chained: bool) -> np.ndarray:
        """Each rank's overhead once it runs a micro-batch of `seconds`: a new segment for an unchained
        shared one right after another shared one, else the current segment's longest grows."""
        seg = self.segments
        grow = np.maximum(seconds - seg.longest[ranks], 0.0)
        if not chained:
            grow = np.where(seg.after_shared[ranks], seconds, grow)
        return seg.overhead[ranks] + self.stretch * grow

    def add_shared(self, seq: int, group_size: int, widest: int, ratio: float) -> None:
        """Extend the open chain or start the new one that ends `seq` soonest, overhead included (a tie goes
        to the chain); a sequence of one rank (offloaded) may join a chain too, where it is no slower. No
        widening toward a target as `DPPlacer` has: chains take idle ranks."""
        seg, builder = self.segments, self.builder
        fresh = (
            np.argpartition(seg.clock + seg.overhead, group_size - 1)[:group_size]
            if group_size < seg.clock.size
            else np.arange(group_size)
        )
        seconds = builder.time_of([seq], group_size, ratio)
        start = float(seg.clock[fresh].max())
        best = float((start + seconds + self._grown_overhead(fresh, seconds, group_size == 1)).max())
        chosen, chosen_ratio, times = None, ratio, {}
        for chain in self.open_chains.least_loaded(max(group_size, 2), widest):
            size = chain.ranks.size
            if size not in times:
                wide_ratio = 0.0 if builder.lens[seq] <= size * self.capacity else ratio
                times[size] = (builder.time_of([seq], size, wide_ratio), wide_ratio)
            wide, wide_ratio = times[size]
            end = chain.clock + wide + chain.overhead + self.stretch * max(wide - chain.longest, 0.0)
            if end <= best:
                chosen, chosen_ratio, best = chain, wide_ratio, end
        if chosen is None:
            self._start_chain(seq, sorted(fresh.tolist()), ratio, start)
        else:
            self._extend_chain(seq, chosen, chosen_ratio)

    def _settle(self, chain: Chain) -> None:
        """Read back the members' state after a micro-batch of the chain was placed, and list it anew."""
        seg, ranks = self.segments, chain.ranks
        chain.clock = float(seg.clock[ranks[0]])
        chain.overhead = float(seg.overhead[ranks].max())
        chain.longest = float(seg.longest[ranks].min())
        self.open_chains.push(chain)

    def _start_chain(self, seq: int, group: list[int], ratio: float, start: float) -> None:
        """Run `seq` on `group` from `start`, closing the chains its ranks were in; members free earlier get
        an idle gap to backfill before it. A shared micro-batch starts a chain, one of one rank none."""
        seg = self.segments
        mb = self.builder.add(group, [seq], ratio)
        ranks = np.array(group)
        seg.overhead[ranks] = self._grown_overhead(ranks, mb.est_time, not mb.shared)
        new_segment = seg.after_shared[ranks] if mb.shared else np.zeros(ranks.size, dtype=bool)
        seg.longest[ranks] = np.where(new_segment, mb.est_time, np.maximum(seg.longest[ranks], mb.est_time))
        seg.after_shared[ranks] = mb.shared
        chain = Chain(ranks) if mb.shared else None
        entry = Entry(EntryKind.CHAINED if chain else EntryKind.SHARED, micro_batch=mb.id, chain=chain)
        for r in group:
            left = self.member_of[r]
            if left is not None:
                left.open = False
            self.member_of[r] = chain
        self.loads.join(entry, list(zip(seg.clock[ranks].tolist(), group)), start)
        seg.clock[ranks] = start + mb.est_time
        if chain is not None:
            chain.members.append(entry)
            self.chains.append(chain)
            self._settle(chain)

    def _extend_chain(self, seq: int, chain: Chain, ratio: float) -> None:
        """Run `seq` on `chain`'s ranks right after its last micro-batch: all members are free together."""
        seg, ranks = self.segments, chain.ranks
        mb = self.builder.add(ranks.tolist(), [seq], ratio)
        seg.overhead[ranks] = self._grown_overhead(ranks, mb.est_time, True)
        seg.longest[ranks] = np.maximum(seg.longest[ranks], mb.est_time)
        seg.clock[ranks] += mb.est_time
        entry = Entry(EntryKind.CHAINED, micro_batch=mb.id, chain=chain)
        self.loads.extend(entry, ranks.tolist())
        chain.members.append(entry)
        self._settle(chain)

    def schedule(self) -> list[list[int]]:
        """As `RankLoads.schedule`, each rank's micro-batches rising from short to long and falling again:
        every chain in `_rise_and_fall` order (the same on all its members, so it stays chained), the packed
        ones before a rank's first chain shortest first, those after its last one longest first. A 1F1B
        pipeline fills on its first micro-batch and drains on its last, and a long one right after a short
        one stalls the stages below: in benchmarks/planner.py section 5 this order beat both each chain's
        creation order (longest first) and shortest first."""
        built = self.builder.micro_batches  # indexed by id
        est = {m.id: m.est_time for m in built}
        floors = self._floors()
        for chain in self.chains:
            ids = [e.micro_batch for e in chain.members]
            rising = sorted(ids, key=est.__getitem__)
            for entry, i in zip(chain.members, _rise_and_fall(rising, est, floors.get(chain, 0.0))):
                entry.micro_batch = i
        order = self.loads.schedule()
        for ids in order:
            _sort_packed_runs(ids, [built[i].shared for i in ids], [built[i].est_time for i in ids])
        return order

    def _floors(self) -> dict[Chain, float]:
        """Per chain, the longest packed micro-batch that follows it as its members' last chain."""
        floors: dict[Chain, float] = {}
        for entries, open_one in zip(self.loads.entries, self.loads.open):
            last = next((k for k in range(len(entries) - 1, -1, -1) if entries[k].built), -1)
            chain = entries[last].chain if last >= 0 else None
            if chain is None:
                continue
            after = [e.seconds for e in entries[last + 1 :]] + [open_one.seconds]
            floors[chain] = max(floors.get(chain, 0.0), *after)
        return floors


def _rise_and_fall(rising: list[int], est: dict[int, float], floor: float) -> list[int]:
    """A chain's micro-batches (`rising`: shortest first) in the order its pipelines run them: those
    shorter than `floor` (the packed ones that follow) first, then the rest up to the longest and down
    again toward `floor`."""
    low = [i for i in rising if est[i] < floor]
    high = rising[len(low) :]
    return low + high[0::2] + high[1::2][::-1]


def _sort_packed_runs(ids: list[int], shared: list[bool], seconds: list[float]) -> None:
    """Sort one rank's packed micro-batches before its first shared one shortest first, those after its
    last shared one longest first, in place. Those between two chains stay as placed: sorting them too
    measured slower (benchmarks/planner.py section 5)."""
    k = 0
    while k < len(ids):
        if shared[k]:
            k += 1
            continue
        end = next((j for j in range(k, len(ids)) if shared[j]), len(ids))
        if k == 0 or end == len(ids):
            run = sorted(range(k, end), key=seconds.__getitem__, reverse=end == len(ids))
            ids[k:end] = [ids[j] for j in run]
        k = end
