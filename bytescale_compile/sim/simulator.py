"""Step simulator: run a Plan on the cost model's clock instead of on GPUs.

Each rank runs its schedule in order. A packed micro-batch starts when its rank is free; a shared one
when all its ranks are (ring attention keeps the group in lockstep), the early ones idling until then.
A micro-batch takes its compute split by zigzag, overlapped with the ring P2P and the offload copies,
whichever is longest. Without a topology (`Hardware.topology`) that is the planner's estimate. With one,
each ring hop is charged to the links it crosses (`Topology.hop`), and a link's bandwidth is shared
among the hops of every ring whose span overlaps on it: the timeline is re-run with the shared
bandwidths until it settles (`CONTENTION_ROUNDS` at most). With pp_size > 1 each HDP rank is a pipeline
of pp stages: its micro-batches occupy it for time/pp each, and it ends with the fill and drain of its
1F1B run stage by stage (`sim/pipeline.py`), each stage-to-stage send charged on the link between the
two stages (`pipeline_sends`; `sends=False` leaves them out). The step ends with one gradient all-reduce
over all ranks, then the optimizer step (`CostModel.optimizer_time`, each device stepping its shard).

Every micro-batch costs its sequences' work (`CostModel.seq_time`, the planner's `est_time`) plus, once on each
of its ranks, `CostModel.micro_batch_overhead`: every layer's launches and the micro-batch's fixed cost, however
many sequences it packs. So one rank running one micro-batch takes `CostModel.micro_batch_time` of its
sequences, then the all-reduce (several ranks) and `optimizer_time`.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict, deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

from ..planner.group_size import fastest_groups
from ..planner.pipeline_order import chained_micro_batches
from ..planner.plan import MicroBatch, Plan, PlanError, local_tokens
from ..planner.split import SP_AUTO, split_time
from .pipeline import PipelineRun, first_order_bubble, one_f_one_b
from .timeline import Span, Timeline

if TYPE_CHECKING:
    from ..planner.cost_model import CostModel
    from ..planner.topology import Link, Topology

__all__ = [
    "CONTENTION_ROUNDS",
    "DIRECT_EXCHANGE_SHARE",
    "boundary_bytes_per_token",
    "pipeline_sends",
    "simulate",
    "step_time",
    "bubble_rates",
    "pipeline_bubbles",
    "busy_times",
    "lower_bound",
    "optimizer_shards",
    "p2p_bytes",
    "ulysses_bytes",
    "throughput",
]

CONTENTION_ROUNDS = 4
"""Re-runs of the timeline with link bandwidths shared among the rings that overlap in it."""


def simulate(plan: Plan, cost_model: CostModel, sends: bool = True) -> Timeline:
    """The per-rank timeline of one training step under `plan`; `sends=False` leaves the pipeline's
    stage-to-stage sends uncharged."""
    return _timeline(plan, cost_model, *_settle(plan, cost_model), sends)


def step_time(plan: Plan, cost_model: CostModel, sends: bool = True) -> float:
    """`simulate(plan, cost_model, sends).step_time` without building the timeline's spans."""
    duration, start = _settle(plan, cost_model)
    runs = _pipeline_runs(plan, cost_model, duration, sends)
    return _step_end(plan, cost_model, duration, _rank_ends(plan, duration, start), runs)


def boundary_bytes_per_token(cost_model: CostModel) -> float:
    """Bytes one token's activations take at a stage boundary: its hidden state
    (`CostModel.hidden_bytes_per_token`, which the TP all-reduces of T(s) reduce too)."""
    return cost_model.hidden_bytes_per_token


def _boundary_bandwidths(plan: Plan, cost_model: CostModel, rank: int) -> list[float]:
    """Bytes/s between consecutive stages of HDP rank `rank`'s pipeline. Stages are placed stage-major,
    stage s of rank i at position s x world_size + i, so each stage's ranks stay adjacent as the rings
    (and `Topology`'s rank numbering) assume; a send runs at the slowest link its hop crosses."""
    topology, world = cost_model.hardware.topology, plan.world_size
    if topology is None:
        return [cost_model.network_bandwidth] * (plan.pp_size - 1)
    return [
        min(topology.bandwidth(link) for link in topology.hop(s * world + rank, (s + 1) * world + rank))
        for s in range(plan.pp_size - 1)
    ]


