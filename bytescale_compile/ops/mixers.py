"""`bytescale::causal_conv1d` and `bytescale::scan`: the token mixers of hybrid models, segment-aware.

Short convolutions (LFM2, and the one before every Mamba or gated-delta layer) and linear recurrences
(Mamba's selective scan, Mamba2's SSD, the gated delta rule of Qwen3-Next) read earlier tokens. Packed or
shared, they must read only those of their own sequence, and a shared sequence's earlier chunks live on
other ranks. These ops read where the pieces of a row are at run time, as `bytescale::attention` does:

- a shared micro-batch (the context's group has several ranks): the rank's zigzag chunks, with halos and
  states from the other ranks (`runtime/dist_mixers.py`);
- else the context's `cu_seqlens`, or the rows' packing an optimized model read from `position_ids`
  (`runtime.context.RowPacking`);
- else one sequence per row, like the eager model.

Each returns, beside its output, a bool `[B, T]` marking where the pieces of each row start; the backward op
takes it, so a packed row's backward needs no context. Like the attention backward, the backward ops are
opaque ops of their own, reading the context when the backward graph runs.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from bytescale_compile.kernels.recurrences import RECURRENCES, Recurrence
from bytescale_compile.runtime.context import ContextError, RowPacking, current_context, innermost
from bytescale_compile.runtime.dist_mixers import (
    MixerRow,
    causal_conv,
    causal_conv_backward,
    packed_row,
    ring_row,
    scan_backward,
    summary_shapes,
)
from bytescale_compile.runtime.dist_mixers import scan as scan_row
from bytescale_compile.runtime.ring_attention import make_ring

__all__ = ["causal_conv1d", "causal_conv1d_backward", "scan", "scan_backward_op", "SCAN_OUTPUT", "boundary_bytes"]

SCAN_OUTPUT = {"ssd": 0, "selective": 0, "gated_delta": 2}
"""Which input of each recurrence the output is shaped like (x, x, v)."""


def _rows(batch: int, tokens: int) -> list[MixerRow]:
    """The pieces of every row, from the context (a ring or packed cu_seqlens), an optimized model's row packing,
    or one sequence per row."""
    ctx = current_context()
    if ctx is not None and (ctx.is_ring or ctx.cu_seqlens is not None):
        if batch != 1:
            raise ContextError(
                f"micro-batch {ctx.micro_batch_id}: packed or shared sequences need a single row, got {batch} rows"
            )
        if ctx.is_ring:
            assert ctx.layout is not None and ctx.group is not None
            if ctx.ulysses > 1:
                raise ContextError(
                    f"micro-batch {ctx.micro_batch_id}: convolutions and scans do not run under a Ulysses split yet "
                    f"(degree {ctx.ulysses}); share this model's micro-batches with ulysses=1"
                )
            ring = make_ring(ctx.layout, ctx.group, ctx.ring_timeout_s, ctx.ring_stats, None)
            row = ring_row(ring)
            if sum(p.length for p in row.pieces) != tokens:
                raise ContextError(
                    f"micro-batch {ctx.micro_batch_id}: this rank holds {sum(p.length for p in row.pieces)} tokens "
                    f"of the shared sequences but a mixer input has {tokens}"
                )
            return [row]
        ctx.check_tokens(tokens)
        assert ctx.cu_seqlens is not None
        return [packed_row(ctx.cu_seqlens.tolist())]
    packing = innermost(RowPacking)
    if packing is not None:
        return [packed_row(packing.row(b, tokens).tolist()) for b in range(batch)]
    return [packed_row([0, tokens])] * batch


def _starts(rows: list[MixerRow], tokens: int, device: torch.device) -> Tensor:
    starts = torch.zeros(len(rows), tokens, dtype=torch.bool)
    for b, row in enumerate(rows):
        for p in row.pieces:
            if p.length:
                starts[b, p.offset] = True
    return starts.to(device)


def _rows_for_backward(starts: Tensor) -> list[MixerRow]:
    """The rows of the forward: the ring's when the context shares the micro-batch, else read back from `starts`."""
    ctx = current_context()
    if ctx is not None and ctx.is_ring:
        return _rows(starts.shape[0], starts.shape[1])
    tokens = starts.shape[1]
    rows = []
    for row in starts.cpu():
        bounds = row.nonzero().flatten().tolist()
        rows.append(packed_row([*bounds, tokens] if bounds and bounds[0] == 0 else [0, *bounds, tokens]))
    return rows


