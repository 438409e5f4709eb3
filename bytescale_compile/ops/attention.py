"""`bytescale::attention`: causal attention whose packing is read from the micro-batch context.

`window` (Hugging Face's sliding window: a query sees itself and the `window - 1` keys before it) and
`softcap` (Gemma2's `attn_logit_softcapping`: scores become `c * tanh(s / c)`) apply on every path;
V's head dim may differ from Q/K's (DeepSeek-V3), so out is `[B, Hq, T, Dv]`.

The compiled graph holds one opaque call per attention layer and never changes between
micro-batches; at run time the op looks at `current_context()`: with packed `cu_seqlens` every token
attends causally within its own sequence (the row must then be a single one, B == 1); without them,
`position_ids` (passed by the attention pass for Hugging Face's packed-sequence masks) split each row
where positions restart; otherwise it is plain causal attention per row, like SDPA with `is_causal=True`.
When the context's group has several ranks, the row holds this rank's zigzag tokens and the op runs
the packed ring (`runtime/ring_attention.py`), with the context's Ulysses degree beside it
(`runtime/ulysses.py`); a group of one stays local.

`backend` (`CompileConfig.attention_backend`, set on the op when the graph compiles) names the attention backend
of `kernels.dispatch`'s table that every call, local segments and ring blocks alike, must run on; None
leaves the choice to the table and `BYTESCALE_KERNELS`. A single row (a packed micro-batch) is returned
as the kernels give it; only several rows are gathered into one tensor.

Under `torch.autocast` q, k and v may arrive in different dtypes (RoPE promotes q and k back to
fp32); like SDPA, the op then runs in the autocast dtype (`ops/autocast.py`).

The backward is a second opaque op, `bytescale::attention_backward`, rather than a Python formula:
AOTAutograd traces the autograd formula into the backward graph with fake tensors, so anything the
formula read from the context would be frozen at trace time. As its own op it reads the context
when the backward graph runs (which must be under the same context as the forward).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch import Tensor

from bytescale_compile.kernels.attention_ref import (
    check_attention_options,
    check_attention_shapes,
    empty_attention_out,
    layout_like,
)
from bytescale_compile.kernels.dispatch import (
    attention_backend,
    causal_attention_bwd,
    causal_attention_fwd,
    segment_causal_attention_bwd,
    segment_causal_attention_fwd,
)
from bytescale_compile.ops.autocast import register_autocast_rule, to_autocast_dtype
from bytescale_compile.runtime.context import ContextError, MicroBatchContext, current_context, restarts
from bytescale_compile.runtime.ulysses import ulysses_attention_bwd, ulysses_attention_fwd

__all__ = ["attention", "attention_backward"]


def _ring_context(q: Tensor) -> MicroBatchContext | None:
    """The context when this micro-batch is shared by several ranks (ring attention), else None."""
    ctx = current_context()
    if ctx is None or not ctx.is_ring:
        return None
    if q.shape[0] != 1:
        raise ContextError(
            f"micro-batch {ctx.micro_batch_id}: a shared micro-batch needs a single row, got q {tuple(q.shape)}"
        )
    return ctx


def _to_ring(x: Tensor) -> Tensor:
    """The single row `[1, H, T, D]` of a shared micro-batch as the ring takes it, `[T, H, D]`."""
    return x[0].transpose(0, 1)


def _from_ring(x: Tensor, like: Tensor) -> Tensor:
    """The ring's `[T, H, D]` back as a row `[1, H, T, D]` laid out like `like`."""
    return layout_like(x.transpose(0, 1).unsqueeze(0), like)