def pipeline_sends(plan: Plan, cost_model: CostModel, rank: int) -> list[list[float]]:
    """Seconds of each of `rank`'s micro-batches' sends across each stage boundary: its tokens on the rank
    x `boundary_bytes_per_token`, at the boundary's bandwidth, plus one message latency."""
    tokens = {m.id: m.tokens_per_rank for m in plan.micro_batches}
    per_token = boundary_bytes_per_token(cost_model)
    bandwidths = _boundary_bandwidths(plan, cost_model, rank)
    return [[tokens[i] * per_token / bw + cost_model.latency for bw in bandwidths] for i in plan.schedule[rank]]


def _settle(plan: Plan, cost_model: CostModel) -> tuple[dict[int, float], dict[int, float]]:
    """Every micro-batch's duration and start, link bandwidths shared among overlapping rings, and the
    machine's compute among the ranks busy at once where they share one (`Hardware.compute_slots`)."""
    duration, start = _settle_links(plan, cost_model)
    slots = cost_model.hardware.compute_slots
    return (
        (duration, start) if slots is None or not plan.micro_batches else _share_compute(plan, duration, start, slots)
    )


def _share_compute(
    plan: Plan, alone: dict[int, float], start: dict[int, float], slots: float
) -> tuple[dict[int, float], dict[int, float]]:
    """Each micro-batch's duration alone times max(1, busy / slots), where busy is the mean number of
    processes in micro-batches over its span (its own included; a pipeline's pp stages are pp processes,
    counted busy together): processor sharing, averaged over the span. The timeline is re-run with the new
    durations until it settles (`CONTENTION_ROUNDS` at most)."""
    ids = [m.id for m in plan.micro_batches]
    width = np.array([len(m.ranks) * plan.pp_size for m in plan.micro_batches], np.float64)
    base = np.array([alone[i] for i in ids])
    duration = dict(alone)
    for _ in range(CONTENTION_ROUNDS):
        begin = np.array([start[i] for i in ids])
        end = begin + np.array([duration[i] for i in ids]) / plan.pp_size
        overlap = np.minimum(end[:, None], end[None, :]) - np.maximum(begin[:, None], begin[None, :])
        busy = (np.clip(overlap, 0.0, None) * width[None, :]).sum(axis=1) / np.maximum(end - begin, 1e-12)
        shared = dict(zip(ids, (base * np.maximum(1.0, busy / slots)).tolist()))
        if all(abs(shared[i] - duration[i]) <= 1e-9 * duration[i] for i in ids):
            break
        duration = shared
        start = _starts(plan, duration)
    return duration, start


def _settle_links(plan: Plan, cost_model: CostModel) -> tuple[dict[int, float], dict[int, float]]:
    """Every micro-batch's duration and start, link bandwidths shared among overlapping rings."""
    topology = cost_model.hardware.topology
    if topology is None:
        overhead = cost_model.micro_batch_overhead
        duration = {m.id: m.est_time + overhead for m in plan.micro_batches}
        return duration, _starts(plan, duration)
    flows = {m.id: _ring_flows(topology, m) for m in plan.micro_batches if m.shared}
    flows = {i: f for i, f in flows.items() if f}  # a split all Ulysses (r = 1) has no ring
    alone = {i: min(topology.bandwidth(link) / n for link, n in f.items()) for i, f in flows.items()}
    sharing = _LinkSharing.of(flows, topology)
    bandwidth = alone
    duration = _durations(plan, cost_model, bandwidth)
    start = _starts(plan, duration)
    for _ in range(CONTENTION_ROUNDS if sharing.links else 0):
        shared = sharing.bandwidth(alone, start, duration, plan.pp_size)
        if all(abs(shared[i] - bandwidth[i]) <= 1e-9 * bandwidth[i] for i in shared):
            break
        bandwidth = shared
        duration = _durations(plan, cost_model, bandwidth)
        start = _starts(plan, duration)
    return duration, start


def _ring_flows(topology: Topology, m: MicroBatch) -> Counter[Link]:
    """The hops of a shared micro-batch's ring, or of the u rings of its u × r split (rank-list order)."""
    if m.ulysses == 1:
        return topology.ring_flows(sorted(m.ranks))
    return topology.split_ring_flows(m.ranks, m.ulysses)


def _durations(plan: Plan, cost_model: CostModel, bandwidth: dict[int, float]) -> dict[int, float]:
    """Seconds of each micro-batch, `CostModel.micro_batch_overhead` included; a shared one by the planner's own
    `split_time`, its ring at its bandwidth under contention (bytes/s per rank), its all-to-alls at their links'
    bandwidth, uncontended."""
    lens = np.asarray(plan.sequences)
    seq_time = cost_model.seq_time(lens)
    overhead = cost_model.micro_batch_overhead
    out = {}
    for m in plan.micro_batches:
        if not m.shared:
            out[m.id] = m.est_time + overhead
            continue
        ids = list(m.sequences)
        work = float(seq_time[ids].sum())
        ring_bw = bandwidth.get(m.id, math.inf)
        out[m.id] = split_time(cost_model, lens[ids], m.ranks, m.offload_ratio, m.ulysses, work, ring_bw) + overhead
    return out


