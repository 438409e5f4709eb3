"""Triton softmax cross-entropy that overwrites the logits with their gradient (paper §6).

With a large vocabulary the loss is memory-bound: a torch version reads and writes the [N, V] logits
several times (max, exp, sum, scale, scatter) and upcasts bf16 logits to a second fp32 buffer. Here
one program per row reads the row once to get its max and log-sum-exp online in fp32, then reads it
a second time and writes d(loss)/d(logits) over it, in the logits' own dtype. No fp32 copy exists.
A logit scale and final soft-cap (``softcap * tanh(scale * z / softcap)``, Granite/Cohere/Gemma2) are
applied to each element as it is read, and their derivative folded into the gradient written: the
transformed logits are never stored.

`linear_cross_entropy_chunked_triton` is the drop-in for the torch reference
`cross_entropy_ref.linear_cross_entropy_chunked`: the matmuls stay torch, the softmax is this kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .cross_entropy_ref import _check_targets, chunk_rows, run_chunks
from .triton_mode import built_for_interpreter

__all__ = ["INTERPRETED", "cross_entropy_grad_", "linear_cross_entropy_chunked_triton"]

_BLOCK_V_MAX = 8192


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
    cols = tl.arange(0, BLOCK_V)

    # pass 1: per-lane online max and sum of exp, in fp32; a finite floor for the max keeps padded
    # lanes at s = 0 without computing exp(-inf - -inf)
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
    lse = row_max + tl.log(tl.sum(s * tl.exp(m - row_max), axis=0))

    safe_target = tl.where(valid, target, 0).to(tl.int64)
    target_logit, _ = _transformed(tl.load(row_ptr + safe_target).to(tl.float32), scale, softcap, SOFTCAP)
    loss = tl.where(valid, lse - target_logit + z_loss_weight * lse * lse, 0.0)
    tl.store(loss_ptr + row, loss)

    # pass 2: d/dx = weight * (softmax * (1 + 2 z_loss lse) - onehot(target)), times dx/dz; zero for
    # ignored rows
    weight = tl.where(valid, tl.load(weight_ptr), 0.0)
    softmax_scale = weight * (1.0 + 2.0 * z_loss_weight * lse)
    for start in range(0, n_cols, BLOCK_V):
        idx = start + cols
        in_row = idx < n_cols
        z = tl.load(row_ptr + idx, mask=in_row, other=0.0).to(tl.float32)
        x, derivative = _transformed(z, scale, softcap, SOFTCAP)
        grad = (tl.exp(x - lse) * softmax_scale - tl.where(idx == safe_target, weight, 0.0)) * derivative
        tl.store(row_ptr + idx, grad.to(logits_ptr.dtype.element_ty), mask=in_row)


INTERPRETED: bool = built_for_interpreter(_cross_entropy_grad_kernel)
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
    block_v = min(_BLOCK_V_MAX, triton.next_power_of_2(n_cols))
    _cross_entropy_grad_kernel[(n_rows,)](
        logits,
        logits.stride(0),
        target,
        loss,
        weight,
        n_cols,
        ignore_index,
        float(z_loss_weight),
        float(scale),
        1.0 if softcap is None else float(softcap),
        BLOCK_V=block_v,
        SOFTCAP=softcap is not None,
        num_warps=8 if block_v >= 4096 else 4,
    )
    return loss


def linear_cross_entropy_chunked_triton(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    ignore_index: int,
    reduction: str,
    upcast: bool,
    chunk_size: int,
    scale: float = 1.0,
    softcap: float | None = None,
    z_loss_weight: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`cross_entropy_ref.linear_cross_entropy_chunked` with the softmax in the Triton kernel.

    Same arguments and returns, plus `z_loss_weight` (adds `z_loss_weight * lse²` per valid token).
    The logit transform and softmax are always computed in fp32, so `upcast` only picks the loss
    dtype; the gradient of each chunk's logits overwrites them in the input dtype (no fp32 or
    derivative [chunk, V] buffer) and grad_weight/grad_bias accumulate in fp32.
    """
    _check_targets(target, ignore_index, weight.shape[0])
    target = target.contiguous()
    row_weight = torch.ones(1, dtype=torch.float32, device=hidden.device)
    if reduction == "mean":
        row_weight /= (target != ignore_index).sum().clamp(min=1)

    def chunk_grad(logits: torch.Tensor, rows_of: slice) -> torch.Tensor:
        return cross_entropy_grad_(
            logits, target[rows_of], ignore_index, row_weight, z_loss_weight, scale, softcap
        ).sum()

    chunk_size = chunk_rows(chunk_size, hidden.shape[0], weight.shape[0], hidden.dtype.itemsize, hidden.device)
    return run_chunks(hidden, weight, bias, target, ignore_index, reduction, upcast, chunk_size, chunk_grad)