def _row_packing(q: Tensor, position_ids: Tensor | None) -> list[Tensor] | None:
    """cu_seqlens of every row, or None when every row is one causal sequence.

    The context's cu_seqlens win (the runtime packs, and zigzag chunks have non-contiguous
    positions); without them, `position_ids` given by the attention pass mean the model itself
    restricts attention to the segments where positions restart (Hugging Face's packed format).
    """
    ctx = current_context()
    if ctx is not None and ctx.cu_seqlens is not None:
        ctx.check_tokens(q.shape[2])
        if q.shape[0] != 1:
            raise ContextError(
                f"micro-batch {ctx.micro_batch_id}: packed sequences (cu_seqlens) need a single row, "
                f"but the attention input q has shape {tuple(q.shape)} (B={q.shape[0]})"
            )
        return [ctx.cu_seqlens]
    if position_ids is None:
        return None
    return _restarts(position_ids, q.shape[0], q.shape[2])


_last_restarts: tuple[Any, ...] = ()
"""(weakref to position_ids, (its version, batch, tokens), boundaries) of the latest `_restarts` call: every
layer of a forward passes the same position_ids, so reading them to the host once per step is enough."""


def _restarts(position_ids: Tensor, batch: int, tokens: int) -> list[Tensor] | None:
    """Per row, segment boundaries where a position is not its predecessor's plus one (a host read, cached
    while the same, unmodified position_ids tensor comes back)."""
    global _last_restarts
    if position_ids.shape[-1] != tokens:
        raise ValueError(f"position_ids has {position_ids.shape[-1]} tokens but the attention input has {tokens}")
    key = None if position_ids.is_inference() else (position_ids._version, batch, tokens)
    if key is not None and _last_restarts and _last_restarts[0]() is position_ids and _last_restarts[1] == key:
        return _last_restarts[2]
    bounds = restarts(position_ids, batch, tokens)
    if key is not None:
        _last_restarts = (weakref.ref(position_ids), key, bounds)
    return bounds


_BACKEND_SOURCE = "CompileConfig.attention_backend"


def _check_args(q: Tensor, k: Tensor, v: Tensor, window: int | None, softcap: float | None) -> None:
    """Raise ValueError for shapes, a window or a soft-cap the op cannot take (also at trace time)."""
    check_attention_shapes(q, k, v)
    check_attention_options(window, softcap)


@torch.library.custom_op("bytescale::attention", mutates_args=())
def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    position_ids: Optional[Tensor] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    backend: Optional[str] = None,
) -> tuple[Tensor, Tensor]:
    """Causal (or segment-causal over packed sequences) GQA attention, optionally sliding-window and soft-capped.

    q `[B, Hq, T, D]`, k `[B, Hkv, T, D]`, v `[B, Hkv, T, Dv]`, any strides. Returns out
    `[B, Hq, T, Dv]`, laid out in `torch.empty_like(q)`'s dimension order, and lse, contiguous float32
    `[B, Hq, T]`. Packing comes from the context's cu_seqlens, else from restarts of `position_ids`
    (see `_row_packing`); `backend` as in the module docstring.
    """
    _check_args(q, k, v, window, softcap)
    with attention_backend(backend, source=_BACKEND_SOURCE):
        return _attention(q, k, v, scale, position_ids, window, softcap)


def _attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    position_ids: Tensor | None,
    window: int | None,
    softcap: float | None,
) -> tuple[Tensor, Tensor]:
    ring = _ring_context(q)
    if ring is not None:
        assert ring.layout is not None and ring.group is not None  # a ring context has both
        check = ring.first_use((tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, window, softcap))
        out, lse = ulysses_attention_fwd(
            _to_ring(q),
            _to_ring(k),
            _to_ring(v),
            ring.split_layout,
            ring.group,
            scale,
            stats=ring.ring_stats,
            check=check,
            timeout_s=ring.ring_timeout_s,
            window=window,
            softcap=softcap,
        )
        return _from_ring(out, q), lse.unsqueeze(0)
    packing = _row_packing(q, position_ids)
    if packing is None:
        return causal_attention_fwd(q, k, v, scale, window=window, softcap=softcap)
    if len(packing) == 1:
        return segment_causal_attention_fwd(q, k, v, packing[0], scale, window=window, softcap=softcap)
    out, lse = empty_attention_out(q, v), q.new_empty(q.shape[:3], dtype=torch.float32)
    for b, cu in enumerate(packing):
        rows = slice(b, b + 1)
        out[rows], lse[rows] = segment_causal_attention_fwd(
            q[rows], k[rows], v[rows], cu, scale, window=window, softcap=softcap
        )
    return out, lse


