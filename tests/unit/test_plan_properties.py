"""Properties of every plan the trainer can run, on random skewed batches, world sizes, capacities, pipelines and
tensor-parallel groups, for each strategy a `Runtime` plans with (balance, naive, static, auto, and the unsharded
plan of a model with a shard blocker):

1. the plan validates (`Plan.validate`), and the planner refuses a batch exactly when `length_limit` flags it;
2. the inputs the runtime builds from it (`build_micro_batch`) hold every token of the batch exactly once, at its
   position;
3. no rank holds more tokens in a micro-batch than C, or the capacity its offload ratio allows (a ring may round
   each sequence up by two tokens at most, the slack `Plan.validate` allows);
4. the simulator times the ops the executor runs, in the executor's order: each rank's micro-batches, each
   pipeline stage's forwards and backwards, and the ranks of each ring;
5. the executor never deadlocks on a plan the checker accepts: an op-level model of every process of the job
   (below) runs to the end with every message and collective matched; and with one rank's schedule reordered, it
   runs exactly when the checker accepts the reordered plan.

The executor model. Each process of the (pp, hdp, tp) mesh is a list of ops in the order the executor issues them:
its micro-batches in `plan.micro_batches_of` order without pipelines, or its stage's F and B in
`PipelineExecutor._ops` order with them; per layer the ring's P2P (recorded from the runtime's own ring attention
under a recording stand-in for `torch.distributed`) and the TP group's all-reduces; the stage-to-stage sends
(posted, waited at the end of the step) and blocking receives; then the step's gradient sum, figures and norm.
Ranks run with blocking matching semantics: the k-th send from a to b meets the k-th receive of b from a (in-order
P2P matching) and both must name the same message, a wait blocks until its messages have met, and a collective
blocks until its whole group is at it, naming the same collective.

The default run keeps to small meshes and 40 examples a strategy (a few seconds);
`test_plans_keep_the_executor_contract_at_length` (slow) runs every property on more and larger cases. The tests at
the end show the model is not vacuous: schedules the checker rejects deadlock or cross their messages in it.
"""

from __future__ import annotations

import functools
import types
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple
from unittest.mock import patch

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bytescale_compile.engine.batch import build_micro_batch, num_targets
from bytescale_compile.engine.mesh import TrainMesh
from bytescale_compile.engine.pipeline import PipelineExecutor
from bytescale_compile.engine.stages import StageSpec
from bytescale_compile.planner import CostModel, Hardware, MicroBatch, Plan, PlanError, length_limit, plan
from bytescale_compile.planner.pipeline_order import stage_order
from bytescale_compile.planner.plan import capacity_for_ratio, local_tokens
from bytescale_compile.runtime import p2p, ring_attention
from bytescale_compile.runtime.layout import zigzag_layout
from bytescale_compile.sim import pipeline as sim_pipeline
from bytescale_compile.sim import simulator
from bytescale_compile.sim.simulator import simulate, step_time

UNSHARDED = "unsharded"
"""Any strategy once the model has a shard blocker: every sequence alone on one rank."""
STRATEGIES = ("balance", "naive", "static", "auto", UNSHARDED)
BLOCKER = "an attention the ring cannot run"
HARDWARE = ((None, 1), ("l20", 1), ("l20", 2), ("l20", 4), ("h100-nvlink", 2), ("h100-nvlink", 8))
"""(hardware preset, TP size): an HDP rank of one device without a topology, or TP groups on the paper's servers."""
LAYERS_PER_STAGE = 1
"""Attention layers each stage runs in the executor model: more repeat the same ring and all-reduces."""
FAST = settings(max_examples=40)
SLOW = settings(max_examples=150)


@functools.cache
def _cost(hardware: str | None, tp: int) -> CostModel:
    return CostModel.preset("llama-7b", Hardware.preset(hardware, tp) if hardware else None)


