"""torch's FlashAttention-2 (`aten._flash_attention_forward/_backward`, varlen) under our attention contract.

The contract (`dispatch`): q `[Tq, Hq, D]`, k/v `[Tk, Hkv, D]` of packed segments (GQA taken natively, no
`repeat_interleave`), out `[Tq, Hq, D]` and lse fp32 `[Hq, Tq]` with -inf for a query that sees no key, and a
backward that takes the (possibly merged) out and lse, so ring blocks use it too.

FlashAttention's mask differs from ours (`attention_ref.AttentionMask`) in two ways, both handled here:

- It aligns the causal diagonal and the window to the bottom-right of each segment: with s = keys - queries,
  query i sees key j when `i + s - left <= j <= i + s + right` (-1: no bound; `is_causal` is right = 0, no
  left). Ours places them with `offset` (query i sees j when `j <= i + offset` and `i + offset - j < window`).
  `flash_window` maps one onto the other when the two bounds coincide as lines, or says why they cannot;
  `flash_visible` emulates FlashAttention's convention (its argument handling included) for the tests.
- It writes lse = +inf for a query that sees no key and its backward reads +inf there; we write -inf
  (`lse_from_flash`, `lse_to_flash`).

CUDA only: every function that launches a kernel is reached through `dispatch`, whose predicate keeps CPU
tensors away from it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .attention_ref import AttentionMask
from .transfer import to_device

__all__ = [
    "FLASH_DTYPES",
    "MAX_HEAD_DIM",
    "FlashWindow",
    "flash_window",
    "flash_visible",
    "lse_from_flash",
    "lse_to_flash",
    "attention_fwd",
    "attention_bwd",
]

FLASH_DTYPES = (torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256
"""FlashAttention-2's largest head dim; it also needs a multiple of 8 (torch does not pad on this entry point)."""


@dataclass(frozen=True)
class FlashWindow:
    """FlashAttention's mask arguments: `is_causal`, `window_size_left` and `window_size_right` (-1: no bound)."""

    is_causal: bool
    left: int
    right: int


# --- the mask -------------------------------------------------------------------------------------


def flash_window(mask: AttentionMask, lengths: Sequence[tuple[int, int]] | None = None) -> FlashWindow | str:
    """FlashAttention's arguments that give `mask` on every segment, or why no arguments do.

    `lengths` are the (queries, keys) of each segment of the call (a ring block is one segment); None means
    self-attention segments of any packing (each segment's queries over its own keys: causal, offset 0).
    The bounds are mapped as lines (right = offset - s, left = window - 1 - right), so the masks agree on
    every query, including those that see nothing. FlashAttention cannot place a bound right of the
    bottom-right diagonal as far as the longest key segment (it drops such a bound), nor a causal edge or a
    window end above it.
    """
    if lengths is None:
        if not mask.causal or mask.offset != 0:
            return "self-attention segments are causal at offset 0"
        if mask.window is None:
            return FlashWindow(True, -1, 0)
        return FlashWindow(False, mask.window - 1, 0)
    segments = [(q, k) for q, k in lengths if q > 0 and k > 0]  # queries without keys see nothing either way
    if not segments:
        return FlashWindow(True, -1, 0)
    max_q = max(q for q, _ in lengths)  # what FlashAttention is told, and bases its argument handling on
    max_k = max(k for _, k in lengths)
    causal = mask.causal and any(mask.offset < k - 1 for _, k in segments)
    window = (
        mask.window
        if mask.window is not None and any(q - 1 + mask.offset >= mask.window for q, _ in segments)
        else None
    )
    if not causal and window is None:
        # One query per segment: a right edge at 0 (bottom-right causal) still shows it every key, and keeps
        # FlashAttention off its single-query GQA path, which lays the lse out per batch entry.
        return FlashWindow(False, -1, 0 if max_q == 1 else -1)
    shifts = {mask.offset - (k - q) for q, k in segments}
    if len(shifts) > 1:
        return "segments place the diagonal at different shifts from the bottom-right (offset - keys + queries)"
    shift = shifts.pop()
    if causal:
        if shift < 0:
            return (
                f"the causal diagonal (offset {mask.offset}) lies above FlashAttention's bottom-right one "
                f"(offset keys - queries)"
            )
        if shift >= max_k:
            return (
                f"the causal diagonal lies {shift} keys right of FlashAttention's bottom-right one, not fewer than "
                f"the longest key segment ({max_k})"
            )
        right = shift
    else:
        if max_q - 1 > max_k:
            return (
                f"a window without the causal mask needs at most one query more than keys per segment (FlashAttention "
                f"caps the right edge at the longest key segment), got {max_q} queries and {max_k} keys"
            )
        right = max_q - 1
    if window is None:
        return FlashWindow(right == 0, -1, right)
    left = window - 1 - shift
    if left < 0:
        return "the window ends above FlashAttention's bottom-right diagonal (its last queries would see no key)"
    return FlashWindow(False, left, right)


