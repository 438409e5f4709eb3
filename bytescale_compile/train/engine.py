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
from typing import Any, Protocol

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
from .batch import build_micro_batch, num_targets
from .collectives import gather, sync_gradients

__all__ = ["Runtime", "StepStats", "RankWork", "BatchLike", "ListBatch", "ModelProtocolError", "BatchError",
           "SkippedStepsError", "CostModelWarning", "prediction_off", "PREDICTION_TOLERANCE", "RUNTIME_STRATEGIES"]

RUNTIME_STRATEGIES = (*STRATEGIES, AUTO)
"""What a Runtime plans with: the planner's strategies, which name a plan, and "auto", which picks one of
them per step (its plans carry the winner's name, so `planner.STRATEGIES` stays what a Plan may be)."""


class ModelProtocolError(TypeError):
    """The model does not take or return what the runtime's model protocol needs (see DESIGN.md)."""


class BatchError(ValueError):
    """A global batch the runtime cannot train on: not 1-D integer token ids inside the vocabulary."""


class SkippedStepsError(RuntimeError):
    """Too many steps in a row had a non-finite loss or gradient: training is not making progress."""


class CostModelWarning(UserWarning):
    """Measured step times are far from the cost model's predictions: the plans it balances may be poor."""


PREDICTION_TOLERANCE = 2.0
"""Measured and predicted step time may differ by this factor either way before the runtime warns."""
_COMPARED_CALLS = (2, 3)
"""Which of a Runtime's steps are held against the prediction: the first compiles the model."""


class BatchLike(Protocol):
    """What `Runtime.step` reads: every length, and tokens only of this rank's micro-batches."""

    lengths: np.ndarray

    def tokens(self, seq: int, start: int = 0, end: int | None = None) -> torch.Tensor: ...


@dataclass(frozen=True)
class RankWork:
    """What one rank's micro-batches of a step did (`Runtime.forward_backward`)."""

    loss: float
    busy: float
    """Seconds in its micro-batches."""
    micro_batches: int
    p2p_bytes: int
    offloaded_bytes: int
    peak_saved_bytes: int


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


class ListBatch:
    """A list of 1-D integer token tensors as a batch, checked against the vocabulary."""

    def __init__(self, sequences: Sequence[torch.Tensor], vocab_size: int | None) -> None:
        self.sequences = [torch.as_tensor(s) for s in sequences]
        for i, seq in enumerate(self.sequences):
            if seq.dim() != 1 or seq.numel() == 0:
                raise BatchError(f"sequence {i} has shape {tuple(seq.shape)}: each sequence must be a non-empty 1-D "
                                 f"tensor of token ids")
            if seq.dtype.is_floating_point or seq.dtype.is_complex or seq.dtype == torch.bool:
                raise BatchError(f"sequence {i} holds {seq.dtype} values: token ids must be integers")
            low, high = int(seq.min()), int(seq.max())
            if low < 0 or (vocab_size is not None and high >= vocab_size):
                raise BatchError(f"sequence {i} holds token id {low if low < 0 else high}, outside the model's "
                                 f"vocabulary of {vocab_size} (ids 0 to {(vocab_size or 1) - 1})")
        self.lengths = np.array([s.numel() for s in self.sequences], dtype=np.int64)

    def tokens(self, seq: int, start: int = 0, end: int | None = None) -> torch.Tensor:
        return self.sequences[seq][start:end].long()


class Runtime:
    """`Runtime(model, optimizer, config, cost_model, strategy)`; `step(batch) -> StepStats`,
    `evaluate(batch) -> float`.

    `mixed_precision` (None or torch.bfloat16/float16) is the autocast dtype of every forward; the model
    stays where it is, and every micro-batch input goes to the device of its parameters.
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
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.device = next(self.model.parameters()).device
        self.mixed_precision = mixed_precision
        if isinstance(max_skipped_steps, bool) or not isinstance(max_skipped_steps, int) or max_skipped_steps < 1:
            raise ValueError(f"max_skipped_steps must be an int >= 1, got {max_skipped_steps!r}")
        self.max_skipped_steps = max_skipped_steps
        self.vocab_size = _vocab_size(self.model.original_module)
        self._hf_labels = "labels" in inspect.signature(self.model.original_module.forward).parameters
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
                      context_length=self.context_length, shard_blocker="; ".join(blockers) or None)
        result.validate()
        return result

    def _given_plan(self, given: Plan, lengths: np.ndarray) -> Plan:
        """`given`, validated and checked to be a plan of `lengths` for this world size."""
        given.validate()
        if given.world_size != self.world_size:
            raise BatchError(f"the given plan is for {given.world_size} ranks, this run has {self.world_size}")
        if list(given.sequences) != np.asarray(lengths).tolist():
            raise BatchError(f"the given plan is of sequence lengths {list(given.sequences)[:8]}..., not the batch's "
                             f"{np.asarray(lengths).tolist()[:8]}... ({len(given.sequences)} vs {len(lengths)} "
                             f"sequences): plan and batch are of different steps")
        return given

    def shard_blockers(self) -> list[str]:
        """Why this model's sequences cannot be split over ranks or packed (empty: they can); compiles it first
        if needed. Every rank compiles the same model, so every rank reaches the same answer without communicating.
        """
        if not self.model.compilations:
            self._compile_probe()
        return self.model.shard_blockers()

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
        self.model.train()
        with self._autocast():
            self.model(**kwargs)

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
        work = self.forward_backward(step_plan, batch)
        allreduce_bytes = self._sync_gradients()
        totals = self._gather([work.loss, work.busy, float(work.micro_batches), float(work.p2p_bytes),
                               float(work.offloaded_bytes), float(work.peak_saved_bytes)])
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm or math.inf))
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
                          auto_speedup=auto.get("speedup_over_static"))
        self._compare_with_prediction(stats)
        return stats

    def forward_backward(self, step_plan: Plan, batch: BatchLike) -> RankWork:
        """Forward and backward of this rank's micro-batches of `step_plan`, gradients accumulated into `.grad`
        and not yet summed over ranks: a step without its gradient sync and optimizer update."""
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
        if len(self._timed) < _COMPARED_CALLS[-1] or self.rank != 0:
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

    def _sync_gradients(self) -> int:
        """Sum gradients over all ranks; ranks without micro-batches add zeros."""
        return sync_gradients(self.params, self.world_size)

    def _gather(self, values: list[float]) -> np.ndarray:
        return gather(values, self.rank, self.world_size, self.device)


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
    """Rows of the input embedding (HF `get_input_embeddings()`, else the first `nn.Embedding`); None without one."""
    getter = getattr(model, "get_input_embeddings", None)
    embedding = getter() if callable(getter) else next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return embedding.num_embeddings if isinstance(embedding, nn.Embedding) else None
