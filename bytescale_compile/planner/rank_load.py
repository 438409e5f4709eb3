"""What balance's two placers (`placers.py`) share: every rank's load, its entries in order, the packed
micro-batches being filled and the idle gaps to backfill, and the placement of short sequences.

A rank's load is when it is free plus, with pipelines, its 1F1B fill and drain, (pp - 1) times its
longest micro-batch (`drain`): a rank that runs a long micro-batch takes less other work. The loads
are a heap, so the least-loaded ranks come first.

A shared micro-batch starts when its busiest rank is free; the others would idle until then. Each
such gap becomes a packed micro-batch placed just before the shared one (`join`), and later (shorter)
sequences fill it first (`fill_gap`): work that costs the step nothing.

A packed entry takes a sequence only while its tokens stay within the capacity C (`fill_gap`,
`split_gap`, `pack`), and `schedule` makes each non-empty one a micro-batch of its rank: packed
micro-batches hold at most C tokens, and each short sequence is in exactly one.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from .builder import PlanBuilder

__all__ = ["EntryKind", "Entry", "RankLoads"]

_DELTA_CANDIDATES = 4
"""How many gaps, or ranks within δ of the least-loaded one, a short sequence tries before the next choice."""


class EntryKind(Enum):
    SHARED = "shared"
    """The micro-batch of one long sequence, built when placed, over its group (one rank when it only
    fits there offloaded); one entry object on every rank of the group."""
    CHAINED = "chained"
    """A shared micro-batch in a PP-balance chain (`Entry.chain`), whose order in it is set at schedule."""
    PACKED = "packed"
    """Short sequences packed on one rank, built into a micro-batch at schedule."""
    GAP = "gap"
    """A packed micro-batch in the idle time before a shared one; `room` is the seconds still idle."""


@dataclass(eq=False, slots=True)
class Entry:
    """One thing a rank runs, in its order; which fields mean something depends on `kind`."""

    kind: EntryKind
    rank: int = -1
    """The rank of a packed or gap entry (a shared one is on several)."""
    micro_batch: int = -1
    """The id of a shared or chained entry's micro-batch."""
    chain: Chain | None = None
    sequences: list[int] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    room: float = 0.0

    @property
    def built(self) -> bool:
        """Whether its micro-batch exists already (shared or chained), rather than being packed."""
        return self.kind is EntryKind.SHARED or self.kind is EntryKind.CHAINED


class RankLoads:
    """Per-rank load (a heap of (load, rank)) and fill and drain, each rank's entries, its open packed
    micro-batch and the idle gaps (sorted by seconds left, a counter breaking ties)."""

    def __init__(self, builder: PlanBuilder, world_size: int, capacity: int, stretch: float = 0.0) -> None:
        """`stretch` is pp - 1: how many times its longest micro-batch a rank's fill and drain last."""
        self.builder, self.capacity, self.stretch = builder, capacity, stretch
        self.heap = [(0.0, r) for r in range(world_size)]
        self.drain = [0.0] * world_size
        self.entries: list[list[Entry]] = [[] for _ in range(world_size)]
        self.open = [Entry(EntryKind.PACKED, r) for r in range(world_size)]
        self.gaps: list[tuple[float, int, Entry]] = []
        self._gap_keys = itertools.count(1)

    def set_loads(self, loads: np.ndarray, drain: np.ndarray) -> None:
        """Replace every rank's load and fill and drain (the chain placer keeps its own until packing)."""
        self.heap = [(load, r) for r, load in enumerate(loads.tolist())]
        heapq.heapify(self.heap)
        self.drain = drain.tolist()

    def least_load(self) -> float:
        """The least load of a rank still in the heap (inf when `pop_group` took them all)."""
        return self.heap[0][0] if self.heap else float("inf")

    def pop_group(self, size: int) -> list[tuple[float, int]]:
        """The `size` least-loaded ranks, taken off the heap, each with when it is free (its load less its
        fill and drain); one loop, as long sequences without offloading take hundreds of ranks."""
        heap, drain, pop = self.heap, self.drain, heapq.heappop
        group = []
        for _ in range(size):
            load, r = pop(heap)
            group.append((load - drain[r], r))
        return group

    def push(self, load: float, rank: int) -> None:
        heapq.heappush(self.heap, (load, rank))

    def close(self, rank: int) -> None:
        """End `rank`'s open packed micro-batch: later sequences open another after what it runs next."""
        packed = self.open[rank]
        if packed.sequences:
            self.entries[rank].append(packed)
            self.open[rank] = Entry(EntryKind.PACKED, rank)

    def join(self, entry: Entry, group: list[tuple[float, int]], start: float) -> None:
        """Run a shared `entry` from `start` on each rank of `group` (when free, rank), after its open
        packed micro-batch; one free earlier gets a gap to backfill before it."""
        for free, r in group:
            self.close(r)
            if start > free:
                gap = Entry(EntryKind.GAP, r, room=start - free)
                self.entries[r].append(gap)
                self._list_gap(gap)
            self.entries[r].append(entry)

    def extend(self, entry: Entry, ranks: list[int]) -> None:
        """Run a shared `entry` on `ranks` right after what they run last (a chain's next micro-batch)."""
        for r in ranks:
            self.entries[r].append(entry)

    def _list_gap(self, gap: Entry) -> None:
        bisect.insort(self.gaps, (gap.room, next(self._gap_keys), gap))

    def fill_gap(self, seq: int, tokens: int, seconds: float) -> bool:
        """Put the sequence in the tightest idle gap it fits (time and tokens)."""
        at = bisect.bisect_left(self.gaps, (seconds, -1))
        for i in range(at, min(at + _DELTA_CANDIDATES, len(self.gaps))):
            room, _, gap = self.gaps[i]
            if gap.tokens + tokens <= self.capacity:
                del self.gaps[i]
                gap.sequences.append(seq)
                gap.tokens += tokens
                gap.room = room - seconds
                self._list_gap(gap)
                return True
        return False

    def split_gap(self, seq: int, tokens: int, seconds: float) -> bool:
        """Open a further packed micro-batch in the tightest gap whose time is left but whose tokens are
        not: a rank waiting for a chain's other members can run more than one micro-batch of work."""
        at = bisect.bisect_left(self.gaps, (seconds, -1))
        if at == len(self.gaps):
            return False
        room, _, full = self.gaps.pop(at)
        gap = Entry(EntryKind.GAP, full.rank, sequences=[seq], tokens=tokens, room=room - seconds)
        entries = self.entries[full.rank]
        entries.insert(next(k for k, e in enumerate(entries) if e is full) + 1, gap)
        self._list_gap(gap)
        return True

    def _grow_drain(self, rank: int, seconds: float) -> float:
        """How much a micro-batch of `seconds` on `rank` adds to its fill and drain (0 without pipelines)."""
        grown = self.stretch * seconds - self.drain[rank]
        if grown <= 0.0:
            return 0.0
        self.drain[rank] += grown
        return grown

    def pack(self, seq: int, tokens: int, seconds: float, delta: float) -> None:
        """Add the sequence to the open packed micro-batch of the least-loaded rank, or of a rank up to
        `delta` seconds busier whose open one still has room (fewer, fuller micro-batches)."""
        heap, capacity, opened = self.heap, self.capacity, self.open
        least = heapq.heappop(heap)
        chosen = least
        others: list[tuple[float, int]] = []
        if opened[least[1]].tokens + tokens > capacity:
            while heap and len(others) < _DELTA_CANDIDATES and heap[0][0] <= least[0] + delta:
                candidate = heapq.heappop(heap)
                if opened[candidate[1]].tokens + tokens <= capacity:
                    chosen, others = candidate, [*others, least]
                    break
                others.append(candidate)
        for item in others:
            heapq.heappush(heap, item)
        t, r = chosen
        if opened[r].tokens + tokens > capacity:
            self.close(r)
        packed = opened[r]
        packed.sequences.append(seq)
        packed.tokens += tokens
        packed.seconds += seconds
        heapq.heappush(heap, (t + seconds + self._grow_drain(r, packed.seconds), r))

    def schedule(self) -> list[list[int]]:
        """Every rank's micro-batch ids in execution order; packed ones are built here, rank by rank."""
        order = []
        for r, entries in enumerate(self.entries):
            self.close(r)
            ids = []
            for e in entries:
                if e.built:
                    ids.append(e.micro_batch)
                elif e.sequences:
                    ids.append(self.builder.add([r], e.sequences).id)
            order.append(ids)
        return order


@dataclass(eq=False)
class Chain:
    """A group of ranks running consecutive shared micro-batches (`members`, in the order placed); open
    while it is every member's last entry. `clock` (the same on all members), the most overhead and the
    least longest micro-batch of its members' current segments are what `ChainPlacer.add_shared`
    compares; `listing` tells its current place in `_ChainHeaps` from stale ones."""

    ranks: np.ndarray
    members: list[Entry] = field(default_factory=list)
    open: bool = True
    clock: float = 0.0
    overhead: float = 0.0
    longest: float = 0.0
    listing: int = 0