@attention.register_fake
def _attention_fake(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    position_ids: Optional[Tensor] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    backend: Optional[str] = None,
) -> tuple[Tensor, Tensor]:
    _check_args(q, k, v, window, softcap)
    return empty_attention_out(q, v), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("bytescale::attention_backward", mutates_args=())
def attention_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    position_ids: Optional[Tensor] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    backend: Optional[str] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) of `bytescale::attention`, reading the context when it runs.

    grad_out may have any strides (e.g. the expanded ones of a `.sum()`); the kernels copy it into
    the order they need, so copying it here would only add a copy.
    """
    _check_args(q, k, v, window, softcap)
    with attention_backend(backend, source=_BACKEND_SOURCE):
        return _attention_backward(grad_out, q, k, v, out, lse, scale, position_ids, window, softcap)


def _attention_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    position_ids: Tensor | None,
    window: int | None,
    softcap: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    ring = _ring_context(q)
    if ring is not None:
        assert ring.layout is not None and ring.group is not None  # a ring context has both
        dq, dk, dv = ulysses_attention_bwd(
            _to_ring(grad_out),
            _to_ring(q),
            _to_ring(k),
            _to_ring(v),
            _to_ring(out),
            lse[0],
            ring.split_layout,
            ring.group,
            scale,
            stats=ring.ring_stats,
            timeout_s=ring.ring_timeout_s,
            window=window,
            softcap=softcap,
        )
        return _from_ring(dq, q), _from_ring(dk, k), _from_ring(dv, v)
    packing = _row_packing(q, position_ids)
    if packing is None:
        return causal_attention_bwd(grad_out, q, k, v, out, lse, scale, window=window, softcap=softcap)
    if len(packing) == 1:
        return segment_causal_attention_bwd(
            grad_out, q, k, v, out, lse, packing[0], scale, window=window, softcap=softcap
        )
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for b, cu in enumerate(packing):
        rows = slice(b, b + 1)
        dq[rows], dk[rows], dv[rows] = segment_causal_attention_bwd(
            grad_out[rows], q[rows], k[rows], v[rows], out[rows], lse[rows], cu, scale, window=window, softcap=softcap
        )
    return dq, dk, dv


@attention_backward.register_fake
def _attention_backward_fake(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    position_ids: Optional[Tensor] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    backend: Optional[str] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    _check_args(q, k, v, window, softcap)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, scale, position_ids, window, softcap, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, position_ids)
    ctx.scale, ctx.window, ctx.softcap, ctx.backend = scale, window, softcap, backend


def _backward(ctx: Any, grad_out: Tensor, grad_lse: Tensor | None) -> tuple[Tensor | None, ...]:
    """lse is an auxiliary output (for merging partial attentions); its gradient is ignored."""
    del grad_lse
    q, k, v, out, lse, position_ids = ctx.saved_tensors
    dq, dk, dv = torch.ops.bytescale.attention_backward(
        grad_out, q, k, v, out, lse, ctx.scale, position_ids, ctx.window, ctx.softcap, ctx.backend
    )
    return dq, dk, dv, None, None, None, None, None


attention.register_autograd(_backward, setup_context=_setup_context)


def _autocast_args(dtype: torch.dtype, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """q, k, v in the autocast dtype, as SDPA runs under autocast; the rest as given."""
    return (*(to_autocast_dtype(x, dtype) for x in args[:3]), *args[3:])


register_autocast_rule(attention, _autocast_args)