def _check_conv(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> None:
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[2]:
        raise ValueError(
            f"causal_conv1d takes x [B, T, C] and a depthwise weight [C, k], got x {tuple(x.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (x.shape[2],):
        raise ValueError(f"causal_conv1d's bias must be [C] = [{x.shape[2]}], got {tuple(bias.shape)}")


@torch.library.custom_op("bytescale::causal_conv1d", mutates_args=())
def causal_conv1d(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Depthwise causal convolution over tokens, within each sequence: x [B, T, C], weight [C, k], bias [C].

    Returns y [B, T, C] (x's dtype; computed in fp32) and where the pieces of each row start, bool [B, T].
    Equals `conv1d(x.transpose(1, 2), weight[:, None], bias, padding=k - 1, groups=C)[..., :T]` on each sequence.
    """
    _check_conv(x, weight, bias)
    rows = _rows(x.shape[0], x.shape[1])
    b = bias if bias is not None else weight.new_zeros(weight.shape[0])
    y = torch.stack([causal_conv(x[i], weight, b, row) for i, row in enumerate(rows)])
    return y, _starts(rows, x.shape[1], x.device)


@causal_conv1d.register_fake
def _causal_conv1d_fake(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    _check_conv(x, weight, bias)
    return torch.empty_like(x), x.new_empty(x.shape[:2], dtype=torch.bool)


@torch.library.custom_op("bytescale::causal_conv1d_backward", mutates_args=())
def causal_conv1d_backward(
    grad: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], starts: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dweight, dbias) of `causal_conv1d`; dbias is zeros [C] when there is no bias."""
    b = bias if bias is not None else weight.new_zeros(weight.shape[0])
    dx, dw, db = torch.empty_like(x), torch.zeros_like(weight), torch.zeros_like(b)
    for i, row in enumerate(_rows_for_backward(starts)):
        dx[i], dwi, dbi = causal_conv_backward(x[i], weight, b, row, grad[i])
        dw += dwi
        db += dbi
    return dx, dw, db


@causal_conv1d_backward.register_fake
def _causal_conv1d_backward_fake(
    grad: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], starts: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(weight), weight.new_empty(weight.shape[0])


def _conv_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight, bias, output[1])
    ctx.has_bias = bias is not None


def _conv_backward(ctx: Any, grad: Tensor, grad_starts: Tensor | None) -> tuple[Tensor | None, ...]:
    del grad_starts
    x, weight, bias, starts = ctx.saved_tensors
    dx, dw, db = torch.ops.bytescale.causal_conv1d_backward(grad, x, weight, bias, starts)
    return dx, dw, db if ctx.has_bias else None


causal_conv1d.register_autograd(_conv_backward, setup_context=_conv_setup)


# --- linear recurrences ---------------------------------------------------------------------------


def _recurrence(kind: str, inputs: list[Tensor]) -> Recurrence:
    if kind not in RECURRENCES:
        raise ValueError(f"unknown recurrence {kind!r}: bytescale::scan knows {sorted(RECURRENCES)}")
    rec = RECURRENCES[kind]
    tokens = [inputs[i] for i in rec.token_inputs]
    if any(t.dim() < 2 or t.shape[:2] != tokens[0].shape[:2] for t in tokens):
        raise ValueError(
            f"bytescale::scan({kind!r}): the token inputs must share their leading [B, T], got "
            f"{[tuple(t.shape) for t in tokens]}"
        )
    return rec


def _row_inputs(rec: Recurrence, inputs: list[Tensor], b: int) -> list[Tensor]:
    return [x[b] if i in rec.token_inputs else x for i, x in enumerate(inputs)]


@torch.library.custom_op("bytescale::scan", mutates_args=())
def scan(kind: str, inputs: list[Tensor]) -> tuple[Tensor, Tensor]:
    """The linear recurrence `kind` (`kernels/recurrences.py`) over each sequence of each row.

    Token inputs are `[B, T, ...]`, the others (A) as the recurrence takes them. Returns its output
    `[B, T, ...]` and where the pieces of each row start, bool `[B, T]`.
    """
    rec = _recurrence(kind, inputs)
    like = inputs[SCAN_OUTPUT[kind]]
    rows = _rows(like.shape[0], like.shape[1])
    y = torch.stack([scan_row(rec, _row_inputs(rec, inputs, b), row) for b, row in enumerate(rows)])
    return y.to(like.dtype), _starts(rows, like.shape[1], like.device)


@scan.register_fake
def _scan_fake(kind: str, inputs: list[Tensor]) -> tuple[Tensor, Tensor]:
    _recurrence(kind, inputs)
    like = inputs[SCAN_OUTPUT[kind]]
    return torch.empty_like(like), like.new_empty(like.shape[:2], dtype=torch.bool)


@torch.library.custom_op("bytescale::scan_backward", mutates_args=())
def scan_backward_op(kind: str, inputs: list[Tensor], starts: Tensor, grad: Tensor) -> list[Tensor]:
    """Gradients of every input of `bytescale::scan`."""
    rec = _recurrence(kind, inputs)
    grads = [torch.zeros_like(x) for x in inputs]
    for b, row in enumerate(_rows_for_backward(starts)):
        row_grads = scan_backward(rec, _row_inputs(rec, inputs, b), row, grad[b])
        for i, g in enumerate(row_grads):
            if i in rec.token_inputs:
                grads[i][b] = g
            else:
                grads[i] += g
    return grads


@scan_backward_op.register_fake
def _scan_backward_fake(kind: str, inputs: list[Tensor], starts: Tensor, grad: Tensor) -> list[Tensor]:
    return [torch.empty_like(x) for x in inputs]


def _scan_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    kind, tensors = inputs
    ctx.save_for_backward(*tensors, output[1])
    ctx.kind = kind


def _scan_backward(ctx: Any, grad: Tensor, grad_starts: Tensor | None) -> tuple[Any, ...]:
    del grad_starts
    *tensors, starts = ctx.saved_tensors
    return None, torch.ops.bytescale.scan_backward(ctx.kind, tensors, starts, grad)


scan.register_autograd(_scan_backward, setup_context=_scan_setup)


def boundary_bytes(kind: str, inputs: list[Tensor]) -> int:
    """Bytes that one chunk boundary of a shared sequence moves forward for this call: the k - 1 halo tokens of a
    convolution ("conv": inputs x, weight), or a recurrence's state summary (M, b) in fp32."""
    if kind == "conv":
        x, weight = inputs[:2]
        return int((weight.shape[1] - 1) * x.shape[2] * x.element_size())
    rec = RECURRENCES[kind]
    row = [x[0] if i in rec.token_inputs else x for i, x in enumerate(inputs)]
    m, h = summary_shapes(rec, row)
    return 4 * int(torch.Size(m).numel() + torch.Size(h).numel())
