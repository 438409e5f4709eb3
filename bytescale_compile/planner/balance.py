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
balanced time, spreading long sequences over more ranks (`_longest_micro_batch`), in groups that tile
the ranks (`_tile_heavy`).

PP-balance keeps a group of pipelines together for consecutive shared sequences, a chain (`_Chains`),
as static's CP rows are: in the executable 1F1B order (`pipeline_order.stage_order`) only chained shared
micro-batches overlap in a pipeline, the others wait for the previous shared one's backward. Packed
micro-batches go after the chains, and each pipeline runs its micro-batches from short to long and
back (`_Chains.schedule`), so that 1F1B fills and drains on short ones. At pp = 2 and 4 this took the
step of benchmarks/planner.py section 5 from 1.5-2.7x static's to 0.77-0.96x of it.

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


@dataclass
class _Chain:
    """A group of ranks running consecutive shared micro-batches (`ids`); open while it is every member's
    last entry. `clock` (the same on all members), the most overhead and the least longest micro-batch of
    its members' current segments are kept for `_Chains.add_shared`; `stamp` tells its current entry in
    `_Chains.chains` from stale ones."""

    ranks: np.ndarray
    ids: list[int]
    open: bool = True
    clock: float = 0.0
    overhead: float = 0.0
    longest: float = 0.0
    stamp: int = 0

    def settle(self, state: _Chains) -> None:
        """Read back the members' state after a micro-batch of the chain was placed, and list it anew."""
        self.clock = float(state.clock[self.ranks[0]])
        self.overhead = float(state.overhead[self.ranks].max())
        self.longest = float(state.longest[self.ranks].min())
        self.stamp = state.stamp()
        heapq.heappush(state.chains.setdefault(self.ranks.size, []), (self.clock + self.overhead, self.stamp, self))


