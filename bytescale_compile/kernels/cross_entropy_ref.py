"""Torch reference of the fused linear cross-entropy (paper: "Fused SoftmaxCrossEntropy").

The lm_head logits of a long micro-batch are the largest activation of a causal LM ([T, V] in fp32,
plus as much again for their gradient). Here they are produced ``chunk_size`` tokens at a time and
turned into their gradient in place, so only one [chunk_size, V] buffer (two when bf16 inputs are
upcast) ever exists. The gradients of hidden, weight and bias are computed in the same pass, which
costs three matmuls instead of the four that a separate forward and backward would need, but
grad_weight is summed over the chunks in an fp32 [V, H] buffer.

`linear_cross_entropy_vocab_slices` is the same loss without that buffer, for when the tokens are fewer
than the vocabulary: a first walk over token chunks keeps only each token's log-sum-exp (here as its max
logit and sum of exp, which bf16 logits subtract exactly), then a walk
over slices of the vocabulary recomputes [T, Vs] logits for all tokens, turns them into their gradient
and writes grad_weight of those rows with one matmul over all tokens, while grad_hidden sums over the
slices in an fp32 [T, H] buffer. Four matmuls instead of three, T·H fp32 held instead of V·H.
`run_chunks` and `run_vocab_slices` are the loops the torch and Triton versions share.

Models that scale or soft-cap their logits (Granite, Cohere, Gemma2) give the loss
``softcap * tanh(scale * z / softcap)`` (or ``scale * z``) of the linear's output z; the chunk applies
that transform before the softmax and its derivative after, so z's gradient is what the matmuls see.

`vocab_parallel_linear_cross_entropy_chunked` is the same loss for an lm_head split over the vocabulary
across a tensor-parallel group (Megatron's vocabulary-parallel cross-entropy): each rank walks its
[chunk_size, V/tp] logits twice, once for the per-token max, sum of exp and target logit that the group
combines, once more for the gradients, which need the whole vocabulary's log-sum-exp. It has no Triton
variant: it runs as written here on every device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "ChunkGrad",
    "SliceGrad",
    "chunk_rows",
    "linear_cross_entropy_chunked",
    "linear_cross_entropy_vocab_slices",
    "run_chunks",
    "run_vocab_slices",
    "slice_rows",
    "vocab_parallel_linear_cross_entropy_chunked",
]

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


def slice_rows(max_rows: int, n_tokens: int, vocab: int, bytes_per_row_entry: int, device: torch.device) -> int:
    """Vocabulary rows per slice of `linear_cross_entropy_vocab_slices`: `chunk_rows` with the roles of tokens and
    vocabulary swapped, so the [T, slice] buffers fit the same budget; and they hold no more logits than a chunk of
    `max_rows` tokens would, so the config's `loss_chunk_size` bounds the buffers of both implementations."""
    same_entries = max(1, max_rows * vocab // max(1, n_tokens))
    return chunk_rows(same_entries, vocab, n_tokens, bytes_per_row_entry, device)


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
        chunk_size: int,
        upcast: bool,
        scale: float,
        softcap: float | None,
        slices: bool = False,
    ) -> tuple[int, _LogitsWork]:
        """(tokens per chunk, the buffers for such a chunk), or with `slices` (vocabulary rows per slice, the
        buffers for all tokens of such a slice): sized to fit the device's budget for the logits, the upcast copy
        and the derivative together."""
        upcast_buffer = upcast and hidden.dtype != torch.float32
        work_dtype = torch.float32 if upcast_buffer else hidden.dtype
        entry_bytes = hidden.dtype.itemsize + work_dtype.itemsize * (int(upcast_buffer) + int(softcap is not None))
        n_tokens = hidden.shape[0]
        if slices:
            rows = slice_rows(chunk_size, n_tokens, vocab, entry_bytes, hidden.device)
            shape = (n_tokens, min(rows, vocab))
        else:
            rows = chunk_rows(chunk_size, n_tokens, vocab, entry_bytes, hidden.device)
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