# --- cases -----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One batch and job: what `Runtime.plan` passes to `plan()`."""

    lengths: tuple[int, ...]
    world: int
    capacity: int
    pp: int
    hardware: str | None
    tp: int
    strategy: str

    @property
    def cost(self) -> CostModel:
        return _cost(self.hardware, self.tp)

    def plan(self) -> Plan:
        """The plan the trainer would run, as `Runtime.plan` asks for it."""
        unsharded = self.strategy == UNSHARDED
        return plan(
            list(self.lengths),
            world_size=self.world,
            capacity=self.capacity,
            cost_model=self.cost,
            strategy="balance" if unsharded else self.strategy,
            pp_size=self.pp,
            shard_blockers=(BLOCKER,) if unsharded else (),
            step_time=step_time,
        )

    def too_long(self) -> np.ndarray:
        """The sequences `length_limit` says no plan of this case holds."""
        unsharded = self.strategy == UNSHARDED
        return length_limit(
            list(self.lengths),
            world_size=self.world,
            capacity=self.capacity,
            cost_model=self.cost,
            strategy="balance" if unsharded else self.strategy,
            pp_size=self.pp,
            shard_blockers=(BLOCKER,) if unsharded else (),
        ).too_long


def _cases(
    strategy: str, max_world: int, max_sequences: int, capacities: tuple[int, ...], max_tp: int
) -> st.SearchStrategy[Case]:
    """Skewed batches: mostly short sequences, some up to C, some longer than C (up to the whole cluster's W x C),
    and in about one batch of five one past W x C, which only offloading can hold (or nothing can)."""

    @st.composite
    def cases(draw: st.DrawFn) -> Case:
        world = draw(st.integers(1, max_world))
        capacity = draw(st.sampled_from(capacities))
        short = st.integers(1, capacity // 4)
        medium = st.integers(capacity // 4, capacity)
        # a model with a shard blocker runs nothing longer than C: the rare huge sequence below shows its refusal
        long = medium if strategy == UNSHARDED else st.integers(capacity + 1, max(world, 2) * capacity)
        lengths = draw(st.lists(st.one_of(*[short] * 6, *[medium] * 3, long, long), min_size=1, max_size=max_sequences))
        if draw(st.integers(0, 4)) == 0:
            lengths.insert(
                draw(st.integers(0, len(lengths))), draw(st.integers(world * capacity, 3 * world * capacity))
            )
        hw, tp = draw(st.sampled_from([(hw, tp) for hw, tp in HARDWARE if tp <= max_tp]))
        return Case(tuple(lengths), world, capacity, draw(st.integers(1, 4)), hw, tp, strategy)

    return cases()


def _planned(case: Case) -> Plan | None:
    """The case's plan, or None where the planner refuses the batch, which it must do exactly when a sequence is
    too long for every plan of the case (property 1's second half)."""
    too_long = case.too_long()
    try:
        result = case.plan()
    except PlanError as e:
        assert too_long.size, f"refused a batch length_limit accepts: {e}"
        return None
    assert not too_long.size, f"planned sequences {too_long.tolist()} that length_limit says no plan holds"
    return result


# --- 1 to 3: validation, tokens, capacity ----------------------------------------------------------------------------


def _check_validates(p: Plan, case: Case) -> None:
    p.validate()
    assert p.sequences == list(case.lengths)
    assert (p.world_size, p.capacity, p.pp_size) == (case.world, case.capacity, case.pp)


def _check_tokens_and_capacity(p: Plan) -> None:
    """Build every rank's inputs of every micro-batch as the executor does, from a batch whose token ids are their
    own global indices: each id must come out exactly once, at its position in its sequence, and no rank may hold
    more than its capacity. Offloading r raises C to the capacity Eq. 2 allows (`capacity_for_ratio`). A packed
    micro-batch holds at most that, and at most C without offloading; so does a ring of one sequence without
    offloading (zigzag gives its fullest rank ceil(s / D) tokens, and s <= D x C). Otherwise a ring may hold up to
    two tokens a sequence more, the slack `Plan.validate` allows: Eq. 2 sizes r for s / D tokens a rank, the
    fullest rank holds ceil(s / D), and a row of several sequences (static's) rounds each one up."""
    lengths = np.asarray(p.sequences, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)])

    def read(seq: int, start: int, end: int) -> torch.Tensor:
        return torch.arange(int(starts[seq]) + start, int(starts[seq]) + end)

    seen = np.zeros(int(starts[-1]), dtype=np.int64)
    num_items = num_targets(lengths)
    for mb in p.micro_batches:
        held = []
        for rank in mb.ranks:
            inputs = build_micro_batch(mb, rank, lengths, read, num_items)
            ids = inputs.input_ids[0].numpy()
            seq_of = np.searchsorted(starts, ids, side="right") - 1
            assert set(seq_of.tolist()) <= set(mb.sequences), f"micro-batch {mb.id} reads another's sequence"
            assert np.array_equal(ids - starts[seq_of], inputs.position_ids[0].numpy())
            np.add.at(seen, ids, 1)
            held.append(ids.size)
        assert max(held) == mb.tokens_per_rank, (
            f"micro-batch {mb.id}: ranks hold {held}, plan says {mb.tokens_per_rank}"
        )
        limit = capacity_for_ratio(p.capacity, mb.offload_ratio, p.layers_per_rank)
        slack = 2 * len(mb.sequences) if mb.shared else 0
        assert max(held) <= limit + slack, f"micro-batch {mb.id} holds {max(held)} tokens on a rank, over {limit}"
        if mb.offload_ratio == 0 and (len(mb.sequences) == 1 or not mb.shared):
            assert max(held) <= p.capacity, f"micro-batch {mb.id} holds {max(held)} tokens on a rank, over C"
    twice = np.flatnonzero(seen != 1)
    assert not twice.size, f"token {twice[0]} is run {seen[twice[0]]} times"


