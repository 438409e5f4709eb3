"""The Plan: which ranks run which sequences, in which order, with which offload ratio.

A micro-batch is a set of whole sequences processed jointly by its ranks: one rank packs them
locally; several split each sequence zigzag over them and run ring attention. The JSON form is the
contract of DESIGN.md; `validate()` checks every invariant the runtime relies on and names the one
that breaks.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import networkx as nx
import numpy as np

__all__ = ["MicroBatch", "Plan", "PlanError", "local_tokens", "capacity_for_ratio"]

STRATEGIES = ("balance", "naive", "static")


class PlanError(ValueError):
    """A plan that cannot be built or run; the message names the broken invariant or the limit."""


@dataclass(frozen=True)
class MicroBatch:
    id: int
    ranks: tuple[int, ...]
    sequences: tuple[int, ...]
    offload_ratio: float
    tokens_per_rank: int
    est_time: float

    @property
    def shared(self) -> bool:
        """Runs ring attention over several ranks (and so must be ordered consistently)."""
        return len(self.ranks) > 1


@dataclass
class Plan:
    strategy: str
    world_size: int
    capacity: int
    pp_size: int
    sequences: list[int]
    micro_batches: list[MicroBatch]
    schedule: list[list[int]]
    layers_per_rank: int = 0
    """l of Eq. 2, needed to check the capacity an offload ratio allows; 0 when nothing is offloaded."""
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(asdict(self), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            data = json.loads(text)
            mbs = [MicroBatch(id=int(m["id"]), ranks=tuple(m["ranks"]), sequences=tuple(m["sequences"]),
                              offload_ratio=float(m["offload_ratio"]), tokens_per_rank=int(m["tokens_per_rank"]),
                              est_time=float(m["est_time"])) for m in data["micro_batches"]]
            return cls(strategy=data["strategy"], world_size=int(data["world_size"]), capacity=int(data["capacity"]),
                       pp_size=int(data.get("pp_size", 1)), sequences=[int(s) for s in data["sequences"]],
                       micro_batches=mbs, schedule=[[int(i) for i in r] for r in data["schedule"]],
                       layers_per_rank=int(data.get("layers_per_rank", 0)), meta=dict(data.get("meta", {})))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise PlanError(f"malformed plan JSON: {type(e).__name__}: {e}") from e

    def micro_batches_of(self, rank: int) -> list[MicroBatch]:
        by_id = {m.id: m for m in self.micro_batches}
        return [by_id[i] for i in self.schedule[rank]]

    def validate(self) -> None:
        """Raise PlanError naming the first broken invariant of DESIGN.md's valid plans."""
        _check_header(self)
        by_id = _check_micro_batches(self)
        _check_sequences_covered(self)
        _check_schedule(self, by_id)
        _check_deadlock_free(self, by_id)


