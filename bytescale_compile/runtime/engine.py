"""The HDP training engine: one global batch → a plan → this rank's micro-batches → one optimizer step.

Every rank sees the same sequence lengths and plans identically (the planner is deterministic), so a
bad batch fails on every rank with the planner's message before any communication. Each rank then
runs its own micro-batches in plan order — different counts on different ranks — forward and backward
under each micro-batch's context and the step's act_ctx (which offloads the micro-batch's share r of
its saved activations, paper §4.2); ranks sharing a micro-batch meet in its ring. One bucketed
all-reduce sums the gradients (the loss is token-level, so a plain sum equals data parallelism's
gradient, paper Eq. 2 = Eq. 1), then clipping and the optimizer step. Strategies differ only in
the plan: "balance", "naive" and "static" all run through this code.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..api import OptimizedModule, optimize
from ..config import Config
from ..planner import CostModel, MicroBatch, ModelShape, Plan, plan
from .batch import build_micro_batch, num_targets
from .context import micro_batch
from .offload import get_act_ctx

__all__ = ["Runtime", "StepStats", "BatchLike"]

_BUCKET_BYTES = 25 * 2 ** 20


class BatchLike(Protocol):
    """What `Runtime.step` reads: every length, and tokens only of this rank's micro-batches."""

    lengths: np.ndarray

    def tokens(self, seq: int, start: int = 0, end: int | None = None) -> torch.Tensor: ...


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

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.time if self.time else 0.0

    @property
    def busy_spread(self) -> float:
        """max / min busy time over ranks that had work."""
        busy = [b for b in self.busy if b > 0]
        return max(busy) / min(busy) if busy else 1.0


class _ListBatch:
    """A list of 1-D token tensors as a batch."""

    def __init__(self, sequences: Sequence[torch.Tensor]) -> None:
        self.sequences = [torch.as_tensor(s).reshape(-1) for s in sequences]
        self.lengths = np.array([s.numel() for s in self.sequences], dtype=np.int64)

    def tokens(self, seq: int, start: int = 0, end: int | None = None) -> torch.Tensor:
        return self.sequences[seq][start:end].long()


class Runtime:
    """`Runtime(model, optimizer, config, cost_model, strategy)`; `step(batch) -> StepStats`."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, config: Config | None = None,
                 cost_model: CostModel | None = None, strategy: str = "balance", *, capacity: int = 8192,
                 max_grad_norm: float | None = 1.0, context_length: int | None = None) -> None:
        self.model = model if isinstance(model, OptimizedModule) else optimize(model, config)
        self.optimizer = optimizer
        self.cost_model = cost_model or default_cost_model(self.model)
        self.strategy, self.capacity, self.max_grad_norm = strategy, capacity, max_grad_norm
        self.context_length = context_length
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self._hf_labels = "labels" in inspect.signature(self.model.forward).parameters
        self.steps = 0

    def plan(self, lengths: np.ndarray) -> Plan:
        """The step's plan, validated before any communication (identical on every rank)."""
        result = plan(lengths, self.world_size, self.capacity, self.cost_model, strategy=self.strategy,
                      context_length=self.context_length)
        result.validate()
        return result

    def step(self, batch: BatchLike | Sequence[torch.Tensor]) -> StepStats:
        if not hasattr(batch, "lengths"):
            batch = _ListBatch(batch)
        start = time.perf_counter()
        step_plan = self.plan(np.asarray(batch.lengths))
        plan_time = time.perf_counter() - start
        num_items = num_targets(batch.lengths)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=False)
        loss, busy, p2p = torch.zeros(()), 0.0, 0
        mine = step_plan.micro_batches_of(self.rank)
        act_ctx = get_act_ctx(len(mine), [self._offload_ratio(mb) for mb in mine])
        for i, mb in enumerate(mine):
            began = time.perf_counter()
            inputs = build_micro_batch(mb, self.rank, batch.lengths, batch.tokens, num_items)
            kwargs = inputs.model_kwargs()
            if self._hf_labels:
                kwargs["labels"] = kwargs["shift_labels"]
            act_ctx.update_micro_batch_id(i)
            with micro_batch(ctx=inputs.context), act_ctx:
                mb_loss = self.model(**kwargs).loss
                mb_loss.backward()
            loss += mb_loss.detach()
            busy += time.perf_counter() - began
            p2p += inputs.context.ring_stats.bytes_sent
        allreduce_bytes = self._sync_gradients()
        offloaded = sum(s.offloaded_bytes for s in act_ctx.stats)
        peak_saved = max((s.peak_resident_bytes for s in act_ctx.stats), default=0)
        totals = self._gather([loss.item(), busy, float(len(mine)), float(p2p), float(offloaded), float(peak_saved)])
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.optimizer.step()
        self.steps += 1
        return StepStats(step=self.steps, strategy=self.strategy, loss=float(totals[:, 0].sum()),
                         tokens=int(np.asarray(batch.lengths).sum()), time=time.perf_counter() - start,
                         plan_time=plan_time, busy=totals[:, 1].tolist(), micro_batches=totals[:, 2].astype(int).tolist(),
                         p2p_bytes=int(totals[:, 3].sum()), allreduce_bytes=allreduce_bytes,
                         offloaded_bytes=int(totals[:, 4].sum()), peak_saved_bytes=totals[:, 5].astype(int).tolist(),
                         plan=step_plan)

    def _offload_ratio(self, mb: MicroBatch) -> float:
        """The plan's r ("auto"), Config's fixed ratio, or 0 ("off")."""
        mode = self.model.compile_config.offload
        if mode == "auto":
            return mb.offload_ratio
        return 0.0 if mode == "off" else float(mode)

    def _sync_gradients(self) -> int:
        """Sum gradients over all ranks in ~25 MiB buckets; ranks without micro-batches add zeros."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.world_size == 1:
            return 0
        sent, bucket, size = 0, [], 0
        for p in self.params:
            bucket.append(p)
            size += p.numel() * p.element_size()
            if size >= _BUCKET_BYTES:
                sent += _all_reduce(bucket)
                bucket, size = [], 0
        if bucket:
            sent += _all_reduce(bucket)
        return sent

    def _gather(self, values: list[float]) -> np.ndarray:
        """Every rank's `values` as a [world_size, len(values)] array (one small all-reduce)."""
        table = torch.zeros(self.world_size, len(values), dtype=torch.float64)
        table[self.rank] = torch.tensor(values, dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(table)
        return table.numpy()


def _all_reduce(params: list[nn.Parameter]) -> int:
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset: offset + p.numel()].view_as(p.grad))
        offset += p.numel()
    return flat.numel() * flat.element_size()


def default_cost_model(model: nn.Module) -> CostModel:
    """An analytic cost model from the model's config (our LLaMA or a Hugging Face one)."""
    cfg = getattr(model, "config", None)

    def field(*names: str) -> Any:
        for name in names:
            if hasattr(cfg, name):
                return getattr(cfg, name)
        raise ValueError(f"cannot read {names[0]} from {type(model).__name__}.config: pass Runtime(cost_model=...)")

    shape = ModelShape(name=type(model).__name__, layers=field("num_layers", "num_hidden_layers"),
                       hidden=field("hidden_size"), heads=field("num_heads", "num_attention_heads"),
                       kv_heads=field("num_kv_heads", "num_key_value_heads"), ffn=field("intermediate_size"),
                       vocab=field("vocab_size"))
    return CostModel.analytic(shape)
