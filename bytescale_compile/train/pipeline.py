"""The 1F1B pipeline executor: one optimizer step of an HDP plan with `pp_size > 1` (ByteScale's PP inside
each HDP rank, whose pipelines may run different numbers of micro-batches: the paper's "Solve PP Imbalance").

The job has `hdp * pp` processes, stage-major: global rank `g` runs stage `g // hdp` of pipeline (HDP rank)
`g % hdp`, so its previous stage is `g - hdp` and its next `g + hdp`. Every stage rank of pipeline `i` runs
the micro-batches of `plan.schedule[i]` in `stage_order` — the one order `Plan.validate()` proves
deadlock-free, also the simulator's — with blocking receives and non-blocking sends:

- F(k): build the micro-batch's inputs; a stage after the first receives the previous stage's hidden states
  `[1, tokens this rank holds, hidden]` (a small header first, so a wrong micro-batch or shape is an error,
  not a hang or garbage), runs its stage under the micro-batch's context and sends the output on; the last
  stage keeps the loss.
- B(k): the last stage back-propagates its loss, the others the gradient received from the next stage, both
  under the same context again (ring attention's backward reads it); a stage after the first sends its
  input's gradient back.

A micro-batch shared by several pipelines runs ring attention among the stage's global ranks of those
pipelines. Afterwards the gradients of each stage are summed over its HDP ranks (one process group per
stage), the gradient norm is taken over all stages for clipping, and one optimizer step follows — skipped on
every rank when the loss or the norm is not finite, as in the HDP `Runtime`. Activation offloading is not
applied here (every micro-batch runs with ratio 0).

`torch.distributed.pipelining` is not used: its stages infer one activation shape from the first
micro-batch and receive every micro-batch into buffers of that shape, its schedules take a fixed number of
equal micro-batches split from one batch tensor, and they have no per-micro-batch hook for the ring
context; ByteScale's micro-batches differ in length and count per pipeline, and shared ones must meet in
`stage_order`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..planner.pipeline_order import chained_micro_batches, stage_order
from ..planner.plan import MicroBatch, Plan, PlanError
from ..runtime.context import MicroBatchContext, micro_batch
from .batch import MicroBatchInputs, build_micro_batch, num_targets
from .collectives import gather, sync_gradients
from .engine import BatchLike, ListBatch, ModelProtocolError
from .stages import StageSpec, is_hf_model, stage_inputs

__all__ = ["PipelineExecutor", "PipelineStats", "StageWork", "PipelineSetupError", "StageTransferError",
           "check_stage_plan"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""Activation dtypes a header can name, by index."""
_Sends = list[tuple[Any, torch.Tensor]]
"""Posted sends with the tensors they read, which must stay alive until sent."""


class PipelineSetupError(ValueError):
    """The processes, the stage module and the plan do not fit together (world size, stage index, pp_size)."""


class StageTransferError(RuntimeError):
    """A stage received a tensor other than the one its schedule expects: the stage ranks disagree on the plan."""


@dataclass
class PipelineStats:
    """One pipeline step, the same on every rank (lists are indexed by global rank)."""

    loss: float
    """Token-level loss of the global batch: the sum over the last stage's ranks."""
    time: float
    busy: list[float]
    """Seconds each rank computed in its micro-batches (waits for the neighbouring stages left out)."""
    micro_batches: list[int]
    stage_bytes: int
    """Activation and gradient bytes all ranks sent between stages."""
    ring_bytes: int
    """Ring-attention bytes all ranks sent."""
    allreduce_bytes: int
    """Gradient bytes this rank all-reduced with the other HDP ranks of its stage."""
    grad_norm: float
    """Of the whole model's summed gradient (all stages), before clipping."""
    skipped: bool


@dataclass
class _InFlight:
    """One micro-batch between its forward and its backward on this stage."""

    context: MicroBatchContext
    received: torch.Tensor | None
    """The previous stage's hidden states (requires grad); None on the first stage."""
    output: torch.Tensor
    """Hidden states for the next stage, or the loss on the last stage."""


@dataclass
class StageWork:
    """What this stage rank's ops of a step did (`PipelineExecutor.forward_backward`), before any reduction."""

    loss: float = 0.0
    busy: float = 0.0
    stage_bytes: int = 0
    ring_bytes: int = 0


def check_stage_plan(plan: Plan, spec: StageSpec, world_size: int, rank: int) -> None:
    """Everything about the plan that can be checked before communicating: raise `PlanError` or
    `PipelineSetupError` on every rank alike, so no rank is left waiting on another."""
    plan.validate()
    if plan.pp_size != spec.pp_size:
        raise PipelineSetupError(f"the plan has pp_size {plan.pp_size} but the stage module is stage {spec.index} "
                                 f"of {spec.pp_size}: split the model with split_stages(model, plan.pp_size)")
    if plan.world_size * plan.pp_size != world_size:
        raise PipelineSetupError(f"the plan's {plan.world_size} HDP ranks x pp_size {plan.pp_size} need "
                                 f"{plan.world_size * plan.pp_size} processes, but the job has {world_size}")
    if rank // plan.world_size != spec.index:
        raise PipelineSetupError(f"global rank {rank} runs stage {rank // plan.world_size} (stage-major: rank = "
                                 f"stage * {plan.world_size} + HDP rank) but holds stage module {spec.index}")