# --- 4: the simulator's order against the executor's -----------------------------------------------------------------


def _executor_order(p: Plan, mesh: TrainMesh) -> list[tuple[str, MicroBatch]]:
    """The (F or B, micro-batch) ops global rank `mesh.rank` runs, in order, from the executors' own code:
    `WholeModelExecutor.forward_backward` runs `plan.micro_batches_of(rank)`, each forward then backward;
    `PipelineExecutor._ops` gives a stage's 1F1B order (an executor built without its process groups, which
    `_ops` does not read)."""
    if p.pp_size == 1:
        return [(kind, mb) for mb in p.micro_batches_of(mesh.hdp_rank) for kind in "FB"]
    executor = object.__new__(PipelineExecutor)
    executor.spec = StageSpec(mesh.stage, p.pp_size, range(0))
    executor.hdp_rank = mesh.hdp_rank
    mine, order = executor._ops(p)
    return [(kind, mine[k]) for kind, k in order]


@dataclass
class _Simulated:
    """What `simulate` timed: each HDP rank's micro-batch spans by start, and with pipelines each (HDP rank,
    stage)'s F and B ops in the order its 1F1B run timed them (micro-batch ids)."""

    spans: dict[int, list[Any]] = field(default_factory=lambda: defaultdict(list))
    stage_ops: dict[tuple[int, int], list[tuple[str, int]]] = field(default_factory=dict)


def _simulated(p: Plan, cost: CostModel) -> _Simulated:
    """Run `simulate` with spies on the 1F1B runs it starts (one per HDP rank, in rank order) and on the
    `stage_order` each run takes its stages' op orders from."""
    runs: list[list[list[tuple[str, int]]]] = []

    def run_spy(*args: Any, **kwargs: Any) -> sim_pipeline.PipelineRun:
        runs.append([])
        return sim_pipeline.one_f_one_b(*args, **kwargs)

    def order_spy(*args: Any, **kwargs: Any) -> list[tuple[str, int]]:
        order = stage_order(*args, **kwargs)
        runs[-1].append(order)
        return order

    with patch.object(simulator, "one_f_one_b", run_spy), patch.object(sim_pipeline, "stage_order", order_spy):
        timeline = simulate(p, cost)
    out = _Simulated()
    for span in sorted(timeline.spans, key=lambda s: (s.start, s.end)):
        if span.kind in ("packed", "shared"):
            out.spans[span.rank].append(span)
    if p.pp_size > 1:
        assert len(runs) == p.world_size
        for rank, stages in enumerate(runs):
            ids = p.schedule[rank]
            assert len(stages) == (p.pp_size if ids else 0)  # an empty pipeline times nothing
            for stage, order in enumerate(stages):
                out.stage_ops[rank, stage] = [(kind, ids[j]) for kind, j in order]
    return out