def _accumulate_fp32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (fp32) += a @ b, the matmul on the inputs' dtype (no fp32 copy of either).

    CUDA (and meta, for shape checks) accumulate in fp32 inside the matmul (`out_dtype`); the CPU has
    no such kernel, so there the product is rounded to the input dtype once before the add.
    """
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.device.type in ("cuda", "meta"):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc += a @ b


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The chunk loop the implementations share: logits of `chunk_size` tokens at a time, turned into
    their gradient by `chunk_grad`, then grad_hidden, and grad_weight/grad_bias accumulated in fp32.
    Every matmul runs on the inputs' dtype; the loss stays on the device (no host sync)."""
    grad_hidden = torch.empty_like(hidden)
    grad_weight = weight.new_zeros(weight.shape, dtype=torch.float32)
    grad_bias = None if bias is None else bias.new_zeros(weight.shape[0], dtype=torch.float32)
    loss_sum = hidden.new_zeros((), dtype=torch.float32)

    for rows_of, h, dlogits in _chunk_outputs(hidden, weight, bias, chunk_size):
        loss_sum += chunk_grad(dlogits, rows_of)
        torch.matmul(dlogits, weight, out=grad_hidden[rows_of])
        _accumulate_fp32_(grad_weight, dlogits.t(), h)
        if grad_bias is not None:
            grad_bias += dlogits.sum(dim=0, dtype=torch.float32)

    return (
        _reduced_loss(loss_sum, target != ignore_index, reduction, upcast, hidden.dtype),
        grad_hidden,
        grad_weight.to(weight.dtype),
        None if grad_bias is None or bias is None else grad_bias.to(bias.dtype),
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The slice loop the vocabulary-sliced implementations share, once the first walk gave the summed fp32 token
    loss `loss_sum`: logits of `slice_size` vocabulary rows for all tokens at a time, turned into their gradient by
    `slice_grad`; then those rows of grad_weight as one matmul over all tokens, written in weight's dtype, and
    grad_hidden summed over the slices in fp32. Every matmul runs on the inputs' dtype; no host sync."""
    grad_hidden = hidden.new_zeros(hidden.shape, dtype=torch.float32)
    grad_weight = weight.new_empty(weight.shape)
    grad_bias = None if bias is None else bias.new_empty(bias.shape)

    for cols, dlogits in _slice_outputs(hidden, weight, bias, slice_size):
        slice_grad(dlogits, cols)
        torch.matmul(dlogits.t(), hidden, out=grad_weight[cols])
        _accumulate_fp32_(grad_hidden, dlogits, weight[cols])
        if grad_bias is not None:
            grad_bias[cols] = dlogits.sum(dim=0, dtype=torch.float32)

    return (
        _reduced_loss(loss_sum, target != ignore_index, reduction, upcast, hidden.dtype),
        grad_hidden.to(hidden.dtype),
        grad_weight,
        grad_bias,
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
    row_weight = _row_weights(valid, reduction)
    chunk_size, logits_work = _LogitsWork.allocate(hidden, weight.shape[0], chunk_size, upcast, scale, softcap)

    def chunk_grad(z: torch.Tensor, rows_of: slice) -> torch.Tensor:
        logits, derivative = logits_work.logits_and_derivative(z)
        loss = _logits_to_dlogits(logits, target[rows_of], valid[rows_of], row_weight[rows_of])
        logits_work.grad_to_z_(z, logits, derivative)
        return loss

    return run_chunks(hidden, weight, bias, target, ignore_index, reduction, upcast, chunk_size, chunk_grad)


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
    """The first walk over the chunks: this shard's statistics, the logits discarded chunk by chunk."""
    n_tokens = hidden.shape[0]
    row_max, sum_exp, target_logit = hidden.new_empty((3, n_tokens), dtype=torch.float32)
    for rows_of, _, z in _chunk_outputs(hidden, weight, bias, chunk_size):
        logits = logits_work.logits(z)
        chunk_max = logits.amax(dim=1, keepdim=True)
        row_max[rows_of] = chunk_max.squeeze(1)
        target_logit[rows_of] = logits.gather(1, safe_target[rows_of]).squeeze(1)
        sum_exp[rows_of] = logits.sub_(chunk_max).exp_().sum(dim=1, dtype=torch.float32)
    return _TokenStats(row_max, sum_exp, torch.where(in_shard, target_logit, 0.0))


def _combine_over_group(shard: _TokenStats, group: dist.ProcessGroup) -> _TokenStats:
    """The whole vocabulary's statistics from every shard's, as Megatron combines them: an all-reduce of the
    max, then one of the sums of exp rescaled to it together with the target logits (only their owner's is
    non-zero)."""
    row_max = shard.row_max.clone()
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    sums = torch.stack([shard.sum_exp * (shard.row_max - row_max).exp(), shard.target_logit])
    dist.all_reduce(sums, group=group)
    return _TokenStats(row_max, sums[0], sums[1])


def vocab_parallel_linear_cross_entropy_chunked(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    ignore_index: int,
    reduction: str,
    upcast: bool,
    chunk_size: int,
    scale: float,
    softcap: float | None,
    group: dist.ProcessGroup,
    vocab_start: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`linear_cross_entropy_chunked` of an lm_head whose rows are split over the ranks of `group`: this
    rank holds weight (and bias) rows [vocab_start, vocab_start + V/tp) of the whole vocabulary.

    hidden [N, H] and target [N] (ids of the whole vocabulary) are the same on every rank. Every rank
    calls it (it communicates twice, O(N) each). Returns the loss of the whole vocabulary (the same on
    every rank), this rank's partial grad_hidden (the sum over the group is the gradient: the caller
    all-reduces it, a column-parallel lm_head's input already does in backward), and the gradients
    of this rank's weight and bias rows. Costs one matmul more than the unsplit loss: the logits are
    recomputed for the gradients, which need the whole vocabulary's log-sum-exp.
    """
    vocab = weight.shape[0]
    _check_targets(target, ignore_index, vocab * dist.get_world_size(group))
    valid = target != ignore_index
    local_target = target - vocab_start
    in_shard = valid & (local_target >= 0) & (local_target < vocab)
    safe_target = torch.where(in_shard, local_target, 0).unsqueeze(1)
    chunk_size, logits_work = _LogitsWork.allocate(hidden, vocab, chunk_size, upcast, scale, softcap)
    stats = _combine_over_group(
        _shard_stats(hidden, weight, bias, chunk_size, logits_work, safe_target, in_shard), group
    )
    token_loss = stats.token_loss(valid)
    row_weight = _row_weights(valid, reduction)
    row_factor, target_weight = row_weight / stats.sum_exp, row_weight * in_shard

    def chunk_grad(z: torch.Tensor, rows_of: slice) -> torch.Tensor:
        logits, derivative = logits_work.logits_and_derivative(z)
        _dlogits_from_stats_(
            logits, stats.row_max[rows_of], row_factor[rows_of], safe_target[rows_of], target_weight[rows_of]
        )
        logits_work.grad_to_z_(z, logits, derivative)
        return token_loss[rows_of].sum()

    return run_chunks(hidden, weight, bias, target, ignore_index, reduction, upcast, chunk_size, chunk_grad)


# --- vocabulary slices ----------------------------------------------------------------------------


def linear_cross_entropy_vocab_slices(
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
    """`linear_cross_entropy_chunked` without its fp32 [V, H] grad_weight buffer; same arguments and returns.

    The first walk, over chunks of `chunk_size` tokens, keeps each token's max logit and sum of exp (fp32 [N]) and
    gives the loss; the second, over slices of the vocabulary (`slice_rows`), recomputes their logits for all tokens
    and turns them into their gradient with those statistics. One matmul more than the token chunks, and an fp32
    [N, H] grad_hidden buffer held instead of [V, H]: it pays when N < V.
    """
    vocab = weight.shape[0]
    _check_targets(target, ignore_index, vocab)
    valid = target != ignore_index
    safe_target = torch.where(valid, target, 0)
    rows, chunk_work = _LogitsWork.allocate(hidden, vocab, chunk_size, upcast, scale, softcap)
    stats = _shard_stats(hidden, weight, bias, rows, chunk_work, safe_target.unsqueeze(1), valid)
    del chunk_work  # the chunks' buffers go before the slices' come
    row_weight = _row_weights(valid, reduction)
    row_factor = row_weight / stats.sum_exp
    slice_size, slice_work = _LogitsWork.allocate(hidden, vocab, chunk_size, upcast, scale, softcap, slices=True)

    def slice_grad(z: torch.Tensor, cols: slice) -> None:
        logits, derivative = slice_work.logits_and_derivative(z)
        local_target = safe_target - cols.start
        in_slice = valid & (local_target >= 0) & (local_target < z.shape[1])
        local_target = torch.where(in_slice, local_target, 0).unsqueeze(1)
        _dlogits_from_stats_(logits, stats.row_max, row_factor, local_target, row_weight * in_slice)
        slice_work.grad_to_z_(z, logits, derivative)

    loss_sum = stats.token_loss(valid).sum()
    return run_vocab_slices(
        hidden, weight, bias, target, ignore_index, reduction, upcast, loss_sum, slice_size, slice_grad
    )
