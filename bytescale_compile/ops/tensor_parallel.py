"""The collectives of Megatron-style tensor parallelism, on plain (local) tensors inside compiled graphs.

A tensor-parallel model runs its compiled graphs on each rank's local shards (see
`capture/tensor_parallel.py`); these four operators are the only places its ranks talk:

    copy_to_tp      identity forward, all-reduce of the gradient backward   (before a column-parallel linear)
    tp_all_reduce   all-reduce forward, identity backward                   (after a row-parallel linear)
    tp_all_gather   gather along a dim forward, the local slice backward    (a gathered column-parallel output)
    split_to_tp     the local slice forward, gather backward                (a replicated input to a row-parallel linear)

The two collectives are `bytescale::` custom ops, one node each in the graphs (the loss pass reads
`tp_all_gather` to find a vocabulary-parallel lm_head); the group travels as its name.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

__all__ = ["tp_group", "tp_all_reduce", "tp_all_gather", "copy_to_tp", "split_to_tp", "tp_rank", "tp_size"]


def tp_group(group_name: str) -> dist.ProcessGroup:
    """The process group a graph names (custom ops take strings, not groups)."""
    return _resolve_process_group(cast(Any, group_name))


def tp_rank(group_name: str) -> int:
    return dist.get_rank(tp_group(group_name))


def tp_size(group_name: str) -> int:
    return dist.get_world_size(tp_group(group_name))


@torch.library.custom_op("bytescale::tp_all_reduce", mutates_args=())
def tp_all_reduce(x: Tensor, group_name: str) -> Tensor:
    """Sum of `x` over the TP group (the partial outputs of a row-parallel linear)."""
    out = x.contiguous().clone()
    dist.all_reduce(out, group=tp_group(group_name))
    return out


@tp_all_reduce.register_fake
def _(x: Tensor, group_name: str) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _all_reduce_setup(ctx: Any, inputs: tuple, output: Tensor) -> None:
    pass


def _all_reduce_backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
    """Every rank's partial output reaches the sum once: each receives the (replicated) gradient as it is."""
    return grad, None


tp_all_reduce.register_autograd(_all_reduce_backward, setup_context=_all_reduce_setup)


@torch.library.custom_op("bytescale::tp_all_gather", mutates_args=())
def tp_all_gather(x: Tensor, dim: int, group_name: str) -> Tensor:
    """The group's shards of `x` concatenated along `dim` in rank order (each rank's shard the same size)."""
    group = tp_group(group_name)
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


@tp_all_gather.register_fake
def _(x: Tensor, dim: int, group_name: str) -> Tensor:
    shape = list(x.shape)
    shape[dim] = shape[dim] * tp_size(group_name)
    return x.new_empty(shape)


def _all_gather_setup(ctx: Any, inputs: tuple, output: Tensor) -> None:
    x, dim, group_name = inputs
    ctx.dim, ctx.group_name, ctx.local = dim, group_name, x.shape[dim]


def _all_gather_backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
    """The output is replicated, so every rank already holds the whole gradient: keep this rank's slice."""
    start = tp_rank(ctx.group_name) * ctx.local
    return grad.narrow(ctx.dim, start, ctx.local).contiguous(), None, None


tp_all_gather.register_autograd(_all_gather_backward, setup_context=_all_gather_setup)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group_name: str) -> Tensor:
        ctx.group_name = group_name
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return tp_all_reduce(grad, ctx.group_name), None


class _SplitToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group_name: str, rank: int, size: int) -> Tensor:
        ctx.group_name = group_name
        local = x.shape[-1] // size
        return x.narrow(-1, rank * local, local).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return tp_all_gather(grad, grad.dim() - 1, ctx.group_name), None, None, None


def copy_to_tp(x: Tensor, group_name: str) -> Tensor:
    """`x`, replicated over the group, entering column-parallel work: each rank's gradient of it is partial."""
    return _CopyToTP.apply(x, group_name)


def split_to_tp(x: Tensor, group_name: str, *, rank: int, size: int) -> Tensor:
    """This rank's slice of the last dim of replicated `x` (a row-parallel linear's input). The rank and size are
    the caller's plain ints: resolving the group inside a traced forward would break the graph."""
    return _SplitToTP.apply(x, group_name, rank, size)