def _check_orders_agree(p: Plan, case: Case, ops: dict[int, list[Op]]) -> None:
    """The micro-batches each rank runs and their order, each stage's F/B order, and the ranks that meet in each
    ring: as simulated, and as the executor (and its op-level model, `ops`) runs them."""
    sim = _simulated(p, case.cost)
    for rank in range(p.world_size):
        mesh = TrainMesh(p.pp_size, p.world_size, case.tp, rank * case.tp)  # stage 0, TP index 0
        forwards = [mb.id for kind, mb in _executor_order(p, mesh) if kind == "F"]
        assert [s.micro_batch for s in sim.spans[rank]] == forwards, f"rank {rank}"
        for stage in range(p.pp_size if p.pp_size > 1 else 0):
            mesh = TrainMesh(p.pp_size, p.world_size, case.tp, (stage * p.world_size + rank) * case.tp)
            executed = [(kind, mb.id) for kind, mb in _executor_order(p, mesh)]
            assert sim.stage_ops.get((rank, stage), []) == executed, f"rank {rank} stage {stage}"
    starts: dict[int, set[float]] = defaultdict(set)
    met: dict[int, set[int]] = defaultdict(set)
    for rank, spans in sim.spans.items():
        for s in spans:
            starts[s.micro_batch].add(s.start)
            met[s.micro_batch].add(rank)
    ring_ranks = _ring_members(p, case.tp, ops)
    for mb in p.micro_batches:
        assert len(starts[mb.id]) == 1, f"micro-batch {mb.id}'s ranks start it at different times"
        assert met[mb.id] == set(mb.ranks)
        if mb.shared:
            assert ring_ranks[mb.id] == set(mb.ranks)
        else:
            assert mb.id not in ring_ranks


def _ring_members(p: Plan, tp: int, ops: dict[int, list[Op]]) -> dict[int, set[int]]:
    """Per micro-batch, the HDP ranks whose processes post its ring P2P in the executor model's `ops`, each to a
    peer at its own stage and TP index (`Executor.in_mesh`)."""
    members: dict[int, set[int]] = defaultdict(set)
    for rank, rank_ops in ops.items():
        me = TrainMesh(p.pp_size, p.world_size, tp, rank)
        for op in rank_ops:
            if isinstance(op, Post) and op.tag[0] == "ring":
                peer = TrainMesh(p.pp_size, p.world_size, tp, op.peer)
                assert (peer.stage, peer.tp_rank) == (me.stage, me.tp_rank), f"ring from {rank} to {op.peer}"
                members[op.tag[1]].update((me.hdp_rank, peer.hdp_rank))
    return members


# --- 5: the op-level executor model ----------------------------------------------------------------------------------

Tag = tuple[Any, ...]


class Post(NamedTuple):
    """A non-blocking isend or irecv (`batch_isend_irecv`, `dist.isend`); a `Wait` names it by `handle`."""

    kind: Literal["send", "recv"]
    peer: int
    tag: Tag
    handle: int


class Wait(NamedTuple):
    """Block until every posted message of `handles` has met its counterpart."""

    handles: tuple[int, ...]


class Collective(NamedTuple):
    """A blocking collective (all-reduce) over the process group `group`."""

    group: tuple[int, ...]
    tag: Tag


Op = Post | Wait | Collective


@dataclass
class Outcome:
    """How `run_ranks` ended."""

    stuck: dict[int, Op]
    """The op each process that never finished waits at."""
    mismatches: list[str]
    """Messages or collectives that met a counterpart naming something else (wrong data, or a hang on a
    backend that checks sizes)."""

    @property
    def finished(self) -> bool:
        return not self.stuck and not self.mismatches


