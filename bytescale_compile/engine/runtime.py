"""The HDP training engine: one global batch → a plan → this rank's micro-batches → one optimizer step.

Every rank sees the same sequence lengths and plans identically (the planner is deterministic), so a
bad batch fails on every rank with the planner's message before any communication. Each rank then
runs its own micro-batches in plan order — different counts on different ranks — forward and backward
under each micro-batch's context and the step's act_ctx (which offloads the micro-batch's share r of
its saved activations, paper §4.2); ranks sharing a micro-batch meet in its ring. Bucketed
reductions sum the gradients (the loss is token-level, so a plain sum equals data parallelism's
gradient, paper Eq. 2 = Eq. 1), then clipping and the optimizer step — skipped on every rank when
the loss or the gradient norm is not finite (both are the same on every rank after the reductions).
Strategies differ only in the plan: "balance", "naive", "static" and "auto" (the fastest of the planner's
candidates under the simulator, `planner/auto.py`) all run through this code.

What differs between a whole model and a pipeline stage lives in the Runtime's one `Executor`
(`engine/executor.py`). With pipelines (a stage from `pipeline_stage`, `pp_size > 1`) the forwards and
backwards run in 1F1B on the stage's ranks (`engine/pipeline.py`); gradients are summed over the stage's HDP
ranks only, and the norm that clipping and the skip test read spans every stage.

Mixed precision is autocast around the forward, the loss coming back in fp32 and the backward outside autocast
as PyTorch recommends. With a torch optimizer, parameters, gradients and optimizer state stay fp32 (the master
weights) and the gradients are all-reduced after the backward. With the `DistributedOptimizer`
(`engine/dist_optim.py`) the weights are bf16, the gradients accumulate into an fp32 buffer whose buckets are
reduce-scattered during the backward, and each rank updates its shard of the fp32 master weights.

A step runs and measures: the simulator's predictions for its plan are `Runtime.predict`'s, made on request for
the steps that are logged (`engine/diagnostics.py`). The one the step makes itself: after its first measured steps
(steps 2 and 3 of this Runtime: the first compiles) rank 0 holds their wall time against the prediction for their
plans and warns once, naming the cost model, when they differ by more than 2× either way: plans balanced by a cost
model that far off may be poor. What planning reads of the compiled model (shard blockers, mixer costs) is probed
once (`engine/probe.py`), on the first plan or given at construction.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from ..api import OptimizedModule, optimize
from ..config import CompileConfig
from ..planner import DEFAULT_SP, RUNTIME_STRATEGIES, CostModel, Plan, PlanRequest, check_sp, validate_splits
from ..planner.memory import MemoryBudgetError, MemoryModel, format_bytes
from ..sim.simulator import step_time
from .batch import BatchError, BatchLike, ListBatch, ModelProtocolError, RankWork, Stopwatch, ids_checked
from .collectives import check_replica_gradients, gather, sync_gradients
from .diagnostics import PREDICTION_TOLERANCE, CostModelWarning, StepDiagnostics, StepPrediction, prediction_off
from .dist_optim import DistributedOptimizer
from .executor import Executor
from .mesh import tp_group
from .optim import StepGuard, guarded_step
from .probe import SetupProbe, default_cost_model, executor_for, fitted_cost_model, probe_executor
from .routing import RouterTraining

__all__ = [
    "Runtime",
    "StepStats",
    "RankWork",
    "BatchLike",
    "ListBatch",
    "ModelProtocolError",
    "BatchError",
    "SkippedStepsError",
    "NoOptimizerError",
    "CostModelWarning",
    "StepPrediction",
    "SetupProbe",
    "default_cost_model",
    "prediction_off",
    "PREDICTION_TOLERANCE",
    "RUNTIME_STRATEGIES",
]


class SkippedStepsError(RuntimeError):
    """Too many steps in a row had a non-finite loss or gradient: training is not making progress."""


class NoOptimizerError(RuntimeError):
    """A step asked of a Runtime built without an optimizer, which runs forwards and backwards only."""


@dataclass
class StepStats:
    """What one step measured, the same on every rank (predictions for its plan: `Runtime.predict`)."""

    step: int
    strategy: str
    loss: float
    tokens: int
    time: float
    plan_time: float
    busy: list[float]
    """Seconds each rank spent in its micro-batches."""
    micro_batches: list[int]
    p2p_bytes: int
    """Ring and all-to-all bytes sent by all ranks together, forward and backward (under tensor parallelism
    each TP rank sends its own heads')."""
    mixer_bytes: int
    """Of `p2p_bytes`: the halos and state summaries of a hybrid's convolutions and scans."""
    allreduce_bytes: int
    """Gradient bytes each rank put into reductions: all-reduced, or reduce-scattered by the distributed
    optimizer."""
    offloaded_bytes: int
    """Saved-activation bytes all ranks together copied to host memory (paper §4.2)."""
    peak_saved_bytes: list[int]
    """Per rank: the most saved-activation bytes resident on the device in any of its micro-batches."""
    plan: Plan
    """The plan this step ran (the same on every rank)."""
    grad_norm: float = 0.0
    """Of the summed gradient, before clipping."""
    skipped: bool = False
    """The loss or the gradient norm was not finite: no optimizer step was taken (on any rank)."""
    auto_choice: str | None = None
    """Strategy "auto": the candidate it ran (`planner.auto.CANDIDATES`, e.g. "balance", "static"); else None."""
    auto_speedup: float | None = None
    """Strategy "auto": the simulated speedup of its choice over static (None also where static cannot plan
    the batch, and for a model that cannot be sharded, which has one plan whatever the strategy)."""
    stage_bytes: int = 0
    """Hidden states and gradients all ranks sent between pipeline stages (0 without pipelines)."""
    bubbles: list[float] | None = None
    """Pipelines: per HDP rank, the share of its stages' time not spent computing, 1 - (busy seconds of its
    stages) / (pp x the slowest rank's forward-backward seconds); None without pipelines."""
    reduce_time: float = 0.0
    """Seconds rank 0 waited for the gradient reduction after its backward: what the overlap left exposed."""
    reduce_overlap: float = 0.0
    """Distributed optimizer: the share of rank 0's gradient buckets reduce-scattered while its backward still
    ran (0 with the all-reduce after the backward)."""
    predicted_peak_bytes: list[int] | None = None
    """Per HDP rank: the memory model's peak over its micro-batches of the plan (None without a memory model)."""
    measured_peak_bytes: list[int] | None = None
    """Per global rank on CUDA: `torch.cuda.max_memory_allocated` during the step (None elsewhere)."""
    measured_reserved_peak_bytes: list[int] | None = None
    """Per global rank on CUDA: `torch.cuda.max_memory_reserved` during the step, what the model predicts."""
    aux_loss: float = 0.0
    """Of `loss`: an MoE model's load-balancing loss times its `router_aux_loss_coef`, per sequence
    (`engine/routing.py`); 0 without one."""
    expert_load: list[float] | None = None
    """Per MoE layer: tokens routed to its busiest expert over the mean per expert, summed over ranks (1: balanced);
    None for a dense model."""

    @property
    def ce_loss(self) -> float:
        """The cross-entropy part of `loss`."""
        return self.loss - self.aux_loss

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.time if self.time else 0.0

    @property
    def busy_spread(self) -> float:
        """max / min busy time over ranks that had work."""
        busy = [b for b in self.busy if b > 0]
        return max(busy) / min(busy) if busy else 1.0


_SHARDED_BYTES = ("p2p_bytes", "mixer_bytes")
"""`RankWork` figures that differ between the ranks of a TP group: each moves its own shard's K/V, halos and
states."""


def _every_rank(
    work: RankWork,
    measured: dict[str, float | torch.Tensor],
    *,
    rank: int,
    world_size: int,
    device: torch.device,
    tp_size: int = 1,
) -> dict[str, np.ndarray]:
    """Every rank's `work` and `measured` figures by name, one entry per global rank that leads its TP group
    (stage-major; every rank of a group ran the same micro-batches), but the bytes each rank sent for its own shard
    of the heads or channels summed over its group: from one all-reduce and one host read, the step's only read of
    the device. `work.busy` is read too, so the device must have done the step's work (`Stopwatch.wait`)."""
    mine: dict[str, float | torch.Tensor] = {f.name: getattr(work, f.name) for f in dataclasses.fields(work)}
    mine |= {"busy": work.busy.busy, **measured}
    names = list(mine)
    table = gather(list(mine.values()), rank, world_size, device)
    columns = {name: table[::tp_size, i] for i, name in enumerate(names)}
    for name in _SHARDED_BYTES:
        columns[name] = table[:, names.index(name)].reshape(-1, tp_size).sum(axis=1)
    return columns


@dataclass(frozen=True)
class _Ran:
    """What running a step left for its `StepStats`: every rank's figures (`_every_rank`) and the reduction's."""

    ranks: dict[str, np.ndarray]
    reduced_bytes: int
    reduce_time: float
    reduce_overlap: float
    routed: torch.Tensor | None
    """The routers' sums, for `RouterTraining.finish` (None for a dense model)."""


class Runtime:
    """`Runtime(model, optimizer, config, cost_model, strategy)`; `step(batch) -> StepStats`,
    `evaluate(batch) -> float`, `predict(stats) -> StepPrediction`.

    `optimizer=None` makes a Runtime that plans, runs forwards and backwards (`forward_backward`, calibration) and
    evaluates, but refuses `step`. `probe` is the model's `SetupProbe` when setup made one (`engine/probe.py`);
    without it the Runtime probes on its first plan.

    `mixed_precision` (None or torch.bfloat16/float16) is the autocast dtype of every forward; the model
    stays where it is, and every micro-batch input goes to the device of its parameters.

    Given a pipeline stage (`bsc.pipeline_stage(model, pp_size)`) instead of a whole model, the job's
    `pp_size * hdp` processes train pipelines: `rank` and `world_size` are then the HDP rank and the number
    of HDP ranks (what plans are made for), the plans have the stage's `pp_size`, each step runs in 1F1B
    (`engine/pipeline.py`), and the optimizer holds the stage's parameters only.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | DistributedOptimizer | None,
        config: CompileConfig | None = None,
        cost_model: CostModel | None = None,
        strategy: str = "balance",
        *,
        capacity: int = 8192,
        max_grad_norm: float | None = 1.0,
        context_length: int | None = None,
        mixed_precision: torch.dtype | None = None,
        max_skipped_steps: int = 3,
        memory: MemoryModel | None = None,
        memory_budget: int | None = None,
        sp: str = DEFAULT_SP,
        expert_bias_update: float | None = None,
        router_aux_loss: str = "sequence",
        probe: SetupProbe | None = None,
    ) -> None:
        if strategy not in RUNTIME_STRATEGIES:
            raise ValueError(f"strategy must be one of {RUNTIME_STRATEGIES}, got {strategy!r}")
        if mixed_precision not in (None, torch.bfloat16, torch.float16):
            raise ValueError(f"mixed_precision must be None, torch.bfloat16 or torch.float16, got {mixed_precision!r}")
        _check_int("capacity", capacity)
        if context_length is not None:
            _check_int("context_length", context_length)
        if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be None or a number > 0, got {max_grad_norm!r}")
        self.model = model if isinstance(model, OptimizedModule) else optimize(model, config)
        self.optimizer = optimizer
        self.strategy, self.capacity, self.max_grad_norm = strategy, capacity, max_grad_norm
        self.context_length = context_length
        self.global_rank = dist.get_rank() if dist.is_initialized() else 0
        self.global_world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.mixed_precision = mixed_precision
        self.executor: Executor = executor_for(self.model, mixed_precision)
        """Runs this rank's micro-batches: of the whole model, or of its pipeline stage."""
        self.device = self.executor.device
        self.pp_size = self.executor.pp_size
        mesh = self.executor.mesh
        self.tp_size = mesh.tp
        """Ranks of a TP group: one HDP rank of the plans."""
        self._probe: SetupProbe | None = None
        """What planning reads of the compiled model (`probe`), once taken."""
        self.cost_model = cost_model or default_cost_model(self.model)
        self._refuse_with_tp(optimizer)
        self.sp = check_sp(sp)
        """How shared micro-batches split their ranks u × r (`planner.split`): "ring", "ulysses" or "auto"; under
        tensor parallelism u splits each TP rank's shard of the heads."""
        self.world_size, self.rank = mesh.hdp, mesh.hdp_rank
        """HDP ranks: the ranks a plan is made for; this rank's."""
        if isinstance(max_skipped_steps, bool) or not isinstance(max_skipped_steps, int) or max_skipped_steps < 1:
            raise ValueError(f"max_skipped_steps must be an int >= 1, got {max_skipped_steps!r}")
        self.max_skipped_steps = max_skipped_steps
        self.memory, self.memory_budget = memory, memory_budget
        """What a rank holds (`planner/memory.py`), and the bytes a plan's predicted peak must fit (None: any)."""
        self.vocab_size = _vocab_size(self.model.original_module)
        self.routing = RouterTraining.of(
            self.model.original_module, pp_size=self.pp_size, bias_update=expert_bias_update, scope=router_aux_loss
        )
        """An MoE model's routers: the load-balancing loss per sequence (`router_aux_loss`, "sequence"; other scopes
        are refused), their figures, and DeepSeek-V3's aux-loss-free balancing when `expert_bias_update` (the bias
        step γ) is given."""
        self.steps = 0
        self._skipped_in_a_row: list[int] = []
        self._replicas_unchecked = self.tp_size > 1
        """Tensor parallelism: the replicated parameters' gradients are yet to be compared over the TP group."""
        self.diagnostics = StepDiagnostics(warns=self.global_rank == 0)
        """Predictions of this Runtime's steps (`predict`), and the check of its first ones against them."""
        if probe is not None:
            self._take_probe(probe)

    def _check_replicas(self, sharded: DistributedOptimizer | None) -> None:
        """Refuse, on the first step and before its update, plain parameters whose summed gradients differ over
        their TP group (`collectives.check_replica_gradients`): partial gradients nothing sums."""
        self._replicas_unchecked = False
        if sharded is not None:  # the gradients live in its buffer
            grads = {id(p): view for p, view in zip(sharded.params, sharded.grads.views)}
        else:
            grads = {id(p): p.grad for p in self.params if p.grad is not None}
        module = self.model.original_module
        replicated = [
            (name, grads[id(p)])
            for name, p in module.named_parameters()
            if id(p) in grads and not isinstance(p, DTensor)
        ]
        check_replica_gradients(replicated, tp_group(module))

    def _refuse_with_tp(self, optimizer: object) -> None:
        """Torch's own ZeRO-1 under tensor parallelism, refused before any step rather than failing in one."""
        if self.tp_size > 1 and type(optimizer) is ZeroRedundancyOptimizer:
            raise ValueError(
                f"torch's ZeroRedundancyOptimizer broadcasts whole parameters, which c10d cannot do for tensor-parallel "
                f"(DTensor) ones (tp {self.tp_size}): build ZeRO-1 with engine.optim.build_optimizer(model, ..., "
                f"zero=True), which broadcasts local shards"
            )

    def plan(self, lengths: np.ndarray) -> Plan:
        """The step's plan, validated before any communication (identical on every rank).

        A model whose compiled graphs hold an attention the pass left alone is never sharded nor packed:
        every sequence runs alone on one rank, and one longer than the capacity is refused.
        """
        return self.plan_request().plan(lengths)

    def plan_request(self) -> PlanRequest:
        """How this run plans each step: its settings, cost model and shard blockers (the Ray scheduler plans
        with the same request)."""
        return PlanRequest(
            world_size=self.world_size,
            capacity=self.capacity,
            cost_model=self.cost_model,
            strategy=self.strategy,
            pp_size=self.pp_size,
            context_length=self.context_length,
            sp=self.sp,
            shard_blockers=self.probe.shard_blockers,
            step_time=step_time,
        )

    @property
    def cost_model(self) -> CostModel:
        """What plans are made and predicted with. Whatever hardware it was made for, its heads are sharded over
        this run's TP group (`CostModel.tp_size`): a Ulysses degree splits each TP rank's heads; and it
        recomputes each layer's forward where the model is gradient-checkpointed (`CostModel.recompute`)."""
        return self._cost_model

    @cost_model.setter
    def cost_model(self, cost_model: CostModel) -> None:
        cost_model = fitted_cost_model(cost_model, self.model, self.tp_size)
        if self._probe is not None:  # set after the probe: charged the model's mixer costs alike
            cost_model = self._probe.charged(cost_model)
        self._cost_model = cost_model

    def _validate(self, step_plan: Plan) -> None:
        """`step_plan.validate()` with the head counts of one device (a TP rank's shard of them), which each
        micro-batch's Ulysses degree must divide."""
        validate_splits(step_plan, self.cost_model)

    def predicted_peaks(self, step_plan: Plan) -> list[int] | None:
        """Per HDP rank, the memory model's peak over its micro-batches (each at its offload ratio as this run
        applies it); None without a memory model."""
        if self.memory is None:
            return None
        memory = self.memory
        ratios = {mb.id: self.executor.offload_ratio(mb) for mb in step_plan.micro_batches}
        return [
            int(
                max(
                    (memory.peak(mb.tokens_per_rank, ratios[mb.id]) for mb in step_plan.micro_batches_of(r)),
                    default=memory.peak(0),
                )
            )
            for r in range(step_plan.world_size)
        ]

    def _check_memory(self, step_plan: Plan, peaks: list[int] | None) -> None:
        """Refuse a plan whose predicted `peaks` exceed the memory budget on some rank, before anything runs."""
        memory = self.memory
        if peaks is None or memory is None or self.memory_budget is None or max(peaks) <= self.memory_budget:
            return
        rank = int(np.argmax(peaks))
        mb = max(step_plan.micro_batches_of(rank), key=lambda m: m.tokens_per_rank)
        raise MemoryBudgetError(
            f"the plan's micro-batch {mb.id} puts {mb.tokens_per_rank} tokens on HDP rank {rank} at offload ratio "
            f"{self.executor.offload_ratio(mb):.2f}: a predicted peak of {format_bytes(peaks[rank])} "
            f"(static {format_bytes(memory.static.total)}) over the budget of {format_bytes(self.memory_budget)}; "
            f"lower the capacity (now {self.capacity}; --capacity auto fits it) or raise the budget"
        )

    def _given_plan(self, given: Plan, lengths: np.ndarray) -> Plan:
        """`given`, validated and checked to be a plan of `lengths` for this world size."""
        self._validate(given)
        if (given.world_size, given.pp_size) != (self.world_size, self.pp_size):
            raise BatchError(
                f"the given plan is for {given.world_size} HDP ranks x pp_size {given.pp_size}, this run "
                f"has {self.world_size} x {self.pp_size}"
            )
        if list(given.sequences) != np.asarray(lengths).tolist():
            raise BatchError(
                f"the given plan is of sequence lengths {list(given.sequences)[:8]}..., not the batch's "
                f"{np.asarray(lengths).tolist()[:8]}... ({len(given.sequences)} vs {len(lengths)} "
                f"sequences): plan and batch are of different steps"
            )
        blockers = self.shard_blockers()
        joint = next((mb for mb in given.micro_batches if len(mb.ranks) > 1 or len(mb.sequences) > 1), None)
        if blockers and joint is not None:
            raise BatchError(
                f"the given plan runs micro-batch {joint.id} ({len(joint.sequences)} sequence(s) on ranks "
                f"{list(joint.ranks)}), but this model takes one sequence per micro-batch on one rank: "
                f"{'; '.join(blockers)}"
            )
        return given

    def shard_blockers(self) -> list[str]:
        """Why this model's sequences cannot be split over ranks or packed (empty: they can), from its probe."""
        return list(self.probe.shard_blockers)

    @property
    def probe(self) -> SetupProbe:
        """What planning reads of the compiled model (`engine/probe.py`), probed once: given at construction, or
        on the first call, which compiles the model if needed (with pipelines, on every rank at once: the stages'
        reasons are gathered). Taking it charges the cost model the model's mixer costs."""
        if self._probe is None:
            self._take_probe(probe_executor(self.executor, self.cost_model))
        return cast(SetupProbe, self._probe)

    def _take_probe(self, probe: SetupProbe) -> None:
        ours = (self.world_size, self.pp_size, self.tp_size)
        if (probe.hdp, probe.pp_size, probe.tp_size) != ours:
            raise ValueError(
                f"the given probe is of {probe.hdp} HDP ranks x pp {probe.pp_size} x tp {probe.tp_size}, this Runtime "
                f"runs {ours[0]} x pp {ours[1]} x tp {ours[2]}: probe the module this Runtime runs"
            )
        self._probe = probe
        self.cost_model = self.cost_model  # charged the probe's mixer costs

    def step(self, batch: BatchLike | Sequence[torch.Tensor], plan: Plan | None = None) -> StepStats:
        """Plan `batch` (or run the ready-made `plan`, e.g. the remote scheduler's, checked against the batch)
        and train one step on it: what it measured (the simulator's figures for its plan: `predict`)."""
        optimizer = self._stepped_optimizer()
        batch = _as_batch(batch, self.vocab_size)
        start = time.perf_counter()
        step_plan = self.plan(np.asarray(batch.lengths)) if plan is None else self._given_plan(plan, batch.lengths)
        plan_time = time.perf_counter() - start
        peaks = self.predicted_peaks(step_plan)
        self._check_memory(step_plan, peaks)  # the planner's plans and given ones alike
        ran = self._run(step_plan, batch, optimizer)
        ranks, mine = ran.ranks, self.global_rank // self.tp_size  # this rank's TP group's row
        loss, grad_norm = float(ranks["loss"].sum()), float(ranks["grad_norm"][mine])
        skipped = bool(ranks["skipped"][mine])
        self.steps += 1
        self._count_skip(skipped, loss, grad_norm)
        router = self.routing.finish(ran.routed, update=not skipped)
        auto = step_plan.auto
        cuda = self.device.type == "cuda"
        stats = StepStats(
            step=self.steps,
            strategy=self.strategy,
            loss=loss,
            tokens=int(np.asarray(batch.lengths).sum()),
            time=time.perf_counter() - start,
            plan_time=plan_time,
            busy=ranks["busy"].tolist(),
            micro_batches=ranks["micro_batches"].astype(int).tolist(),
            p2p_bytes=int(ranks["p2p_bytes"].sum()),
            mixer_bytes=int(ranks["mixer_bytes"].sum()),
            allreduce_bytes=ran.reduced_bytes,
            offloaded_bytes=int(ranks["offloaded_bytes"].sum()),
            peak_saved_bytes=ranks["peak_saved_bytes"].astype(int).tolist(),
            plan=step_plan,
            grad_norm=grad_norm,
            skipped=skipped,
            auto_choice=auto.chosen if auto else None,
            auto_speedup=auto.speedup_over_static if auto else None,
            stage_bytes=int(ranks["stage_bytes"].sum()),
            bubbles=self.executor.bubbles(ranks["busy"], float(ranks["forward_backward_time"].max())),
            reduce_time=ran.reduce_time,
            reduce_overlap=ran.reduce_overlap,
            predicted_peak_bytes=peaks,
            measured_peak_bytes=ranks["measured_peak_bytes"].astype(int).tolist() if cuda else None,
            measured_reserved_peak_bytes=ranks["measured_reserved_peak_bytes"].astype(int).tolist() if cuda else None,
            aux_loss=router.aux_loss if router is not None else 0.0,
            expert_load=router.expert_load if router is not None else None,
        )
        self.diagnostics.check(step=stats.step, seconds=stats.time, plan=step_plan, cost_model=self.cost_model)
        return stats

    def _run(self, step_plan: Plan, batch: BatchLike, optimizer: torch.optim.Optimizer | DistributedOptimizer) -> _Ran:
        """Forward and backward of this rank's micro-batches, the gradient reduction, clipping and the optimizer
        step (or its skip), then every rank's figures: the step's one wait for the device, at its end."""
        optimizer.zero_grad(set_to_none=False)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        sharded = optimizer if isinstance(optimizer, DistributedOptimizer) else None
        if sharded is not None:
            sharded.start(len(step_plan.micro_batches_of(self.rank)))
        clock = Stopwatch(self.device)
        began = clock.mark()
        with self.routing.tally() as tally:
            work = self.executor.forward_backward(step_plan, batch)
        backward_done = clock.mark()
        if sharded is not None:
            reduced_bytes = sharded.finish()
        else:
            reduced_bytes = sync_gradients(self.params, self.world_size, self.executor.sync_group)
        reduced = clock.mark()
        routed = self.routing.reduce(tally, self.device, self.tp_size)  # read after the figures' gather
        if self._replicas_unchecked:
            self._check_replicas(sharded)
        cuda = self.device.type == "cuda"
        measured = torch.cuda.max_memory_allocated(self.device) if cuda else 0
        reserved = torch.cuda.max_memory_reserved(self.device) if cuda else 0
        guard = self._clip_and_step(work.loss)
        clock.wait()  # the step's one wait for the device, once the optimizer step is issued: the clocks are read
        ranks = _every_rank(
            work,
            {
                "forward_backward_time": clock.seconds(began, backward_done),
                "measured_peak_bytes": measured,
                "measured_reserved_peak_bytes": reserved,
                "grad_norm": guard.norm,
                "skipped": guard.skip,
            },
            rank=self.global_rank,
            world_size=self.global_world_size,
            device=self.device,
            tp_size=self.tp_size,
        )
        overlap = sharded.launched_in_backward if sharded is not None else 0.0
        return _Ran(ranks, reduced_bytes, clock.seconds(backward_done, reduced), overlap, routed)

    def predict(self, step: StepStats | Plan) -> StepPrediction:
        """The simulator's figures for a step's plan under this Runtime's cost model, to hold its measured ones
        against: for the steps that are logged, once each (`engine/diagnostics.py`)."""
        return self.diagnostics.predict(step.plan if isinstance(step, StepStats) else step, self.cost_model)

    def forward_backward(self, step_plan: Plan, batch: BatchLike) -> RankWork:
        """Forward and backward of this rank's micro-batches of `step_plan`, gradients accumulated into `.grad`
        and not yet summed over ranks: a step without its gradient sync and optimizer update. Returns once the
        device has done them, so that a caller timing it on the host (calibration) times the work, not its launch."""
        work = self.executor.forward_backward(step_plan, batch)
        work.busy.wait()
        return work

    def evaluate(self, batch: BatchLike | Sequence[torch.Tensor]) -> float:
        """The token-level loss of `batch` (the same on every rank): planned and run like a step, in eval mode
        without gradients, so nothing is offloaded and no parameter or optimizer state changes."""
        batch = _as_batch(batch, self.vocab_size)
        loss = self.executor.evaluate(self.plan(np.asarray(batch.lengths)), batch)
        return float(self.gather([loss]).sum())  # the one read of the device

    def gather(self, values: Sequence[float | torch.Tensor]) -> np.ndarray:
        """Every HDP rank's `values` (host numbers, or 0-dim tensors on the device) as a [pp × HDP ranks,
        len(values)] array (stage-major; a TP group's once: its ranks did the same work), from one all-reduce over
        the world and one host read."""
        return gather(values, self.global_rank, self.global_world_size, self.device)[:: self.tp_size]

    def _count_skip(self, skipped: bool, loss: float, grad_norm: float) -> None:
        """Raise once `max_skipped_steps` steps in a row were skipped (the parameters are still those before them)."""
        self._skipped_in_a_row = self._skipped_in_a_row + [self.steps] if skipped else []
        if len(self._skipped_in_a_row) >= self.max_skipped_steps:
            raise SkippedStepsError(
                f"steps {self._skipped_in_a_row} were all skipped (last loss {loss}, gradient norm {grad_norm}); the "
                f"parameters are unchanged since step {self._skipped_in_a_row[0] - 1}: check the data (a batch with "
                f"no target gives 0/0) and the learning rate, or resume from a checkpoint"
            )

    def _stepped_optimizer(self) -> torch.optim.Optimizer | DistributedOptimizer:
        """The optimizer a step updates; a Runtime built without one refuses steps."""
        if self.optimizer is None:
            raise NoOptimizerError(
                "this Runtime was built with optimizer=None, for forwards and backwards only (calibration, "
                "forward_backward, evaluate): build it with the optimizer the steps update"
            )
        return self.optimizer

    def _clip_and_step(self, loss: torch.Tensor | float) -> StepGuard:
        """Clip the summed gradients to `max_grad_norm` over the whole model (every stage) and take the optimizer
        step, skipped on every rank when their norm or some rank's `loss` (this rank's) is not finite. Decided on
        the device: the distributed optimizer and fused AdamW take the guard without a host sync. The guard holds
        the norm before clipping and the skip flag, for the host to read after the step."""
        optimizer = self._stepped_optimizer()
        if isinstance(optimizer, DistributedOptimizer):
            guard = StepGuard.of(optimizer.grad_norm(), self.max_grad_norm, bad_loss=self._nonfinite(loss))
            optimizer.step(guard)
            return guard
        norm = self.executor.grad_norm(self.params)
        guard = StepGuard.of(norm, self.max_grad_norm, bad_loss=self._nonfinite(loss))
        guarded_step(optimizer, guard, self.params)
        return guard

    def _nonfinite(self, loss: torch.Tensor | float) -> torch.Tensor:
        """1.0 on every rank where some rank's `loss` is not finite, else 0.0: a 0-dim device tensor, summed over the
        world by one small all-reduce that the host does not wait for."""
        if isinstance(loss, torch.Tensor):
            flag = (~torch.isfinite(loss.detach().to(self.device, torch.float32))).float()
        else:  # a host float: filled on the device, no copy to wait for
            flag = torch.full((), float(not math.isfinite(loss)), dtype=torch.float32, device=self.device)
        if self.global_world_size > 1:
            dist.all_reduce(flag)
        return flag.clamp_(max=1.0)


def _as_batch(batch: BatchLike | Sequence[torch.Tensor], vocab_size: int | None) -> BatchLike:
    """`batch` with its reads checked against the vocabulary, or a list of token tensors as a `ListBatch`."""
    if hasattr(batch, "lengths"):
        return ids_checked(cast(BatchLike, batch), vocab_size)
    return ListBatch(batch, vocab_size)


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an int >= 1 (tokens), got {value!r}")


def _vocab_size(model: nn.Module) -> int | None:
    """Rows of the input embedding (HF `get_input_embeddings()`, else the first `nn.Embedding`), or the config's
    `vocab_size` (a pipeline stage after the first, which holds no embedding, checks the batch alike); None
    without either."""
    getter = getattr(model, "get_input_embeddings", None)
    embedding = (
        getter() if callable(getter) else next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    )
    if isinstance(embedding, nn.Embedding):
        return embedding.num_embeddings
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    return vocab if isinstance(vocab, int) else None
