"""Triton softmax cross-entropy that overwrites the logits with their gradient (paper §6).

With a large vocabulary the loss is memory-bound: a torch version reads and writes the [N, V] logits
several times (max, exp, sum, scale, scatter) and upcasts bf16 logits to a second fp32 buffer. Here
one program per row reads the row once to get its max and log-sum-exp online in fp32, then reads it
a second time and writes d(loss)/d(logits) over it, in the logits' own dtype. No fp32 copy exists.
A logit scale and final soft-cap (``softcap * tanh(scale * z / softcap)``, Granite/Cohere/Gemma2) are
applied to each element as it is read, and their derivative folded into the gradient written: the
transformed logits are never stored.

`linear_cross_entropy_token_chunks_triton` is the drop-in for the torch reference
`cross_entropy_ref.linear_cross_entropy_token_chunks`: the matmuls stay torch, the softmax is this kernel.
`linear_cross_entropy_vocab_slices_triton` is the one for `cross_entropy_ref.linear_cross_entropy_vocab_slices`:
`_lse_kernel` gives each token's log-sum-exp and loss from its chunk's logits (read once, not written), and
`_slice_grad_kernel` turns a vocabulary slice's logits of all tokens into their gradient with it, element by element.
The three kernels share the row's log-sum-exp, loss and gradient formulas (`_row_lse`, `_row_loss`, `_grad_of_z`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from ..lazy import lazy_getattr
from .cross_entropy_ref import _check_targets, _chunk_outputs, chunk_rows, run_chunks, run_vocab_slices, slice_rows
from .triton_mode import built_for_interpreter

__all__ = [
    "INTERPRETED",
    "cross_entropy_grad_",
    "linear_cross_entropy_token_chunks_triton",
    "linear_cross_entropy_vocab_slices_triton",
]

_BLOCK_V_MAX = 8192
_SLICE_BLOCK_T = 16
_SLICE_BLOCK_V = 512


@triton.jit
def _transformed(z, scale, softcap, SOFTCAP: tl.constexpr):
    """The logits the loss sees for linear output z, and their derivative d(logits)/dz.

    tanh(u) is sign(u) * (1 - e) / (1 + e) with e = exp(-2|u|) (no tanh in the interpreter), which
    cannot overflow; its absolute error near 0 is that of fp32, 1e-7 of the cap.
    """
    if SOFTCAP:
        u = z * (scale / softcap)
        e = tl.exp(-2.0 * tl.abs(u))
        t = (1.0 - e) / (1.0 + e)
        t = tl.where(u < 0, -t, t)
        logits = softcap * t
        derivative = scale * (1.0 - t * t)
    else:
        logits = z * scale
        derivative = scale
    return logits, derivative


@triton.jit
def _row_lse(row_ptr, n_cols, scale, softcap, BLOCK_V: tl.constexpr, SOFTCAP: tl.constexpr):
    """log-sum-exp of one row's transformed logits: per-lane online max and sum of exp, in fp32; a finite
    floor for the max keeps padded lanes at s = 0 without computing exp(-inf - -inf)."""
    cols = tl.arange(0, BLOCK_V)
    m = tl.full([BLOCK_V], -1e30, tl.float32)
    s = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, n_cols, BLOCK_V):
        in_row = start + cols < n_cols
        z = tl.load(row_ptr + start + cols, mask=in_row, other=0.0).to(tl.float32)
        x, _ = _transformed(z, scale, softcap, SOFTCAP)
        x = tl.where(in_row, x, float("-inf"))
        m_new = tl.maximum(m, x)
        s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
        m = m_new
    row_max = tl.max(m, axis=0)
    return row_max + tl.log(tl.sum(s * tl.exp(m - row_max), axis=0))


@triton.jit
def _row_loss(row_ptr, target, valid, lse, z_loss_weight, scale, softcap, SOFTCAP: tl.constexpr):
    """A row's loss lse - x[target] + z_loss * lse², 0 when its target is ignored."""
    safe_target = tl.where(valid, target, 0).to(tl.int64)
    target_logit, _ = _transformed(tl.load(row_ptr + safe_target).to(tl.float32), scale, softcap, SOFTCAP)
    return tl.where(valid, lse - target_logit + z_loss_weight * lse * lse, 0.0)


