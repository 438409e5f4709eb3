"""The collectives of a training step, shared by the HDP `Runtime` and the pipeline executor: summing
gradients over the ranks that hold the same parameters, and gathering per-rank figures; with the gradients'
squares and clipping, which read a tensor-parallel (DTensor) gradient through its local shard."""

from __future__ import annotations

from typing import cast

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from ..planner.memory import BUCKET_BYTES

__all__ = ["BUCKET_BYTES", "gather", "sync_gradients", "local", "grad_square_sum", "clip_grads_"]


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


def grad_square_sum(params: list[nn.Parameter], count_replicated: bool = True) -> float:
    """Σ g² over this rank's gradients; a gradient replicated over its TP group (a plain one or a Replicate
    DTensor) only when `count_replicated`, so that summing over the group counts it once."""
    total = 0.0
    for p in params:
        if p.grad is None:
            continue
        sharded = isinstance(p.grad, DTensor) and not all(isinstance(pl, Replicate) for pl in p.grad.placements)
        if sharded or count_replicated:
            total += float(local(p.grad).double().pow(2).sum())
    return total


def clip_grads_(params: list[nn.Parameter], max_norm: float, norm: float) -> None:
    """Scale the gradients by min(1, max_norm / (norm + 1e-6)): `torch.nn.utils.clip_grads_with_norm_`'s
    factor, applied to local shards."""
    grads = [local(p.grad) for p in params if p.grad is not None]
    if grads:
        coef = max_norm / (torch.tensor(norm, device=grads[0].device) + 1e-6)  # in torch's dtype and order
        torch._foreach_mul_(grads, torch.clamp(coef, max=1.0))


def _all_reduce(params: list[nn.Parameter], group: dist.ProcessGroup | None) -> int:
    grads = [local(cast(torch.Tensor, p.grad)) for p in params]  # `sync_gradients` gave every parameter one
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    return flat.numel() * flat.element_size()


def gather(values: list[float], rank: int, world_size: int, device: torch.device) -> np.ndarray:
    """Every rank's `values` as a [world_size, len(values)] array (one small all-reduce)."""
    table = torch.zeros(world_size, len(values), dtype=torch.float64, device=device)
    table[rank] = torch.tensor(values, dtype=torch.float64)
    if world_size > 1:
        dist.all_reduce(table)
    return table.cpu().numpy()