def run_ranks(ops: dict[int, list[Op]]) -> Outcome:
    """Run every process's ops until none can move. A post never blocks, but a message counts as delivered only
    once its counterpart is posted too (a synchronous send: the strictest a backend may be), the k-th send on a
    channel meeting its k-th receive; a wait blocks until its messages are delivered; a collective blocks until
    every rank of its group is at one of that group."""
    heads = dict.fromkeys(ops, 0)
    met: dict[int, set[int]] = {r: set() for r in ops}
    unmatched: dict[tuple[int, int, str], deque[tuple[Tag, int]]] = defaultdict(deque)
    arrived: dict[tuple[int, ...], dict[int, Tag]] = defaultdict(dict)
    mismatches: list[str] = []
    ready = deque(ops)
    while ready:
        rank = ready.popleft()
        while heads[rank] < len(ops[rank]):
            op = ops[rank][heads[rank]]
            if isinstance(op, Post):
                channel = (rank, op.peer) if op.kind == "send" else (op.peer, rank)
                other = "recv" if op.kind == "send" else "send"
                if unmatched[(*channel, other)]:
                    tag, handle = unmatched[(*channel, other)].popleft()
                    if tag != op.tag:
                        mismatches.append(f"{channel[0]} -> {channel[1]}: {op.kind} {op.tag} met {other} {tag}")
                    met[rank].add(op.handle)
                    met[op.peer].add(handle)
                    ready.append(op.peer)
                else:
                    unmatched[(*channel, op.kind)].append((op.tag, op.handle))
            elif isinstance(op, Wait):
                if not met[rank].issuperset(op.handles):
                    break
            else:
                waiting = arrived[op.group]
                waiting[rank] = op.tag
                if len(waiting) < len(op.group):
                    break
                if len(set(waiting.values())) > 1:
                    mismatches.append(f"group {list(op.group)} ran different collectives: {waiting}")
                for other_rank in op.group:
                    if other_rank != rank:
                        heads[other_rank] += 1
                        ready.append(other_rank)
                del arrived[op.group]
            heads[rank] += 1
    stuck = {r: ops[r][heads[r]] for r in ops if heads[r] < len(ops[r])}
    return Outcome(stuck, mismatches)


RingEvent = tuple[str, int, int]
"""("send" or "recv", peer's index in the group, elements) for a post; ("wait", index of the post, 0)."""


class _RecordingDist:
    """What ring attention calls of `torch.distributed`, recording posts and waits instead of communicating. A
    receive gets a same-shaped tensor the call sends (the descriptor exchange, which every rank sends alike, then
    parses), else zeros."""

    isend, irecv = "send", "recv"

    def __init__(self, index: int, size: int) -> None:
        self.index, self.size = index, size
        self.events: list[RingEvent] = []

    def is_initialized(self) -> bool:
        return True

    def get_rank(self) -> int:
        return self.index

    def get_world_size(self) -> int:
        return self.size

    def get_backend(self) -> str:
        return "gloo"

    @staticmethod
    def P2POp(kind: str, tensor: torch.Tensor, peer: int) -> tuple[str, torch.Tensor, int]:  # noqa: N802
        return kind, tensor, peer

    def batch_isend_irecv(self, ops: list[tuple[str, torch.Tensor, int]]) -> list[Any]:
        sent = [t for kind, t, _ in ops if kind == "send"]
        works = []
        for kind, tensor, peer in ops:
            source = next((s for s in sent if s.shape == tensor.shape), None)
            if kind == "recv" and source is not None:
                tensor.copy_(source)
            elif kind == "recv":
                tensor.zero_()
            works.append(types.SimpleNamespace(wait=functools.partial(self._wait, len(self.events))))
            self.events.append((kind, peer, tensor.numel()))
        return works

    def _wait(self, post: int, timeout: object = None) -> None:
        self.events.append(("wait", post, 0))


@functools.cache
def ring_events(size: int, index: int) -> tuple[tuple[RingEvent, ...], tuple[RingEvent, ...]]:
    """The P2P posts and waits of group rank `index` in one ring attention of `size` ranks, forward and backward,
    recorded from `ring_attention.packed_ring_attention` itself on one sequence of 4 x size tokens (every zigzag
    chunk non-empty, so every pair exchanges something: a sequence shorter than 2 x size tokens would skip
    some transfers, on both sides alike)."""
    layout = zigzag_layout([4 * size], size)
    tokens = layout.rank(index).num_tokens
    q, k, v = (torch.ones(tokens, 1, 2, requires_grad=True) for _ in range(3))
    recorder = _RecordingDist(index, size)
    with patch.object(p2p, "dist", recorder):
        out = ring_attention.packed_ring_attention(q, k, v, layout, tuple(range(size)))
        forward = len(recorder.events)
        out.sum().backward()
    backward = [(kind, at - forward if kind == "wait" else at, n) for kind, at, n in recorder.events[forward:]]
    return tuple(recorder.events[:forward]), tuple(backward)


