"""Torch reference of the fused linear cross-entropy (paper: "Fused SoftmaxCrossEntropy").

The lm_head logits of a long micro-batch are the largest activation of a causal LM ([T, V] in fp32,
plus as much again for their gradient). Here they are produced ``chunk_size`` tokens at a time and
turned into their gradient in place, so only one [chunk_size, V] buffer (two when bf16 inputs are
upcast) ever exists. The gradients of hidden, weight and bias are computed in the same pass, which
costs three matmuls instead of the four that a separate forward and backward would need.

Models that scale or soft-cap their logits (Granite, Cohere, Gemma2) give the loss
``softcap * tanh(scale * z / softcap)`` (or ``scale * z``) of the linear's output z; the chunk applies
that transform before the softmax and its derivative after, so z's gradient is what the matmuls see.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["ChunkGrad", "chunk_rows", "linear_cross_entropy_chunked", "run_chunks"]

CPU_CHUNK_BUDGET_BYTES = 256 * 2**20
"""The [chunk, V] buffers of one chunk on the CPU (1024 rows of V = 32K in fp32 take 125 MiB)."""
CUDA_FREE_FRACTION = 8
"""On CUDA a chunk's buffers take at most this fraction of the free memory (read once per call)."""
CUDA_CHUNK_BUDGET_BYTES = 2 * 2**30
"""... and at most this much (2 GiB holds 8K rows of V = 128K in bf16; not yet tuned on a GPU)."""


