"""Torch reference kernels for causal, sliding-window and segment-causal attention (what CPU runs).

Layout is SDPA's: q `[B, Hq, Tq, D]`, k `[B, Hkv, Tk, D]`, v `[B, Hkv, Tk, Dv]`, with Hq a multiple of
Hkv and Dv free to differ from D (DeepSeek-V3's MLA). Under GQA query head h reads kv head
`h // (Hq // Hkv)` (as `repeat_interleave`, HF `repeat_kv`, SDPA `enable_gqa`). Every forward returns
`(out, lse)`: `out` `[B, Hq, Tq, Dv]` in q's dtype and in the dimension order `torch.empty_like(q)` has;
`lse` the contiguous float32 `[B, Hq, Tq]` natural log of each query's softmax denominator. Gradients
are laid out like `torch.empty_like` of their input. Fixed layouts let the custom ops' fake kernels
promise them; following the inputs' layout (models pass q as a transposed `[B, T, H, D]` view) is
what the fused kernel does anyway, so no copies are added.

Scores are `scale * q.k`, soft-capped to `c * tanh(s / c)` with `softcap=c` (Gemma2), and query i of a
block sees key j when `(not causal or j <= i + offset) and (window is None or i + offset - j < window)`
(`AttentionMask`). A query that sees no key gets out 0, lse -inf and no gradient.

On CPU in fp32/bf16/fp16 without a soft-cap the fused aten flash kernel does the work (it is what eager
SDPA runs, so the compiled model costs what the eager one does); a mask it cannot express (a window,
an offset) goes in as an additive bias, one query tile at a time, each tile given only the keys its
window reaches, so a sliding window costs O(T * window), not O(T^2). Everything else (soft-cap, other
dtypes) runs the explicit math on the same tiles; the dense math over a whole block is the
independent reference in tests.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "AttentionMask",
    "empty_like_order",
    "empty_attention_out",
    "layout_like",
    "check_attention_shapes",
    "check_attention_options",
    "causal_attention_fwd",
    "causal_attention_bwd",
    "segment_causal_attention_fwd",
    "segment_causal_attention_bwd",
    "math_causal_attention_fwd",
    "math_causal_attention_bwd",
    "math_attention_bwd_from_lse",
    "block_attention_fwd",
    "block_attention_bwd",
    "cpu_flash_causal_attention_fwd",
    "cpu_flash_causal_attention_bwd",
]

_CPU_FLASH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TILE_ROWS = 128
"""Query rows per tile of a masked attention: the fused kernel computes a tile's whole bias, so a
window w wastes about `_TILE_ROWS / w` of the work; smaller tiles cost more calls."""
_TILE_ELEMENTS = 1 << 22
"""Most elements one tile's scores (math) or bias (fused) may hold, whatever the sequence length."""


# --- the mask -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionMask:
    """Which keys each query of one block sees: `visible(i, j)` of the attention contract.

    `offset` is the position of the block's first query minus that of its first key (0 for plain
    and segment-causal attention); `window` is Hugging Face's sliding window (a query sees itself and
    the `window - 1` keys before it).
    """

    causal: bool = True
    window: int | None = None
    offset: int = 0

    def __post_init__(self) -> None:
        check_attention_options(self.window, None)
        if self.offset < 0:
            raise ValueError(
                f"attention block offset (first query position - first key position) must be >= 0, got {self.offset}"
            )

    def visible(self, tq: int, tk: int, device: torch.device | str = "cpu") -> Tensor:
        """Dense boolean `[tq, tk]`: True where query i sees key j."""
        i = torch.arange(tq, device=device)[:, None] + self.offset
        j = torch.arange(tk, device=device)[None, :]
        ok = torch.ones(tq, tk, dtype=torch.bool, device=device)
        if self.causal:
            ok &= j <= i
        if self.window is not None:
            ok &= i - j < self.window
        return ok

    def key_range(self, first_row: int, end_row: int, tk: int) -> tuple[int, int]:
        """[lo, hi) of the keys that queries [first_row, end_row) may see."""
        lo = 0 if self.window is None else min(tk, max(0, first_row + self.offset - self.window + 1))
        hi = min(tk, end_row + self.offset) if self.causal else tk
        return lo, max(lo, hi)

    def rows_with_keys(self, tq: int, tk: int) -> int:
        """How many queries see at least one key; they come first (the rest run past the window)."""
        if tk == 0:
            return 0
        if self.window is None:
            return tq
        return max(0, min(tq, tk - self.offset + self.window - 1))

    def simplified(self, tq: int, tk: int) -> AttentionMask:
        """The same visibility on a `tq x tk` block, without the constraints that exclude nothing there."""
        causal = self.causal and self.offset < tk - 1
        window = self.window if self.window is not None and tq - 1 + self.offset >= self.window else None
        return AttentionMask(causal, window, self.offset if causal or window is not None else 0)

    def tile(self, first_row: int, first_key: int) -> AttentionMask:
        """The mask of the sub-block whose first query is `first_row` and first key `first_key`."""
        return replace(self, offset=self.offset + first_row - first_key)


