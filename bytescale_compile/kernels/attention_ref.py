"""Torch reference kernels for causal and segment-causal attention (what CPU runs).

Layout is SDPA's: q `[B, Hq, T, D]`, k/v `[B, Hkv, T, D]`, with Hq a multiple of Hkv. Under GQA query
head h reads kv head `h // (Hq // Hkv)` (as `repeat_interleave`, HF `repeat_kv`, SDPA `enable_gqa`).
Every forward returns `(out, lse)`: `out` shaped, typed and laid out like `torch.empty_like(q)`;
`lse` the contiguous float32 `[B, Hq, T]` natural log of each query's softmax denominator. Gradients
are laid out like `torch.empty_like` of their input. Fixed layouts let the custom ops' fake kernels
promise them; following the inputs' layout (models pass q as a transposed `[B, T, H, D]` view) is
what the fused kernel does anyway, so no copies are added.

On CPU in fp32/bf16/fp16 the fused aten flash kernel does the work (it is what eager SDPA runs, so
the compiled model costs what the eager one does); the explicit math version covers everything else
and serves as the independent reference in tests.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "layout_like",
    "check_attention_shapes",
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


def check_attention_shapes(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Raise ValueError unless q/k/v are SDPA-layout tensors that causal GQA attention accepts."""
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"attention expects 4-D [B, H, T, D] q/k/v, got {shapes}")
    if k.shape != v.shape:
        raise ValueError(f"attention expects k and v of the same shape, got {shapes}")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"attention expects q/k/v with the same B, T and D, got {shapes}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"attention expects Hq a multiple of Hkv (GQA), got {shapes}")


def layout_like(t: Tensor, ref: Tensor) -> Tensor:
    """`t` in the memory layout `torch.empty_like(ref)` has, copying only when it differs."""
    want = torch.empty_like(ref, dtype=t.dtype)
    if all(a == b for a, b, n in zip(t.stride(), want.stride(), t.shape) if n > 1):
        return t
    return want.copy_(t)


# --- math reference: any device, any dtype ------------------------------------------------------


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


def _masked_scores(q: Tensor, k: Tensor, scale: float, causal: bool = True) -> Tensor:
    """Scaled scores `[B, Hq, Tq, Tk]` in the compute dtype, -inf where a causal key lies in the future."""
    ct = _compute_dtype(q.dtype)
    k = _repeat_kv(k, q.shape[1] // k.shape[1])
    scores = torch.matmul(q.to(ct), k.to(ct).transpose(-1, -2)) * scale
    if not causal:
        return scores
    future = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).triu(diagonal=1)
    return scores.masked_fill(future, float("-inf"))