def _chunk_budget_bytes(device: torch.device) -> int:
    """Bytes one chunk's [chunk, V] buffers may take on `device`."""
    if device.type != "cuda":
        return CPU_CHUNK_BUDGET_BYTES
    free, _ = torch.cuda.mem_get_info(device)
    return min(CUDA_CHUNK_BUDGET_BYTES, free // CUDA_FREE_FRACTION)


def chunk_rows(max_rows: int, n_tokens: int, vocab: int, bytes_per_row_entry: int, device: torch.device) -> int:
    """Tokens per chunk: at most `max_rows` (the config's `loss_chunk_size`) and `n_tokens`, and no more
    than the memory budget of `device` holds at `bytes_per_row_entry` bytes per logit (all [chunk, V]
    buffers together); a multiple of 64 when that is at least 64, so the matmuls keep full tiles."""
    fits = _chunk_budget_bytes(device) // max(1, vocab * bytes_per_row_entry)
    rows = max(1, min(max_rows, n_tokens, fits))
    return rows // 64 * 64 if rows >= 64 else rows


def _check_targets(target: torch.Tensor, ignore_index: int, vocab: int) -> None:
    """Raise ValueError on a target outside [0, V) that is not ignore_index (eager would assert).

    Off the CPU the check is an asynchronous device assert, so a loss call never waits for the device.
    """
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if target.device.type != "cpu":
        torch._assert_async(
            ~bad.any(),
            f"a target value is out of range for vocabulary size V={vocab} "
            f"(allowed: 0 <= target < {vocab}, or ignore_index={ignore_index})",
        )
        return
    if bool(bad.any()):
        value = int(target[bad][0])
        raise ValueError(
            f"target value {value} is out of range for vocabulary size V={vocab} "
            f"(allowed: 0 <= target < {vocab}, or ignore_index={ignore_index})"
        )


def _logits_to_dlogits(
    work: torch.Tensor, target: torch.Tensor, valid: torch.Tensor, row_weight: torch.Tensor
) -> torch.Tensor:
    """Turn chunk logits into d(loss)/d(logits) in place; return the chunk's summed token loss.

    ``row_weight`` is 1 (sum) or 1/n_valid (mean) at valid targets and 0 at ignored ones, so ignored
    rows end up all zero. The loss is returned unweighted (fp32) so the caller reduces it once.
    """
    safe_target = torch.where(valid, target, 0).unsqueeze(1)
    work.sub_(work.amax(dim=1, keepdim=True))
    target_logit = work.gather(1, safe_target).squeeze(1).float()
    work.exp_()
    sum_exp = work.sum(dim=1, dtype=torch.float32)
    token_loss = (sum_exp.log() - target_logit) * valid
    work.mul_((row_weight / sum_exp).unsqueeze(1))
    work.scatter_add_(1, safe_target, -row_weight.to(work.dtype).unsqueeze(1))
    return token_loss.sum()


def _transform_logits_(
    z: torch.Tensor, scale: float, softcap: float | None, derivative_buf: torch.Tensor | None
) -> torch.Tensor | float:
    """Overwrite the linear's output z with the logits the loss sees; return d(logits)/dz.

    Without a cap the logits are ``scale * z`` and the derivative is the float `scale`. With one they
    are ``softcap * tanh(scale * z / softcap)`` and the derivative ``scale * (1 - tanh²)`` is written
    to `derivative_buf` (z's shape and dtype), since z itself is overwritten.
    """
    if softcap is None:
        if scale != 1.0:
            z.mul_(scale)
        return scale
    capped = z.mul_(scale / softcap).tanh_()
    derivative = torch.mul(capped, capped, out=derivative_buf).neg_().add_(1.0).mul_(scale)
    capped.mul_(softcap)
    return derivative


ChunkGrad = Callable[[torch.Tensor, slice], torch.Tensor]
"""`(z, rows) -> summed fp32 loss of the chunk`: overwrites the chunk's linear output z with d(loss)/dz
in its own dtype."""


def _accumulate_grad_weight(grad_weight: torch.Tensor, dlogits: torch.Tensor, h: torch.Tensor) -> None:
    """grad_weight (fp32) += dlogits^T h, the matmul on the inputs' dtype (no fp32 copy of either).

    CUDA (and meta, for shape checks) accumulate in fp32 inside the matmul (`out_dtype`); the CPU has
    no such kernel, so there the chunk's product is rounded to the input dtype once before the add.
    """
    if dlogits.dtype == grad_weight.dtype:
        grad_weight.addmm_(dlogits.t(), h)
    elif grad_weight.device.type in ("cuda", "meta"):
        torch.addmm(grad_weight, dlogits.t(), h, out_dtype=torch.float32, out=grad_weight)
    else:
        grad_weight += dlogits.t() @ h


def run_chunks(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    ignore_index: int,
    reduction: str,
    upcast: bool,
    chunk_size: int,
    chunk_grad: ChunkGrad,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The chunk loop both implementations share: logits of `chunk_size` tokens at a time, turned into
    their gradient by `chunk_grad`, then grad_hidden, and grad_weight/grad_bias accumulated in fp32.
    Every matmul runs on the inputs' dtype; the loss stays on the device (no host sync)."""
    n_tokens, vocab = hidden.shape[0], weight.shape[0]
    n_valid = (target != ignore_index).sum()
    logits_buf = hidden.new_empty(min(chunk_size, n_tokens), vocab)
    grad_hidden = torch.empty_like(hidden)
    grad_weight = weight.new_zeros(weight.shape, dtype=torch.float32)
    grad_bias = None if bias is None else bias.new_zeros(vocab, dtype=torch.float32)
    loss_sum = hidden.new_zeros((), dtype=torch.float32)

    for start in range(0, n_tokens, chunk_size):
        rows_of = slice(start, min(start + chunk_size, n_tokens))
        h = hidden[rows_of]
        logits = logits_buf[: h.shape[0]]
        if bias is None:
            torch.matmul(h, weight.t(), out=logits)
        else:
            torch.addmm(bias, h, weight.t(), out=logits)
        loss_sum += chunk_grad(logits, rows_of)
        torch.matmul(logits, weight, out=grad_hidden[rows_of])
        _accumulate_grad_weight(grad_weight, logits, h)
        if grad_bias is not None:
            grad_bias += logits.sum(dim=0, dtype=torch.float32)

    loss = loss_sum / n_valid if reduction == "mean" else loss_sum
    return (
        loss.to(torch.float32 if upcast else hidden.dtype),
        grad_hidden,
        grad_weight.to(weight.dtype),
        None if grad_bias is None or bias is None else grad_bias.to(bias.dtype),
    )


def linear_cross_entropy_chunked(
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Loss of ``cross_entropy(softcap * tanh(scale * linear(hidden, weight, bias) / softcap), target)``
    (``scale * linear(...)`` when softcap is None) and its gradients.

    hidden [N, H], weight [V, H], bias [V] or None, target [N] int64. ``upcast`` does the logit
    transform and softmax in fp32 (as ``logits.float()`` would); otherwise in the input dtype. A
    softcap costs one more [chunk_size, V] buffer, for tanh's derivative. Returns
    (loss, grad_hidden, grad_weight, grad_bias or None): the loss in fp32 if upcast else hidden's
    dtype, the gradients of the returned loss in their inputs' dtypes. "mean" over zero valid
    targets gives a nan loss and zero gradients, like eager ``F.cross_entropy``.
    """
    _check_targets(target, ignore_index, weight.shape[0])
    valid = target != ignore_index
    row_weight = valid.float()
    if reduction == "mean":
        row_weight /= valid.sum().clamp(min=1)
    upcast_buffer = upcast and hidden.dtype != torch.float32
    work_dtype = torch.float32 if upcast_buffer else hidden.dtype
    work_bytes = work_dtype.itemsize * (int(upcast_buffer) + int(softcap is not None))
    chunk_size = chunk_rows(
        chunk_size, hidden.shape[0], weight.shape[0], hidden.dtype.itemsize + work_bytes, hidden.device
    )
    buf_shape = (min(chunk_size, hidden.shape[0]), weight.shape[0])
    work_buf = hidden.new_empty(buf_shape, dtype=work_dtype) if upcast_buffer else None
    derivative_buf = hidden.new_empty(buf_shape, dtype=work_dtype) if softcap is not None else None

    def chunk_grad(logits: torch.Tensor, rows_of: slice) -> torch.Tensor:
        rows = logits.shape[0]
        work = work_buf[:rows].copy_(logits) if work_buf is not None else logits  # the buffer iff upcast_buffer
        derivative = _transform_logits_(work, scale, softcap, None if derivative_buf is None else derivative_buf[:rows])
        loss = _logits_to_dlogits(work, target[rows_of], valid[rows_of], row_weight[rows_of])
        if softcap is not None or scale != 1.0:
            work.mul_(derivative)
        if upcast_buffer:
            logits.copy_(work)  # dlogits in the input dtype feed both gradient matmuls
        return loss

    return run_chunks(hidden, weight, bias, target, ignore_index, reduction, upcast, chunk_size, chunk_grad)
