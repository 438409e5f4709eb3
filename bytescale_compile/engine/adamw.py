"""AdamW as the engine steps it: two parameter groups, torch's fused kernel, and a step whose clipping and skip are
decided on the device.

Weight decay pulls matrices and embeddings toward zero; on a norm's gain or a bias it would only fight the scale the
layer needs, so parameters with fewer than two dimensions get none (the usual GPT/LLaMA recipe).

AdamW is torch's fused kernel wherever torch has one (plain CUDA and CPU parameters; DTensors keep foreach): one
pass over the weights, moments and gradients, where the foreach implementation makes about eight. It also takes the
step's clipping and its skip decision as device tensors (`StepGuard`: `grad_scale` divides the gradients,
`found_inf` skips the update and leaves the step counters), so deciding either never waits for the host. Both
optimizers build on this module: torch's AdamW (`optim.py`) and the distributed optimizer (`dist_optim.py`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from .collectives import clip_grads_, local

__all__ = [
    "IMPLEMENTATION_FLAGS",
    "StepGuard",
    "fused_supported",
    "guarded_step",
    "keeping_implementation",
    "param_groups",
]

_FUSED_DEVICES = ("cuda", "cpu")
"""Devices whose fused AdamW kernel we run (torch has more; these are the ones tested)."""

IMPLEMENTATION_FLAGS = ("fused", "foreach", "capturable")
"""An optimizer group's keys that choose torch's implementation, not the arithmetic: a checkpoint's values of them
do not replace the running optimizer's."""

_CLIP_EPS = 1e-6
"""`torch.nn.utils.clip_grads_with_norm_`'s guard against a zero norm."""


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Trainable parameters with >= 2 dimensions (decayed), then the rest (norms, biases: not decayed)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


@contextmanager
def keeping_implementation(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Around a `load_state_dict`: keep each group's implementation (`fused`, `foreach`, `capturable`) as built,
    not as saved. Torch takes the saved groups whole, so a checkpoint of the foreach AdamW would turn a fused one
    back into foreach; step counters go where the implementation reads them: onto the parameters' devices in fp32
    for the fused kernel, onto the CPU for the foreach one (which torch moves to the device when the checkpoint's
    groups were fused, costing the foreach step a host read per parameter)."""
    built = [{key: group[key] for key in IMPLEMENTATION_FLAGS if key in group} for group in optimizer.param_groups]
    yield
    for group, flags in zip(optimizer.param_groups, built):
        group.update(flags)
        on_device = flags.get("fused") or flags.get("capturable")
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if isinstance(state.get("step"), torch.Tensor):
                where = local(p).device if on_device else torch.device("cpu")
                state["step"] = state["step"].to(device=where, dtype=torch.float32)


def fused_supported(params: list[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW takes `params`: plain floating-point tensors on a device with the kernel. Not
    DTensors: the kernel refuses their plain step counters over a TP group of more than one rank."""
    return bool(params) and all(
        not isinstance(p, DTensor) and p.is_floating_point() and p.device.type in _FUSED_DEVICES for p in params
    )


@dataclass(frozen=True)
class StepGuard:
    """What the next optimizer step does with the summed gradients, decided on the device so that no host sync
    precedes the step: `norm` is their 2-norm (0-dim fp32), clipped to `max_norm` (None: not clipped); the step is
    skipped where `skip` is 1.0 (a non-finite norm, or a non-finite loss anywhere). Read `norm` and `skip` on the
    host only once the step has been issued."""

    norm: torch.Tensor
    skip: torch.Tensor
    max_norm: float | None = None

    @classmethod
    def of(cls, norm: torch.Tensor, max_norm: float | None, *, bad_loss: torch.Tensor | None = None) -> StepGuard:
        """The guard of gradients of norm `norm`; `bad_loss` (0-dim, nonzero: some rank's loss is not finite)
        skips the step too."""
        norm = norm.float()
        skip = (~torch.isfinite(norm)).float()
        if bad_loss is not None:
            skip = torch.maximum(skip, (bad_loss != 0).float())
        return cls(norm, skip, max_norm)

    def grad_scale(self) -> torch.Tensor | None:
        """What a fused step divides the gradients by to clip them, `1 / min(1, max_norm / (norm + 1e-6))` (1 where
        the norm is not finite: the step is skipped then); None without clipping."""
        if self.max_norm is None:
            return None
        divisor = torch.clamp((self.norm + _CLIP_EPS) / self.max_norm, min=1.0)
        return torch.where(torch.isfinite(divisor), divisor, torch.ones_like(divisor))


def guarded_step(optimizer: torch.optim.Optimizer, guard: StepGuard, params: list[nn.Parameter]) -> None:
    """Clip `params`' gradients and step `optimizer` as `guard` says. A fused Adam(W), ZeRO-1 over one included,
    takes both as device tensors (no host sync); any other optimizer gets the gradients scaled in place by
    `clip_grads_with_norm_`'s factor and steps unless the host, reading `guard.skip`, says otherwise."""
    target = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    if _fused(target):
        _step_fused(optimizer, target, guard)
        return
    if guard.max_norm is not None:
        clip_grads_(params, guard.max_norm, guard.norm)
    if not bool(guard.skip):
        optimizer.step()


def _fused(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every group of `optimizer` runs torch's fused Adam(W), whose step reads `grad_scale`/`found_inf`."""
    return isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and all(
        g.get("fused") for g in optimizer.param_groups
    )


def _step_fused(stepped: torch.optim.Optimizer, fused: torch.optim.Optimizer, guard: StepGuard) -> None:
    """`stepped.step()` with `fused` (itself, or ZeRO's local optimizer) reading the guard as torch's GradScaler
    hands it over: attributes its step passes to the kernel."""
    fused.grad_scale = guard.grad_scale()  # type: ignore[attr-defined]
    fused.found_inf = guard.skip  # type: ignore[attr-defined]
    try:
        stepped.step()
    finally:
        fused.grad_scale = fused.found_inf = None  # type: ignore[attr-defined]
