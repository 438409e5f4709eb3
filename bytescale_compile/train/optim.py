"""AdamW over two parameter groups and the learning-rate schedule (linear warmup, then cosine).

Weight decay pulls matrices and embeddings toward zero; on a norm's gain or a bias it would only fight
the scale the layer needs, so parameters with fewer than two dimensions get none (the usual GPT/LLaMA
recipe). The schedule is a pure function of the step, set on the optimizer before every step: a resumed
run gets exactly the learning rates of an uninterrupted one without any scheduler state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

__all__ = ["LRSchedule", "build_optimizer", "param_groups"]


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Trainable parameters with >= 2 dimensions (decayed), then the rest (norms, biases: not decayed)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def build_optimizer(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    zero: bool = False,
    process_group: dist.ProcessGroup | None = None,
) -> torch.optim.Optimizer:
    """AdamW over `param_groups`; with `zero`, ZeRO-1 (each rank of `process_group`, default all, keeps and
    updates its shard of the state; a pipeline stage passes its `stage_group`)."""
    groups = [g for g in param_groups(model, weight_decay) if g["params"]]
    if zero:
        return ZeroRedundancyOptimizer(
            groups, optimizer_class=torch.optim.AdamW, process_group=process_group, lr=lr, betas=betas
        )
    return torch.optim.AdamW(groups, lr=lr, betas=betas)


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