@dataclass(frozen=True)
class _LinkSharing:
    """The (link, ring) pairs on links more than one ring crosses, as flat arrays."""

    links: int
    link: np.ndarray
    ring: np.ndarray
    hops: np.ndarray
    bandwidth_of: np.ndarray

    @classmethod
    def of(cls, flows: Mapping[int, Mapping[Link, int]], topology: Topology) -> _LinkSharing:
        users: dict[Link, list[int]] = defaultdict(list)
        for i, f in flows.items():
            for lk in f:
                users[lk].append(i)
        shared = [(link, ids) for link, ids in users.items() if len(ids) > 1]
        link = np.array([k for k, (_, ids) in enumerate(shared) for _ in ids], np.int64)
        ring = np.array([i for _, ids in shared for i in ids], np.int64)
        hops = np.array([flows[i][lk] for lk, ids in shared for i in ids], np.float64)
        bandwidth_of = np.array([topology.bandwidth(lk) for lk, ids in shared for _ in ids], np.float64)
        return cls(len(shared), link, ring, hops, bandwidth_of)

    def bandwidth(
        self, alone: dict[int, float], start: dict[int, float], duration: dict[int, float], pp: int
    ) -> dict[int, float]:
        """Each ring's bytes/s per rank when every link's bandwidth is split among the hops of all rings
        whose spans overlap on it: the slowest of its links (`alone` covers those it has to itself).
        Ring j overlaps ring i iff begin_j < end_i and not end_j <= begin_i; both counts are prefix sums
        over the (link, time)-sorted begins and ends."""
        begin = np.array([start[i] for i in self.ring.tolist()])
        end = begin + np.array([duration[i] for i in self.ring.tolist()]) / pp
        offset = self.link * (float(end.max()) + 1.0)
        begins, ends = offset + begin, offset + end
        total = self._hops_below(begins, ends, offset, "left") - self._hops_below(ends, begins, offset, "right")
        out = dict(alone)
        for i, bw in zip(self.ring.tolist(), (self.bandwidth_of / total).tolist()):
            if bw < out[i]:
                out[i] = bw
        return out

    def _hops_below(
        self, keys: np.ndarray, limits: np.ndarray, offset: np.ndarray, side: Literal["left", "right"]
    ) -> np.ndarray:
        """Per pair: the hops of the pairs on the same link whose key is below its limit (or equal, "right")."""
        order = np.argsort(keys, kind="stable")
        cumulative = np.concatenate(([0.0], np.cumsum(self.hops[order])))
        sorted_keys = keys[order]
        return (
            cumulative[np.searchsorted(sorted_keys, limits, side=side)]
            - cumulative[np.searchsorted(sorted_keys, offset, side="left")]
        )


def _starts(plan: Plan, duration: dict[int, float]) -> dict[int, float]:
    """Every micro-batch's start: each rank runs its schedule in order, a shared micro-batch starting
    when its last rank arrives."""
    by_id = {m.id: m for m in plan.micro_batches}
    pp = plan.pp_size
    clock = [0.0] * plan.world_size
    head = [0] * plan.world_size
    arrived: dict[int, int] = {}
    start: dict[int, float] = {}
    todo = deque(range(plan.world_size))
    while todo:
        rank = todo.popleft()
        schedule = plan.schedule[rank]
        while head[rank] < len(schedule):
            mb = by_id[schedule[head[rank]]]
            if len(mb.ranks) == 1:
                start[mb.id] = clock[rank]
                clock[rank] += duration[mb.id] / pp
                head[rank] += 1
                continue
            arrived[mb.id] = arrived.get(mb.id, 0) + 1
            if arrived[mb.id] == len(mb.ranks):
                begin = max(clock[r] for r in mb.ranks)
                start[mb.id] = begin
                for r in mb.ranks:
                    clock[r] = begin + duration[mb.id] / pp
                    head[r] += 1
                    if r != rank:
                        todo.append(r)
                continue
            break
    stuck = [r for r in range(plan.world_size) if head[r] < len(plan.schedule[r])]
    if stuck:
        raise PlanError(f"simulation deadlocked: ranks {stuck[:8]} wait on shared micro-batches that never assemble")
    return start