@triton.jit
def _grad_of_z(z, is_target, lse, weight, z_loss_weight, scale, softcap, SOFTCAP: tl.constexpr):
    """d(loss)/dz * weight from the linear output z (fp32): weight * (softmax * (1 + 2 z_loss lse) - onehot(target))
    of the logits x, times dx/dz. `weight` is 0 on ignored rows, which makes their gradient zero."""
    x, derivative = _transformed(z, scale, softcap, SOFTCAP)
    softmax_scale = weight * (1.0 + 2.0 * z_loss_weight * lse)
    return (tl.exp(x - lse) * softmax_scale - tl.where(is_target, weight, 0.0)) * derivative


@triton.jit
def _cross_entropy_grad_kernel(
    logits_ptr,
    stride_row,
    target_ptr,
    loss_ptr,
    weight_ptr,
    n_cols,
    ignore_index,
    z_loss_weight,
    scale,
    softcap,
    BLOCK_V: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """One row of z: loss (lse - x[target] + z_loss * lse²) of x = transformed z into loss_ptr,
    d(loss)/dz * weight over z."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    target = tl.load(target_ptr + row)
    valid = target != ignore_index
    lse = _row_lse(row_ptr, n_cols, scale, softcap, BLOCK_V, SOFTCAP)
    tl.store(loss_ptr + row, _row_loss(row_ptr, target, valid, lse, z_loss_weight, scale, softcap, SOFTCAP))

    # the row read again, its gradient written over it
    weight = tl.where(valid, tl.load(weight_ptr), 0.0)
    cols = tl.arange(0, BLOCK_V)
    for start in range(0, n_cols, BLOCK_V):
        idx = start + cols
        in_row = idx < n_cols
        z = tl.load(row_ptr + idx, mask=in_row, other=0.0).to(tl.float32)
        grad = _grad_of_z(z, idx == target, lse, weight, z_loss_weight, scale, softcap, SOFTCAP)
        tl.store(row_ptr + idx, grad.to(logits_ptr.dtype.element_ty), mask=in_row)


@triton.jit
def _lse_kernel(
    logits_ptr,
    stride_row,
    target_ptr,
    lse_ptr,
    loss_ptr,
    n_cols,
    ignore_index,
    z_loss_weight,
    scale,
    softcap,
    BLOCK_V: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """One row of z: the log-sum-exp of x = transformed z into lse_ptr and the row's loss into loss_ptr; z is
    left as it is."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    target = tl.load(target_ptr + row)
    lse = _row_lse(row_ptr, n_cols, scale, softcap, BLOCK_V, SOFTCAP)
    tl.store(lse_ptr + row, lse)
    tl.store(
        loss_ptr + row, _row_loss(row_ptr, target, target != ignore_index, lse, z_loss_weight, scale, softcap, SOFTCAP)
    )


@triton.jit
def _slice_grad_kernel(
    z_ptr,
    stride_row,
    target_ptr,
    lse_ptr,
    weight_ptr,
    n_rows,
    n_cols,
    col_start,
    ignore_index,
    z_loss_weight,
    scale,
    softcap,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """A [BLOCK_T, BLOCK_V] tile of the linear output z of vocabulary columns from `col_start`, overwritten with
    d(loss)/dz * weight from each row's log-sum-exp over the whole vocabulary."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    in_rows = rows < n_rows
    target = tl.load(target_ptr + rows, mask=in_rows, other=ignore_index)
    lse = tl.load(lse_ptr + rows, mask=in_rows, other=0.0)
    weight = tl.where(target != ignore_index, tl.load(weight_ptr), 0.0)
    ptrs = z_ptr + rows[:, None] * stride_row + cols[None, :]
    in_tile = in_rows[:, None] & (cols < n_cols)[None, :]
    z = tl.load(ptrs, mask=in_tile, other=0.0).to(tl.float32)
    is_target = (col_start + cols)[None, :] == target[:, None]
    grad = _grad_of_z(z, is_target, lse[:, None], weight[:, None], z_loss_weight, scale, softcap, SOFTCAP)
    tl.store(ptrs, grad.to(z_ptr.dtype.element_ty), mask=in_tile)


INTERPRETED: bool = built_for_interpreter(_cross_entropy_grad_kernel, _lse_kernel, _slice_grad_kernel)
"""Whether the kernel runs in Triton's interpreter (CPU tensors) rather than on the GPU."""


def cross_entropy_grad_(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    weight: torch.Tensor,
    z_loss_weight: float = 0.0,
    scale: float = 1.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """Overwrite `logits` [N, V] with d(loss)/d(logits); return the per-row loss [N] fp32 (unweighted).

    `weight` is a one-element fp32 tensor on the logits' device: the gradient factor of every valid
    row (1 for "sum", 1/n_valid for "mean"); a device tensor, so "mean" needs no host sync. Rows whose
    target is `ignore_index` get zero loss and zero gradient. With `scale`/`softcap` the loss is that
    of ``softcap * tanh(scale * logits / softcap)`` (``scale * logits`` without a cap), and the
    gradient written is still the one of `logits` as given.
    """
    n_rows, n_cols = logits.shape
    if logits.stride(1) != 1:
        raise ValueError(f"logits must have contiguous rows (stride 1 along V), got strides {logits.stride()}")
    loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    if n_rows == 0:
        return loss
    _cross_entropy_grad_kernel[(n_rows,)](
        logits,
        logits.stride(0),
        target,
        loss,
        weight,
        n_cols,
        ignore_index,
        float(z_loss_weight),
        *_transform_args(scale, softcap),
        **_row_launch(n_cols, softcap),
    )
    return loss


def _transform_args(scale: float, softcap: float | None) -> tuple[float, float]:
    """The kernels' `scale` and `softcap` arguments (their SOFTCAP flag goes with the launch)."""
    return float(scale), 1.0 if softcap is None else float(softcap)


def _row_launch(n_cols: int, softcap: float | None = None) -> dict[str, int | bool]:
    """Block and warps of a kernel that walks whole rows of `n_cols` logits, and its SOFTCAP flag."""
    block_v = min(_BLOCK_V_MAX, triton.next_power_of_2(n_cols))
    return {"BLOCK_V": block_v, "SOFTCAP": softcap is not None, "num_warps": 8 if block_v >= 4096 else 4}


def _row_weight(target: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    """The gradient factor of every valid row as a one-element fp32 device tensor: 1, or 1/n_valid for "mean"."""
    row_weight = torch.ones(1, dtype=torch.float32, device=target.device)
    if reduction == "mean":
        row_weight /= (target != ignore_index).sum().clamp(min=1)
    return row_weight


def linear_cross_entropy_token_chunks_triton(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    ignore_index: int,
    reduction: str,
    upcast: bool,
    max_workspace_bytes: int,
    scale: float = 1.0,
    softcap: float | None = None,
    z_loss_weight: float = 0.0,
    *,
    grad_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`cross_entropy_ref.linear_cross_entropy_token_chunks` with the softmax in the Triton kernel.

    Same arguments and returns, plus `z_loss_weight` (adds `z_loss_weight * lse²` per valid token).
    The logit transform and softmax are always computed in fp32, so `upcast` only picks the loss
    dtype; the gradient of each chunk's logits overwrites them in the input dtype, so the chunk's only
    [chunk, V] buffer is its logits (no fp32 or derivative copy) and `max_workspace_bytes` holds twice the
    rows the upcast torch reference gets. grad_weight is written by one matmul per chunk, as in the reference.
    """
    _check_targets(target, ignore_index, weight.shape[0])
    target = target.contiguous()
    row_weight = _row_weight(target, ignore_index, reduction)

    def chunk_grad(logits: torch.Tensor, rows_of: slice) -> torch.Tensor:
        return cross_entropy_grad_(
            logits, target[rows_of], ignore_index, row_weight, z_loss_weight, scale, softcap
        ).sum()

    rows = chunk_rows(
        n_tokens=hidden.shape[0],
        vocab=weight.shape[0],
        hidden=hidden.shape[1],
        bytes_per_logit=hidden.dtype.itemsize,
        max_workspace_bytes=max_workspace_bytes,
        device=hidden.device,
    )
    return run_chunks(hidden, weight, bias, target, ignore_index, reduction, upcast, rows, chunk_grad, grad_dtype)


def linear_cross_entropy_vocab_slices_triton(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    ignore_index: int,
    reduction: str,
    upcast: bool,
    max_workspace_bytes: int,
    scale: float = 1.0,
    softcap: float | None = None,
    z_loss_weight: float = 0.0,
    *,
    grad_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`cross_entropy_ref.linear_cross_entropy_vocab_slices` with the softmax in the Triton kernels.

    Same arguments and returns as `linear_cross_entropy_token_chunks_triton` (`z_loss_weight`, `grad_dtype` too):
    the first walk keeps each token's log-sum-exp (fp32 [N]), the second overwrites each slice's logits with their
    gradient in the input dtype (no fp32 or derivative buffer, so the slices are as wide as the logits alone
    allow).
    """
    n_tokens, vocab = hidden.shape[0], weight.shape[0]
    _check_targets(target, ignore_index, vocab)
    target = target.contiguous()
    row_weight = _row_weight(target, ignore_index, reduction)
    transform = _transform_args(scale, softcap)
    lse, token_loss = hidden.new_empty((2, n_tokens), dtype=torch.float32)
    budget = {"bytes_per_logit": hidden.dtype.itemsize, "max_workspace_bytes": max_workspace_bytes}
    rows = chunk_rows(n_tokens=n_tokens, vocab=vocab, hidden=hidden.shape[1], device=hidden.device, **budget)
    for rows_of, _, z in _chunk_outputs(hidden, weight, bias, rows):
        _lse_kernel[(z.shape[0],)](
            z,
            z.stride(0),
            target[rows_of],
            lse[rows_of],
            token_loss[rows_of],
            vocab,
            ignore_index,
            float(z_loss_weight),
            *transform,
            **_row_launch(vocab, softcap),
        )

    def slice_grad(z: torch.Tensor, cols: slice) -> None:
        n_cols = z.shape[1]
        if n_tokens == 0:
            return
        block_v = min(_SLICE_BLOCK_V, triton.next_power_of_2(n_cols))
        grid = (triton.cdiv(n_tokens, _SLICE_BLOCK_T), triton.cdiv(n_cols, block_v))
        _slice_grad_kernel[grid](
            z,
            z.stride(0),
            target,
            lse,
            row_weight,
            n_tokens,
            n_cols,
            cols.start,
            ignore_index,
            float(z_loss_weight),
            *transform,
            BLOCK_T=_SLICE_BLOCK_T,
            BLOCK_V=block_v,
            SOFTCAP=softcap is not None,
        )

    slice_size = slice_rows(n_tokens=n_tokens, vocab=vocab, device=hidden.device, **budget)
    loss_sum = token_loss.sum()
    return run_vocab_slices(
        hidden, weight, bias, target, ignore_index, reduction, upcast, loss_sum, slice_size, slice_grad, grad_dtype
    )


if not TYPE_CHECKING:  # mypy sees only the current names
    __getattr__ = lazy_getattr(
        __name__,
        {},
        globals(),
        renamed={"linear_cross_entropy_chunked_triton": f"{__name__}:linear_cross_entropy_token_chunks_triton"},
    )