class _Process:
    """One process's ops as the executor issues them, with fresh handles for its posts."""

    def __init__(self, mesh: TrainMesh) -> None:
        self.mesh = mesh
        self.ops: list[Op] = []
        self.pending_sends: list[int] = []

    def post(self, kind: Literal["send", "recv"], peer: int, tag: Tag) -> int:
        self.ops.append(Post(kind, peer, tag, len(self.ops)))
        return len(self.ops) - 1

    def receive(self, peer: int, tag: Tag) -> None:
        """`PipelineExecutor._receive`: a blocking header, then a blocking tensor."""
        for part in ("header", "tensor"):
            self.ops.append(Wait((self.post("recv", peer, (*tag, part)),)))

    def send(self, peer: int, tag: Tag) -> None:
        """`PipelineExecutor._send`: header and tensor posted, waited at the end of the step."""
        self.pending_sends += [self.post("send", peer, (*tag, part)) for part in ("header", "tensor")]

    def ring(self, mb: MicroBatch, layer: int, direction: str) -> None:
        """One ring attention of `mb` (`ring_events`), among the processes of its HDP ranks at this stage and TP
        index (`Executor.in_mesh`)."""
        group = [self.mesh.global_rank(r) for r in mb.ranks]
        forward, backward = ring_events(len(group), mb.ranks.index(self.mesh.hdp_rank))
        handles: dict[int, int] = {}
        for i, (kind, peer, elements) in enumerate(forward if direction == "F" else backward):
            if kind == "wait":
                self.ops.append(Wait((handles[peer],)))
            else:
                tag = ("ring", mb.id, self.mesh.stage, layer, direction, elements)
                handles[i] = self.post("send" if kind == "send" else "recv", group[peer], tag)

    def tp_all_reduce(self, mb: MicroBatch, layer: int, what: str) -> None:
        """A Megatron all-reduce of the hidden state over this process's TP group (none at TP 1)."""
        if self.mesh.tp > 1:
            first = self.mesh.rank - self.mesh.tp_rank
            self.ops.append(Collective(tuple(range(first, first + self.mesh.tp)), ("tp", mb.id, layer, what)))

    def layers(self, mb: MicroBatch, direction: str) -> None:
        """The stage's layers: attention (a ring when shared) then MLP forward, MLP then attention backward."""
        layers = range(LAYERS_PER_STAGE) if direction == "F" else reversed(range(LAYERS_PER_STAGE))
        for layer in layers:
            if direction == "B":
                self.tp_all_reduce(mb, layer, "mlp backward")
            if mb.shared:
                self.ring(mb, layer, direction)
            self.tp_all_reduce(mb, layer, "attention" if direction == "F" else "attention backward")
            if direction == "F":
                self.tp_all_reduce(mb, layer, "mlp")

    def step(self, order: list[tuple[str, MicroBatch]]) -> None:
        """The executor's F and B ops, then the Runtime's gradient sum (the HDP ranks of this stage and TP index),
        with pipelines or TP the gradient norm's all-reduce, the flag of a non-finite loss (every process, with
        several) and last the figures (every process)."""
        mesh, first, last = self.mesh, self.mesh.stage == 0, self.mesh.stage == self.mesh.pp - 1
        stride = mesh.hdp * mesh.tp
        for kind, mb in order:
            if kind == "F":
                if not first:
                    self.receive(mesh.rank - stride, ("hidden", mb.id, mesh.stage - 1))
                self.layers(mb, "F")
                if not last:
                    self.send(mesh.rank + stride, ("hidden", mb.id, mesh.stage))
            else:
                if not last:
                    self.receive(mesh.rank + stride, ("gradient", mb.id, mesh.stage))
                self.layers(mb, "B")
                if not first:
                    self.send(mesh.rank - stride, ("gradient", mb.id, mesh.stage - 1))
        if self.pending_sends:
            self.ops.append(Wait(tuple(self.pending_sends)))
        world = tuple(range(mesh.pp * mesh.hdp * mesh.tp))
        self.ops.append(Collective(tuple(mesh.global_rank(r) for r in range(mesh.hdp)), ("gradients",)))
        if mesh.pp > 1:
            self.ops.append(Collective(world, ("gradient norm",)))
        elif mesh.tp > 1:
            first_of_group = mesh.rank - mesh.tp_rank
            self.ops.append(Collective(tuple(range(first_of_group, first_of_group + mesh.tp)), ("gradient norm",)))
        if len(world) > 1:
            self.ops.append(Collective(world, ("non-finite loss",)))
        self.ops.append(Collective(world, ("figures",)))


