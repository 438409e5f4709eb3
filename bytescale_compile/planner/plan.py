"""The Plan: which ranks run which sequences, in which order, with which offload ratio.

A micro-batch is a set of whole sequences processed jointly by its ranks: one rank packs them
locally; several split each sequence zigzag over them and run ring attention, or, with a Ulysses
degree u > 1, a u × r split: groups of u consecutive ranks of its rank list run head-parallel attention
(all-to-alls), and a ring of r = D(s) / u runs among the groups. The JSON form is the
contract of DESIGN.md; `validate()` checks every invariant the runtime relies on and names the one
that breaks.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import networkx as nx
import numpy as np

from ..strategies import DEFAULT_SP, STRATEGIES
from .pipeline_order import chained_micro_batches, stage_order

__all__ = [
    "AutoChoice",
    "BalanceSettings",
    "MicroBatch",
    "Plan",
    "PlanError",
    "StaticMesh",
    "local_tokens",
    "split_tokens",
    "capacity_for_ratio",
]


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
    ulysses: int = 1
    """The Ulysses degree u of a shared micro-batch: groups of u consecutive ranks of `ranks` turn token shards
    into head shards; 1 runs the plain zigzag ring over all its ranks."""

    @property
    def shared(self) -> bool:
        """Runs ring attention over several ranks (and so must be ordered consistently)."""
        return len(self.ranks) > 1

    @property
    def ring(self) -> int:
        """The ring degree r = D(s) / u (the number of Ulysses groups)."""
        return len(self.ranks) // self.ulysses


@dataclass(frozen=True)
class AutoChoice:
    """Which candidate strategy="auto" chose (`auto.CANDIDATES`), every candidate's simulated step time, and the
    winner's speedup over static (None where static cannot plan the batch) and over the runner-up."""

    chosen: str
    step_time: dict[str, float]
    speedup_over_static: float | None
    speedup_over_runner_up: float


@dataclass(frozen=True)
class BalanceSettings:
    """How a balance plan placed its sequences: within `delta` seconds of the least-loaded rank, over `buckets`
    FLOP buckets, by the placer of `mode` ("dp" without pipelines, "pp" with them)."""

    delta: float
    buckets: int
    mode: str


@dataclass(frozen=True)
class StaticMesh:
    """The static baseline's DP x CP mesh and the context length of its rows."""

    cp: int
    dp: int
    context_length: int