class _Chains(_Ranks):
    """PP-balance's placement of shared sequences: keep a group of ranks together for consecutive shared
    sequences (a chain, as static's CP rows are), so their pipelines run them in plain 1F1B.

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
    """

    def __init__(self, builder: PlanBuilder, world_size: int, capacity: int, pp_size: int) -> None:
        super().__init__(builder, world_size, capacity, pp_size)
        self.clock = np.zeros(world_size)
        self.overhead = np.zeros(world_size)
        """(pp - 1) x the longest micro-batch of each segment so far, the current one included."""
        self.longest = np.zeros(world_size)
        """The longest micro-batch of each rank's current segment."""
        self.after_shared = np.zeros(world_size, dtype=bool)
        """Whether a rank's last entry is a shared micro-batch."""
        self.member_of: list[_Chain | None] = [None] * world_size
        self.chains: dict[int, list[tuple[float, int, _Chain]]] = {}
        """Per group size, a heap of chains by members' load (clock + overhead); closed or stale entries
        are dropped when they come to the top."""
        self._stamps = 0
        self.runs: list[list[int]] = []
        """Every chain's micro-batch ids, in the order placed."""

    def stamp(self) -> int:
        self._stamps += 1
        return self._stamps

    def _open_chains(self, smallest: int, widest: int) -> list[_Chain]:
        """Of each group size from `smallest` to `widest`, the open chain whose members are least loaded: it
        ends a sequence soonest unless another ran shorter micro-batches so far, which, as sequences come
        longest first, is rare. At 1024 ranks there are hundreds of chains of two."""
        found = []
        for size, heap in self.chains.items():
            if smallest <= size <= widest:
                while heap and (not heap[0][2].open or heap[0][1] != heap[0][2].stamp):
                    heapq.heappop(heap)
                if heap:
                    found.append(heap[0][2])
        return found

    def _grown_overhead(self, ranks: np.ndarray, seconds: float, chained: bool) -> np.ndarray:
        """Each rank's overhead once it runs a micro-batch of `seconds`: a new segment for an unchained
        shared one right after another shared one, else the current segment's longest grows."""
        grow = np.maximum(seconds - self.longest[ranks], 0.0)
        if not chained:
            grow = np.where(self.after_shared[ranks], seconds, grow)
        return self.overhead[ranks] + self.stretch * grow

    def add_shared(self, seq: int, group_size: int, widest: int, ratio: float) -> None:  # type: ignore[override]
        """Extend the open chain or start the new one that ends `seq` soonest, overhead included (a tie goes
        to the chain); a sequence of one rank (offloaded) may join a chain too, where it is no slower. No
        widening bound as `_Ranks` has: chains take idle ranks."""
        fresh = np.argpartition(self.clock + self.overhead, group_size - 1)[:group_size] \
            if group_size < self.clock.size else np.arange(group_size)
        seconds = self.builder.time_of([seq], group_size, ratio)
        start = float(self.clock[fresh].max())
        best = float((start + seconds + self._grown_overhead(fresh, seconds, group_size == 1)).max())
        chosen, chosen_ratio, times = None, ratio, {}
        for chain in self._open_chains(max(group_size, 2), widest):
            size = chain.ranks.size
            if size not in times:
                wide_ratio = 0.0 if self.builder.lens[seq] <= size * self.capacity else ratio
                times[size] = (self.builder.time_of([seq], size, wide_ratio), wide_ratio)
            wide, wide_ratio = times[size]
            end = chain.clock + wide + chain.overhead + self.stretch * max(wide - chain.longest, 0.0)
            if end <= best:
                chosen, chosen_ratio, best = chain, wide_ratio, end
        if chosen is None:
            self._start_chain(seq, sorted(fresh.tolist()), ratio, start)
        else:
            self._extend_chain(seq, chosen, chosen_ratio)

    def _start_chain(self, seq: int, group: list[int], ratio: float, start: float) -> None:
        """Run `seq` on `group` from `start`; members free earlier get an idle gap to backfill before it."""
        mb = self.builder.add(group, [seq], ratio)
        ranks = np.array(group)
        self.overhead[ranks] = self._grown_overhead(ranks, mb.est_time, not mb.shared)
        new_segment = self.after_shared[ranks] if mb.shared else np.zeros(ranks.size, dtype=bool)
        self.longest[ranks] = np.where(new_segment, mb.est_time, np.maximum(self.longest[ranks], mb.est_time))
        self.after_shared[ranks] = mb.shared
        for r, free in zip(group, self.clock[ranks].tolist()):
            self.close(r)
            if self.member_of[r] is not None:
                self.member_of[r].open = False
                self.member_of[r] = None
            if start > free:
                gap = _Packed(r, room=start - free)
                self.entries[r].append(gap)
                bisect.insort(self.gaps, (gap.room, self._next_gap_id(), gap))
            self.entries[r].append(mb.id)
        self.clock[ranks] = start + mb.est_time
        if mb.shared:
            chain = _Chain(ranks, [mb.id])
            chain.settle(self)
            self.runs.append(chain.ids)
            for r in group:
                self.member_of[r] = chain

    def _extend_chain(self, seq: int, chain: _Chain, ratio: float) -> None:
        """Run `seq` on `chain`'s ranks right after its last micro-batch: all members are free together."""
        ranks = chain.ranks
        mb = self.builder.add(ranks.tolist(), [seq], ratio)
        self.overhead[ranks] = self._grown_overhead(ranks, mb.est_time, True)
        self.longest[ranks] = np.maximum(self.longest[ranks], mb.est_time)
        self.clock[ranks] += mb.est_time
        for r in ranks.tolist():
            self.entries[r].append(mb.id)
        chain.ids.append(mb.id)
        chain.settle(self)

    def schedule(self) -> list[list[int]]:
        """As `_Ranks.schedule`, each rank's micro-batches rising from short to long and falling again: every
        chain in `_rise_and_fall` order (the same on all its members, so it stays chained), the packed ones
        before a rank's first chain shortest first, those after its last one longest first. A 1F1B
        pipeline fills on its first micro-batch and drains on its last, and a long one right after a short
        one stalls the stages below: in benchmarks/planner.py section 5 this order beat each chain's
        creation order (longest first) by 3-15% and shortest first by 2-3%."""
        est = {m.id: m.est_time for m in self.builder.micro_batches}
        floors = self._floors()
        rename: dict[int, int] = {}
        for run, floor in zip(self.runs, floors):
            rename.update(zip(run, _rise_and_fall(sorted(run, key=est.__getitem__), est, floor)))
        for entries in self.entries:
            entries[:] = [rename.get(e, e) if isinstance(e, int) else e for e in entries]
        order = super().schedule()
        built = self.builder.micro_batches  # indexed by id
        for ids in order:
            _sort_packed_runs(ids, [built[i].shared for i in ids], [built[i].est_time for i in ids])
        return order

    def _floors(self) -> list[float]:
        """Per chain (in `runs`), the longest packed micro-batch that follows it as its members' last chain."""
        run_of = {i: k for k, run in enumerate(self.runs) for i in run}
        floors = [0.0] * len(self.runs)
        for entries, open_one in zip(self.entries, self.open):
            last = next((k for k in range(len(entries) - 1, -1, -1) if isinstance(entries[k], int)), None)
            if last is None or entries[last] not in run_of:
                continue
            after = [e.seconds for e in entries[last + 1:]] + [open_one.seconds]
            k = run_of[entries[last]]
            floors[k] = max(floors[k], *after)
        return floors

    def _fill_gap(self, seq: int, tokens: int, seconds: float) -> bool:
        """Also open a further packed micro-batch in a gap whose time is left but whose tokens are not: a
        rank waiting seconds for a chain's other members can run more than one micro-batch of work."""
        if super()._fill_gap(seq, tokens, seconds):
            return True
        at = bisect.bisect_left(self.gaps, (seconds, -1))
        if at == len(self.gaps):
            return False
        room, _, full = self.gaps.pop(at)
        gap = _Packed(full.rank, [seq], tokens, room - seconds)
        entries = self.entries[full.rank]
        entries.insert(next(k for k, e in enumerate(entries) if e is full) + 1, gap)
        bisect.insort(self.gaps, (gap.room, self._next_gap_id(), gap))
        return True

    def pack_after(self) -> None:
        """Hand the loads to the packed placement (`add_packed`): busy time plus fill and drain."""
        self.heap = [(float(c + o), r) for r, (c, o) in enumerate(zip(self.clock, self.overhead))]
        heapq.heapify(self.heap)
        self.drain = (self.stretch * self.longest).tolist()


