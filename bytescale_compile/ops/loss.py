"""``bytescale::fused_linear_cross_entropy``: lm_head linear + cross-entropy as one custom op.

The loss pass replaces ``F.linear`` (+ optional ``.float()``, logit scale and final soft-cap) +
``F.cross_entropy`` with this op so the full fp32 logits are never held, forward or backward. The op computes the gradients of hidden,
weight and bias in its forward (three matmuls instead of four) and returns them as extra outputs;
its autograd backward only scales them, in place, by the incoming gradient of the loss. Nothing in either op
waits for the device. Under `torch.autocast`
the matmuls run in the autocast dtype and the softmax in fp32, as linear + cross_entropy would.

``bytescale::vocab_parallel_linear_cross_entropy`` is the same loss for a tensor-parallel lm_head split
over the vocabulary (each rank holds V/tp rows of the weight): the ranks combine per-token statistics,
never the logits (Megatron's vocabulary-parallel cross-entropy): one all-gather of [3, chunk] statistics per
chunk. It runs the torch reference kernel on every device.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor
from torch._subclasses.functional_tensor import FunctionalTensor

from bytescale_compile.config import DEFAULT_LOSS_WORKSPACE_BYTES
from bytescale_compile.kernels.dispatch import (
    linear_cross_entropy,
    vocab_parallel_linear_cross_entropy_chunked,
)
from bytescale_compile.ops.autocast import register_autocast_rule, to_autocast_dtype
from bytescale_compile.ops.tensor_parallel import tp_group, tp_size

__all__ = [
    "fused_linear_cross_entropy",
    "fused_linear_cross_entropy_op",
    "vocab_parallel_linear_cross_entropy_op",
    "REDUCTIONS",
]

REDUCTIONS = ("sum", "mean")


def _check_args(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    target: Tensor,
    reduction: str,
    max_workspace_bytes: int,
    scale: float,
    softcap: Optional[float],
) -> None:
    """Raise ValueError on arguments the op cannot handle; shapes and dtypes only (fake-safe)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if max_workspace_bytes < 1:
        raise ValueError(f"max_workspace_bytes must be >= 1, got {max_workspace_bytes}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float, got {scale}")
    if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a finite float > 0 or None, got {softcap}")
    if hidden.dim() < 1 or not hidden.dtype.is_floating_point:
        raise ValueError(
            f"hidden must be a floating tensor [..., H], got shape {tuple(hidden.shape)} dtype {hidden.dtype}"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.dtype != hidden.dtype:
        raise ValueError(
            f"weight must be [V, H={hidden.shape[-1]}] of hidden's dtype {hidden.dtype}, got shape "
            f"{tuple(weight.shape)} dtype {weight.dtype}"
        )
    if bias is not None and (tuple(bias.shape) != (weight.shape[0],) or bias.dtype != hidden.dtype):
        raise ValueError(
            f"bias must be [V={weight.shape[0]}] of hidden's dtype {hidden.dtype} or None, got "
            f"shape {tuple(bias.shape)} dtype {bias.dtype}"
        )
    if target.dtype != torch.int64 or target.numel() != math.prod(hidden.shape[:-1]):
        raise ValueError(
            f"target must be an int64 tensor with one entry per token of hidden "
            f"{tuple(hidden.shape)}, got shape {tuple(target.shape)} dtype {target.dtype}"
        )


def _check_shard(weight: Tensor, group_name: str, vocab_start: int) -> None:
    """Raise ValueError unless `weight` is one of the group's equal vocabulary shards, starting at `vocab_start`."""
    tp, shard = tp_size(group_name), weight.shape[0]
    starts = [rank * shard for rank in range(tp)]
    if vocab_start not in starts:
        raise ValueError(
            f"vocab_start must be the rank's index in TP group {group_name!r} (size {tp}) times the shard's "
            f"V/tp={shard} rows, one of {starts}; got {vocab_start}"
        )


def _run_kernel(
    kernel: Callable[..., tuple[Tensor, Tensor, Tensor, Optional[Tensor]]],
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    target: Tensor,
    *args: Any,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`kernel` on the tokens flattened (hidden [N, H], target [N]); its outputs as the ops return them:
    grad_hidden in hidden's shape, grad_bias empty without a bias (an op output cannot be None)."""
    loss, grad_hidden, grad_weight, grad_bias = kernel(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, target.reshape(-1), *args
    )
    return loss, grad_hidden.view(hidden.shape), grad_weight, hidden.new_empty(0) if grad_bias is None else grad_bias


@torch.library.custom_op("bytescale::fused_linear_cross_entropy", mutates_args=())
def fused_linear_cross_entropy_op(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    target: Tensor,
    ignore_index: int,
    reduction: str,
    upcast: bool,
    max_workspace_bytes: int,
    scale: float = 1.0,
    softcap: Optional[float] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``cross_entropy(logits[.float()], target)`` without the full logits, where logits is
    ``softcap * tanh(scale * linear(hidden, weight, bias) / softcap)``, or ``scale * linear(...)``
    when softcap is None.

    hidden [..., H], weight [V, H], bias [V] or None, target [...] int64 with hidden's token count.
    `max_workspace_bytes` caps the [chunk, V] buffers of one chunk (the config's `loss_workspace_bytes`); the chunk
    itself follows the data (`cross_entropy_ref.chunk_rows`). Returns (loss, grad_hidden, grad_weight, grad_bias),
    the gradients in their inputs' dtypes. Only output [0], the loss, is differentiable: callers use it and ignore
    the rest, which are the op's saved gradients (of the loss itself, until an eager backward scales them in place
    by the incoming gradient). grad_bias is empty when bias is None.
    """
    _check_args(hidden, weight, bias, target, reduction, max_workspace_bytes, scale, softcap)
    options = (ignore_index, reduction, upcast, max_workspace_bytes, scale, softcap)
    return _run_kernel(linear_cross_entropy, hidden, weight, bias, target, *options)


@torch.library.custom_op("bytescale::vocab_parallel_linear_cross_entropy", mutates_args=())
def vocab_parallel_linear_cross_entropy_op(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    target: Tensor,
    ignore_index: int,
    reduction: str,
    upcast: bool,
    max_workspace_bytes: int,
    scale: float,
    softcap: Optional[float],
    group_name: str,
    vocab_start: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`fused_linear_cross_entropy_op` of an lm_head split over the vocabulary across the TP group
    `group_name`: weight [V/tp, H] and bias [V/tp] are this rank's rows, from `vocab_start` (rank × V/tp);
    hidden and target (ids of the whole vocabulary) are the same on every rank, and every rank calls it.

    The loss is of the whole vocabulary, the same on every rank; grad_weight and grad_bias are of this
    rank's rows; grad_hidden is this rank's partial gradient, left for the caller to sum over the group
    (`copy_to_tp` before the column-parallel lm_head does, in its backward).
    """
    _check_args(hidden, weight, bias, target, reduction, max_workspace_bytes, scale, softcap)
    _check_shard(weight, group_name, vocab_start)
    options = (ignore_index, reduction, upcast, max_workspace_bytes, scale, softcap)
    group = tp_group(group_name)
    return _run_kernel(
        vocab_parallel_linear_cross_entropy_chunked, hidden, weight, bias, target, *options, group, vocab_start
    )


def _fake(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    target: Tensor,
    ignore_index: int,
    reduction: str,
    upcast: bool,
    max_workspace_bytes: int,
    scale: float = 1.0,
    softcap: Optional[float] = None,
    *shard: Any,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Both ops' shapes and dtypes (the vocabulary-parallel op passes its group_name and vocab_start as `shard`);
    the data-dependent target check runs in the real kernels."""
    _check_args(hidden, weight, bias, target, reduction, max_workspace_bytes, scale, softcap)
    if shard:
        _check_shard(weight, *shard)
    loss = hidden.new_empty((), dtype=torch.float32 if upcast else hidden.dtype)
    grad_bias = hidden.new_empty(0) if bias is None else torch.empty_like(bias)
    return loss, torch.empty_like(hidden), torch.empty_like(weight), grad_bias


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    """Keep the gradients the forward already computed; they are constants to autograd."""
    _, grad_hidden, grad_weight, grad_bias = output
    ctx.has_bias = inputs[2] is not None
    ctx.n_inputs = len(inputs)
    ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
    ctx.mark_non_differentiable(grad_hidden, grad_weight, grad_bias)


def _backward(ctx: Any, grad_loss: Tensor, *_unused: Tensor) -> tuple[Optional[Tensor], ...]:
    """Chain rule: the saved gradients are of the loss, so scale them by d(out)/d(loss). Eagerly in place (nothing
    else reads them: the op's callers use its loss only), which saves a [V, H] buffer and its write; so the eager
    backward runs once: a second one (``retain_graph=True``) finds them modified and autograd raises. Traced
    (torch.compile), the graph is functional whatever is written here, and in place would make the op's other
    outputs depend on the backward, which AOTAutograd rejects: there the product is out of place, and reusing the
    saved buffer, which the backward frees, is Inductor's choice. Only hidden, weight and bias (the first three inputs of both ops)
    get one."""
    grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
    traced = isinstance(grad_weight, FunctionalTensor)
    scale: Callable[[Tensor, Tensor], Tensor] = torch.mul if traced else Tensor.mul_
    return (
        scale(grad_hidden, grad_loss),
        scale(grad_weight, grad_loss),
        scale(grad_bias, grad_loss) if ctx.has_bias else None,
        *(None,) * (ctx.n_inputs - 3),
    )


_UPCAST_ARG = 6
"""Position of `upcast` in both ops' arguments."""


def _autocast_args(dtype: torch.dtype, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """hidden, weight and bias in the autocast dtype (the linear's rule) and the softmax in fp32 (the
    cross-entropy's rule: autocast runs it on fp32 logits), so the loss is fp32."""
    cast = [to_autocast_dtype(x, dtype) for x in args[:3]] + list(args[3:])
    cast[_UPCAST_ARG] = True
    return tuple(cast)


for _op in (fused_linear_cross_entropy_op, vocab_parallel_linear_cross_entropy_op):
    _op.register_fake(_fake)
    _op.register_autograd(_backward, setup_context=_setup_context)
    register_autocast_rule(_op, _autocast_args)


def fused_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Optional[Tensor] = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    upcast: bool = True,
    max_workspace_bytes: int = DEFAULT_LOSS_WORKSPACE_BYTES,
    scale: float = 1.0,
    softcap: Optional[float] = None,
) -> Tensor:
    """Loss of ``F.cross_entropy(logits.float(), target, ...)``, fused, where logits is
    ``softcap * tanh(scale * F.linear(hidden, weight, bias) / softcap)`` (``scale * F.linear(...)``
    without a cap)."""
    return fused_linear_cross_entropy_op(
        hidden, weight, bias, target, ignore_index, reduction, upcast, max_workspace_bytes, scale, softcap
    )[0]