def local_tokens(seq_lens: np.ndarray | list[int], group_size: int) -> int:
    """Most tokens any rank of the group holds under the zigzag layout (2N chunks, earlier ones larger), in
    O(sequences + ranks): rank r holds 2(n // 2N) tokens of each sequence, plus one for each whose remainder
    n % 2N exceeds r and one for each whose remainder exceeds 2N-1-r."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    if group_size == 1:
        return int(lens.sum())
    chunks = 2 * group_size
    base, extra = np.divmod(lens, chunks)
    above = lens.size - np.cumsum(np.bincount(extra, minlength=chunks))  # above[k]: remainders > k
    return int(2 * base.sum() + (above[:group_size] + above[group_size:][::-1]).max())


def capacity_for_ratio(capacity: int, ratio: float, layers_per_rank: int) -> int:
    """Tokens a rank can hold with offload ratio r (Eq. 2 with Act linear in s):
    (2 + (1 - r)(l - 2)) · tokens ≤ l · C."""
    if ratio <= 0 or layers_per_rank <= 2:
        return capacity
    return int(layers_per_rank * capacity / (2 + (1 - ratio) * (layers_per_rank - 2)) + 1e-6)


def _check_header(plan: Plan) -> None:
    if plan.strategy not in STRATEGIES:
        raise PlanError(f"strategy {plan.strategy!r} is not one of {STRATEGIES}")
    if plan.world_size < 1 or plan.capacity < 1 or plan.pp_size < 1:
        raise PlanError(f"world_size, capacity and pp_size must be >= 1, got {plan.world_size}, {plan.capacity}, {plan.pp_size}")
    if len(plan.schedule) != plan.world_size:
        raise PlanError(f"schedule has {len(plan.schedule)} rank lists for world_size {plan.world_size}")
    bad = [i for i, s in enumerate(plan.sequences) if not isinstance(s, int) or s < 1]
    if bad:
        raise PlanError(f"sequence lengths must be positive ints; sequence {bad[0]} has {plan.sequences[bad[0]]!r}")


def _check_micro_batches(plan: Plan) -> dict[int, MicroBatch]:
    by_id: dict[int, MicroBatch] = {}
    for m in plan.micro_batches:
        if m.id in by_id:
            raise PlanError(f"micro-batch id {m.id} appears twice")
        by_id[m.id] = m
        if not m.ranks or len(set(m.ranks)) != len(m.ranks) or not all(0 <= r < plan.world_size for r in m.ranks):
            raise PlanError(f"micro-batch {m.id} has ranks {list(m.ranks)}: need distinct ranks in [0, {plan.world_size})")
        if not m.sequences or not all(0 <= s < len(plan.sequences) for s in m.sequences):
            raise PlanError(f"micro-batch {m.id} lists sequences {list(m.sequences)[:8]} outside [0, {len(plan.sequences)})")
        if not 0.0 <= m.offload_ratio <= 1.0:
            raise PlanError(f"micro-batch {m.id} has offload_ratio {m.offload_ratio}, outside [0, 1]")
        lens = [plan.sequences[s] for s in m.sequences]
        held = local_tokens(lens, len(m.ranks))
        if m.tokens_per_rank != held:
            raise PlanError(f"micro-batch {m.id}: tokens_per_rank is {m.tokens_per_rank} but its ranks hold up to {held}")
        limit = capacity_for_ratio(plan.capacity, m.offload_ratio, plan.layers_per_rank)
        slack = 2 * len(lens) if m.shared else 0  # zigzag rounds each sequence to whole chunks
        if held > limit + slack:
            raise PlanError(f"micro-batch {m.id}: {held} tokens per rank exceed the capacity {limit} that "
                            f"offload_ratio {m.offload_ratio} allows (C={plan.capacity}, l={plan.layers_per_rank})")
    return by_id


def _check_sequences_covered(plan: Plan) -> None:
    seen = np.zeros(len(plan.sequences), dtype=np.int64)
    for m in plan.micro_batches:
        np.add.at(seen, list(m.sequences), 1)
    if (seen != 1).any():
        i = int(np.flatnonzero(seen != 1)[0])
        raise PlanError(f"sequence {i} (length {plan.sequences[i]}) is in {int(seen[i])} micro-batches, must be in exactly one")


def _check_schedule(plan: Plan, by_id: dict[int, MicroBatch]) -> None:
    placed: dict[int, list[int]] = {i: [] for i in by_id}
    for rank, ids in enumerate(plan.schedule):
        for i in ids:
            if i not in by_id:
                raise PlanError(f"rank {rank} schedules micro-batch {i}, which does not exist")
            placed[i].append(rank)
    for i, ranks in placed.items():
        if sorted(ranks) != sorted(by_id[i].ranks):
            raise PlanError(f"micro-batch {i} belongs to ranks {sorted(by_id[i].ranks)} but is scheduled on {sorted(ranks)}")


def _check_deadlock_free(plan: Plan, by_id: dict[int, MicroBatch]) -> None:
    """Shared micro-batches block until all their ranks arrive: the per-rank orders must agree on one
    global order, i.e. the graph of "runs before" edges between them has no cycle."""
    graph = nx.DiGraph()
    for ids in plan.schedule:
        shared = [i for i in ids if by_id[i].shared]
        graph.add_edges_from(zip(shared[:-1], shared[1:]))
    try:
        cycle = nx.find_cycle(graph)
    except nx.NetworkXNoCycle:
        return
    order = " -> ".join(str(a) for a, _ in cycle) + f" -> {cycle[0][0]}"
    raise PlanError(f"schedule would deadlock: shared micro-batches {order} wait on each other in a cycle "
                    f"(ranks sharing them run them in different orders)")