Order = Callable[[Plan, TrainMesh], list[tuple[str, MicroBatch]]]


def executor_ops(p: Plan, tp: int, order: Order = _executor_order) -> dict[int, list[Op]]:
    """Every process's ops for one training step of `p` on pp x hdp x tp processes (`TrainMesh`'s layout)."""
    processes = {}
    for rank in range(p.pp_size * p.world_size * tp):
        process = _Process(TrainMesh(p.pp_size, p.world_size, tp, rank))
        process.step(order(p, process.mesh))
        processes[rank] = process.ops
    return processes


def _accepts(p: Plan) -> bool:
    try:
        p.validate()
    except PlanError:
        return False
    return True


def _check_never_deadlocks(ops: dict[int, list[Op]]) -> None:
    outcome = run_ranks(ops)
    assert outcome.finished, f"stuck at {dict(list(outcome.stuck.items())[:4])}; mismatched {outcome.mismatches[:2]}"


def _check_reordering(p: Plan, tp: int, rank: int, order: list[int]) -> None:
    """One rank's schedule reordered: the checker must accept it exactly when the executor model finishes it."""
    schedule = [list(ids) for ids in p.schedule]
    schedule[rank] = order
    reordered = Plan(
        p.strategy, p.world_size, p.capacity, p.pp_size, p.sequences, p.micro_batches, schedule, p.layers_per_rank
    )
    assert _accepts(reordered) == run_ranks(executor_ops(reordered, tp)).finished, (schedule, p.pp_size, tp)


# --- the tests -------------------------------------------------------------------------------------------------------


def _check_all(case: Case, data: st.DataObject) -> None:
    """Every property on one case; one rank's schedule reordered as `data` draws it."""
    p = _planned(case)
    if p is None:
        return
    _check_validates(p, case)
    _check_tokens_and_capacity(p)
    ops = executor_ops(p, case.tp)
    _check_orders_agree(p, case, ops)
    _check_never_deadlocks(ops)
    rank = data.draw(st.sampled_from([r for r, ids in enumerate(p.schedule) if ids]))
    _check_reordering(p, case.tp, rank, data.draw(st.permutations(p.schedule[rank])))


@pytest.mark.parametrize("strategy", STRATEGIES)
@FAST
@given(data=st.data())
def test_plans_keep_the_executor_contract(strategy: str, data: st.DataObject) -> None:
    _check_all(data.draw(_cases(strategy, max_world=6, max_sequences=16, capacities=(256, 1024), max_tp=4)), data)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
@SLOW
@given(data=st.data())
def test_plans_keep_the_executor_contract_at_length(strategy: str, data: st.DataObject) -> None:
    _check_all(
        data.draw(_cases(strategy, max_world=16, max_sequences=60, capacities=(256, 1024, 4096), max_tp=8)), data
    )


# --- the model is not vacuous ----------------------------------------------------------------------------------------


def _hand_plan(ranks_of: list[list[int]], schedule: list[list[int]], pp: int = 1, length: int = 100) -> Plan:
    """Micro-batch i holds sequence i (`length` tokens) on ranks `ranks_of[i]`; `schedule[r]` is rank r's order."""
    held = [local_tokens([length], len(r)) for r in ranks_of]
    mbs = [MicroBatch(i, tuple(r), (i,), 0.0, held[i], 1.0) for i, r in enumerate(ranks_of)]
    return Plan("balance", len(schedule), 8192, pp, [length] * len(mbs), mbs, schedule)


