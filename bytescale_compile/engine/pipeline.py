"""The 1F1B pipeline executor: a step's forwards and backwards of an HDP plan with `pp_size > 1` on one stage
rank (ByteScale's PP inside each HDP rank, whose pipelines may run different numbers of micro-batches: the
paper's "Solve PP Imbalance"), the `Executor` (`engine/executor.py`) a `Runtime` holds for a stage. The Runtime
plans, then sums the stage's gradients over `sync_group`, clips to the norm over all stages and steps the
optimizer.

The job has `hdp * pp` processes, stage-major: global rank `g` runs stage `g // hdp` of pipeline (HDP rank)
`g % hdp`, so its previous stage is `g - hdp` and its next `g + hdp`. Every stage rank of pipeline `i` runs
the micro-batches of `plan.schedule[i]` in `stage_order` — the one order `Plan.validate()` proves
deadlock-free, also the simulator's — with blocking receives and non-blocking sends:

- F(k): a stage after the first receives the previous stage's hidden states
  `[1, tokens this rank holds, hidden]` (a small header first, so a wrong micro-batch or shape is an error,
  not a hang or garbage), runs its stage under the micro-batch's context, the act_ctx and autocast, and sends
  the output on; the last stage adds its loss to the step's, on the device.
- B(k): the last stage back-propagates its loss, the others the gradient received from the next stage, both
  under the same contexts again (ring attention's backward reads the micro-batch's, the offloaded
  activations come back through the act_ctx); a stage after the first sends its input's gradient back.

Every micro-batch's inputs are built and copied to the device at the start of the step (`Executor.device_inputs`),
and a stage rank is busy from the end of an op's receive to the end of its compute (a `Stopwatch`'s spans): nothing
but the receives' headers waits for the device between micro-batches.

A micro-batch shared by several pipelines runs ring attention among the stage's global ranks of those
pipelines. Each stage offloads the plan's share r of its own micro-batches' saved activations (several are
in flight under 1F1B: the act_ctx keys them by micro-batch). Evaluation runs the same order's forwards only.

`torch.distributed.pipelining` is not used: its stages infer one activation shape from the first
micro-batch and receive every micro-batch into buffers of that shape, its schedules take a fixed number of
equal micro-batches split from one batch tensor, and they have no per-micro-batch hook for the ring
context; ByteScale's micro-batches differ in length and count per pipeline, and shared ones must meet in
`stage_order`.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..api import OptimizedModule
from ..planner.pipeline_order import Op, chained_micro_batches, stage_order
from ..planner.plan import MicroBatch, Plan, PlanError
from ..runtime.context import MicroBatchContext, micro_batch
from ..runtime.offload import ActivationContext, get_act_ctx
from ..runtime.p2p import P2PStats
from .batch import BatchLike, MicroBatchInputs, ModelProtocolError, RankWork, Stopwatch
from .collectives import grad_square_sum
from .executor import Executor, rank_work
from .mesh import TrainMesh, hdp_group, tp_size_of
from .stages import StageSpec, full_model_name, split_stages, stage_inputs, stage_spec

__all__ = [
    "PipelineExecutor",
    "PipelineSetupError",
    "StageTransferError",
    "check_stage_plan",
    "whole_state",
    "pipeline_stage",
    "stage_group",
]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""Activation dtypes a header can name, by index."""
_Sends = list[tuple[Any, torch.Tensor]]
"""Posted sends with the tensors they read, which must stay alive until sent."""


class PipelineSetupError(ValueError):
    """The processes, the stage module and the plan do not fit together (world size, stage index, pp_size)."""


class StageTransferError(RuntimeError):
    """A stage received a tensor other than the one its schedule expects: the stage ranks disagree on the plan."""


@dataclass
class _InFlight:
    """One micro-batch between its forward and its backward on this stage."""

    context: MicroBatchContext
    received: torch.Tensor | None
    """The previous stage's hidden states (requires grad); None on the first stage."""
    output: torch.Tensor
    """Hidden states for the next stage, or the loss on the last stage."""