def _rise_and_fall(rising: list[int], est: dict[int, float], floor: float) -> list[int]:
    """A chain's micro-batches (`rising`: shortest first) in the order its pipelines run them: those
    shorter than `floor` (the packed ones that follow) first, then the rest up to the longest and down
    again toward `floor`."""
    low = [i for i in rising if est[i] < floor]
    high = rising[len(low):]
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
    (`_spread_heavy`), with pipelines onto groups that tile the ranks (`_tile_heavy`). Raises PlanError
    when a sequence does not fit the cluster."""
    i = inputs
    needed, ratio = ranks_needed(i.lens, i.world_size, i.capacity, i.cost_model, i.layers, offload=offload)
    ranks, ratio = _spread_heavy(i.lens, needed, ratio, i.seq_time, i.world_size, i.capacity, i.fastest,
                                 _longest_micro_batch(i.balanced, i.pp_size))
    if i.pp_size == 1:
        return ranks, ratio
    return _tile_heavy(i.lens, needed, ranks, ratio, i.world_size, i.capacity, i.fastest)


def _tile_heavy(lens: np.ndarray, needed: np.ndarray, ranks: np.ndarray, ratio: np.ndarray, world_size: int,
                capacity: int, fastest: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """With pipelines, widen each spread sequence's group to the next divisor of the world size, where it
    is no slower there (`fastest`): chains of equal groups then tile the ranks, as a static mesh's rows
    do, instead of leaving a few ranks to join a chain late (2 of 32 with groups of 15: a 17% longer step
    at pp = 4 on GitHub-like data in benchmarks/planner.py section 5)."""
    spread = ranks > np.maximum(needed, 1)
    if not spread.any():
        return ranks, ratio
    divisors = np.array([d for d in range(1, world_size + 1) if world_size % d == 0])
    tiled = divisors[np.searchsorted(divisors, ranks)]
    widen = spread & (tiled <= fastest)
    ranks = np.where(widen, tiled, ranks)
    return ranks, np.where(widen & (lens <= ranks * capacity), 0.0, ratio)


def schedule_balance(inputs: BalanceInputs, ranks: np.ndarray, ratio: np.ndarray, offload: bool,
                     delta: float | None = None) -> Plan:
    """Place every sequence, in bucket order, on its `ranks` with offload `ratio` (`balance_ranks`)."""
    i = inputs
    builder = PlanBuilder("balance", i.lens, i.world_size, i.capacity, i.cost_model, i.pp_size, i.layers, i.seq_time)
    if delta is None:
        delta = DEFAULT_DELTA * i.total_work / i.world_size
    seq_time, lens_list, ranks_list, ratio_list = i.seq_time.tolist(), i.lens.tolist(), ranks.tolist(), ratio.tolist()
    widest = np.maximum(i.fastest, ranks).tolist()
    if i.pp_size > 1:
        state = _Chains(builder, i.world_size, i.capacity, i.pp_size)
        _place_chains_first(state, i.sequence.tolist(), ranks_list, ratio_list, widest, lens_list, seq_time, delta)
        return builder.build(state.schedule(), delta=delta, buckets=i.buckets, balance="pp", offload=offload)
    state = _Ranks(builder, i.world_size, i.capacity, i.pp_size)
    for s in i.sequence.tolist():
        if ranks_list[s] > 0:
            state.add_shared(s, ranks_list[s], widest[s], ratio_list[s], i.balanced)
        else:
            state.add_packed(s, lens_list[s], seq_time[s], delta)
    return builder.build(state.schedule(), delta=delta, buckets=i.buckets, balance="dp", offload=offload)


def _place_chains_first(state: _Chains, order: list[int], ranks: list[int], ratio: list[float], widest: list[int],
                        lens: list[int], seq_time: list[float], delta: float) -> None:
    """PP-balance's placement: every shared sequence (in `order`, the longest first) into a chain, then the
    packed ones after the chains or in the gaps before them (`_Chains`)."""
    for s in order:
        if ranks[s] > 0:
            state.add_shared(s, ranks[s], widest[s], ratio[s])
    state.pack_after()
    for s in order:
        if ranks[s] == 0:
            state.add_packed(s, lens[s], seq_time[s], delta)


def plan_balance(lens: np.ndarray, world_size: int, capacity: int, cost_model: CostModel, pp_size: int = 1,
                 delta: float | None = None, num_buckets: int = 16, offload: bool = True) -> Plan:
    """`delta` defaults to 1% of the balanced per-rank time (`DEFAULT_DELTA`); `offload=False` is the
    ablation that gives every long sequence its D(s, 0) ranks."""
    inputs = balance_inputs(lens, world_size, capacity, cost_model, pp_size, num_buckets)
    return schedule_balance(inputs, *balance_ranks(inputs, offload), offload, delta)