def _rank_ends(plan: Plan, duration: dict[int, float], start: dict[int, float]) -> list[float]:
    """When each rank's last micro-batch ends."""
    clock = [0.0] * plan.world_size
    for m in plan.micro_batches:
        end = start[m.id] + duration[m.id] / plan.pp_size
        for r in m.ranks:
            if end > clock[r]:
                clock[r] = end
    return clock


def _pipeline_runs(plan: Plan, cost_model: CostModel, duration: dict[int, float], sends: bool) -> list[PipelineRun]:
    """The 1F1B run of every rank's pipeline, stage by stage (a rank without micro-batches: an empty run, bubble
    0); none without pipelines."""
    if plan.pp_size == 1:
        return []
    shared_ids = {m.id for m in plan.micro_batches if m.shared}
    chained = chained_micro_batches(plan)
    runs = []
    for rank, ids in enumerate(plan.schedule):
        runs.append(
            one_f_one_b(
                [duration[i] for i in ids],
                plan.pp_size,
                pipeline_sends(plan, cost_model, rank) if sends else 0.0,
                [i in shared_ids for i in ids],
                [i in chained for i in ids],
            )
        )
    return runs


def optimizer_shards(plan: Plan, cost_model: CostModel) -> int:
    """Devices the optimizer state is sharded over: every HDP rank's pipeline stages and TP devices, as the
    distributed optimizer (bf16) and ZeRO-1 shard it. An fp32 AdamW without ZeRO steps its stage's whole copy on
    every HDP rank, so its step is predicted hdp times too short."""
    return plan.world_size * plan.pp_size * cost_model.hardware.tp_size


def _sync_time(plan: Plan, cost_model: CostModel) -> float:
    """The gradient all-reduce over all ranks (none on one)."""
    return cost_model.allreduce_time() if plan.world_size > 1 else 0.0


def _step_end(
    plan: Plan, cost_model: CostModel, duration: dict[int, float], clock: list[float], runs: list[PipelineRun]
) -> float:
    """With pp > 1 each rank's pipeline adds its 1F1B fill and drain (`runs`, `_pipeline_runs`); then the
    gradient all-reduce over all ranks and the optimizer step."""
    if runs:
        # each pipeline's 1F1B run adds its fill and drain to its micro-batches' time / pp
        clock = [
            c + run.makespan - sum(duration[i] for i in ids) / plan.pp_size
            for c, run, ids in zip(clock, runs, plan.schedule)
        ]
    optimizer = cost_model.optimizer_time(optimizer_shards(plan, cost_model))
    return max(clock, default=0.0) + _sync_time(plan, cost_model) + optimizer


def _timeline(
    plan: Plan, cost_model: CostModel, duration: dict[int, float], start: dict[int, float], sends: bool
) -> Timeline:
    """The spans of every micro-batch on every rank, then the all-reduce and the optimizer step."""
    spans: list[Span] = []
    for m in plan.micro_batches:
        end = start[m.id] + duration[m.id] / plan.pp_size
        kind = "shared" if m.shared else "packed"
        spans.extend(Span(r, start[m.id], end, m.id, kind, m.tokens_per_rank, len(m.ranks)) for r in m.ranks)
    runs = _pipeline_runs(plan, cost_model, duration, sends)
    end = _step_end(plan, cost_model, duration, _rank_ends(plan, duration, start), runs)
    optimizer = cost_model.optimizer_time(optimizer_shards(plan, cost_model))
    sync_end = end - optimizer
    sync = _sync_time(plan, cost_model)
    spans.extend(Span(r, sync_end - sync, sync_end, -1, "allreduce") for r in range(plan.world_size))
    if optimizer:
        spans.extend(Span(r, sync_end, end, -1, "optimizer") for r in range(plan.world_size))
    return Timeline(plan.strategy, plan.world_size, spans, [run.bubble_rate for run in runs] if runs else None)


def pipeline_bubbles(plan: Plan, cost_model: CostModel, sends: bool = True) -> list[float]:
    """Each HDP rank's pipeline bubble rate, stage by stage (1F1B, waiting on the sends unless `sends=False`);
    0 for a rank without micro-batches or without pipelines."""
    if plan.pp_size == 1 or not plan.micro_batches:
        return [0.0] * plan.world_size
    return [run.bubble_rate for run in _pipeline_runs(plan, cost_model, _settle(plan, cost_model)[0], sends)]


