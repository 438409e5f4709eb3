"""The HDP training engine: one global batch → a plan → this rank's micro-batches → one optimizer step.

Every rank sees the same sequence lengths and plans identically (the planner is deterministic), so a
bad batch fails on every rank with the planner's message before any communication. Each rank then
runs its own micro-batches in plan order — different counts on different ranks — forward and backward
under each micro-batch's context and the step's act_ctx (which offloads the micro-batch's share r of
its saved activations, paper §4.2); ranks sharing a micro-batch meet in its ring. One bucketed
all-reduce sums the gradients (the loss is token-level, so a plain sum equals data parallelism's
gradient, paper Eq. 2 = Eq. 1), then clipping and the optimizer step — skipped on every rank when
the loss or the gradient norm is not finite (both are the same on every rank after the reductions).
Strategies differ only in the plan: "balance", "naive", "static" and "auto" (the fastest of the planner's
candidates under the simulator, `planner/auto.py`) all run through this code.

With pipelines (a stage from `pipeline_stage`, `pp_size > 1`) the forwards and backwards run in 1F1B on the
stage's ranks (`train/pipeline.py`); gradients are summed over the stage's HDP ranks only, and the norm that
clipping and the skip test read spans every stage.

Mixed precision is autocast around the forward only: parameters, gradients and optimizer state stay
fp32 (the master weights), the loss comes back in fp32, and the backward runs outside autocast as
PyTorch recommends.

After its first measured steps (steps 2 and 3 of this Runtime: the first compiles) rank 0 holds their
wall time against the simulator's prediction for their plans and warns once, naming the cost model,
when they differ by more than 2× either way: plans balanced by a cost model that far off may be poor.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..api import OptimizedModule, optimize
from ..config import Config
from ..planner import AUTO, STRATEGIES, CostModel, MicroBatch, Plan, plan
from ..planner.model_shape import model_shape
from ..runtime.context import micro_batch
from ..runtime.offload import get_act_ctx
from ..sim.simulator import step_time
from .batch import (
    BatchError,
    BatchLike,
    ListBatch,
    ModelProtocolError,
    RankWork,
    build_micro_batch,
    num_targets,
)
from .collectives import gather, sync_gradients
from .pipeline import PipelineExecutor
from .stages import is_hf_model, stage_inputs, stage_spec

__all__ = ["Runtime", "StepStats", "RankWork", "BatchLike", "ListBatch", "ModelProtocolError", "BatchError",
           "SkippedStepsError", "CostModelWarning", "prediction_off", "PREDICTION_TOLERANCE", "RUNTIME_STRATEGIES"]

RUNTIME_STRATEGIES = (*STRATEGIES, AUTO)
"""What a Runtime plans with: the planner's strategies, which name a plan, and "auto", which picks one of
them per step (its plans carry the winner's name, so `planner.STRATEGIES` stays what a Plan may be)."""


class SkippedStepsError(RuntimeError):
    """Too many steps in a row had a non-finite loss or gradient: training is not making progress."""


class CostModelWarning(UserWarning):
    """Measured step times are far from the cost model's predictions: the plans it balances may be poor."""


PREDICTION_TOLERANCE = 2.0
"""Measured and predicted step time may differ by this factor either way before the runtime warns."""
_COMPARED_CALLS = (2, 3)
"""Which of a Runtime's steps are held against the prediction: the first compiles the model."""


@dataclass
class StepStats:
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
    """Ring bytes sent by all ranks together, forward and backward."""
    allreduce_bytes: int
    """Gradient bytes each rank all-reduced."""
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
    predicted_time: float = 0.0
    """Seconds the simulator predicts for `plan` under the runtime's cost model."""
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

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.time if self.time else 0.0

    @property
    def time_vs_predicted(self) -> float:
        """Measured / predicted step time (0 without a prediction): above 1, slower than the cost model says."""
        return self.time / self.predicted_time if self.predicted_time > 0 else 0.0

    @property
    def busy_spread(self) -> float:
        """max / min busy time over ranks that had work."""
        busy = [b for b in self.busy if b > 0]
        return max(busy) / min(busy) if busy else 1.0


class Runtime:
    """`Runtime(model, optimizer, config, cost_model, strategy)`; `step(batch) -> StepStats`,
    `evaluate(batch) -> float`.

    `mixed_precision` (None or torch.bfloat16/float16) is the autocast dtype of every forward; the model
    stays where it is, and every micro-batch input goes to the device of its parameters.

    Given a pipeline stage (`bsc.pipeline_stage(model, pp_size)`) instead of a whole model, the job's
    `pp_size * hdp` processes train pipelines: `rank` and `world_size` are then the HDP rank and the number
    of HDP ranks (what plans are made for), the plans have the stage's `pp_size`, each step runs in 1F1B
    (`train/pipeline.py`), and the optimizer holds the stage's parameters only.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, config: Config | None = None,
                 cost_model: CostModel | None = None, strategy: str = "balance", *, capacity: int = 8192,
                 max_grad_norm: float | None = 1.0, context_length: int | None = None,
                 mixed_precision: torch.dtype | None = None, max_skipped_steps: int = 3) -> None:
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
        self.cost_model = cost_model or default_cost_model(self.model)
        self.strategy, self.capacity, self.max_grad_norm = strategy, capacity, max_grad_norm
        self.context_length = context_length
        self.global_rank = dist.get_rank() if dist.is_initialized() else 0
        self.global_world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.device = next(self.model.parameters()).device
        self.mixed_precision = mixed_precision
        spec = stage_spec(self.model)
        self.pp_size = spec.pp_size if spec is not None else 1
        self.pipeline = (PipelineExecutor(self.model, autocast=self._autocast, offload_ratio=self._offload_ratio)
                         if spec is not None else None)
        """The 1F1B executor of this rank's stage; None for a whole model."""
        self.world_size = self.global_world_size // self.pp_size
        """HDP ranks: the ranks a plan is made for."""
        self.rank = self.global_rank % self.world_size
        if isinstance(max_skipped_steps, bool) or not isinstance(max_skipped_steps, int) or max_skipped_steps < 1:
            raise ValueError(f"max_skipped_steps must be an int >= 1, got {max_skipped_steps!r}")
        self.max_skipped_steps = max_skipped_steps
        self.vocab_size = _vocab_size(self.model.original_module)
        original = self.model.original_module
        self._hf_labels = is_hf_model(original) or "labels" in inspect.signature(original.forward).parameters
        self._blockers: list[str] | None = None
        self.steps = 0
        self._skipped_in_a_row: list[int] = []
        self._timed: list[StepStats] = []
        """This Runtime's steps so far, up to the last of `_COMPARED_CALLS`."""

    def plan(self, lengths: np.ndarray) -> Plan:
        """The step's plan, validated before any communication (identical on every rank).

        A model whose compiled graphs hold an attention the pass left alone is never sharded nor packed:
        every sequence runs alone on one rank, and one longer than the capacity is refused.
        """
        blockers = self.shard_blockers()
        result = plan(lengths, self.world_size, self.capacity, self.cost_model, strategy=self.strategy,
                      pp_size=self.pp_size, context_length=self.context_length,
                      shard_blocker="; ".join(blockers) or None)
        result.validate()
        return result

    def _given_plan(self, given: Plan, lengths: np.ndarray) -> Plan:
        """`given`, validated and checked to be a plan of `lengths` for this world size."""
        given.validate()
        if (given.world_size, given.pp_size) != (self.world_size, self.pp_size):
            raise BatchError(f"the given plan is for {given.world_size} HDP ranks x pp_size {given.pp_size}, this run "
                             f"has {self.world_size} x {self.pp_size}")
        if list(given.sequences) != np.asarray(lengths).tolist():
            raise BatchError(f"the given plan is of sequence lengths {list(given.sequences)[:8]}..., not the batch's "
                             f"{np.asarray(lengths).tolist()[:8]}... ({len(given.sequences)} vs {len(lengths)} "
                             f"sequences): plan and batch are of different steps")
        blockers = self.shard_blockers()
        joint = next((mb for mb in given.micro_batches if len(mb.ranks) > 1 or len(mb.sequences) > 1), None)
        if blockers and joint is not None:
            raise BatchError(f"the given plan runs micro-batch {joint.id} ({len(joint.sequences)} sequence(s) on ranks "
                             f"{list(joint.ranks)}), but this model takes one sequence per micro-batch on one rank: "
                             f"{'; '.join(blockers)}")
        return given

    def shard_blockers(self) -> list[str]:
        """Why this model's sequences cannot be split over ranks or packed (empty: they can); compiles it first
        if needed. Every rank compiles the same model, so every rank reaches the same answer without communicating.
        Pipeline stages hold different layers: the first call gathers every stage's reasons (a collective), so
        every rank plans alike.
        """
        if not self.model.compilations:
            self._compile_probe()
        if self.pipeline is None:
            return self.model.shard_blockers()
        if self._blockers is None:
            everyone: list[list[str]] = [[] for _ in range(self.global_world_size)]
            dist.all_gather_object(everyone, self.model.shard_blockers())
            self._blockers = list(dict.fromkeys(reason for reasons in everyone for reason in reasons))
        return self._blockers

    def _compile_probe(self) -> None:
        """Compile the model on a tiny packed row (two sequences of 4 tokens) so planning can read its report.

        Forward only, outside any micro-batch context: nothing is communicated and no gradient is touched.
        """
        positions = torch.arange(4, device=self.device).repeat(2)[None]
        labels = torch.zeros_like(positions)
        labels[:, 3::4] = -100
        kwargs = {"input_ids": torch.zeros_like(positions), "position_ids": positions, "shift_labels": labels,
                  "num_items_in_batch": torch.tensor(6, device=self.device)}
        if self._hf_labels:
            kwargs["labels"] = labels
        if self.pipeline is not None:
            hidden = torch.zeros(1, 8, self.pipeline.hidden_size, device=self.device, dtype=self.params[0].dtype)
            kwargs = stage_inputs(self.pipeline.spec, kwargs, None if self.pipeline.spec.is_first else hidden)
        self.model.train()
        with self._autocast():
            self.model.compile_and_run(**kwargs)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.mixed_precision is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.mixed_precision)

    def step(self, batch: BatchLike | Sequence[torch.Tensor], plan: Plan | None = None) -> StepStats:
        """Plan `batch` (or run the ready-made `plan`, e.g. the remote scheduler's, checked against the batch)
        and train one step on it."""
        if not hasattr(batch, "lengths"):
            batch = ListBatch(batch, self.vocab_size)
        start = time.perf_counter()
        step_plan = self.plan(np.asarray(batch.lengths)) if plan is None else self._given_plan(plan, batch.lengths)
        plan_time = time.perf_counter() - start
        self.optimizer.zero_grad(set_to_none=False)
        began = time.perf_counter()
        work = self.forward_backward(step_plan, batch)
        forward_backward_time = time.perf_counter() - began
        allreduce_bytes = sync_gradients(self.params, self.world_size,
                                         self.pipeline.stage_group if self.pipeline is not None else None)
        totals = self._gather([work.loss, work.busy, float(work.micro_batches), float(work.p2p_bytes),
                               float(work.offloaded_bytes), float(work.peak_saved_bytes), float(work.stage_bytes),
                               forward_backward_time])
        grad_norm = self._clip_gradients()
        skipped = not (math.isfinite(grad_norm) and math.isfinite(float(totals[:, 0].sum())))
        if not skipped:
            self.optimizer.step()
        self.steps += 1
        self._count_skip(skipped, float(totals[:, 0].sum()), grad_norm)
        auto = step_plan.meta.get("auto", {})
        stats = StepStats(step=self.steps, strategy=self.strategy, loss=float(totals[:, 0].sum()),
                          tokens=int(np.asarray(batch.lengths).sum()), time=time.perf_counter() - start,
                          plan_time=plan_time, busy=totals[:, 1].tolist(),
                          micro_batches=totals[:, 2].astype(int).tolist(), p2p_bytes=int(totals[:, 3].sum()),
                          allreduce_bytes=allreduce_bytes,
                          offloaded_bytes=int(totals[:, 4].sum()), peak_saved_bytes=totals[:, 5].astype(int).tolist(),
                          plan=step_plan, grad_norm=grad_norm, skipped=skipped,
                          predicted_time=step_time(step_plan, self.cost_model), auto_choice=auto.get("chosen"),
                          auto_speedup=auto.get("speedup_over_static"), stage_bytes=int(totals[:, 6].sum()),
                          bubbles=self._bubbles(totals[:, 1], float(totals[:, 7].max())))
        self._compare_with_prediction(stats)
        return stats

    def forward_backward(self, step_plan: Plan, batch: BatchLike) -> RankWork:
        """Forward and backward of this rank's micro-batches of `step_plan`, gradients accumulated into `.grad`
        and not yet summed over ranks: a step without its gradient sync and optimizer update."""
        if self.pipeline is not None:
            return self.pipeline.forward_backward(step_plan, batch)
        num_items = num_targets(batch.lengths)
        self.model.train()
        loss, busy, p2p = torch.zeros((), device=self.device), 0.0, 0
        mine = step_plan.micro_batches_of(self.rank)
        act_ctx = get_act_ctx(len(mine), [self._offload_ratio(mb) for mb in mine])
        for i, mb in enumerate(mine):
            began = time.perf_counter()
            inputs = build_micro_batch(mb, self.rank, batch.lengths, batch.tokens, num_items)
            act_ctx.update_micro_batch_id(i)
            with micro_batch(ctx=inputs.context), act_ctx:
                with self._autocast():
                    mb_loss = self._loss(self.model(**inputs.model_kwargs(self.device, self._hf_labels))).float()
                mb_loss.backward()
            loss += mb_loss.detach()
            busy += time.perf_counter() - began
            p2p += inputs.context.ring_stats.bytes_sent
        return RankWork(loss=loss.item(), busy=busy, micro_batches=len(mine), p2p_bytes=p2p,
                        offloaded_bytes=sum(s.offloaded_bytes for s in act_ctx.stats),
                        peak_saved_bytes=max((s.peak_resident_bytes for s in act_ctx.stats), default=0))

    def _compare_with_prediction(self, stats: StepStats) -> None:
        """Warn once, on rank 0, when this Runtime's steps `_COMPARED_CALLS` together took more than
        `PREDICTION_TOLERANCE` times their predicted time, or less than its inverse."""
        if len(self._timed) >= _COMPARED_CALLS[-1]:
            return
        self._timed.append(stats)
        if len(self._timed) < _COMPARED_CALLS[-1] or self.global_rank != 0:
            return
        compared = self._timed[_COMPARED_CALLS[0] - 1:]
        measured, predicted = sum(s.time for s in compared), sum(s.predicted_time for s in compared)
        if prediction_off(measured, predicted):
            steps = f"steps {compared[0].step}-{compared[-1].step}"
            warnings.warn(_prediction_message(steps, measured, predicted, self.cost_model), CostModelWarning,
                          stacklevel=3)

    def evaluate(self, batch: BatchLike | Sequence[torch.Tensor]) -> float:
        """The token-level loss of `batch` (the same on every rank): planned and run like a step, in eval mode
        without gradients, so nothing is offloaded and no parameter or optimizer state changes."""
        if not hasattr(batch, "lengths"):
            batch = ListBatch(batch, self.vocab_size)
        step_plan = self.plan(np.asarray(batch.lengths))
        if self.pipeline is not None:
            return float(self._gather([self.pipeline.evaluate(step_plan, batch)])[:, 0].sum())
        num_items = num_targets(batch.lengths)
        loss = torch.zeros((), dtype=torch.float64)
        self.model.eval()
        try:
            with torch.no_grad():
                for mb in step_plan.micro_batches_of(self.rank):
                    inputs = build_micro_batch(mb, self.rank, batch.lengths, batch.tokens, num_items)
                    with micro_batch(ctx=inputs.context), self._autocast():
                        loss += self._loss(self.model(**inputs.model_kwargs(self.device, self._hf_labels))).double().cpu()
        finally:
            self.model.train()
        return float(self._gather([loss.item()])[:, 0].sum())

    def _count_skip(self, skipped: bool, loss: float, grad_norm: float) -> None:
        """Raise once `max_skipped_steps` steps in a row were skipped (the parameters are still those before them)."""
        self._skipped_in_a_row = self._skipped_in_a_row + [self.steps] if skipped else []
        if len(self._skipped_in_a_row) >= self.max_skipped_steps:
            raise SkippedStepsError(
                f"steps {self._skipped_in_a_row} were all skipped (last loss {loss}, gradient norm {grad_norm}); the "
                f"parameters are unchanged since step {self._skipped_in_a_row[0] - 1}: check the data (a batch with "
                f"no target gives 0/0) and the learning rate, or resume from a checkpoint")

    def _loss(self, output: Any) -> torch.Tensor:
        loss = getattr(output, "loss", None)
        if not isinstance(loss, torch.Tensor):
            model = type(self.model.original_module).__name__
            given = "input_ids, position_ids, shift_labels, num_items_in_batch" + (", labels" if self._hf_labels else "")
            raise ModelProtocolError(f"{model} returned no loss (output.loss is {loss!r}) although the runtime passed "
                                     f"{given}: its forward must compute the summed next-token loss from shift_labels "
                                     f"(or labels) divided by num_items_in_batch")
        return loss

    def _offload_ratio(self, mb: MicroBatch) -> float:
        """The plan's r ("auto"), Config's fixed ratio, or 0 ("off")."""
        mode = self.model.compile_config.offload
        if mode == "auto":
            return mb.offload_ratio
        return 0.0 if mode == "off" else float(mode)

    def _clip_gradients(self) -> float:
        """Clip the summed gradients to `max_grad_norm` over the whole model (every stage); their norm before."""
        if self.pipeline is None:
            return float(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm or math.inf))
        norm = self.pipeline.grad_norm(self.params)
        if self.max_grad_norm is not None and math.isfinite(norm) and self.max_grad_norm / (norm + 1e-6) < 1.0:
            for p in self.params:
                p.grad.mul_(self.max_grad_norm / (norm + 1e-6))
        return norm

    def _bubbles(self, busy: np.ndarray, forward_backward_time: float) -> list[float] | None:
        """Each pipeline's measured bubble rate from its stages' busy seconds (stage-major ranks)."""
        if self.pipeline is None or forward_backward_time <= 0:
            return None
        per_stage = busy.reshape(self.pp_size, self.world_size)
        return (1.0 - per_stage.sum(axis=0) / (self.pp_size * forward_backward_time)).tolist()

    def _gather(self, values: list[float]) -> np.ndarray:
        return gather(values, self.global_rank, self.global_world_size, self.device)


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an int >= 1 (tokens), got {value!r}")


