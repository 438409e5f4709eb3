"""The two collectives of a training step, shared by the HDP `Runtime` and the pipeline executor: summing
gradients over the ranks that hold the same parameters, and gathering per-rank figures."""

from __future__ import annotations

from typing import cast

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..planner.memory import BUCKET_BYTES

__all__ = ["BUCKET_BYTES", "gather", "sync_gradients"]


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
        size += p.numel() * p.element_size()
        if size >= BUCKET_BYTES:
            sent += _all_reduce(bucket, group)
            bucket, size = [], 0
    if bucket:
        sent += _all_reduce(bucket, group)
    return sent


def _all_reduce(params: list[nn.Parameter], group: dist.ProcessGroup | None) -> int:
    grads = [cast(torch.Tensor, p.grad) for p in params]  # `sync_gradients` gave every parameter one
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for p, g in zip(params, grads):
        g.copy_(flat[offset : offset + p.numel()].view_as(g))
        offset += p.numel()
    return flat.numel() * flat.element_size()


def gather(values: list[float], rank: int, world_size: int, device: torch.device) -> np.ndarray:
    """Every rank's `values` as a [world_size, len(values)] array (one small all-reduce)."""
    table = torch.zeros(world_size, len(values), dtype=torch.float64, device=device)
    table[rank] = torch.tensor(values, dtype=torch.float64)
    if world_size > 1:
        dist.all_reduce(table)
    return table.cpu().numpy()