def math_causal_attention_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool = True) -> tuple[Tensor, Tensor]:
    """Attention spelled out (scores, mask, lse, softmax): slow, but obviously right."""
    scores = _masked_scores(q, k, scale, causal)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    v = _repeat_kv(v, q.shape[1] // v.shape[1]).to(scores.dtype)
    out = torch.matmul(probs, v).to(q.dtype)
    return layout_like(out, q), lse.to(torch.float32).contiguous()


def math_causal_attention_bwd(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of `math_causal_attention_fwd`, recomputing the softmax from scratch.

    It deliberately ignores any saved out/lse so that, as a test reference, it checks them
    instead of trusting them.
    """
    n_kv = k.shape[1]
    n_rep = q.shape[1] // n_kv
    probs = torch.softmax(_masked_scores(q, k, scale), dim=-1)
    ct = probs.dtype
    g = grad_out.to(ct)
    k_rep = _repeat_kv(k, n_rep).to(ct)
    v_rep = _repeat_kv(v, n_rep).to(ct)
    dv = torch.matmul(probs.transpose(-1, -2), g)
    dprobs = torch.matmul(g, v_rep.transpose(-1, -2))
    dscores = probs * (dprobs - (dprobs * probs).sum(dim=-1, keepdim=True)) * scale
    dq = torch.matmul(dscores, k_rep)
    dk = torch.matmul(dscores.transpose(-1, -2), q.to(ct))
    return _grads_like(dq, dk, dv, q, k, v)


def math_attention_bwd_from_lse(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, causal: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block of a larger attention, given the *final* out and lse of its queries.

    With P = exp(S - lse) and D = rowsum(dO * O) taken from the merged result, each key block's
    contribution is exact on its own: this is how a ring computes partial gradients.
    """
    n_kv = k.shape[1]
    n_rep = q.shape[1] // n_kv
    scores = _masked_scores(q, k, scale, causal)
    ct = scores.dtype
    probs = torch.exp(scores - lse.to(ct).unsqueeze(-1))
    g = grad_out.to(ct)
    dv = torch.matmul(probs.transpose(-1, -2), g)
    dprobs = torch.matmul(g, _repeat_kv(v, n_rep).to(ct).transpose(-1, -2))
    delta = (g * out.to(ct)).sum(dim=-1, keepdim=True)
    dscores = probs * (dprobs - delta) * scale
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


def cpu_flash_causal_attention_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool = True) -> tuple[Tensor, Tensor]:
    """Attention through aten's fused CPU flash kernel (the one eager SDPA uses)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale
    )
    return layout_like(out, q), lse.to(torch.float32).contiguous()


def cpu_flash_causal_attention_bwd(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, causal: bool = True
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients through aten's fused CPU flash backward, reusing the forward's out and lse."""
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, causal, scale=scale
    )
    return layout_like(dq, q), layout_like(dk, k), layout_like(dv, v)


# --- dispatch -------------------------------------------------------------------------------------


def causal_attention_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Causal attention per batch row: returns (out like `empty_like(q)`, float32 lse [B, Hq, T])."""
    if _use_cpu_flash(q, k, v):
        return cpu_flash_causal_attention_fwd(q, k, v, scale)
    return math_causal_attention_fwd(q, k, v, scale)


def causal_attention_bwd(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of `causal_attention_fwd`; dk/dv summed over each kv group, in k/v's dtype."""
    if _use_cpu_flash(q, k, v):
        return cpu_flash_causal_attention_bwd(grad_out, q, k, v, out, lse, scale)
    return math_causal_attention_bwd(grad_out, q, k, v, scale)


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
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor | Sequence[int], scale: float
) -> tuple[Tensor, Tensor]:
    """Causal attention within each packed sequence of a single row (B == 1)."""
    _check_single_row(q)
    out = torch.empty_like(q)
    lse = q.new_empty(q.shape[:3], dtype=torch.float32)
    for s, e in _segments(cu_seqlens, q.shape[2]):
        if e > s:
            out[:, :, s:e], lse[:, :, s:e] = causal_attention_fwd(
                q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], scale
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
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of `segment_causal_attention_fwd`, one packed sequence at a time."""
    _check_single_row(q)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for s, e in _segments(cu_seqlens, q.shape[2]):
        if e > s:
            sl = (slice(None), slice(None), slice(s, e))
            dq[sl], dk[sl], dv[sl] = causal_attention_bwd(
                grad_out[sl], q[sl], k[sl], v[sl], out[sl], lse[sl], scale
            )
    return dq, dk, dv


def block_attention_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    """One block of a distributed attention: causal on the diagonal, full below it (Tq may differ from Tk)."""
    if _use_cpu_flash(q, k, v):
        return cpu_flash_causal_attention_fwd(q, k, v, scale, causal)
    return math_causal_attention_fwd(q, k, v, scale, causal)


def block_attention_bwd(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, causal: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """Partial gradients of one block given the merged out and lse of its queries."""
    if _use_cpu_flash(q, k, v):
        return cpu_flash_causal_attention_bwd(grad_out, q, k, v, out, lse, scale, causal)
    return math_attention_bwd_from_lse(grad_out, q, k, v, out, lse, scale, causal)
