"""The collectives of a training step, shared by the HDP `Runtime` and the pipeline executor: summing
gradients over the ranks that hold the same parameters, and gathering per-rank figures; with the gradients'
squares and clipping, which read a tensor-parallel (DTensor) gradient through its local shard; and the check,
once, that a tensor-parallel model's plain (replicated) parameters got the same gradient on every rank of their
TP group.

A plain parameter that each TP rank applies to its own heads only (Qwen3's `q_norm` / `k_norm` under torch's
`parallelize_module` with column-parallel q/k/v) gets a partial gradient on each rank, and nothing sums them:
the replicas drift apart silently. Replicas computed honestly from the same tokens are bitwise equal (measured on
CPU under both `bsc.tensor_parallel` and a user's plan), while partial ones differ by the order of the gradient
itself, so `REPLICA_TOLERANCE` sits far from both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from ..kernels.transfer import to_device
from ..planner.memory import BUCKET_BYTES

__all__ = [
    "BUCKET_BYTES",
    "REPLICA_TOLERANCE",
    "ReplicaGradientError",
    "check_replica_gradients",
    "clip_grads_",
    "gather",
    "grad_square_sum",
    "local",
    "sync_gradients",
]

REPLICA_TOLERANCE = 1e-3
"""How far apart (relative to the gradient's Σ|g| or Σg²) a replicated parameter's checksums may be over its TP
group: honest replicas are equal up to the last bit or a nondeterministic kernel's rounding, partial ones O(1)."""

_SHOWN = 16
"""Parameters named in the refusal; the count says how many more."""


class ReplicaGradientError(RuntimeError):
    """Plain parameters of a tensor-parallel model got different gradients on the ranks of their TP group: each
    holds a part only, and training them would let the replicas drift apart."""


def sync_gradients(params: list[nn.Parameter], group_size: int, group: dist.ProcessGroup | None = None) -> int:
    """Sum each parameter's gradient over the `group_size` ranks of `group` (default: all), in buckets of
    `BUCKET_BYTES`; a parameter no micro-batch touched adds zeros. The bytes this rank all-reduced."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if group_size == 1:
        return 0
    sent, bucket, size = 0, [], 0
    for p in params:
        bucket.append(p)
        size += local(p).numel() * p.element_size()
        if size >= BUCKET_BYTES:
            sent += _all_reduce(bucket, group)
            bucket, size = [], 0
    if bucket:
        sent += _all_reduce(bucket, group)
    return sent


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (in place: it shares storage), a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def grad_square_sum(params: list[nn.Parameter], count_replicated: bool = True) -> torch.Tensor:
    """Σ g² over this rank's gradients as a 0-dim fp32 tensor on their device (nothing waits for the host); a
    gradient replicated over its TP group (a plain one or a Replicate DTensor) only when `count_replicated`, so
    that summing over the group counts it once. One fp32 `_foreach_norm` over them: no fp64 copies."""
    grads = [local(p.grad) for p in params if p.grad is not None and (count_replicated or _sharded(p.grad))]
    if not grads:
        device = local(params[0]).device if params else torch.device("cpu")
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm([g.float() for g in grads])
    return torch.linalg.vector_norm(torch.stack(norms)).square()


def _sharded(t: torch.Tensor) -> bool:
    return isinstance(t, DTensor) and not all(isinstance(pl, Replicate) for pl in t.placements)


def clip_grads_(params: list[nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """Scale the gradients by min(1, max_norm / (norm + 1e-6)): `torch.nn.utils.clip_grads_with_norm_`'s
    factor, applied to local shards, on the device. A non-finite `norm` leaves them as they are (that step is
    skipped)."""
    grads = [local(p.grad) for p in params if p.grad is not None]
    if grads:
        coef = max_norm / (norm.to(grads[0].device) + 1e-6)  # in torch's dtype and order
        coef = torch.where(torch.isfinite(coef), torch.clamp(coef, max=1.0), torch.ones_like(coef))
        torch._foreach_mul_(grads, coef)


def _all_reduce(params: list[nn.Parameter], group: dist.ProcessGroup | None) -> int:
    grads = [local(cast(torch.Tensor, p.grad)) for p in params]  # `sync_gradients` gave every parameter one
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    return flat.numel() * flat.element_size()


def gather(values: Sequence[float | torch.Tensor], rank: int, world_size: int, device: torch.device) -> np.ndarray:
    """Every rank's `values` as a [world_size, len(values)] float64 array: one all-reduce of one tensor and one host
    read. A value may be a 0-dim tensor on the device (a step's loss, its gradient norm), read only here with the
    rest; the host numbers go over in one pinned, non-blocking copy, so the read is the only wait."""
    table = torch.zeros(world_size, len(values), dtype=torch.float64, device=device)
    table[rank] = _row(values, device)
    if world_size > 1:
        dist.all_reduce(table)
    return table.cpu().numpy()


def _row(values: Sequence[float | torch.Tensor], device: torch.device) -> torch.Tensor:
    """`values` as one float64 row on `device`: host numbers (host tensors too) copied together, device tensors
    placed without leaving the device."""
    on_device = [isinstance(v, torch.Tensor) and v.device.type != "cpu" for v in values]
    host = [0.0 if there else float(v) for v, there in zip(values, on_device)]
    row = to_device(torch.tensor(host, dtype=torch.float64), device)
    if not any(on_device):
        return row
    return torch.stack(
        [
            cast(torch.Tensor, v).detach().reshape(()).to(device, torch.float64) if there else row[i]
            for i, (v, there) in enumerate(zip(values, on_device))
        ]
    )


def check_replica_gradients(
    grads: Sequence[tuple[str, torch.Tensor]],
    tp_group: dist.ProcessGroup,
    *,
    tolerance: float = REPLICA_TOLERANCE,
) -> None:
    """Raise `ReplicaGradientError` on every rank when some replicated parameter's gradient (`grads`: its name and
    what this rank holds of it) differs over `tp_group`, naming them all and the fix.

    One all-reduce of the checksums (Σg, Σ|g|, Σg² per parameter) over the TP group, one of a count over the world
    so that every rank, of every TP group and pipeline stage, refuses alike; the names are gathered only then."""
    device = grads[0][1].device if grads else torch.device("cpu")
    sums = torch.zeros(2, len(grads), 3, dtype=torch.float64, device=device)
    for i, (_, g) in enumerate(grads):
        g = g.detach().double()
        sums[0, i] = torch.stack([g.sum(), g.abs().sum(), g.pow(2).sum()])
    sums[1] = -sums[0]
    dist.all_reduce(sums, op=dist.ReduceOp.MAX, group=tp_group)
    high, spread = sums[0], sums[0] + sums[1]  # max, and max - min
    scale = torch.stack([high[:, 1], high[:, 1], high[:, 2]], dim=1)
    differ = (spread > tolerance * scale).any(dim=1).tolist()
    mine = [name for (name, _), bad in zip(grads, differ) if bad]
    count = torch.tensor([float(len(mine))], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    if not count.item():
        return
    every: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    names = sorted({name for found in every for name in found or ()})
    shown = ", ".join(names[:_SHOWN]) + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")
    tp = dist.get_world_size(tp_group)
    raise ReplicaGradientError(
        f"{len(names)} replicated (non-DTensor) parameter(s) of this tensor-parallel model got different "
        f"gradients on the {tp} ranks of their TP group, so each holds only its rank's part: {shown}. "
        f"They are applied to each rank's own shard (e.g. a per-head q_norm / k_norm after column-parallel q/k/v), "
        f"and a plan of torch's parallelize_module does not sum their gradients; no optimizer step was taken. "
        f"Shard the model with bsc.tensor_parallel(model, {tp}), which sums them, or mark their modules "
        f"'replicated_with_grad_allreduce' in the plan you give it: bsc.tensor_parallel(model, {tp}, "
        f"plan={{..., 'model.layers.*.self_attn.q_norm': 'replicated_with_grad_allreduce'}})"
    )