class PipelineExecutor:
    """`PipelineExecutor(stage, optimizer)`; `step(plan, batch) -> PipelineStats`.

    `stage` is this rank's module from `split_stages(model, pp_size)` (plain or through `optimize()`), the
    optimizer over its parameters. Construct it on every rank at once: it creates one process group per
    stage (a collective call).
    """

    def __init__(self, stage: nn.Module, optimizer: torch.optim.Optimizer, *,
                 max_grad_norm: float | None = 1.0) -> None:
        spec = getattr(stage, "spec", None)
        if not isinstance(spec, StageSpec):
            raise PipelineSetupError(f"{type(stage).__name__} has no StageSpec .spec: pass a module from "
                                     f"split_stages(model, pp_size), optionally through optimize()")
        if not dist.is_initialized():
            raise PipelineSetupError("the pipeline executor needs torch.distributed initialised (hdp * pp processes)")
        self.stage, self.spec, self.optimizer, self.max_grad_norm = stage, spec, optimizer, max_grad_norm
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if self.world_size % spec.pp_size:
            raise PipelineSetupError(f"{self.world_size} processes cannot hold pipelines of {spec.pp_size} stages")
        self.hdp = self.world_size // spec.pp_size
        if self.rank // self.hdp != spec.index:
            raise PipelineSetupError(f"global rank {self.rank} runs stage {self.rank // self.hdp} (stage-major, "
                                     f"{self.hdp} HDP ranks) but holds stage module {spec.index}")
        self.hdp_rank = self.rank % self.hdp
        groups = [dist.new_group([s * self.hdp + r for r in range(self.hdp)]) for s in range(spec.pp_size)]
        self.stage_group = groups[spec.index]
        self.params = [p for p in stage.parameters() if p.requires_grad]
        self.device = self.params[0].device if self.params else torch.device("cpu")
        model = getattr(stage, "original_module", stage)
        self.hidden_size = int(model.config.hidden_size)
        self._hf_labels = is_hf_model(model)

    def step(self, plan: Plan, batch: BatchLike | Sequence[torch.Tensor]) -> PipelineStats:
        """Forward and backward of this stage's micro-batches of `plan`, gradient sync, clipping, optimizer step."""
        if not hasattr(batch, "lengths"):
            batch = ListBatch(batch, None)
        start = time.perf_counter()
        self._check(plan, batch)
        self.optimizer.zero_grad(set_to_none=False)
        work = self.forward_backward(plan, batch)
        allreduce_bytes = sync_gradients(self.params, self.hdp, self.stage_group)
        # after the sync a stage's HDP ranks hold equal gradients: one of them counts the stage's share of the norm
        stage_sq = sum(float(p.grad.double().pow(2).sum()) for p in self.params) if self.hdp_rank == 0 else 0.0
        totals = gather([work.loss, work.busy, float(len(plan.schedule[self.hdp_rank])), stage_sq,
                         float(work.stage_bytes), float(work.ring_bytes)], self.rank, self.world_size, self.device)
        loss, grad_norm = float(totals[:, 0].sum()), math.sqrt(float(totals[:, 3].sum()))
        skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
        if not skipped:
            self._clip(grad_norm)
            self.optimizer.step()
        return PipelineStats(loss=loss, time=time.perf_counter() - start, busy=totals[:, 1].tolist(),
                             micro_batches=totals[:, 2].astype(int).tolist(), stage_bytes=int(totals[:, 4].sum()),
                             ring_bytes=int(totals[:, 5].sum()), allreduce_bytes=allreduce_bytes,
                             grad_norm=grad_norm, skipped=skipped)

    def _check(self, plan: Plan, batch: BatchLike) -> None:
        check_stage_plan(plan, self.spec, self.world_size, self.rank)
        lengths = [int(n) for n in np.asarray(batch.lengths)]
        if lengths != plan.sequences:
            raise PlanError(f"the plan was made for sequence lengths {plan.sequences[:8]}... but the batch has "
                            f"{lengths[:8]}...: plan this batch")

    def forward_backward(self, plan: Plan, batch: BatchLike) -> StageWork:
        """This stage's F and B ops of its pipeline, in `stage_order`; gradients accumulate in `.grad`."""
        mine = plan.micro_batches_of(self.hdp_rank)
        chained = chained_micro_batches(plan)
        order = stage_order(self.spec.index, self.spec.pp_size, [mb.shared for mb in mine],
                            [mb.id in chained for mb in mine])
        num_items = num_targets(batch.lengths)
        self.stage.train()
        work, in_flight, sends = StageWork(), {}, []
        for kind, k in order:
            began = time.perf_counter()
            if kind == "F":
                inputs = build_micro_batch(mine[k], self.hdp_rank, batch.lengths, batch.tokens, num_items)
                in_flight[k], waited = self._forward(inputs, sends, work)
            else:
                waited = self._backward(mine[k], in_flight.pop(k), sends, work)
            work.busy += time.perf_counter() - began - waited
            sends = [(request, t) for request, t in sends if not request.is_completed()]
        for request, _ in sends:
            request.wait()
        return work

    def _forward(self, inputs: MicroBatchInputs, sends: _Sends, work: StageWork) -> tuple[_InFlight, float]:
        """F: receive (after the first stage), run the stage, send on (before the last); the seconds waited."""
        mb, waited, received = inputs.micro_batch, 0.0, None
        if not self.spec.is_first:
            shape = (1, inputs.num_tokens, self.hidden_size)
            received, waited = self._receive(self.rank - self.hdp, mb, "hidden states", shape)
            received.requires_grad_()
        context = self._context(inputs)
        with micro_batch(ctx=context):
            out = self.stage(**stage_inputs(self.spec, inputs.model_kwargs(self.device, self._hf_labels), received))
        if self.spec.is_last:
            out = self._loss(out).float()
            work.loss += float(out.detach())
        else:
            work.stage_bytes += self._send(out, self.rank + self.hdp, mb, sends)
        return _InFlight(context, received, out), waited

    def _backward(self, mb: MicroBatch, state: _InFlight, sends: _Sends, work: StageWork) -> float:
        """B: back-propagate the loss or the next stage's gradient, send the input's gradient back; the seconds
        waited."""
        waited = 0.0
        with micro_batch(ctx=state.context):
            if self.spec.is_last:
                state.output.backward()
            else:
                grad, waited = self._receive(self.rank + self.hdp, mb, "gradient", tuple(state.output.shape))
                torch.autograd.backward(state.output, grad)
        if state.received is not None:
            work.stage_bytes += self._send(state.received.grad, self.rank - self.hdp, mb, sends)
        work.ring_bytes += state.context.ring_stats.bytes_sent
        return waited

    def _context(self, inputs: MicroBatchInputs) -> MicroBatchContext:
        """The micro-batch's context; a shared one's ring runs among this stage's ranks of its pipelines."""
        mb = inputs.micro_batch
        if not mb.shared:
            return inputs.context
        return dataclasses.replace(inputs.context, group=tuple(self.spec.index * self.hdp + r for r in mb.ranks))

    def _loss(self, output: Any) -> torch.Tensor:
        loss = getattr(output, "loss", None)
        if not isinstance(loss, torch.Tensor):
            raise ModelProtocolError(f"the last stage ({type(self.stage).__name__}) returned no loss (output.loss is "
                                     f"{loss!r}): split the model with split_stages(), whose last stage computes it")
        return loss

    def _send(self, tensor: torch.Tensor, peer: int, mb: MicroBatch, sends: _Sends) -> int:
        """Post a header (micro-batch id, shape, dtype) and the tensor to `peer`, kept in `sends` with their
        requests until sent; the bytes sent."""
        payload = tensor.detach().contiguous()
        header = torch.tensor([mb.id, *payload.shape, _DTYPES.index(payload.dtype)], dtype=torch.int64,
                              device=payload.device)
        sends += [(dist.isend(header, peer), header), (dist.isend(payload, peer), payload)]
        return payload.numel() * payload.element_size()

    def _receive(self, peer: int, mb: MicroBatch, what: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, float]:
        """The tensor `peer` sends for micro-batch `mb`, checked against its header; the seconds waited."""
        began = time.perf_counter()
        header = torch.empty(2 + len(shape), dtype=torch.int64, device=self.device)
        dist.recv(header, src=peer)
        got_id, *got_shape, dtype = header.tolist()
        if got_id != mb.id or tuple(got_shape) != shape or not 0 <= dtype < len(_DTYPES):
            raise StageTransferError(
                f"rank {self.rank} (stage {self.spec.index}) expected the {what} of micro-batch {mb.id} with shape "
                f"{list(shape)} from rank {peer}, got micro-batch {got_id} with shape {got_shape} (dtype code "
                f"{dtype}): the stage ranks run different plans or batches")
        tensor = torch.empty(shape, dtype=_DTYPES[dtype], device=self.device)
        dist.recv(tensor, src=peer)
        return tensor, time.perf_counter() - began

    def _clip(self, grad_norm: float) -> None:
        """Scale the gradients as `clip_grad_norm_` would over the whole model (the norm spans every stage)."""
        if self.max_grad_norm is None:
            return
        coef = self.max_grad_norm / (grad_norm + 1e-6)
        if coef < 1.0:
            for p in self.params:
                p.grad.mul_(coef)
