"""How one rank runs its part of a step's plan: the `Executor` a `Runtime` holds, and its whole-model kind.

The Runtime plans, sums gradients, clips and steps the optimizer alike for every model; what depends on
whether this rank holds the whole model or one pipeline stage sits behind this interface: running its
micro-batches (forward and backward, or forwards alone to evaluate), the gradient norm over the whole model,
the group gradients are summed over, the bubbles, what a compile probe passes, and the shard blockers every
rank plans with. `WholeModelExecutor` (here) runs HDP without pipelines; `PipelineExecutor`
(`engine/pipeline.py`) runs one stage of 1F1B pipelines.

Neither waits for the device between micro-batches: their inputs go to the device together at the start
(`device_inputs`), the loss is summed there, and busy time is a `Stopwatch`'s, all read once by the Runtime at the
end of the step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..api import OptimizedModule
from ..planner.plan import MicroBatch, Plan
from ..runtime.context import micro_batch
from ..runtime.offload import ActivationContext, get_act_ctx
from ..runtime.p2p import P2PStats
from .batch import (
    BatchLike,
    MicroBatchInputs,
    ModelProtocolError,
    RankWork,
    Stopwatch,
    build_micro_batch,
    device_inputs,
    num_targets,
)
from .collectives import grad_square_sum
from .mesh import TrainMesh, replica_group
from .stages import is_hf_model

__all__ = ["Executor", "WholeModelExecutor", "rank_work"]


class Executor(ABC):
    """This rank's module (through `optimize()`) and how to run its micro-batches of a plan.

    `mixed_precision` (None or an autocast dtype) is the autocast of every forward; the share r of saved
    activations a micro-batch offloads comes from the module's `CompileConfig.offload`.
    """

    pp_size: int
    """Stages of a pipeline (1: the whole model)."""
    sync_group: dist.ProcessGroup | None
    """The ranks that hold the same parameters, over which gradients are summed (None: every rank)."""
    mesh: TrainMesh
    """Where this rank sits in the world laid out (pp, hdp, tp)."""

    def __init__(self, model: OptimizedModule, mixed_precision: torch.dtype | None = None) -> None:
        self.model, self.mixed_precision = model, mixed_precision
        first = next(model.parameters(), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self.dtype = first.dtype if first is not None else torch.get_default_dtype()
        original = model.original_module
        self.hf_labels = is_hf_model(original) or "labels" in inspect.signature(original.forward).parameters
        """Also pass the targets as `labels`: what a Hugging Face forward reads them from."""

    @abstractmethod
    def forward_backward(self, plan: Plan, batch: BatchLike) -> RankWork:
        """Forward and backward of this rank's micro-batches of `plan`, gradients accumulated into `.grad` and
        not yet summed over ranks; queued on the device, nothing read back."""

    @abstractmethod
    def evaluate(self, plan: Plan, batch: BatchLike) -> torch.Tensor:
        """This rank's part of the loss of `plan`, in eval mode without gradients (the ranks' parts sum to it): a
        0-dim float64 tensor on the device, not yet read."""

    @abstractmethod
    def grad_norm(self, params: list[nn.Parameter]) -> torch.Tensor:
        """The 2-norm of the whole model's gradient, once `sync_group` has summed `params`' gradients: a 0-dim
        device tensor, so that clipping and the skip decision need no host sync."""

    @abstractmethod
    def shard_blockers(self) -> list[str]:
        """Why the model's sequences cannot be split over ranks or packed (empty: they can), the same on every
        rank; read after the module has compiled."""

    @abstractmethod
    def probe_inputs(self, kwargs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What this rank's module takes in place of the model protocol's `kwargs`, to compile it."""

    @abstractmethod
    def bubbles(self, busy: np.ndarray, forward_backward_time: float) -> list[float] | None:
        """Per HDP rank, the share of its stages' time not spent computing, from every global rank's busy
        seconds and the slowest forward-backward; None without pipelines."""

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.mixed_precision is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.mixed_precision)

    def offload_ratio(self, mb: MicroBatch) -> float:
        """The share r of its saved activations `mb` offloads: the plan's ("auto"), CompileConfig's fixed ratio, or
        nothing ("off")."""
        mode = self.model.compile_config.offload
        if mode == "auto":
            return mb.offload_ratio
        return 0.0 if mode == "off" else float(mode)

    def in_mesh(self, inputs: MicroBatchInputs) -> MicroBatchInputs:
        """`inputs` whose context holds the global batch's targets (what a router's load-balancing loss weighs its
        sequences by) and a shared micro-batch's ring among the global ranks of its HDP ranks at this rank's stage
        and TP index (the plan names HDP ranks)."""
        group = inputs.context.group
        context = dataclasses.replace(
            inputs.context,
            num_items=int(inputs.num_items_in_batch),
            group=None if group is None else tuple(self.mesh.global_rank(r) for r in group),
        )
        return dataclasses.replace(inputs, context=context)

    def device_inputs(self, mine: list[MicroBatch], batch: BatchLike) -> list[MicroBatchInputs]:
        """The inputs of this rank's micro-batches `mine`, built on the host (`in_mesh`, which reads their target
        count there) and copied to the device together (`batch.device_inputs`), before the first one runs."""
        num_items = num_targets(batch.lengths)
        rank = self.mesh.hdp_rank
        built = [self.in_mesh(build_micro_batch(mb, rank, batch.lengths, batch.tokens, num_items)) for mb in mine]
        return device_inputs(built, self.device)

    def act_ctx(self, mine: list[MicroBatch]) -> ActivationContext:
        """The step's act_ctx over this rank's micro-batches, each offloading its `offload_ratio`."""
        return get_act_ctx(len(mine), [self.offload_ratio(mb) for mb in mine])