@dataclass
class Plan:
    """What the planner decided for one global batch. The fields after `layers_per_rank` say how it was planned,
    each set by the strategies it concerns and None (or empty) otherwise; nothing reads them to run the plan."""

    strategy: str
    world_size: int
    capacity: int
    pp_size: int
    sequences: list[int]
    micro_batches: list[MicroBatch]
    schedule: list[list[int]]
    layers_per_rank: int = 0
    """l of Eq. 2, needed to check the capacity an offload ratio allows; 0 when nothing is offloaded."""
    sp: str = DEFAULT_SP
    """How shared micro-batches split their ranks u x r (`split.choose_split`)."""
    offload: bool | None = None
    """Naive and balance: whether long sequences could offload activations."""
    balance: BalanceSettings | None = None
    mesh: StaticMesh | None = None
    shard_blockers: tuple[str, ...] = ()
    """Why the model cannot be sharded or packed (the compile report's): non-empty, every sequence ran alone on
    one rank (`unsharded.plan_unsharded`)."""
    auto: AutoChoice | None = None
    """strategy="auto": the candidate it chose and why."""

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(asdict(self), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            data = json.loads(text)
            mbs = [
                MicroBatch(
                    id=int(m["id"]),
                    ranks=tuple(m["ranks"]),
                    sequences=tuple(m["sequences"]),
                    offload_ratio=float(m["offload_ratio"]),
                    tokens_per_rank=int(m["tokens_per_rank"]),
                    est_time=float(m["est_time"]),
                    ulysses=int(m.get("ulysses", 1)),
                )
                for m in data["micro_batches"]
            ]
            return cls(
                strategy=data["strategy"],
                world_size=int(data["world_size"]),
                capacity=int(data["capacity"]),
                pp_size=int(data.get("pp_size", 1)),
                sequences=[int(s) for s in data["sequences"]],
                micro_batches=mbs,
                schedule=[[int(i) for i in r] for r in data["schedule"]],
                layers_per_rank=int(data.get("layers_per_rank", 0)),
                **_how_planned({**data.get("meta", {}), **data}),
            )
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise PlanError(f"malformed plan JSON: {type(e).__name__}: {e}") from e

    def micro_batches_of(self, rank: int) -> list[MicroBatch]:
        by_id = {m.id: m for m in self.micro_batches}
        return [by_id[i] for i in self.schedule[rank]]

    def splits(self) -> dict[str, int]:
        """Shared micro-batches per u × r split ("2x4": u = 2, r = 4), most frequent first."""
        counts = Counter(f"{m.ulysses}x{m.ring}" for m in self.micro_batches if m.shared)
        return dict(counts.most_common())

    def validate(self, *, heads: int | None = None, kv_heads: int | None = None) -> None:
        """Raise PlanError naming the first broken invariant of DESIGN.md's valid plans. With the model's
        query `heads` (and `kv_heads`, for the message), also that every Ulysses degree divides them."""
        _check_header(self)
        by_id = _check_micro_batches(self, heads, kv_heads)
        _check_sequences_covered(self)
        _check_schedule(self, by_id)
        _check_deadlock_free(self, by_id)


def _how_planned(data: dict[str, Any]) -> dict[str, Any]:
    """The fields saying how a plan was planned, from its JSON; plans written before they were typed kept them in
    a "meta" dict (balance's "balance" a string, "delta" and "buckets" beside it, "unsharded" the joined blockers,
    static's "cp", "dp" and "context_length" at its top), which load the same."""
    fields: dict[str, Any] = {"sp": data.get("sp") or DEFAULT_SP, "offload": data.get("offload")}
    balance = data.get("balance")
    if isinstance(balance, str):
        balance = {"delta": data["delta"], "buckets": data["buckets"], "mode": balance}
    fields["balance"] = BalanceSettings(**balance) if balance else None
    mesh = data.get("mesh") or ({k: data[k] for k in ("cp", "dp", "context_length")} if "cp" in data else None)
    fields["mesh"] = StaticMesh(**mesh) if mesh else None
    blockers = data.get("shard_blockers") or ([data["unsharded"]] if data.get("unsharded") else [])
    fields["shard_blockers"] = tuple(blockers)
    fields["auto"] = AutoChoice(**data["auto"]) if data.get("auto") else None
    return fields


def local_tokens(seq_lens: np.ndarray | list[int], group_size: int) -> int:
    """Most tokens any rank of the group holds under the zigzag layout (2N chunks, earlier ones larger), in
    O(sequences + ranks): rank r holds 2(n // 2N) tokens of each sequence, plus one for each whose remainder
    n % 2N exceeds r and one for each whose remainder exceeds 2N-1-r."""
    if len(seq_lens) == 1:  # one sequence (most shared micro-batches), on ints
        return zigzag_tokens(int(seq_lens[0]), group_size)
    lens = np.asarray(seq_lens, dtype=np.int64)
    if group_size == 1:
        return int(lens.sum())
    chunks = 2 * group_size
    base, extra = np.divmod(lens, chunks)
    above = lens.size - np.cumsum(np.bincount(extra, minlength=chunks))  # above[k]: remainders > k
    return int(2 * base.sum() + (above[:group_size] + above[group_size:][::-1]).max())


def zigzag_tokens(length, group_size):
    """`local_tokens` of one sequence, on ints or elementwise on arrays: rank r of N holds zigzag chunks r and
    2N-1-r, each n // 2N tokens, plus one of the n % 2N left over for each of the first chunks."""
    base, extra = divmod(length, 2 * group_size)
    return 2 * base + (extra >= 1) + (extra >= group_size + 1)


def split_tokens(seq_lens: np.ndarray | list[int], group_size: int, ulysses: int = 1) -> int:
    """Most tokens any rank of a u × r split holds: its virtual rank's zigzag share over r = group_size / u
    ranks (`local_tokens`), cut into u contiguous parts, the earlier ones taking the remainder
    (`runtime/layout.py`'s `UlyssesLayout`). `local_tokens` at u = 1."""
    if ulysses == 1:
        return local_tokens(seq_lens, group_size)
    return -(-local_tokens(seq_lens, group_size // ulysses) // ulysses)


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
        raise PlanError(
            f"world_size, capacity and pp_size must be >= 1, got {plan.world_size}, {plan.capacity}, {plan.pp_size}"
        )
    if len(plan.schedule) != plan.world_size:
        raise PlanError(f"schedule has {len(plan.schedule)} rank lists for world_size {plan.world_size}")
    bad = [i for i, s in enumerate(plan.sequences) if not isinstance(s, int) or s < 1]
    if bad:
        raise PlanError(f"sequence lengths must be positive ints; sequence {bad[0]} has {plan.sequences[bad[0]]!r}")


def _check_split(m: MicroBatch, heads: int | None, kv_heads: int | None) -> None:
    """The u × r split of a micro-batch: u an int >= 1 dividing D(s) = its ranks, and the query heads when known."""
    u, d = m.ulysses, len(m.ranks)
    if isinstance(u, bool) or not isinstance(u, int) or u < 1:
        raise PlanError(f"micro-batch {m.id} has Ulysses degree u={u!r}: need an int >= 1")
    if d % u:
        raise PlanError(
            f"micro-batch {m.id} has Ulysses degree u={u} on D(s)={d} ranks: u must divide D(s) "
            f"(u x r = D(s) with r the ring degree)"
        )
    if heads is not None and heads % u:
        raise PlanError(
            f"micro-batch {m.id} has Ulysses degree u={u} (D(s)={d}), which does not divide the model's "
            f"{heads} query heads (H_kv={kv_heads}): u must divide H"
        )


def _check_micro_batches(plan: Plan, heads: int | None = None, kv_heads: int | None = None) -> dict[int, MicroBatch]:
    by_id: dict[int, MicroBatch] = {}
    for m in plan.micro_batches:
        if m.id in by_id:
            raise PlanError(f"micro-batch id {m.id} appears twice")
        by_id[m.id] = m
        if not m.ranks or len(set(m.ranks)) != len(m.ranks) or not all(0 <= r < plan.world_size for r in m.ranks):
            raise PlanError(
                f"micro-batch {m.id} has ranks {list(m.ranks)}: need distinct ranks in [0, {plan.world_size})"
            )
        if not m.sequences or not all(0 <= s < len(plan.sequences) for s in m.sequences):
            raise PlanError(
                f"micro-batch {m.id} lists sequences {list(m.sequences)[:8]} outside [0, {len(plan.sequences)})"
            )
        if not 0.0 <= m.offload_ratio <= 1.0:
            raise PlanError(f"micro-batch {m.id} has offload_ratio {m.offload_ratio}, outside [0, 1]")
        _check_split(m, heads, kv_heads)
        lens = [plan.sequences[s] for s in m.sequences]
        if max(lens) < len(m.ranks):
            raise PlanError(
                f"micro-batch {m.id} splits sequences of at most {max(lens)} tokens over {len(m.ranks)} ranks: the "
                f"zigzag layout leaves its ranks from {max(lens)} on without a token to run"
            )
        held = split_tokens(lens, len(m.ranks), m.ulysses)
        if m.tokens_per_rank != held:
            raise PlanError(
                f"micro-batch {m.id}: tokens_per_rank is {m.tokens_per_rank} but its ranks hold up to {held}"
            )
        limit = capacity_for_ratio(plan.capacity, m.offload_ratio, plan.layers_per_rank)
        # zigzag rounds each sequence to whole chunks; a Ulysses split's parts round up by one more token
        slack = 2 * len(lens) + (m.ulysses > 1) if m.shared else 0
        if held > limit + slack:
            raise PlanError(
                f"micro-batch {m.id}: {held} tokens per rank exceed the capacity {limit} that "
                f"offload_ratio {m.offload_ratio} allows (C={plan.capacity}, l={plan.layers_per_rank})"
            )
    return by_id


def _check_sequences_covered(plan: Plan) -> None:
    seen = np.zeros(len(plan.sequences), dtype=np.int64)
    for m in plan.micro_batches:
        np.add.at(seen, list(m.sequences), 1)
    if (seen != 1).any():
        i = int(np.flatnonzero(seen != 1)[0])
        raise PlanError(
            f"sequence {i} (length {plan.sequences[i]}) is in {int(seen[i])} micro-batches, must be in exactly one"
        )


def _check_schedule(plan: Plan, by_id: dict[int, MicroBatch]) -> None:
    placed: dict[int, list[int]] = {i: [] for i in by_id}
    for rank, ids in enumerate(plan.schedule):
        for i in ids:
            if i not in by_id:
                raise PlanError(f"rank {rank} schedules micro-batch {i}, which does not exist")
            placed[i].append(rank)
    for i, ranks in placed.items():
        if sorted(ranks) != sorted(by_id[i].ranks):
            raise PlanError(
                f"micro-batch {i} belongs to ranks {sorted(by_id[i].ranks)} but is scheduled on {sorted(ranks)}"
            )


def _check_deadlock_free(plan: Plan, by_id: dict[int, MicroBatch]) -> None:
    """Shared micro-batches block until all their ranks arrive: the per-rank orders must agree on one
    global order; with pipelines, on the ops of every stage."""
    if plan.pp_size == 1:
        _check_shared_order(plan, by_id)
    else:
        _check_one_f_one_b(plan, by_id)


def _check_shared_order(plan: Plan, by_id: dict[int, MicroBatch]) -> None:
    """The graph of "runs before" edges between shared micro-batches has no cycle."""
    graph = nx.DiGraph()
    for ids in plan.schedule:
        shared = [i for i in ids if by_id[i].shared]
        graph.add_edges_from(zip(shared[:-1], shared[1:]))
    try:
        cycle = nx.find_cycle(graph)
    except nx.NetworkXNoCycle:
        return
    order = " -> ".join(str(a) for a, _ in cycle) + f" -> {cycle[0][0]}"
    raise PlanError(
        f"schedule would deadlock: shared micro-batches {order} wait on each other in a cycle "
        f"(ranks sharing them run them in different orders)"
    )


def _check_one_f_one_b(plan: Plan, by_id: dict[int, MicroBatch]) -> None:
    """Each stage rank runs its pipeline's forwards (F) and backwards (B) in `stage_order`, and a shared
    micro-batch's F or B on a stage is one ring over all its pipelines: the graph of dependencies between
    ops (stage orders, F down the stages, B back up) must have no cycle. `stage_order` keeps shared
    micro-batches apart, so only pipelines disagreeing on their order make one."""
    graph = nx.DiGraph()
    graph.add_edges_from(_one_f_one_b_edges(plan, by_id))  # not nx.DiGraph(a set): that imports pandas
    if nx.is_directed_acyclic_graph(graph):
        return
    cycle = _short_cycle(graph)
    names = " -> ".join(_op_name(op, plan.pp_size) for op in cycle)
    blamed = _conflicting_orders(plan, by_id, cycle)
    pipelines = sorted({i for ranks in blamed.values() for i in ranks})
    runs = "; ".join(f"pipelines {ranks} run {edge}" for edge, ranks in blamed.items())
    raise PlanError(
        f"schedule would deadlock under 1F1B: {names} wait on each other in a cycle; the stage "
        f"orders of pipelines (HDP ranks) {pipelines} run the forwards and backwards of shared "
        f"micro-batches in different orders ({runs}): every pipeline must run the shared micro-batches "
        f"it holds in one global order"
    )


def _op(kind: int, mb: int, stage: int, pp: int) -> int:
    """One int per op (kind 0 = F, 1 = B): networkx builds a graph of ints about 1.3x faster than of tuples."""
    return (mb * pp + stage) * 2 + kind


def _op_name(op: int, pp: int) -> str:
    rest, kind = divmod(op, 2)
    mb, stage = divmod(rest, pp)
    return f"{'FB'[kind]}(mb {mb}, stage {stage})"


def _stage_ops(ids: list[int], stage: int, pp: int, by_id: dict[int, MicroBatch], chained: set[int]) -> list[int]:
    """The ops one stage rank of a pipeline scheduling `ids` runs, in its 1F1B order."""
    order = stage_order(stage, pp, [by_id[i].shared for i in ids], [i in chained for i in ids])
    return [_op(kind == "B", ids[j], stage, pp) for kind, j in order]


def _one_f_one_b_edges(plan: Plan, by_id: dict[int, MicroBatch]) -> set[tuple[int, int]]:
    """Stage-order and stage-to-stage edges of the pipelines holding a shared micro-batch: the others
    each form a 1F1B pipeline of their own, which never waits on itself. A set: pipelines sharing
    micro-batches repeat many edges, and networkx adds each edge several times slower than a set."""
    pp, seen, chained = plan.pp_size, set(), chained_micro_batches(plan)
    edges: set[tuple[int, int]] = set()
    for ids in plan.schedule:
        if not any(by_id[i].shared for i in ids):
            continue
        for s in range(pp):
            edges.update(itertools.pairwise(_stage_ops(ids, s, pp, by_id, chained)))
        for i in ids:
            if i not in seen:
                seen.add(i)
                forward = [_op(0, i, s, pp) for s in range(pp)]
                edges.update(itertools.pairwise(forward))  # F(j, s) after F(j, s - 1)
                edges.update((f + 3, f + 1) for f in forward[:-1])  # B(j, s) after B(j, s + 1)
                edges.add((forward[-1], forward[-1] + 1))  # B(j, last) after F(j, last)
    return edges


def _short_cycle(graph: nx.DiGraph) -> list[int]:
    """A shortest cycle through one op of the smallest strongly connected component, first op repeated
    last (a readable cycle; `nx.find_cycle` may wander through hundreds of ops)."""
    cyclic = (c for c in nx.strongly_connected_components(graph) if len(c) > 1)
    component = min(cyclic, key=lambda c: (len(c), min(c)))
    sub = graph.subgraph(component)
    start = min(component)
    paths = nx.single_source_shortest_path(sub, start)
    back = min(sub.predecessors(start), key=lambda op: len(paths[op]))
    return [*paths[back], start]


def _conflicting_orders(plan: Plan, by_id: dict[int, MicroBatch], cycle: list[int]) -> dict[str, list[int]]:
    """For each edge "u -> v" of the cycle between two micro-batches on one stage, the pipelines whose
    stage order runs v right after u."""
    pp, blamed, chained = plan.pp_size, {}, chained_micro_batches(plan)
    for u, v in zip(cycle[:-1], cycle[1:]):
        mb_u, stage = divmod(u // 2, pp)
        mb_v, stage_v = divmod(v // 2, pp)
        if stage != stage_v or mb_u == mb_v:
            continue
        ranks = [
            i
            for i in by_id[mb_u].ranks
            if any(
                a == u and b == v
                for a, b in itertools.pairwise(_stage_ops(plan.schedule[i], stage, pp, by_id, chained))
            )
        ]
        blamed[f"{_op_name(u, pp)} -> {_op_name(v, pp)}"] = ranks
    return blamed