def flash_visible(
    window: FlashWindow, len_q: int, len_k: int, *, max_q: int, max_k: int, backward: bool = False
) -> Tensor:
    """Dense boolean `[len_q, len_k]`: which keys FlashAttention-2 shows each query of one segment, given the
    call's longest segments, as torch's vendored copy does.

    Its argument handling (`mha_varlen_fwd` / `mha_varlen_bwd`, then `set_params_fprop`): with one query the
    forward drops `is_causal`; `is_causal` sets right = 0; a bound >= max_k becomes -1; right = 0 without a
    left bound is causal; one missing bound becomes max_k when the other is set. Then `mask.h`: causal
    `j <= i + s`, local `i + s - left <= j <= i + s + right`, with s = len_k - len_q.
    """
    is_causal, left, right = window.is_causal, window.left, window.right
    if max_q == 1 and not backward:
        is_causal = False
    if is_causal:
        right = 0
    if left >= max_k:
        left = -1
    if right >= max_k:
        right = -1
    causal = left < 0 and right == 0
    if left < 0 and right >= 0:
        left = max_k
    if left >= 0 and right < 0:
        right = max_k
    i = torch.arange(len_q)[:, None]
    j = torch.arange(len_k)[None, :]
    shift = len_k - len_q
    if causal:
        return (j <= i + shift).expand(len_q, len_k)
    if left >= 0 or right >= 0:
        return (j >= i + shift - left) & (j <= i + shift + right)
    return torch.ones(len_q, len_k, dtype=torch.bool)


# --- the lse --------------------------------------------------------------------------------------


def lse_from_flash(lse: Tensor) -> Tensor:
    """FlashAttention's lse in our convention, in place: +inf (a query that sees no key) becomes -inf."""
    return lse.masked_fill_(torch.isposinf(lse), float("-inf"))


def lse_to_flash(lse: Tensor) -> Tensor:
    """Our lse as FlashAttention's backward reads it, a new contiguous tensor: -inf becomes +inf, so the
    probabilities exp(s - lse) of a query that sees no key are 0, not NaN."""
    return torch.where(torch.isneginf(lse), float("inf"), lse)


# --- the kernels ----------------------------------------------------------------------------------
# aten::_flash_attention_forward(Tensor query, Tensor key, Tensor value, Tensor? cum_seq_q, Tensor? cum_seq_k,
#     SymInt max_q, SymInt max_k, float dropout_p, bool is_causal, bool return_debug_mask, *, float? scale=None,
#     SymInt? window_size_left=None, SymInt? window_size_right=None, ...) -> (output, softmax_logsumexp, rng_state,
#     unused, debug_attn_mask)
# aten::_flash_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out,
#     Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p,
#     bool is_causal, Tensor rng_state, Tensor unused, *, float? scale=None, SymInt? window_size_left=None,
#     SymInt? window_size_right=None) -> (grad_query, grad_key, grad_value)
# With cum_seq_q/k (int32 on the device) q/k/v are [total, heads, head_dim], the lse [heads, total_q] fp32. The
# kernels read rows and heads at any stride with a contiguous head dim; the backward makes grad_out and out
# contiguous itself. k/v may have fewer heads (GQA): the backward sums each group's dk/dv.

