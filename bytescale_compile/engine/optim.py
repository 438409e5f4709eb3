"""The optimizer a run trains with (`build_optimizer`, chosen from the weights' dtype and ZeRO) and the
learning-rate schedule (linear warmup, then cosine).

For fp32 weights torch's AdamW over `adamw.param_groups`, fused where torch has the kernel; with ZeRO-1 each rank of
the group that holds the same parameters keeps and updates the state of its share of them, a tensor-parallel
(DTensor) parameter partitioned and broadcast as this rank's local shard. For bf16 weights the distributed
optimizer (`dist_optim.py`). The schedule is a pure function of the step, set on the optimizer before every step: a
resumed run gets exactly the learning rates of an uninterrupted one without any scheduler state.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from .adamw import (
    IMPLEMENTATION_FLAGS,
    StepGuard,
    fused_supported,
    guarded_step,
    keeping_implementation,
    param_groups,
)
from .collectives import local
from .dist_optim import DistributedOptimizer
from .mesh import replica_group

__all__ = [
    "IMPLEMENTATION_FLAGS",
    "LRSchedule",
    "LocalZeroRedundancyOptimizer",
    "StepGuard",
    "build_optimizer",
    "fused_supported",
    "guarded_step",
    "keeping_implementation",
    "param_groups",
]
"""`adamw`'s names are also importable from here, where they were first."""


def build_optimizer(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    zero: bool = False,
    process_group: dist.ProcessGroup | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    grad_reduce_dtype: torch.dtype = torch.float32,
) -> torch.optim.Optimizer | DistributedOptimizer:
    """The optimizer of a model whose weights are in `dtype`, over `param_groups`: for fp32 weights AdamW, with
    `zero` ZeRO-1 (each rank of `process_group` keeps and updates its shard of the state), fused where torch has
    the kernel (`fused_supported`); for bf16 weights the distributed optimizer (`dist_optim.py`: fp32 main weights
    and moments sharded over the group, gradients reduced in `grad_reduce_dtype`), which always shards. The group
    defaults to the ranks holding the same parameters (`mesh.replica_group`: all, or with tensor parallelism the
    HDP ranks of this TP index); a pipeline stage passes its `stage_group`."""
    if dtype == torch.bfloat16:
        if zero:
            raise ValueError("bf16 weights train with the distributed optimizer, which always shards: drop zero")
        return DistributedOptimizer(
            model, lr, weight_decay, betas, group=process_group, grad_reduce_dtype=grad_reduce_dtype
        )
    if dtype != torch.float32:
        raise ValueError(f"weights train in float32 (AdamW) or bfloat16 (the distributed optimizer), not {dtype}")
    groups = [g for g in param_groups(model, weight_decay) if g["params"]]
    fused = fused_supported([p for g in groups for p in g["params"]])
    if zero:
        return LocalZeroRedundancyOptimizer(
            groups,
            optimizer_class=torch.optim.AdamW,
            process_group=replica_group(model, process_group),
            lr=lr,
            betas=betas,
            fused=fused,
        )
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=fused)


class LocalZeroRedundancyOptimizer(ZeroRedundancyOptimizer):
    """Torch's ZeRO-1, its updated parameters broadcast as local tensors: c10d cannot broadcast a DTensor, and a
    tensor-parallel rank holds and updates only its shard. The partition (by global size) is the same at every TP
    index, so each parameter's state lives on one HDP rank, as DTensors over its TP group. A plain parameter is
    its own local tensor: without tensor parallelism this is torch's ZeRO-1 bit for bit."""

    _partition_parameters: Callable[[], list[list[dict[str, Any]]]]
    """Torch's partition, per rank its parameter groups (a method its type stub leaves out)."""

    def _broadcast_params_from_rank(self, rank: int) -> list[Any]:
        """Group rank `rank`'s share, as local tensors: the handles of the asynchronous broadcasts."""
        source = dist.get_global_rank(self.process_group, rank)
        return [
            dist.broadcast(local(p.detach()), src=source, group=self.process_group, async_op=True)
            for group in self._partition_parameters()[rank]
            for p in group["params"]
        ]


class HasParamGroups(Protocol):
    """What a schedule sets learning rates on: a torch optimizer, or the distributed optimizer."""

    param_groups: list[dict[str, Any]]


@dataclass(frozen=True)
class LRSchedule:
    """Linear warmup to `peak` over steps 1..`warmup`, then cosine from `peak` (the next step) down to
    `peak * min_ratio` at step `decay_steps`, where it stays."""

    peak: float
    warmup: int
    decay_steps: int
    min_ratio: float = 0.1

    def lr(self, step: int) -> float:
        """The learning rate of optimizer step `step` (1-based)."""
        if step <= self.warmup:
            return self.peak * step / self.warmup
        progress = min(1.0, (step - self.warmup - 1) / max(1, self.decay_steps - self.warmup - 1))
        floor = self.peak * self.min_ratio
        return floor + 0.5 * (self.peak - floor) * (1.0 + math.cos(math.pi * progress))

    def apply(self, optimizer: HasParamGroups, step: int) -> float:
        """Set every group's learning rate for `step`; returns it."""
        lr = self.lr(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr
