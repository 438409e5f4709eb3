"""Torch reference of the fused linear cross-entropy (paper: "Fused SoftmaxCrossEntropy").

The lm_head logits of a long micro-batch are the largest activation of a causal LM ([T, V] in fp32,
plus as much again for their gradient). Here they are produced a chunk of tokens at a time and
turned into their gradient in place, so only one [chunk, V] buffer (two when bf16 inputs are
upcast, one more for a soft-cap's derivative) ever exists. The gradients of hidden, weight and bias are
computed in the same pass, three matmuls per chunk instead of the four that a separate forward and backward
would need.

The chunk follows the data (`chunk_rows`): about T·H/V tokens (Liger-Kernel's rule), a power of two and at
least `config.LOSS_MIN_CHUNK`, so the [chunk, V] logits are about as large as hidden itself and the grad_weight
matmul has a long inner dimension; the caller's `max_workspace_bytes` (the config's `loss_workspace_bytes`)
caps the chunk's buffers, and on the CPU `CPU_CHUNK_BUDGET_BYTES` does too. grad_weight is written once per
chunk by its matmul (`addmm`, beta 0 for the first chunk, 1 after), straight into the gradient returned:
in the weight's dtype by default, so under bf16 the sum over the chunks is rounded to bf16 after each
chunk (as Liger-Kernel does), or in fp32 with `grad_dtype=torch.float32`. No fp32 [V, H] accumulator is
read and written per chunk, and no copy follows.

`linear_cross_entropy_vocab_slices` is the same loss walked the other way, for when the tokens are fewer
than the vocabulary: a first walk over token chunks keeps only each token's log-sum-exp (here as its max
logit and sum of exp, which bf16 logits subtract exactly), then a walk
over slices of the vocabulary recomputes [T, Vs] logits for all tokens, turns them into their gradient
and writes grad_weight of those rows with one matmul over all tokens, while grad_hidden sums over the
slices in an fp32 [T, H] buffer. Four matmuls instead of three.
`run_chunks` and `run_vocab_slices` are the loops the torch and Triton versions share.

Models that scale or soft-cap their logits (Granite, Cohere, Gemma2) give the loss
``softcap * tanh(scale * z / softcap)`` (or ``scale * z``) of the linear's output z; the chunk applies
that transform before the softmax and its derivative after, so z's gradient is what the matmuls see.

`vocab_parallel_linear_cross_entropy_chunked` is the same loss for an lm_head split over the vocabulary
across a tensor-parallel group (Megatron's vocabulary-parallel cross-entropy), with the same three matmuls
per chunk: each rank computes its [chunk, V/tp] logits once, and one all-gather of each token's
(max, sum of exp, target logit) per chunk ([3, chunk] fp32 per rank) gives every rank the whole vocabulary's
log-sum-exp before the logits turn into their gradient. It has no Triton variant: it runs as written here on
every device.

No function here waits for the device: the loss stays a device tensor, the chunking reads shapes only, and
the target check is a host check on the CPU and an asynchronous device assert elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..config import loss_chunk_tokens
from ..lazy import lazy_getattr

__all__ = [
    "CPU_CHUNK_BUDGET_BYTES",
    "ChunkGrad",
    "SliceGrad",
    "chunk_rows",
    "linear_cross_entropy_token_chunks",
    "linear_cross_entropy_vocab_slices",
    "logit_bytes",
    "run_chunks",
    "run_vocab_slices",
    "slice_rows",
    "vocab_parallel_linear_cross_entropy_chunked",
]

CPU_CHUNK_BUDGET_BYTES = 256 * 2**20
"""The [chunk, V] buffers of one chunk on the CPU, whatever the cap (1024 rows of V = 32K in fp32 take 125 MiB)."""


def _budget_bytes(max_workspace_bytes: int, device: torch.device) -> int:
    """Bytes one chunk's (or slice's) buffers may take on `device`: the caller's cap, and on the CPU no more
    than `CPU_CHUNK_BUDGET_BYTES`. Shapes only, so every rank of a group gets the same chunks."""
    if device.type == "cpu":
        return min(max_workspace_bytes, CPU_CHUNK_BUDGET_BYTES)
    return max_workspace_bytes


def logit_bytes(dtype: torch.dtype, upcast: bool, softcap: float | None) -> int:
    """Bytes the torch kernels hold per logit of a chunk: the linear's output, its fp32 copy when low-precision
    logits are upcast, and tanh's derivative under a soft-cap (in the dtype the softmax runs in)."""
    upcast_buffer = upcast and dtype != torch.float32
    work_bytes = torch.float32.itemsize if upcast_buffer else dtype.itemsize
    return dtype.itemsize + work_bytes * (int(upcast_buffer) + int(softcap is not None))


def chunk_rows(
    *, n_tokens: int, vocab: int, hidden: int, bytes_per_logit: int, max_workspace_bytes: int, device: torch.device
) -> int:
    """Tokens per chunk (`config.loss_chunk_tokens`) within `_budget_bytes` of `device`, at `bytes_per_logit`
    bytes per logit (all [chunk, V] buffers together)."""
    budget = _budget_bytes(max_workspace_bytes, device)
    return loss_chunk_tokens(
        n_tokens=n_tokens, vocab=vocab, hidden=hidden, bytes_per_logit=bytes_per_logit, budget_bytes=budget
    )


def slice_rows(
    *, n_tokens: int, vocab: int, bytes_per_logit: int, max_workspace_bytes: int, device: torch.device
) -> int:
    """Vocabulary rows per slice of `linear_cross_entropy_vocab_slices`: as many as the budget holds of all tokens'
    [T, slice] buffers (the same cap as the chunks'), at most the vocabulary; a multiple of 64 when it can be."""
    fits = _budget_bytes(max_workspace_bytes, device) // max(1, n_tokens * bytes_per_logit)
    rows = max(1, min(vocab, fits))
    return rows // 64 * 64 if 64 <= rows < vocab else rows


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


def _row_weights(valid: torch.Tensor, reduction: str) -> torch.Tensor:
    """Each token's share of the loss: 1 (sum) or 1/n_valid (mean) at valid targets, 0 at ignored ones."""
    row_weight = valid.float()
    if reduction == "mean":
        row_weight /= valid.sum().clamp(min=1)
    return row_weight


def _reduced_loss(
    loss_sum: torch.Tensor, valid: torch.Tensor, reduction: str, upcast: bool, dtype: torch.dtype
) -> torch.Tensor:
    """The returned loss from the summed fp32 token losses: fp32 if upcast, else the inputs' `dtype`."""
    loss = loss_sum / valid.sum() if reduction == "mean" else loss_sum
    return loss.to(torch.float32 if upcast else dtype)


def _softmax_to_dlogits_(
    exp_logits: torch.Tensor, row_factor: torch.Tensor, safe_target: torch.Tensor, target_weight: torch.Tensor
) -> None:
    """Turn exp(logits - c) into d(loss)/d(logits) in place: × `row_factor` (row weight / sum of exp(logits - c),
    giving the weighted softmax), then - `target_weight` at each row's target column `safe_target` [rows, 1]."""
    exp_logits.mul_(row_factor.unsqueeze(1))
    exp_logits.scatter_add_(1, safe_target, -target_weight.to(exp_logits.dtype).unsqueeze(1))


def _dlogits_from_stats_(
    logits: torch.Tensor,
    row_max: torch.Tensor,
    row_factor: torch.Tensor,
    safe_target: torch.Tensor,
    target_weight: torch.Tensor,
) -> None:
    """`_softmax_to_dlogits_` of some of the vocabulary's logits (a shard's or a slice's), from the whole
    vocabulary's `row_max` [rows] found earlier: the softmax needs all of it, these logits are only part."""
    logits.sub_(row_max.to(logits.dtype).unsqueeze(1)).exp_()
    _softmax_to_dlogits_(logits, row_factor, safe_target, target_weight)


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
    _softmax_to_dlogits_(work, row_weight / sum_exp, safe_target, row_weight)
    return token_loss.sum()


def _cap_logits_(z: torch.Tensor, scale: float, softcap: float | None) -> None:
    """Overwrite the linear's output z with the logits the loss sees, when its derivative is not needed."""
    if softcap is None:
        if scale != 1.0:
            z.mul_(scale)
        return
    z.mul_(scale / softcap).tanh_().mul_(softcap)


def _transform_logits_(
    z: torch.Tensor, scale: float, softcap: float | None, derivative_buf: torch.Tensor | None
) -> torch.Tensor | float:
    """Overwrite the linear's output z with the logits the loss sees; return d(logits)/dz.

    Without a cap the logits are ``scale * z`` and the derivative is the float `scale`. With one they
    are ``softcap * tanh(scale * z / softcap)`` and the derivative ``scale * (1 - tanh²)`` is written
    to `derivative_buf` (z's shape and dtype), since z itself is overwritten.
    """
    if softcap is None:
        _cap_logits_(z, scale, None)
        return scale
    capped = z.mul_(scale / softcap).tanh_()
    derivative = torch.mul(capped, capped, out=derivative_buf).neg_().add_(1.0).mul_(scale)
    capped.mul_(softcap)
    return derivative


def _leading(buf: torch.Tensor, shape: torch.Size | tuple[int, int]) -> torch.Tensor:
    """The first elements of the contiguous `buf` as a contiguous tensor of `shape`: the buffer of a full chunk or
    slice, holding a shorter or narrower last one."""
    return buf.view(-1)[: shape[0] * shape[1]].view(shape)


@dataclass(frozen=True)
class _LogitsWork:
    """The logit transform of the torch kernels and the [chunk, V] (or [T, slice]) buffers it needs: an fp32 copy
    of low-precision logits when they are upcast, and tanh's derivative under a soft-cap."""

    scale: float
    softcap: float | None
    work_buf: torch.Tensor | None
    derivative_buf: torch.Tensor | None

    @classmethod
    def allocate(
        cls,
        hidden: torch.Tensor,
        vocab: int,
        max_workspace_bytes: int,
        upcast: bool,
        scale: float,
        softcap: float | None,
        slices: bool = False,
    ) -> tuple[int, _LogitsWork]:
        """(tokens per chunk, the buffers for such a chunk), or with `slices` (vocabulary rows per slice, the
        buffers for all tokens of such a slice): sized so the logits, the upcast copy and the derivative together
        fit `max_workspace_bytes` (and the CPU's budget)."""
        upcast_buffer = upcast and hidden.dtype != torch.float32
        work_dtype = torch.float32 if upcast_buffer else hidden.dtype
        per_logit, device = logit_bytes(hidden.dtype, upcast, softcap), hidden.device
        n_tokens, width = hidden.shape
        if slices:
            rows = slice_rows(
                n_tokens=n_tokens,
                vocab=vocab,
                bytes_per_logit=per_logit,
                max_workspace_bytes=max_workspace_bytes,
                device=device,
            )
            shape = (n_tokens, min(rows, vocab))
        else:
            rows = chunk_rows(
                n_tokens=n_tokens,
                vocab=vocab,
                hidden=width,
                bytes_per_logit=per_logit,
                max_workspace_bytes=max_workspace_bytes,
                device=device,
            )
            shape = (min(rows, n_tokens), vocab)
        work_buf = hidden.new_empty(shape, dtype=work_dtype) if upcast_buffer else None
        derivative_buf = hidden.new_empty(shape, dtype=work_dtype) if softcap is not None else None
        return rows, cls(scale, softcap, work_buf, derivative_buf)

    def _work(self, z: torch.Tensor) -> torch.Tensor:
        """Where the logits are computed: the upcast buffer holding a copy of z, or z itself."""
        return z if self.work_buf is None else _leading(self.work_buf, z.shape).copy_(z)

    def logits(self, z: torch.Tensor) -> torch.Tensor:
        """The chunk's logits, from the linear's output z (overwritten when not upcast)."""
        work = self._work(z)
        _cap_logits_(work, self.scale, self.softcap)
        return work

    def logits_and_derivative(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | float]:
        """The chunk's logits and d(logits)/dz, for `grad_to_z_` once the logits are their gradient."""
        work = self._work(z)
        derivative_buf = None if self.derivative_buf is None else _leading(self.derivative_buf, z.shape)
        return work, _transform_logits_(work, self.scale, self.softcap, derivative_buf)

    def grad_to_z_(self, z: torch.Tensor, dlogits: torch.Tensor, derivative: torch.Tensor | float) -> None:
        """Leave d(loss)/dz in z (in its own dtype, for both gradient matmuls) from d(loss)/d(logits)."""
        if self.softcap is not None or self.scale != 1.0:
            dlogits.mul_(derivative)
        if self.work_buf is not None:
            z.copy_(dlogits)