def bubble_rates(plan: Plan, cost_model: CostModel, sends: bool = True) -> tuple[float, float]:
    """Mean over ranks with micro-batches of the pipeline bubble rate: stage by stage (`pipeline_bubbles`)
    and the first-order model's (no sends)."""
    if plan.pp_size == 1 or not plan.micro_batches:
        return 0.0, 0.0
    duration, _ = _settle(plan, cost_model)
    ranks = [r for r, ids in enumerate(plan.schedule) if ids]
    runs = _pipeline_runs(plan, cost_model, duration, sends)
    first = [first_order_bubble([duration[i] for i in plan.schedule[r]], plan.pp_size).bubble_rate for r in ranks]
    return float(np.mean([runs[r].bubble_rate for r in ranks])), float(np.mean(first))


def busy_times(timeline: Timeline) -> np.ndarray:
    """Seconds each rank spent in micro-batches (no idling, no all-reduce)."""
    busy = np.zeros(timeline.world_size)
    for s in timeline.spans:
        if s.kind in ("packed", "shared"):
            busy[s.rank] += s.end - s.start
    return busy


def lower_bound(lens: np.ndarray, world_size: int, capacity: int, cost_model: CostModel) -> float:
    """No plan is faster than max(total work / ranks, heaviest sequence's share).

    The share is the least time the heaviest sequences can take on any group size from D(s) up and any u × r
    split of it, by the planner's and simulator's one model of a group's time (`group_size.fastest_groups`,
    every size tried): compute split d ways, the ring's P2P and the all-to-alls at the best placement's
    bandwidth, without offloading (which only adds). Plus one micro-batch's fixed cost (a rank with work runs
    at least one), the gradient all-reduce and the optimizer step, which every plan pays after its last
    micro-batch (unpipelined: pp 1, TP as the hardware's).
    """
    if lens.size == 0:
        return 0.0
    work = cost_model.seq_time(lens)
    heaviest = np.argsort(-work)[:64]
    min_ranks, _ = cost_model.ranks_and_ratio(lens[heaviest], capacity)
    fastest = fastest_groups(
        cost_model, lens[heaviest], work[heaviest], world_size, min_ranks, sp=SP_AUTO, exhaustive=True
    )
    share = float(fastest.seconds.max())
    sync = cost_model.allreduce_time() if world_size > 1 else 0.0
    optimizer = cost_model.optimizer_time(world_size * cost_model.hardware.tp_size)
    return max(float(work.sum()) / world_size, share) + cost_model.micro_batch_overhead + sync + optimizer


DIRECT_EXCHANGE_SHARE = 0.75
"""Of the relay ring's bytes, what the direct exchange sends under a causal mask. Rank i of N holds zigzag
chunks i and 2N-1-i; rank j's queries read both of them when j > i and only chunk i when j < i (chunk
2N-1-i comes after both of j's), so the N(N-1) pairs move 1.5 N(N-1) chunks where a relay ring moves
2 N(N-1). Step time is unchanged: at every step some rank still sends both of its chunks."""


def p2p_bytes(plan: Plan, cost_model: CostModel) -> float:
    """Ring bytes all ranks send in the step (what `StepStats.p2p_bytes` measures): the cost model's relay
    count (`CostModel.ring_bytes`, for a u × r split `CostModel.split_ring_bytes`) times
    `DIRECT_EXCHANGE_SHARE`. The all-to-alls of Ulysses splits are `ulysses_bytes`."""
    relay = 0.0
    for m in plan.micro_batches:
        d = len(m.ranks)
        if d > 1 and m.ulysses == 1:
            relay += d * float(cost_model.ring_bytes(m.tokens_per_rank, d))
        elif d > 1:
            virtual = local_tokens([plan.sequences[i] for i in m.sequences], m.ring)
            relay += d * float(cost_model.split_ring_bytes(virtual, m.ulysses, m.ring))
    return float(DIRECT_EXCHANGE_SHARE * relay)


def ulysses_bytes(plan: Plan, cost_model: CostModel) -> float:
    """All-to-all bytes all ranks send in the step's Ulysses splits (`CostModel.ulysses_bytes` per rank)."""
    return float(
        sum(
            len(m.ranks) * float(cost_model.ulysses_bytes(m.tokens_per_rank, m.ulysses))
            for m in plan.micro_batches
            if m.ulysses > 1
        )
    )


def throughput(plan: Plan, timeline: Timeline) -> float:
    """Tokens per second of the simulated step."""
    return float(sum(plan.sequences)) / timeline.step_time if timeline.step_time else 0.0