@pytest.mark.parametrize("tp", [1, 2])
def test_three_rings_waiting_in_a_cycle_deadlock(tp: int) -> None:
    """Rings A on ranks {0, 1}, B on {1, 2}, C on {0, 2}, each rank running its two in a different order: every
    rank waits at a ring another never reaches. Nothing mismatches; everyone is stuck."""
    cyclic = _hand_plan([[0, 1], [1, 2], [0, 2]], [[0, 2], [1, 0], [2, 1]])
    assert not _accepts(cyclic)
    outcome = run_ranks(executor_ops(cyclic, tp))
    assert len(outcome.stuck) == 3 * tp and not outcome.mismatches
    assert all(isinstance(op, Wait) for op in outcome.stuck.values())
    _check_never_deadlocks(executor_ops(_hand_plan([[0, 1], [1, 2], [0, 2]], [[0, 2], [0, 1], [1, 2]]), tp))


def test_two_ranks_running_their_rings_in_swapped_order_fail() -> None:
    swapped = _hand_plan([[0, 1], [0, 1]], [[0, 1], [1, 0]])
    assert not _accepts(swapped)
    outcome = run_ranks(executor_ops(swapped, 1))
    assert outcome.mismatches and not outcome.finished


def test_plain_1f1b_deadlocks_pipelines_that_stage_order_runs() -> None:
    """Pipelines 0 and 1 share A and B; pipeline 1 runs its own P between them. Under plain 1F1B (one warm-up
    forward on stage 0 of 2) pipeline 0's stage 0 runs F(A) F(B) B(A) and pipeline 1's F(A) F(P) B(A) F(B): their
    rings of F(B) and B(A) meet each other, so messages of one micro-batch reach a rank expecting the other's. The
    model must catch that, and run the executor's own `stage_order` through."""
    apart = _hand_plan([[0, 1], [0, 1], [1], [0]], [[0, 1, 3], [0, 2, 1]], pp=2)

    def plain_1f1b(p: Plan, mesh: TrainMesh) -> list[tuple[str, MicroBatch]]:
        mine = p.micro_batches_of(mesh.hdp_rank)
        warmup = min(p.pp_size - mesh.stage - 1, len(mine))
        steady = [op for k in range(warmup, len(mine)) for op in (("F", k), ("B", k - warmup))]
        order = [("F", k) for k in range(warmup)] + steady + [("B", j) for j in range(len(mine) - warmup, len(mine))]
        return [(kind, mine[k]) for kind, k in order]

    assert _accepts(apart)
    _check_never_deadlocks(executor_ops(apart, 1))
    outcome = run_ranks(executor_ops(apart, 1, plain_1f1b))
    assert outcome.mismatches and not outcome.finished


def test_ring_events_pair_every_send_with_the_peers_receive() -> None:
    """Within one ring, the posts the runtime records on each rank meet their peers' in order and size: the
    in-order matching the executor model relies on, checked on the recorded ring alone."""
    for size in range(2, 6):
        ring = _hand_plan([list(range(size))], [[0]] * size).micro_batches[0]
        ops: dict[int, list[Op]] = {}
        for index in range(size):
            process = _Process(TrainMesh(1, size, 1, index))
            process.ring(ring, 0, "F")
            process.ring(ring, 0, "B")
            ops[index] = process.ops
        assert run_ranks(ops).finished


# --- what the properties found ---------------------------------------------------------------------------------------


def test_a_static_row_shorter_than_its_cp_group_runs_on_a_rank_per_token() -> None:
    """Found by the properties: static sharded a row of one 1-token sequence over its CP group of 2, and the
    zigzag layout left the second rank without a token (`build_micro_batch` raised). The row now runs on one rank,
    and `validate` rejects a plan that leaves a ring's rank empty."""
    static = Case((512, 1), 2, 256, 1, None, 1, "static").plan()
    assert [m.ranks for m in static.micro_batches] == [(0, 1), (0,)]
    _check_tokens_and_capacity(static)
    with pytest.raises(PlanError, match="ranks from 1 on without a token"):
        _hand_plan([[0, 1]], [[0], [0]], length=1).validate()