def check_attention_options(window: int | None, softcap: float | None) -> None:
    """Raise ValueError unless `window` is None or >= 1 and `softcap` None or a positive finite number."""
    if window is not None and window < 1:
        raise ValueError(f"attention window must be a positive number of keys (or None), got {window}")
    if softcap is not None and not (0 < softcap < math.inf):
        raise ValueError(f"attention softcap must be a positive finite number (or None), got {softcap}")


# --- shapes and layouts ---------------------------------------------------------------------------


def check_attention_shapes(q: Tensor, k: Tensor, v: Tensor, same_length: bool = True) -> None:
    """Raise ValueError unless q/k/v are SDPA-layout tensors that GQA attention accepts.

    q `[B, Hq, Tq, D]`, k `[B, Hkv, Tk, D]`, v `[B, Hkv, Tk, Dv]`; Tq == Tk unless `same_length` is False.
    """
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"attention expects 4-D [B, H, T, D] q/k/v, got {shapes}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"attention expects k and v with the same B, Hkv and T (only the head dim may differ), got {shapes}"
        )
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"attention expects q and k with the same B and head dim D, got {shapes}")
    if same_length and q.shape[2] != k.shape[2]:
        raise ValueError(f"attention expects q/k/v with the same T, got {shapes}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"attention expects Hq a multiple of Hkv (GQA), got {shapes}")


def empty_like_order(ref: Tensor, shape: Sequence[int] | None = None, dtype: torch.dtype | None = None) -> Tensor:
    """An empty tensor of `shape` (default ref's) in the dimension order `torch.empty_like(ref)` has.

    Attention's out is `[B, Hq, Tq, Dv]` laid out like q `[B, Hq, Tq, D]`: same order, other last dim.
    """
    strides = torch.empty_like(ref, device="meta").stride()
    order = sorted(range(ref.dim()), key=lambda d: -strides[d])
    return torch.empty_permuted(
        tuple(ref.shape if shape is None else shape),
        order,
        dtype=ref.dtype if dtype is None else dtype,
        device=ref.device,
    )


def layout_like(t: Tensor, ref: Tensor) -> Tensor:
    """`t` in `ref`'s dimension order (see `empty_like_order`), copying only when it differs."""
    want = empty_like_order(ref, t.shape, t.dtype)
    if all(a == b for a, b, n in zip(t.stride(), want.stride(), t.shape) if n > 1):
        return t
    return want.copy_(t)


def empty_attention_out(q: Tensor, v: Tensor) -> Tensor:
    """Empty out `[B, Hq, Tq, Dv]` in q's dtype and dimension order (what the kernels and fake kernels give)."""
    return empty_like_order(q, (*q.shape[:3], v.shape[3]))


# --- math: any device, any dtype --------------------------------------------------------------------


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least fp32 (fp64 stays fp64), so half-precision inputs do not lose the softmax."""
    return torch.promote_types(dtype, torch.float32)


def _repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """Give each query head its kv head (GQA), as HF `repeat_kv` does."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def _sum_kv_groups(grad: Tensor, n_kv_heads: int) -> Tensor:
    """Undo `_repeat_kv` for a gradient: sum over the query heads that shared a kv head."""
    b, h, t, d = grad.shape
    return grad.reshape(b, n_kv_heads, h // n_kv_heads, t, d).sum(dim=2)


def _scores(
    q: Tensor, k: Tensor, scale: float, mask: AttentionMask, softcap: float | None
) -> tuple[Tensor, Tensor | None]:
    """Masked (soft-capped) scores `[B, Hq, Tq, Tk]` in the compute dtype, and the tanh the cap's derivative needs."""
    ct = _compute_dtype(q.dtype)
    k = _repeat_kv(k, q.shape[1] // k.shape[1])
    scores = torch.matmul(q.to(ct), k.to(ct).transpose(-1, -2)) * scale
    tanh = None
    if softcap is not None:
        tanh = torch.tanh(scores / softcap)
        scores = tanh * softcap
    hidden = ~mask.visible(q.shape[2], k.shape[2], q.device)
    return scores.masked_fill(hidden, float("-inf")), tanh


def _probs(scores: Tensor, lse: Tensor) -> Tensor:
    """exp(scores - lse), 0 (not NaN) on rows that see no key (lse -inf)."""
    lse = lse.to(scores.dtype)
    return torch.exp(scores - torch.where(lse == float("-inf"), 0.0, lse).unsqueeze(-1))


def _math_fwd(
    q: Tensor, k: Tensor, v: Tensor, scale: float, mask: AttentionMask, softcap: float | None
) -> tuple[Tensor, Tensor]:
    scores, _ = _scores(q, k, scale, mask, softcap)
    lse = torch.logsumexp(scores, dim=-1)
    v = _repeat_kv(v, q.shape[1] // v.shape[1]).to(scores.dtype)
    out = torch.matmul(_probs(scores, lse), v).to(q.dtype)
    return layout_like(out, q), lse.to(torch.float32).contiguous()


def _math_bwd(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    mask: AttentionMask,
    softcap: float | None,
    saved: tuple[Tensor, Tensor] | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients from P = exp(S - lse) and delta = rowsum(dO * O), with (out, lse) `saved` or recomputed."""
    n_rep = q.shape[1] // k.shape[1]
    scores, tanh = _scores(q, k, scale, mask, softcap)
    ct = scores.dtype
    g = grad_out.to(ct)
    dprobs = torch.matmul(g, _repeat_kv(v, n_rep).to(ct).transpose(-1, -2))
    if saved is None:
        probs = _probs(scores, torch.logsumexp(scores, dim=-1))
        delta = (dprobs * probs).sum(dim=-1, keepdim=True)
    else:
        out, lse = saved
        probs = _probs(scores, lse)
        delta = (g * out.to(ct)).sum(dim=-1, keepdim=True)
    dscores = probs * (dprobs - delta)
    if tanh is not None:
        dscores = dscores * (1 - tanh * tanh)
    dscores = dscores * scale
    dv = torch.matmul(probs.transpose(-1, -2), g)
    dq = torch.matmul(dscores, _repeat_kv(k, n_rep).to(ct))
    dk = torch.matmul(dscores.transpose(-1, -2), q.to(ct))
    return _grads_like(dq, dk, dv, q, k, v)


def _grads_like(dq: Tensor, dk: Tensor, dv: Tensor, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Sum kv-group gradients back to Hkv heads and give each gradient its input's dtype and layout."""
    n_kv = k.shape[1]
    return (
        layout_like(dq.to(q.dtype), q),
        layout_like(_sum_kv_groups(dk, n_kv).to(k.dtype), k),
        layout_like(_sum_kv_groups(dv, n_kv).to(v.dtype), v),
    )


def math_causal_attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    causal: bool = True,
    *,
    window: int | None = None,
    softcap: float | None = None,
    offset: int = 0,
) -> tuple[Tensor, Tensor]:
    """Attention spelled out over the whole block (scores, cap, mask, lse, softmax): slow, but obviously right."""
    check_attention_options(None, softcap)
    return _math_fwd(q, k, v, scale, AttentionMask(causal, window, offset), softcap)


def math_causal_attention_bwd(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    causal: bool = True,
    *,
    window: int | None = None,
    softcap: float | None = None,
    offset: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of `math_causal_attention_fwd`, recomputing the softmax from scratch.

    It deliberately ignores any saved out/lse so that, as a test reference, it checks them
    instead of trusting them.
    """
    check_attention_options(None, softcap)
    return _math_bwd(grad_out, q, k, v, scale, AttentionMask(causal, window, offset), softcap, None)


def math_attention_bwd_from_lse(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    causal: bool,
    *,
    window: int | None = None,
    softcap: float | None = None,
    offset: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block of a larger attention, given the *final* out and lse of its queries.

    With P = exp(S - lse) and D = rowsum(dO * O) taken from the merged result, each key block's
    contribution is exact on its own: this is how a ring computes partial gradients.
    """
    check_attention_options(None, softcap)
    return _math_bwd(grad_out, q, k, v, scale, AttentionMask(causal, window, offset), softcap, (out, lse))


# --- CPU fast path: aten's fused flash kernel -----------------------------------------------------
# aten::_scaled_dot_product_flash_attention_for_cpu(Tensor query, Tensor key, Tensor value,
#     float dropout_p=0., bool is_causal=False, *, Tensor? attn_mask=None, float? scale=None)
#     -> (Tensor output, Tensor logsumexp)
# aten::_scaled_dot_product_flash_attention_for_cpu_backward(Tensor grad_out, Tensor query,
#     Tensor key, Tensor value, Tensor out, Tensor logsumexp, float dropout_p, bool is_causal, *,
#     Tensor? attn_mask=None, float? scale=None) -> (Tensor grad_query, Tensor grad_key, Tensor grad_value)
# Both take GQA k/v directly (grad_key/grad_value come back with Hkv heads) and any strides; the
# backward makes grad_out contiguous in its own [B, T, H, D] order, so callers must not copy it
# first. output and the gradients follow the layout of query/key/value; logsumexp is float32 for
# fp32/bf16/fp16 but laid out [B, T, H] (a transposed view), so it is made contiguous (it is small).
# Measured in torch 2.13: `is_causal` is top-left aligned; attn_mask must have the query's dtype (a
# bool mask is refused), is added to the scores and costs the full Tq x Tk (masked blocks are not
# skipped); a row the mask hides entirely gets out 0 but lse 0 (not -inf), and its backward is NaN
# for lse -inf; q/k/v must share one head dim ("Q/K/V should have the same head size"). So rows
# without keys are kept away from it, and a differing V head dim is zero-padded (as Hugging Face does
# for flash attention in DeepSeek-V3): zero columns change neither scores nor the other outputs.
# The kernels crash on zero-sized inputs, which `_use_cpu_flash` keeps away from them.


def _use_cpu_flash(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether the fused CPU kernel can take these inputs."""
    return (
        q.device.type == "cpu"
        and q.dtype in _CPU_FLASH_DTYPES
        and q.dtype == k.dtype == v.dtype
        and q.numel() > 0
        and k.numel() > 0
    )


def _fused_causal(mask: AttentionMask, tq: int, tk: int) -> bool | None:
    """`is_causal` for the fused kernel when it expresses `mask` on its own, None when it needs a bias."""
    m = mask.simplified(tq, tk)
    if m.window is None and (not m.causal or m.offset == 0):
        return m.causal
    return None


def _fused_mask(mask: AttentionMask, q: Tensor, k: Tensor) -> tuple[bool, Tensor | None]:
    """(is_causal, additive bias or None) that give the fused kernel `mask`."""
    tq, tk = q.shape[2], k.shape[2]
    causal = _fused_causal(mask, tq, tk)
    if causal is not None:
        return causal, None
    bias = torch.zeros(tq, tk, dtype=q.dtype, device=q.device)
    return False, bias.masked_fill_(~mask.visible(tq, tk, q.device), float("-inf"))


def _pad_head(t: Tensor, width: int) -> Tensor:
    """`t` with its last dim zero-padded to `width` (the fused kernel wants one head dim for q/k/v)."""
    return t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1]))


def _flash_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, mask: AttentionMask) -> tuple[Tensor, Tensor]:
    causal, bias = _fused_mask(mask, q, k)
    width = max(q.shape[-1], v.shape[-1])
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _pad_head(q, width), _pad_head(k, width), _pad_head(v, width), 0.0, causal, attn_mask=bias, scale=scale
    )
    return layout_like(out[..., : v.shape[-1]], q), lse.to(torch.float32).contiguous()


def _flash_bwd(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, mask: AttentionMask
) -> tuple[Tensor, Tensor, Tensor]:
    causal, bias = _fused_mask(mask, q, k)
    width = max(q.shape[-1], v.shape[-1])
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        *(_pad_head(t, width) for t in (grad_out, q, k, v, out)), lse, 0.0, causal, attn_mask=bias, scale=scale
    )
    d = q.shape[-1]
    return layout_like(dq[..., :d], q), layout_like(dk[..., :d], k), layout_like(dv[..., : v.shape[-1]], v)


def cpu_flash_causal_attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    causal: bool = True,
    *,
    window: int | None = None,
    offset: int = 0,
) -> tuple[Tensor, Tensor]:
    """Attention through aten's fused CPU flash kernel (the one eager SDPA uses), in one call.

    Every query must see a key (`AttentionMask.rows_with_keys`); the tiled entry points see to that.
    """
    return _flash_fwd(q, k, v, scale, AttentionMask(causal, window, offset))


def cpu_flash_causal_attention_bwd(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    causal: bool = True,
    *,
    window: int | None = None,
    offset: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients through aten's fused CPU flash backward, reusing the (final) out and lse."""
    return _flash_bwd(grad_out, q, k, v, out, lse, scale, AttentionMask(causal, window, offset))


# --- tiles ----------------------------------------------------------------------------------------


def _block_fwd(
    q: Tensor, k: Tensor, v: Tensor, scale: float, mask: AttentionMask, softcap: float | None
) -> tuple[Tensor, Tensor]:
    """One block in one call: fused when it can be, math otherwise."""
    if softcap is None and _use_cpu_flash(q, k, v):
        return _flash_fwd(q, k, v, scale, mask)
    return _math_fwd(q, k, v, scale, mask, softcap)


def _block_bwd(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    mask: AttentionMask,
    softcap: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    if softcap is None and _use_cpu_flash(q, k, v):
        return _flash_bwd(grad_out, q, k, v, out, lse, scale, mask)
    return _math_bwd(grad_out, q, k, v, scale, mask, softcap, (out, lse))


def _tile_rows(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, softcap: float | None) -> int:
    """Query rows per tile: all of them when the fused kernel needs no bias, else few enough that a
    tile's keys (its window's, at most) keep its bias or scores under `_TILE_ELEMENTS`."""
    tq, tk = q.shape[2], k.shape[2]
    fused = softcap is None and _use_cpu_flash(q, k, v)
    if fused and _fused_causal(mask, tq, tk) is not None:
        return max(1, tq)
    span = tk if mask.window is None else min(tk, mask.window + _TILE_ROWS)
    per_row = max(1, span * (1 if fused else q.shape[0] * q.shape[1]))
    return max(1, min(_TILE_ROWS, _TILE_ELEMENTS // per_row))


def _tiles(
    q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, softcap: float | None
) -> Iterator[tuple[slice, slice, AttentionMask]]:
    """(query rows, their keys, the tile's mask) covering every query that sees a key."""
    tk = k.shape[2]
    step = _tile_rows(q, k, v, mask, softcap)
    rows = mask.rows_with_keys(q.shape[2], tk)
    for first in range(0, rows, step):
        end = min(first + step, rows)
        lo, hi = mask.key_range(first, end, tk)
        yield slice(first, end), slice(lo, hi), mask.tile(first, lo)


def _is_one_tile(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, softcap: float | None) -> bool:
    tq = q.shape[2]
    return mask.rows_with_keys(tq, k.shape[2]) == tq and _tile_rows(q, k, v, mask, softcap) >= tq


def _attention_fwd(
    q: Tensor, k: Tensor, v: Tensor, scale: float, mask: AttentionMask, softcap: float | None
) -> tuple[Tensor, Tensor]:
    """out and lse of one block, tiled over queries when a mask or the scores' size asks for it."""
    check_attention_options(None, softcap)
    if _is_one_tile(q, k, v, mask, softcap):
        return _block_fwd(q, k, v, scale, mask, softcap)
    out = empty_attention_out(q, v).zero_()
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    for rows, keys, tile_mask in _tiles(q, k, v, mask, softcap):
        out[:, :, rows], lse[:, :, rows] = _block_fwd(
            q[:, :, rows], k[:, :, keys], v[:, :, keys], scale, tile_mask, softcap
        )
    return out, lse


def _attention_bwd(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    mask: AttentionMask,
    softcap: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of `_attention_fwd` given the final out/lse; tiles' dk/dv add up in the compute dtype."""
    check_attention_options(None, softcap)
    if _is_one_tile(q, k, v, mask, softcap):
        return _block_bwd(grad_out, q, k, v, out, lse, scale, mask, softcap)
    dq = torch.zeros_like(q)
    dk = torch.zeros(k.shape, dtype=_compute_dtype(k.dtype), device=k.device)
    dv = torch.zeros(v.shape, dtype=_compute_dtype(v.dtype), device=v.device)
    for rows, keys, tile_mask in _tiles(q, k, v, mask, softcap):
        dq[:, :, rows], dk_tile, dv_tile = _block_bwd(
            grad_out[:, :, rows],
            q[:, :, rows],
            k[:, :, keys],
            v[:, :, keys],
            out[:, :, rows],
            lse[:, :, rows],
            scale,
            tile_mask,
            softcap,
        )
        dk[:, :, keys] += dk_tile
        dv[:, :, keys] += dv_tile
    return dq, layout_like(dk.to(k.dtype), k), layout_like(dv.to(v.dtype), v)


# --- entry points ---------------------------------------------------------------------------------


def causal_attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Causal (sliding-window) attention per batch row: (out `[B, Hq, T, Dv]`, float32 lse `[B, Hq, T]`)."""
    return _attention_fwd(q, k, v, scale, AttentionMask(True, window), softcap)


def causal_attention_bwd(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of `causal_attention_fwd`; dk/dv summed over each kv group, in k/v's dtype."""
    return _attention_bwd(grad_out, q, k, v, out, lse, scale, AttentionMask(True, window), softcap)


def _segments(cu_seqlens: Tensor | Sequence[int], num_tokens: int) -> list[tuple[int, int]]:
    """(start, end) of every packed sequence, after checking the boundaries cover the row."""
    bounds = [int(x) for x in cu_seqlens]
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != num_tokens:
        raise ValueError(f"cu_seqlens must run from 0 to T={num_tokens}, got {bounds}")
    if any(e < s for s, e in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"cu_seqlens must never decrease, got {bounds}")
    return list(zip(bounds[:-1], bounds[1:]))


def _check_single_row(q: Tensor) -> None:
    if q.shape[0] != 1:
        raise ValueError(f"packed (segment-causal) attention needs batch size 1, got q {tuple(q.shape)}")


def segment_causal_attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor | Sequence[int],
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Causal (sliding-window) attention within each packed sequence of a single row (B == 1)."""
    _check_single_row(q)
    out = empty_attention_out(q, v)
    lse = q.new_empty(q.shape[:3], dtype=torch.float32)
    for s, e in _segments(cu_seqlens, q.shape[2]):
        if e > s:
            out[:, :, s:e], lse[:, :, s:e] = causal_attention_fwd(
                q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], scale, window=window, softcap=softcap
            )
    return out, lse


def segment_causal_attention_bwd(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens: Tensor | Sequence[int],
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of `segment_causal_attention_fwd`, one packed sequence at a time."""
    _check_single_row(q)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for s, e in _segments(cu_seqlens, q.shape[2]):
        if e > s:
            sl = (slice(None), slice(None), slice(s, e))
            dq[sl], dk[sl], dv[sl] = causal_attention_bwd(
                grad_out[sl], q[sl], k[sl], v[sl], out[sl], lse[sl], scale, window=window, softcap=softcap
            )
    return dq, dk, dv


def block_attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    causal: bool,
    *,
    window: int | None = None,
    softcap: float | None = None,
    offset: int = 0,
) -> tuple[Tensor, Tensor]:
    """One block of a distributed attention (Tq may differ from Tk), masked per `AttentionMask`."""
    return _attention_fwd(q, k, v, scale, AttentionMask(causal, window, offset), softcap)


def block_attention_bwd(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    causal: bool,
    *,
    window: int | None = None,
    softcap: float | None = None,
    offset: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Partial gradients of one block given the merged out and lse of its queries."""
    return _attention_bwd(grad_out, q, k, v, out, lse, scale, AttentionMask(causal, window, offset), softcap)