def prediction_off(measured: float, predicted: float, tolerance: float = PREDICTION_TOLERANCE) -> bool:
    """Measured and predicted seconds differ by more than `tolerance` either way (never without a prediction)."""
    if measured <= 0 or predicted <= 0:
        return False
    return max(measured / predicted, predicted / measured) > tolerance


def _prediction_message(steps: str, measured: float, predicted: float, cost_model: CostModel) -> str:
    how = f"{measured / predicted:.3g}x slower" if measured > predicted else f"{predicted / measured:.3g}x faster"
    return (f"{steps} took {measured:.3g} s, {how} than the {predicted:.3g} s that cost model "
            f"{cost_model.source!r} (hardware {cost_model.hardware.name!r}) predicts: plans balanced by it may be "
            f"poor. Fit one on this machine with `bytescale-compile profile MODULE:FACTORY --out cost.json` and pass "
            f"it (Runtime(cost_model=CostModel.load('cost.json')), or cost_model in the training config)")


def default_cost_model(model: nn.Module) -> CostModel:
    """An analytic cost model from the config of the model (behind `optimize()` if wrapped): our LLaMA or any
    Hugging Face causal LM; `ModelConfigError` names the model class and the field it could not read."""
    return CostModel.analytic(model_shape(model))


def _vocab_size(model: nn.Module) -> int | None:
    """Rows of the input embedding (HF `get_input_embeddings()`, else the first `nn.Embedding`), or the config's
    `vocab_size` (a pipeline stage after the first, which holds no embedding, checks the batch alike); None
    without either."""
    getter = getattr(model, "get_input_embeddings", None)
    embedding = getter() if callable(getter) else next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if isinstance(embedding, nn.Embedding):
        return embedding.num_embeddings
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    return vocab if isinstance(vocab, int) else None