def rank_work(
    act_ctx: ActivationContext, *, loss: torch.Tensor, busy: Stopwatch, ring: P2PStats, stage_bytes: int = 0
) -> RankWork:
    """What a step's micro-batches under `act_ctx` did, with its offloading figures."""
    return RankWork(
        loss=loss,
        busy=busy,
        micro_batches=len(act_ctx.stats),
        p2p_bytes=ring.bytes_sent,
        mixer_bytes=ring.mixer_bytes_sent,
        offloaded_bytes=sum(s.offloaded_bytes for s in act_ctx.stats),
        peak_saved_bytes=max((s.peak_resident_bytes for s in act_ctx.stats), default=0),
        stage_bytes=stage_bytes,
    )


class WholeModelExecutor(Executor):
    """The whole model on every TP group: this HDP rank's micro-batches one after another, gradients summed over
    the HDP ranks (HDP without pipelines; with tensor parallelism each rank of a TP group runs them alike)."""

    def __init__(self, model: OptimizedModule, mixed_precision: torch.dtype | None = None) -> None:
        super().__init__(model, mixed_precision)
        self.mesh = TrainMesh.of_world(tp=model.tp_layout.size if model.tp_layout is not None else 1)
        self.pp_size = 1
        self.sync_group = replica_group(model)
        self.rank = self.mesh.hdp_rank

    def forward_backward(self, plan: Plan, batch: BatchLike) -> RankWork:
        self.model.train()
        mine = plan.micro_batches_of(self.rank)
        act_ctx = self.act_ctx(mine)
        loss, busy, ring = torch.zeros((), device=self.device), Stopwatch(self.device), P2PStats()
        for i, inputs in enumerate(self.device_inputs(mine, batch)):
            busy.start()
            act_ctx.update_micro_batch_id(i)
            with micro_batch(ctx=inputs.context), act_ctx:
                mb_loss = self._loss(inputs).float()
                mb_loss.backward()
            loss += mb_loss.detach()
            busy.stop()
            ring.bytes_sent += inputs.context.ring_stats.bytes_sent
            ring.mixer_bytes_sent += inputs.context.ring_stats.mixer_bytes_sent
        return rank_work(act_ctx, loss=loss, busy=busy, ring=ring)

    def evaluate(self, plan: Plan, batch: BatchLike) -> torch.Tensor:
        loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self.model.eval()
        try:
            with torch.no_grad():
                for inputs in self.device_inputs(plan.micro_batches_of(self.rank), batch):
                    with micro_batch(ctx=inputs.context):
                        loss += self._loss(inputs).double()
        finally:
            self.model.train()
        return loss

    def grad_norm(self, params: list[nn.Parameter]) -> torch.Tensor:
        """Every TP group holds the whole summed gradient: its own norm is the model's (a TP shard's squares
        summed over the group, a replicated gradient's counted once). A 0-dim device tensor: no host sync."""
        layout = self.model.tp_layout
        if layout is None:
            return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        squares = grad_square_sum(params, count_replicated=self.mesh.tp_rank == 0)
        dist.all_reduce(squares, group=layout.mesh.get_group())
        return squares.sqrt()

    def shard_blockers(self) -> list[str]:
        return self.model.shard_blockers()

    def probe_inputs(self, kwargs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return kwargs

    def bubbles(self, busy: np.ndarray, forward_backward_time: float) -> list[float] | None:
        return None

    def _loss(self, inputs: MicroBatchInputs) -> torch.Tensor:
        """The model's loss of one micro-batch, its forward under autocast."""
        with self.autocast():
            output: Any = self.model(**inputs.model_kwargs(self.hf_labels))
        loss = getattr(output, "loss", None)
        if not isinstance(loss, torch.Tensor):
            model = type(self.model.original_module).__name__
            given = "input_ids, position_ids, shift_labels, num_items_in_batch" + (", labels" if self.hf_labels else "")
            raise ModelProtocolError(
                f"{model} returned no loss (output.loss is {loss!r}) although the runtime passed "
                f"{given}: its forward must compute the summed next-token loss from shift_labels "
                f"(or labels) divided by num_items_in_batch"
            )
        return loss