_FORWARD = torch.ops.aten._flash_attention_forward
_BACKWARD = torch.ops.aten._flash_attention_backward


@functools.lru_cache(maxsize=256)
def _device_bounds(bounds: tuple[int, ...], device: torch.device) -> Tensor:
    """Segment boundaries as FlashAttention reads them (int32 on the device), copied once per packing: every
    layer, forward and backward, reuses the copy."""
    return to_device(torch.tensor(bounds, dtype=torch.int32), device)


def _longest(bounds: tuple[int, ...]) -> int:
    return max(end - start for start, end in zip(bounds[:-1], bounds[1:]))


def _last_dim_contiguous(x: Tensor) -> Tensor:
    """FlashAttention reads rows and heads at any stride, but the head dim must be contiguous."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_lse(lse: Tensor, n_heads: int, tokens: int) -> None:
    if tuple(lse.shape) != (n_heads, tokens):
        raise RuntimeError(
            f"torch's flash attention returned lse of shape {tuple(lse.shape)}, not [heads, tokens] = "
            f"[{n_heads}, {tokens}]: this torch lays out the varlen lse differently; set BYTESCALE_KERNELS=triton"
        )


def attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    *,
    bounds_q: tuple[int, ...],
    bounds_k: tuple[int, ...],
    window: FlashWindow,
    rows_may_see_nothing: bool,
) -> tuple[Tensor, Tensor]:
    """(out `[Tq, Hq, D]`, lse fp32 `[Hq, Tq]`) of q `[Tq, Hq, D]` over k/v `[Tk, Hkv, D]` per segment.

    `rows_may_see_nothing` False (self-attention segments: every query sees itself) skips the lse conversion.
    """
    n_heads, tokens = q.shape[1], q.shape[0]
    if tokens == 0 or k.shape[0] == 0:
        lse = q.new_full((n_heads, tokens), float("-inf"), dtype=torch.float32)
        return q.new_zeros(tokens, n_heads, v.shape[-1]), lse
    out, lse, _, _, _ = _FORWARD(
        _last_dim_contiguous(q),
        _last_dim_contiguous(k),
        _last_dim_contiguous(v),
        _device_bounds(bounds_q, q.device),
        _device_bounds(bounds_k, q.device),
        _longest(bounds_q),
        _longest(bounds_k),
        0.0,
        window.is_causal,
        False,
        scale=scale,
        window_size_left=window.left,
        window_size_right=window.right,
    )
    _check_lse(lse, n_heads, tokens)
    return out, lse_from_flash(lse) if rows_may_see_nothing else lse


def attention_bwd(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    *,
    bounds_q: tuple[int, ...],
    bounds_k: tuple[int, ...],
    window: FlashWindow,
    rows_may_see_nothing: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) shaped like q, k, v, from the final out and lse `[Hq, Tq]` of the queries (a ring block's
    merged ones): FlashAttention recomputes the probabilities from them, so each block's part is exact.
    dk/dv come back with Hkv heads (torch sums the query heads of each group)."""
    if q.shape[0] == 0 or k.shape[0] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    flash_lse = lse_to_flash(lse) if rows_may_see_nothing else lse.contiguous()
    # With dropout 0 the kernels never read the RNG state; torch's varlen_attn passes placeholders too.
    rng_state = torch.empty(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, device=q.device)
    dq, dk, dv = _BACKWARD(
        grad_out,
        _last_dim_contiguous(q),
        _last_dim_contiguous(k),
        _last_dim_contiguous(v),
        out,
        flash_lse,
        _device_bounds(bounds_q, q.device),
        _device_bounds(bounds_k, q.device),
        _longest(bounds_q),
        _longest(bounds_k),
        0.0,
        window.is_causal,
        rng_state,
        unused,
        scale=scale,
        window_size_left=window.left,
        window_size_right=window.right,
    )
    return dq, dk, dv