ChunkGrad = Callable[[torch.Tensor, slice], torch.Tensor]
"""`(z, rows) -> summed fp32 loss of the chunk`: overwrites the chunk's linear output z with d(loss)/dz
in its own dtype."""

SliceGrad = Callable[[torch.Tensor, slice], None]
"""`(z, vocabulary rows)`: overwrites the slice's linear output z [T, rows] with d(loss)/dz in its own dtype."""


def _grad_dtype(param: torch.Tensor, grad_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype the gradient of `param` is written in: its own (None), or fp32 on request."""
    if grad_dtype is None or grad_dtype == param.dtype:
        return param.dtype
    if grad_dtype != torch.float32:
        raise ValueError(
            f"grad_dtype must be None (the weight's own dtype, {param.dtype}) or torch.float32, got {grad_dtype}"
        )
    return grad_dtype


def _write_grad_(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, first: bool) -> None:
    """grad = a @ b when `first`, else grad += a @ b: one matmul on the operands' dtype (no fp32 copy of either)
    that writes straight into grad, `addmm` with beta 0 then 1, so no accumulator is read and written besides.

    An fp32 grad of low-precision operands: CUDA (and meta, for shape checks) accumulate in fp32 inside the matmul
    (`out_dtype`); the CPU has no such kernel, so there the product is rounded to the operands' dtype once before
    the add.
    """
    beta = 0 if first else 1
    if a.dtype == grad.dtype:
        grad.addmm_(a, b, beta=beta)
    elif grad.device.type in ("cuda", "meta"):
        torch.addmm(grad, a, b, beta=beta, out_dtype=grad.dtype, out=grad)
    elif first:
        grad.copy_(a @ b)
    else:
        grad += a @ b


def _linear_into(z: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """z = h weight^T (+ bias), written into the buffer view z."""
    if bias is None:
        torch.matmul(h, weight.t(), out=z)
    else:
        torch.addmm(bias, h, weight.t(), out=z)


def _chunk_outputs(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, chunk_size: int
) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor]]:
    """(rows, their hidden, their linear output z) for `chunk_size` tokens at a time. Every z is a view of
    one [chunk_size, V] buffer, so the caller is done with a chunk when it asks for the next."""
    n_tokens = hidden.shape[0]
    buf = hidden.new_empty(min(chunk_size, n_tokens), weight.shape[0])
    for start in range(0, n_tokens, chunk_size):
        rows_of = slice(start, min(start + chunk_size, n_tokens))
        h = hidden[rows_of]
        z = buf[: h.shape[0]]
        _linear_into(z, h, weight, bias)
        yield rows_of, h, z


def _slice_outputs(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, slice_size: int
) -> Iterator[tuple[slice, torch.Tensor]]:
    """(vocabulary rows, their linear output z [T, rows] of all tokens) for `slice_size` rows of weight at a time.
    Every z is a view of one [T, slice_size] buffer, so the caller is done with a slice when it asks for the next."""
    vocab = weight.shape[0]
    buf = hidden.new_empty(hidden.shape[0], min(slice_size, vocab))
    for start in range(0, vocab, slice_size):
        cols = slice(start, min(start + slice_size, vocab))
        z = _leading(buf, (hidden.shape[0], cols.stop - start))
        _linear_into(z, hidden, weight[cols], None if bias is None else bias[cols])
        yield cols, z


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
    grad_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The chunk loop the implementations share: logits of `chunk_size` tokens at a time, turned into
    their gradient by `chunk_grad`, then grad_hidden of the chunk's rows, and grad_weight written by one matmul
    per chunk into the gradient returned, in `_grad_dtype(weight, grad_dtype)` (grad_bias, [V], sums in fp32).
    Every matmul runs on the inputs' dtype; the loss stays on the device (no host sync)."""
    dtype = _grad_dtype(weight, grad_dtype)
    grad_hidden = torch.empty_like(hidden)
    grad_weight = weight.new_empty(weight.shape, dtype=dtype)
    grad_bias = None if bias is None else bias.new_zeros(weight.shape[0], dtype=torch.float32)
    loss_sum = hidden.new_zeros((), dtype=torch.float32)
    if hidden.shape[0] == 0:
        grad_weight.zero_()

    for rows_of, h, dlogits in _chunk_outputs(hidden, weight, bias, chunk_size):
        loss_sum += chunk_grad(dlogits, rows_of)
        torch.matmul(dlogits, weight, out=grad_hidden[rows_of])
        _write_grad_(grad_weight, dlogits.t(), h, first=rows_of.start == 0)
        if grad_bias is not None:
            grad_bias += dlogits.sum(dim=0, dtype=torch.float32)

    return (
        _reduced_loss(loss_sum, target != ignore_index, reduction, upcast, hidden.dtype),
        grad_hidden,
        grad_weight,
        None if grad_bias is None else grad_bias.to(dtype),
    )


def run_vocab_slices(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    ignore_index: int,
    reduction: str,
    upcast: bool,
    loss_sum: torch.Tensor,
    slice_size: int,
    slice_grad: SliceGrad,
    grad_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The slice loop the vocabulary-sliced implementations share, once the first walk gave the summed fp32 token
    loss `loss_sum`: logits of `slice_size` vocabulary rows for all tokens at a time, turned into their gradient by
    `slice_grad`; then those rows of grad_weight (and grad_bias) written once, in `_grad_dtype(weight, grad_dtype)`,
    and grad_hidden summed over the slices in fp32. Every matmul runs on the inputs' dtype; no host sync."""
    dtype = _grad_dtype(weight, grad_dtype)
    grad_hidden = hidden.new_zeros(hidden.shape, dtype=torch.float32)
    grad_weight = weight.new_empty(weight.shape, dtype=dtype)
    grad_bias = None if bias is None else bias.new_empty(bias.shape, dtype=dtype)
    if hidden.shape[0] == 0:
        grad_weight.zero_()

    for cols, dlogits in _slice_outputs(hidden, weight, bias, slice_size):
        slice_grad(dlogits, cols)
        _write_grad_(grad_weight[cols], dlogits.t(), hidden, first=True)
        _write_grad_(grad_hidden, dlogits, weight[cols], first=False)
        if grad_bias is not None:
            grad_bias[cols] = dlogits.sum(dim=0, dtype=torch.float32)

    return (
        _reduced_loss(loss_sum, target != ignore_index, reduction, upcast, hidden.dtype),
        grad_hidden.to(hidden.dtype),
        grad_weight,
        grad_bias,
    )


def linear_cross_entropy_token_chunks(
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
    *,
    grad_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Loss of ``cross_entropy(softcap * tanh(scale * linear(hidden, weight, bias) / softcap), target)``
    (``scale * linear(...)`` when softcap is None) and its gradients.

    hidden [N, H], weight [V, H], bias [V] or None, target [N] int64. ``upcast`` does the logit
    transform and softmax in fp32 (as ``logits.float()`` would); otherwise in the input dtype. The chunk is
    `chunk_rows` tokens, its [chunk, V] buffers within `max_workspace_bytes` (a softcap costs one more, for
    tanh's derivative). Returns (loss, grad_hidden, grad_weight, grad_bias or None): the loss in fp32 if upcast
    else hidden's dtype, grad_hidden in hidden's dtype, grad_weight and grad_bias in the weight's dtype, or fp32
    with ``grad_dtype=torch.float32``. "mean" over zero valid targets gives a nan loss and zero gradients, like
    eager ``F.cross_entropy``.
    """
    _check_targets(target, ignore_index, weight.shape[0])
    valid = target != ignore_index
    row_weight = _row_weights(valid, reduction)
    rows, logits_work = _LogitsWork.allocate(hidden, weight.shape[0], max_workspace_bytes, upcast, scale, softcap)

    def chunk_grad(z: torch.Tensor, rows_of: slice) -> torch.Tensor:
        logits, derivative = logits_work.logits_and_derivative(z)
        loss = _logits_to_dlogits(logits, target[rows_of], valid[rows_of], row_weight[rows_of])
        logits_work.grad_to_z_(z, logits, derivative)
        return loss

    return run_chunks(hidden, weight, bias, target, ignore_index, reduction, upcast, rows, chunk_grad, grad_dtype)


# --- vocabulary-parallel --------------------------------------------------------------------------


@dataclass(frozen=True)
class _TokenStats:
    """Per token, fp32 [N]: the max logit, the sum of exp(logit - max) and the target's logit (0 where it is
    not among the logits summed). Of one vocabulary shard, or, combined, of the whole vocabulary."""

    row_max: torch.Tensor
    sum_exp: torch.Tensor
    target_logit: torch.Tensor

    def token_loss(self, valid: torch.Tensor) -> torch.Tensor:
        """log-sum-exp - target logit at valid targets, 0 at ignored ones."""
        return (self.sum_exp.log() + self.row_max - self.target_logit) * valid


def _shard_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    chunk_size: int,
    logits_work: _LogitsWork,
    safe_target: torch.Tensor,
    in_shard: torch.Tensor,
) -> _TokenStats:
    """The vocabulary slices' first walk, over token chunks: each token's statistics of these logits, the logits
    discarded chunk by chunk."""
    n_tokens = hidden.shape[0]
    row_max, sum_exp, target_logit = hidden.new_empty((3, n_tokens), dtype=torch.float32)
    for rows_of, _, z in _chunk_outputs(hidden, weight, bias, chunk_size):
        logits = logits_work.logits(z)
        chunk_max = logits.amax(dim=1, keepdim=True)
        row_max[rows_of] = chunk_max.squeeze(1)
        target_logit[rows_of] = logits.gather(1, safe_target[rows_of]).squeeze(1)
        sum_exp[rows_of] = logits.sub_(chunk_max).exp_().sum(dim=1, dtype=torch.float32)
    return _TokenStats(row_max, sum_exp, torch.where(in_shard, target_logit, 0.0))


def _exp_and_shard_stats_(logits: torch.Tensor, safe_target: torch.Tensor, in_shard: torch.Tensor) -> _TokenStats:
    """Overwrite a chunk's logits of this shard with exp(logit - the shard's max per token); return the shard's
    statistics of the chunk."""
    shard_max = logits.amax(dim=1, keepdim=True)
    target_logit = torch.where(in_shard, logits.gather(1, safe_target).squeeze(1).float(), 0.0)
    sum_exp = logits.sub_(shard_max).exp_().sum(dim=1, dtype=torch.float32)
    return _TokenStats(shard_max.squeeze(1).float(), sum_exp, target_logit)


def _combine_over_group(shard: _TokenStats, group: dist.ProcessGroup) -> _TokenStats:
    """The whole vocabulary's statistics of a chunk from every shard's, with one collective: an all-gather of the
    [3, rows] fp32 statistics; every rank then combines the same [tp, 3, rows] in the same order (the max of the
    maxes, the sums of exp rescaled to it, the target logits of which only their owner's is non-zero), so the loss
    is the same on every rank."""
    mine = torch.stack([shard.row_max, shard.sum_exp, shard.target_logit])
    every = mine.new_empty((dist.get_world_size(group), *mine.shape))
    dist.all_gather(list(every.unbind(0)), mine, group=group)
    row_max = every[:, 0].amax(dim=0)
    sum_exp = (every[:, 1] * (every[:, 0] - row_max).exp()).sum(dim=0)
    return _TokenStats(row_max, sum_exp, every[:, 2].sum(dim=0))


def vocab_parallel_linear_cross_entropy_chunked(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    ignore_index: int,
    reduction: str,
    upcast: bool,
    max_workspace_bytes: int,
    scale: float,
    softcap: float | None,
    group: dist.ProcessGroup,
    vocab_start: int,
    *,
    grad_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`linear_cross_entropy_token_chunks` of an lm_head whose rows are split over the ranks of `group`: this
    rank holds weight (and bias) rows [vocab_start, vocab_start + V/tp) of the whole vocabulary.

    hidden [N, H] and target [N] (ids of the whole vocabulary) are the same on every rank. Every rank
    calls it; the chunks depend on shapes only, so every rank walks the same ones, and each chunk costs one
    all-gather of [3, chunk] fp32 per rank. Returns the loss of the whole vocabulary (the same on every rank),
    this rank's partial grad_hidden (the sum over the group is the gradient: the caller all-reduces it, a
    column-parallel lm_head's input already does in backward), and the gradients of this rank's weight and bias
    rows. The same three matmuls per chunk as the unsplit loss: each chunk's logits are computed once.
    """
    vocab = weight.shape[0]
    _check_targets(target, ignore_index, vocab * dist.get_world_size(group))
    valid = target != ignore_index
    local_target = target - vocab_start
    in_shard = valid & (local_target >= 0) & (local_target < vocab)
    safe_target = torch.where(in_shard, local_target, 0).unsqueeze(1)
    row_weight = _row_weights(valid, reduction)
    rows, logits_work = _LogitsWork.allocate(hidden, vocab, max_workspace_bytes, upcast, scale, softcap)

    def chunk_grad(z: torch.Tensor, rows_of: slice) -> torch.Tensor:
        logits, derivative = logits_work.logits_and_derivative(z)
        shard = _exp_and_shard_stats_(logits, safe_target[rows_of], in_shard[rows_of])
        whole = _combine_over_group(shard, group)
        weight_of_rows = row_weight[rows_of]
        row_factor = weight_of_rows * (shard.row_max - whole.row_max).exp() / whole.sum_exp
        _softmax_to_dlogits_(logits, row_factor, safe_target[rows_of], weight_of_rows * in_shard[rows_of])
        logits_work.grad_to_z_(z, logits, derivative)
        return whole.token_loss(valid[rows_of]).sum()

    return run_chunks(hidden, weight, bias, target, ignore_index, reduction, upcast, rows, chunk_grad, grad_dtype)


# --- vocabulary slices ----------------------------------------------------------------------------


def linear_cross_entropy_vocab_slices(
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
    *,
    grad_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`linear_cross_entropy_token_chunks` walked over vocabulary slices; same arguments and returns.

    The first walk, over chunks of `chunk_rows` tokens, keeps each token's max logit and sum of exp (fp32 [N]) and
    gives the loss; the second, over slices of the vocabulary (`slice_rows`), recomputes their logits for all tokens
    and turns them into their gradient with those statistics, writing each slice's rows of grad_weight once. One
    matmul more than the token chunks, and an fp32 [N, H] grad_hidden buffer.
    """
    vocab = weight.shape[0]
    _check_targets(target, ignore_index, vocab)
    valid = target != ignore_index
    safe_target = torch.where(valid, target, 0)
    rows, chunk_work = _LogitsWork.allocate(hidden, vocab, max_workspace_bytes, upcast, scale, softcap)
    stats = _shard_stats(hidden, weight, bias, rows, chunk_work, safe_target.unsqueeze(1), valid)
    del chunk_work  # the chunks' buffers go before the slices' come
    row_weight = _row_weights(valid, reduction)
    row_factor = row_weight / stats.sum_exp
    slice_size, slice_work = _LogitsWork.allocate(
        hidden, vocab, max_workspace_bytes, upcast, scale, softcap, slices=True
    )

    def slice_grad(z: torch.Tensor, cols: slice) -> None:
        logits, derivative = slice_work.logits_and_derivative(z)
        local_target = safe_target - cols.start
        in_slice = valid & (local_target >= 0) & (local_target < z.shape[1])
        local_target = torch.where(in_slice, local_target, 0).unsqueeze(1)
        _dlogits_from_stats_(logits, stats.row_max, row_factor, local_target, row_weight * in_slice)
        slice_work.grad_to_z_(z, logits, derivative)

    loss_sum = stats.token_loss(valid).sum()
    return run_vocab_slices(
        hidden, weight, bias, target, ignore_index, reduction, upcast, loss_sum, slice_size, slice_grad, grad_dtype
    )


if not TYPE_CHECKING:  # mypy sees only the current names
    __getattr__ = lazy_getattr(
        __name__,
        {},
        globals(),
        renamed={"linear_cross_entropy_chunked": f"{__name__}:linear_cross_entropy_token_chunks"},
    )