@dataclass
class _Tally:
    """This stage rank's running figures of a step."""

    loss: torch.Tensor
    """The last stage's summed loss, float64 on the device (0 on the other stages)."""
    busy: Stopwatch
    stage_bytes: int = 0
    ring: P2PStats = field(default_factory=P2PStats)
    """Ring and mixer bytes this stage rank sent."""

    def count(self, stats: P2PStats, since: P2PStats) -> None:
        """Add what `stats` counted after `since` (a copy taken before)."""
        self.ring.bytes_sent += stats.bytes_sent - since.bytes_sent
        self.ring.mixer_bytes_sent += stats.mixer_bytes_sent - since.mixer_bytes_sent


def pipeline_stage(model: nn.Module, pp_size: int) -> nn.Module:
    """This process's stage of `model` in a job of `pp_size` x HDP processes (stage-major: global rank `g`
    runs stage `g // hdp`); the model itself for `pp_size == 1`. Every rank builds the whole model first."""
    if pp_size == 1:
        return model
    if not dist.is_initialized():
        raise PipelineSetupError(
            f"pp_size {pp_size} needs torch.distributed initialised with pp_size x HDP "
            f"processes (torchrun --nproc_per_node)"
        )
    world = dist.get_world_size()
    if world % pp_size:
        raise PipelineSetupError(
            f"{world} processes cannot hold pipelines of {pp_size} stages: run a multiple of "
            f"{pp_size} processes (pp_size x HDP ranks)"
        )
    return split_stages(model, pp_size)[dist.get_rank() // (world // pp_size)]


def stage_group(spec: StageSpec) -> dist.ProcessGroup:
    """The process group of stage `spec.index`'s HDP ranks, over which its gradients are summed and its ZeRO
    shards live. The first call creates every stage's group, on every rank at once (a collective)."""
    return _stage_groups(dist.get_world_size(), spec.pp_size)[spec.index]


@functools.cache
def _stage_groups(world: int, pp_size: int) -> list[dist.ProcessGroup]:
    hdp = world // pp_size
    return [dist.new_group([s * hdp + r for r in range(hdp)]) for s in range(pp_size)]


def whole_state(model: nn.Module, stage: nn.Module) -> dict[str, torch.Tensor] | None:
    """The whole `model`'s trained tensors on the host, tensor-parallel shards gathered, on global rank 0 (None on
    the others): what a save of the whole model needs. `stage` is this rank's module (`model` itself without
    pipelines). Every rank calls it; the first HDP rank of each stage contributes (its TP group gathers first)."""
    spec = stage_spec(stage)
    plain = getattr(stage, "original_module", stage)
    mesh = TrainMesh.of_world(tp=tp_size_of(plain), pp=spec.pp_size if spec is not None else 1)
    mine: dict[str, torch.Tensor] = {}
    if mesh.hdp_rank == 0:
        tensors = {name: _whole(t).detach().cpu() for name, t in plain.state_dict().items()}
        if mesh.tp_rank == 0:
            mine = {full_model_name(spec, k) if spec is not None else k: t for k, t in tensors.items()}
    if spec is None:
        return mine if mesh.rank == 0 else None
    gathered: list[dict[str, torch.Tensor]] | None = [{} for _ in range(mesh.pp * mesh.hdp * mesh.tp)]
    dist.gather_object(mine, gathered if mesh.rank == 0 else None, dst=0)
    if mesh.rank != 0 or gathered is None:
        return None
    whole = {name: t for tensors in gathered for name, t in tensors.items()}
    unknown, missing = whole.keys() - model.state_dict().keys(), model.state_dict().keys() - whole.keys()
    if unknown or missing:
        raise PipelineSetupError(
            f"the stages' tensors do not make up {type(model).__name__}: not in it {sorted(unknown)[:3]}, "
            f"in no stage {sorted(missing)[:3]}"
        )
    return whole


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel shard gathered over its TP group (a collective), a plain tensor as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def check_stage_plan(plan: Plan, spec: StageSpec, world_size: int, rank: int) -> None:
    """Everything about the plan that can be checked before communicating: raise `PlanError` or
    `PipelineSetupError` on every rank alike, so no rank is left waiting on another."""
    plan.validate()
    _check_fit(plan, spec, world_size, rank)


def _check_fit(plan: Plan, spec: StageSpec, world_size: int, rank: int) -> None:
    """The plan's pipelines, the job's processes and this rank's stage module fit together."""
    if plan.pp_size != spec.pp_size:
        raise PipelineSetupError(
            f"the plan has pp_size {plan.pp_size} but the stage module is stage {spec.index} "
            f"of {spec.pp_size}: split the model with split_stages(model, plan.pp_size)"
        )
    if plan.world_size * plan.pp_size != world_size:
        raise PipelineSetupError(
            f"the plan's {plan.world_size} HDP ranks x pp_size {plan.pp_size} need "
            f"{plan.world_size * plan.pp_size} processes, but the job has {world_size}"
        )
    if rank // plan.world_size != spec.index:
        raise PipelineSetupError(
            f"global rank {rank} runs stage {rank // plan.world_size} (stage-major: rank = "
            f"stage * {plan.world_size} + HDP rank) but holds stage module {spec.index}"
        )


class PipelineExecutor(Executor):
    """`PipelineExecutor(stage, mixed_precision=None)`: the `Executor` of one pipeline stage.

    `stage` is this rank's module from `split_stages(model, pp_size)`, through `optimize()`. Construct it on
    every rank at once: it creates one process group per stage (`stage_group`, a collective call); its
    `sync_group` is this stage's, over which the stage's gradients are summed.
    """

    def __init__(self, stage: OptimizedModule, mixed_precision: torch.dtype | None = None) -> None:
        spec = stage_spec(stage)
        if spec is None:
            raise PipelineSetupError(
                f"{type(stage).__name__} has no StageSpec .spec: pass a module from "
                f"split_stages(model, pp_size), optionally through optimize()"
            )
        if not dist.is_initialized():
            raise PipelineSetupError(
                f"a pipeline of {spec.pp_size} stages needs torch.distributed initialised with "
                f"pp_size x HDP processes (torchrun --nproc_per_node)"
            )
        super().__init__(stage, mixed_precision)
        self.spec, self.pp_size = spec, spec.pp_size
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        tp = stage.tp_layout.size if stage.tp_layout is not None else 1
        if self.world_size % (spec.pp_size * tp):
            raise PipelineSetupError(
                f"{self.world_size} processes cannot hold pipelines of {spec.pp_size} stages of TP groups of {tp}: "
                f"the job needs a multiple of {spec.pp_size * tp}"
            )
        self.mesh = TrainMesh.of_world(tp=tp, pp=spec.pp_size)
        self.hdp = self.mesh.hdp
        if self.mesh.stage != spec.index:
            raise PipelineSetupError(
                f"global rank {self.rank} runs stage {self.mesh.stage} (stage-major, {self.hdp} HDP ranks of "
                f"{tp} TP ranks) but holds stage module {spec.index}"
            )
        self.hdp_rank = self.mesh.hdp_rank
        self.stride = self.hdp * tp
        """Global ranks between a rank and its pipeline neighbour (the same HDP rank and TP index)."""
        self.sync_group = hdp_group(self.mesh) if tp > 1 else stage_group(spec)
        self.hidden_size = int(stage.config.hidden_size)
        self._blockers: list[str] | None = None

    def check(self, plan: Plan, batch: BatchLike) -> None:
        """That a plan its caller validated (the Runtime: `check_stage_plan` less `Plan.validate`, which is
        not cheap at scale and ran already) fits this job and the batch's lengths."""
        _check_fit(plan, self.spec, self.world_size // self.mesh.tp, self.rank // self.mesh.tp)
        lengths = [int(n) for n in np.asarray(batch.lengths)]
        if lengths != plan.sequences:
            raise PlanError(
                f"the plan was made for sequence lengths {plan.sequences[:8]}... but the batch has "
                f"{lengths[:8]}...: plan this batch"
            )

    def forward_backward(self, plan: Plan, batch: BatchLike) -> RankWork:
        """This stage's F and B ops of its pipeline, in `stage_order`; gradients accumulate in `.grad`."""
        self.check(plan, batch)
        mine, order = self._ops(plan)
        act_ctx = self.act_ctx(mine)
        self.model.train()
        tally = self._run(order, mine, batch, act_ctx)
        return rank_work(act_ctx, loss=tally.loss, busy=tally.busy, ring=tally.ring, stage_bytes=tally.stage_bytes)

    def evaluate(self, plan: Plan, batch: BatchLike) -> torch.Tensor:
        """This rank's summed loss of `plan`'s micro-batches (0 before the last stage): the forwards of
        `stage_order` alone, without gradients (dropping the backwards keeps the order deadlock-free)."""
        self.check(plan, batch)
        mine, order = self._ops(plan)
        self.model.eval()
        try:
            with torch.no_grad():
                forwards = [op for op in order if op[0] == "F"]
                return self._run(forwards, mine, batch, get_act_ctx(len(mine), [0.0] * len(mine))).loss
        finally:
            self.model.train()

    def grad_norm(self, params: list[nn.Parameter]) -> torch.Tensor:
        """The 2-norm of the whole model's gradient, over every stage, once each stage's gradients are summed
        over its HDP ranks (its ranks then hold equal ones: the first of them counts the stage; of a TP group,
        every rank its shards and the first the replicated gradients). A 0-dim device tensor: no host sync."""
        if self.hdp_rank == 0:
            total = grad_square_sum(params, count_replicated=self.mesh.tp_rank == 0).to(self.device)
        else:
            total = torch.zeros((), device=self.device)
        dist.all_reduce(total)
        return total.sqrt()

    def shard_blockers(self) -> list[str]:
        """Stages hold different layers: the first call gathers every stage's reasons (a collective), so every
        rank plans alike."""
        if self._blockers is None:
            everyone: list[list[str]] = [[] for _ in range(self.world_size)]
            dist.all_gather_object(everyone, self.model.shard_blockers())
            self._blockers = list(dict.fromkeys(reason for reasons in everyone for reason in reasons))
        return self._blockers

    def probe_inputs(self, kwargs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The stage's share of `kwargs`; a stage after the first gets zero hidden states in their place."""
        hidden = torch.zeros(1, kwargs["input_ids"].shape[1], self.hidden_size, device=self.device, dtype=self.dtype)
        return stage_inputs(self.spec, kwargs, None if self.spec.is_first else hidden)

    def bubbles(self, busy: np.ndarray, forward_backward_time: float) -> list[float] | None:
        """From the busy seconds of each pipeline's stages (global ranks are stage-major)."""
        if forward_backward_time <= 0:
            return None
        per_stage = busy.reshape(self.pp_size, self.hdp)
        return (1.0 - per_stage.sum(axis=0) / (self.pp_size * forward_backward_time)).tolist()

    def _ops(self, plan: Plan) -> tuple[list[MicroBatch], list[Op]]:
        mine = plan.micro_batches_of(self.hdp_rank)
        chained = chained_micro_batches(plan)
        return mine, stage_order(
            self.spec.index, self.spec.pp_size, [mb.shared for mb in mine], [mb.id in chained for mb in mine]
        )

    def _run(self, order: list[Op], mine: list[MicroBatch], batch: BatchLike, act_ctx: ActivationContext) -> _Tally:
        inputs = self.device_inputs(mine, batch)
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        tally, in_flight = _Tally(loss=zero, busy=Stopwatch(self.device)), {}
        sends: _Sends = []
        for kind, k in order:
            act_ctx.update_micro_batch_id(k)
            if kind == "F":
                in_flight[k] = self._forward(inputs[k], act_ctx, sends, tally)
            else:
                self._backward(mine[k], in_flight.pop(k), act_ctx, sends, tally)
            sends = [(request, t) for request, t in sends if not request.is_completed()]
        for request, _ in sends:
            request.wait()
        return tally

    def _forward(self, inputs: MicroBatchInputs, act_ctx: ActivationContext, sends: _Sends, tally: _Tally) -> _InFlight:
        """F: receive (after the first stage), run the stage, send on (before the last)."""
        mb, received = inputs.micro_batch, None
        if not self.spec.is_first:
            shape = (1, inputs.num_tokens, self.hidden_size)
            received = self._receive(self.rank - self.stride, mb, "hidden states", shape)
            received.requires_grad_(torch.is_grad_enabled())
        tally.busy.start()
        kwargs = stage_inputs(self.spec, inputs.model_kwargs(self.hf_labels), received)
        with micro_batch(ctx=inputs.context), act_ctx, self.autocast():
            out = self.model(**kwargs)
        if self.spec.is_last:
            out = self._loss(out).float()
            tally.loss += out.detach().double()  # float64 on the device: the sum of every micro-batch's fp32 loss
        else:
            tally.stage_bytes += self._send(out, self.rank + self.stride, mb, sends)
        tally.busy.stop()
        tally.count(inputs.context.ring_stats, P2PStats())
        return _InFlight(inputs.context, received, out)

    def _backward(
        self, mb: MicroBatch, state: _InFlight, act_ctx: ActivationContext, sends: _Sends, tally: _Tally
    ) -> None:
        """B: back-propagate the loss or the next stage's gradient, send the input's gradient back."""
        before = dataclasses.replace(state.context.ring_stats)
        with micro_batch(ctx=state.context), act_ctx:
            grad = None
            if not self.spec.is_last:
                grad = self._receive(self.rank + self.stride, mb, "gradient", tuple(state.output.shape))
            tally.busy.start()
            torch.autograd.backward(state.output, grad)
        if state.received is not None:
            input_grad = cast(torch.Tensor, state.received.grad)  # the backward above reached the stage's input
            tally.stage_bytes += self._send(input_grad, self.rank - self.stride, mb, sends)
        tally.busy.stop()
        tally.count(state.context.ring_stats, before)

    def _loss(self, output: Any) -> torch.Tensor:
        loss = getattr(output, "loss", None)
        if not isinstance(loss, torch.Tensor):
            raise ModelProtocolError(
                f"the last stage ({type(self.model).__name__}) returned no loss (output.loss is "
                f"{loss!r}): split the model with split_stages(), whose last stage computes it"
            )
        return loss

    def _send(self, tensor: torch.Tensor, peer: int, mb: MicroBatch, sends: _Sends) -> int:
        """Post a header (micro-batch id, shape, dtype) and the tensor to `peer`, kept in `sends` with their
        requests until sent; the bytes sent."""
        payload = tensor.detach().contiguous()
        header = torch.tensor(
            [mb.id, *payload.shape, _DTYPES.index(payload.dtype)], dtype=torch.int64, device=payload.device
        )
        sends += [(dist.isend(header, peer), header), (dist.isend(payload, peer), payload)]
        return payload.numel() * payload.element_size()

    def _receive(self, peer: int, mb: MicroBatch, what: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor `peer` sends for micro-batch `mb`, checked against its header (the one host read of a micro-batch
        on a stage after the first or before the last: a wrong micro-batch or shape is an error, not a hang)."""
        header = torch.empty(2 + len(shape), dtype=torch.int64, device=self.device)
        dist.recv(header, src=peer)
        got_id, *got_shape, dtype = header.tolist()
        if got_id != mb.id or tuple(got_shape) != shape or not 0 <= dtype < len(_DTYPES):
            raise StageTransferError(
                f"rank {self.rank} (stage {self.spec.index}) expected the {what} of micro-batch {mb.id} with shape "
                f"{list(shape)} from rank {peer}, got micro-batch {got_id} with shape {got_shape} (dtype code "
                f"{dtype}): the stage ranks run different plans or batches"
            )
        tensor = torch.empty(shape, dtype=_DTYPES[dtype], device=self.device)
        dist.recv(tensor, src=peer)
        return tensor
