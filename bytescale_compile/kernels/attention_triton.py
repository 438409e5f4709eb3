"""Triton flash attention over packed sequences: segment-causal, GQA, returning the LSE (paper §6).

Layout and conventions are those of `attention_ref` (SDPA's `[B, H, T, D]`, any strides): a row
holds segments given by `cu_seqlens_q`/`cu_seqlens_k` (the same boundaries for every row; one
segment spanning the row without them), query i of a segment sees key j of the same segment when
`not causal or j <= i` (top-left aligned, as the refs and SDPA's `is_causal`, so Tq may differ from
Tk), query head h reads kv head `h // (Hq // Hkv)`. The forward returns `out` like
`torch.empty_like(q)` and the natural-log `lse` contiguous fp32 `[B, Hq, Tq]`; the backward takes the
*final* out/lse of the queries, so one key block of a ring gets its exact partial gradients.

Key blocks the mask empties (past the diagonal, other segments) are never visited. The backward
is atomic-free: one program owns a key block and loops over every query head of its kv group, so
dk/dv come out summed over the group; dq has its own kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from .attention_ref import _segments
from .triton_mode import built_for_interpreter

__all__ = ["INTERPRETED", "attention_fwd", "attention_bwd"]

_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _segment(CU_Q, CU_K, n_seg):
    """This program's batch row and its segment's query and key (start, length); axis 0 of the grid
    runs over rows × segments."""
    b = tl.program_id(0) // n_seg
    seg = tl.program_id(0) % n_seg
    q_start = tl.load(CU_Q + seg)
    k_start = tl.load(CU_K + seg)
    return b, q_start, tl.load(CU_Q + seg + 1) - q_start, k_start, tl.load(CU_K + seg + 1) - k_start


@triton.jit
def _key_end(start_m, q_len, k_len, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """End of the keys that queries [start_m, start_m + BLOCK_M) may see."""
    if CAUSAL:
        return tl.minimum(k_len, start_m + BLOCK_M)
    return k_len


@triton.jit
def _fwd_kernel(
    Q, K, V, O, LSE, CU_Q, CU_K,
    sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd, sob, soh, sot, sod, slb, slh, slt,
    n_seg, group, head_dim, qk_scale,
    CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One query block of one head of one segment: online softmax over its visible key blocks."""
    b, q_start, q_len, k_start, k_len = _segment(CU_Q, CU_K, n_seg)
    h = tl.program_id(2)
    start_m = tl.program_id(1) * BLOCK_M
    if start_m >= q_len:
        return
    kvh = h // group
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < q_len
    d_ok = offs_d < head_dim

    q = tl.load(Q + b * sqb + h * sqh + (q_start + offs_m)[:, None] * sqt + offs_d[None, :] * sqd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = K + b * skb + kvh * skh + offs_d[:, None] * skd
    v_base = V + b * svb + kvh * svh + offs_d[None, :] * svd
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # key block 0 holds a visible key for every row, so m_i is finite from the first iteration on
    for start_n in range(0, _key_end(start_m, q_len, k_len, BLOCK_M, CAUSAL), BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < k_len
        k_t = tl.load(k_base + (k_start + cols)[None, :] * skt, mask=d_ok[:, None] & col_ok[None, :], other=0.0)
        s = tl.dot(q, k_t, input_precision=PRECISION) * qk_scale
        visible = col_ok[None, :]
        if CAUSAL:
            visible = visible & (cols[None, :] <= offs_m[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + (k_start + cols)[:, None] * svt, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # a segment without keys: out 0, lse -inf
    out = acc / l_safe[:, None]
    tl.store(O + b * sob + h * soh + (q_start + offs_m)[:, None] * sot + offs_d[None, :] * sod,
             out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + b * slb + h * slh + (q_start + offs_m) * slt, (m_i + tl.log2(l_safe)) * _LN2, mask=row_ok)


@triton.jit
def _delta_kernel(
    O, DO, DELTA, sob, soh, sot, sod, sdb, sdh, sdt, sdd, T, head_dim,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """delta = rowsum(dO * O) in fp32, laid out contiguous [B, Hq, T]."""
    b = tl.program_id(2)
    h = tl.program_id(1)
    n_heads = tl.num_programs(1)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < T)[:, None] & (offs_d < head_dim)[None, :]
    o = tl.load(O + b * sob + h * soh + offs_m[:, None] * sot + offs_d[None, :] * sod, mask=mask, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdt + offs_d[None, :] * sdd, mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + (b * n_heads + h) * T + offs_m, delta, mask=offs_m < T)


@triton.jit
def _dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, CU_Q, CU_K,
    sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd, sdob, sdoh, sdot, sdod, slb, slh, slt,
    sdkb, sdkh, sdkt, sdkd, sdvb, sdvh, sdvt, sdvd,
    n_seg, group, head_dim, Tq, n_q_heads, scale, qk_scale,
    CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One key block of one kv head: dk, dv summed over the group's query heads and visible queries."""
    b, q_start, q_len, k_start, k_len = _segment(CU_Q, CU_K, n_seg)
    kvh = tl.program_id(2)
    start_n = tl.program_id(1) * BLOCK_N
    if start_n >= k_len:
        return
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    col_ok = cols < k_len
    d_ok = offs_d < head_dim
    kv_mask = col_ok[:, None] & d_ok[None, :]
    k = tl.load(K + b * skb + kvh * skh + (k_start + cols)[:, None] * skt + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
    v = tl.load(V + b * svb + kvh * svh + (k_start + cols)[:, None] * svt + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    first_m = 0
    if CAUSAL:
        first_m = start_n  # earlier queries see none of these keys
    for h in range(kvh * group, kvh * group + group):
        for start_m in range(first_m, q_len, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            row_ok = offs_m < q_len
            q_mask = row_ok[:, None] & d_ok[None, :]
            q = tl.load(Q + b * sqb + h * sqh + (q_start + offs_m)[:, None] * sqt + offs_d[None, :] * sqd, mask=q_mask, other=0.0)
            do = tl.load(DO + b * sdob + h * sdoh + (q_start + offs_m)[:, None] * sdot + offs_d[None, :] * sdod,
                         mask=q_mask, other=0.0)
            lse2 = tl.load(LSE + b * slb + h * slh + (q_start + offs_m) * slt, mask=row_ok, other=0.0) * _LOG2E
            delta = tl.load(DELTA + (b * n_q_heads + h) * Tq + q_start + offs_m, mask=row_ok, other=0.0)
            visible = col_ok[:, None] & row_ok[None, :]
            if CAUSAL:
                visible = visible & (cols[:, None] <= offs_m[None, :])
            s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale
            p_t = tl.where(visible, tl.exp2(s_t - lse2[None, :]), 0.0)
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
            dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)
    tl.store(DK + b * sdkb + kvh * sdkh + (k_start + cols)[:, None] * sdkt + offs_d[None, :] * sdkd,
             (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + b * sdvb + kvh * sdvh + (k_start + cols)[:, None] * sdvt + offs_d[None, :] * sdvd,
             dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, CU_Q, CU_K,
    sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd, sdob, sdoh, sdot, sdod, slb, slh, slt,
    sdqb, sdqh, sdqt, sdqd,
    n_seg, group, head_dim, Tq, n_q_heads, scale, qk_scale,
    CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One query block of one head: dq over its visible key blocks."""
    b, q_start, q_len, k_start, k_len = _segment(CU_Q, CU_K, n_seg)
    h = tl.program_id(2)
    start_m = tl.program_id(1) * BLOCK_M
    if start_m >= q_len:
        return
    kvh = h // group
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < q_len
    d_ok = offs_d < head_dim
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * sqb + h * sqh + (q_start + offs_m)[:, None] * sqt + offs_d[None, :] * sqd, mask=q_mask, other=0.0)
    do = tl.load(DO + b * sdob + h * sdoh + (q_start + offs_m)[:, None] * sdot + offs_d[None, :] * sdod,
                 mask=q_mask, other=0.0)
    lse2 = tl.load(LSE + b * slb + h * slh + (q_start + offs_m) * slt, mask=row_ok, other=0.0) * _LOG2E
    delta = tl.load(DELTA + (b * n_q_heads + h) * Tq + q_start + offs_m, mask=row_ok, other=0.0)
    k_base = K + b * skb + kvh * skh + offs_d[None, :] * skd
    v_base = V + b * svb + kvh * svh + offs_d[None, :] * svd
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(0, _key_end(start_m, q_len, k_len, BLOCK_M, CAUSAL), BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < k_len
        kv_mask = col_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + (k_start + cols)[:, None] * skt, mask=kv_mask, other=0.0)
        v = tl.load(v_base + (k_start + cols)[:, None] * svt, mask=kv_mask, other=0.0)
        visible = row_ok[:, None] & col_ok[None, :]
        if CAUSAL:
            visible = visible & (cols[None, :] <= offs_m[:, None])
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        p = tl.where(visible, tl.exp2(s - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(DQ + b * sdqb + h * sdqh + (q_start + offs_m)[:, None] * sdqt + offs_d[None, :] * sdqd,
             (dq * scale).to(DQ.dtype.element_ty), mask=q_mask)


# --- host side ------------------------------------------------------------------------------------

INTERPRETED: bool = built_for_interpreter(_fwd_kernel, _delta_kernel, _dkdv_kernel, _dq_kernel, _key_end)
"""Whether the kernels run in Triton's interpreter (CPU tensors) rather than on the GPU."""


def _check_shapes(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Raise ValueError unless q `[B, Hq, Tq, D]`, k/v `[B, Hkv, Tk, D]` with Hq a multiple of Hkv."""
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"attention expects q [B, Hq, Tq, D] and k, v of one shape [B, Hkv, Tk, D], got {shapes}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"attention expects q/k/v with the same B and D, got {shapes}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"attention expects Hq a multiple of Hkv (GQA), got {shapes}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"attention expects q/k/v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def _host_list(cu: Tensor | Sequence[int] | None, tokens: int) -> Sequence[int]:
    """Boundaries as host ints, read from a device tensor in one transfer; one segment when None."""
    if cu is None:
        return [0, tokens]
    return cu.tolist() if isinstance(cu, Tensor) else cu


def _bounds(cu_q: Tensor | Sequence[int] | None, cu_k: Tensor | Sequence[int] | None, tq: int, tk: int,
            device: torch.device) -> tuple[Tensor, Tensor, int, int, int]:
    """Device int32 boundaries of q and k, segment count and the longest q and k segments."""
    seg_q = _segments(_host_list(cu_q, tq), tq)
    seg_k = _segments(_host_list(cu_k, tk), tk)
    if len(seg_q) != len(seg_k):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must list the same number of segments, "
                         f"got {len(seg_q)} and {len(seg_k)}")

    def to_device(segs: list[tuple[int, int]]) -> Tensor:
        return torch.tensor([0] + [e for _, e in segs], dtype=torch.int32, device=device)

    return (to_device(seg_q), to_device(seg_k), len(seg_q),
            max(e - s for s, e in seg_q), max(e - s for s, e in seg_k))


def _config(q: Tensor) -> dict[str, Any]:
    """Tile sizes and dot precision: GPU-sized tiles on CUDA, 16-wide ones (several tiles per test) otherwise."""
    on_gpu = q.device.type == "cuda" and not INTERPRETED
    block_d = max(16, triton.next_power_of_2(q.shape[-1]))
    return {
        "PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
        "BLOCK_D": block_d,
        "block": 64 if on_gpu else 16,
        "num_warps": (8 if block_d > 64 else 4) if on_gpu else 1,
    }


def _strides(*tensors: Tensor) -> list[int]:
    return [s for t in tensors for s in t.stride()]


def attention_fwd(
    q: Tensor, k: Tensor, v: Tensor, scale: float, *, causal: bool,
    cu_seqlens_q: Tensor | Sequence[int] | None = None, cu_seqlens_k: Tensor | Sequence[int] | None = None,
) -> tuple[Tensor, Tensor]:
    """(out like `empty_like(q)`, lse fp32 `[B, Hq, Tq]`) of (segment-)causal or full GQA attention."""
    _check_shapes(q, k, v)
    b, n_heads, tq, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(b, n_heads, tq, dtype=torch.float32, device=q.device)
    if q.numel() == 0:
        return out, lse
    cu_q, cu_k, n_seg, max_q, _ = _bounds(cu_seqlens_q, cu_seqlens_k, tq, k.shape[2], q.device)
    cfg = _config(q)
    block = cfg["block"]
    grid = (b * n_seg, triton.cdiv(max_q, 2 * block), n_heads)
    _fwd_kernel[grid](
        q, k, v, out, lse, cu_q, cu_k, *_strides(q, k, v, out, lse),
        n_seg, n_heads // k.shape[1], d, scale * _LOG2E.value,
        CAUSAL=causal, PRECISION=cfg["PRECISION"], BLOCK_M=2 * block, BLOCK_N=block, BLOCK_D=cfg["BLOCK_D"],
        num_warps=cfg["num_warps"],
    )
    return out, lse


def attention_bwd(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, *, causal: bool,
    cu_seqlens_q: Tensor | Sequence[int] | None = None, cu_seqlens_k: Tensor | Sequence[int] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) like `empty_like` of q, k, v, given the final out and lse of the queries."""
    _check_shapes(q, k, v)
    b, n_heads, tq, d = q.shape
    n_kv, tk = k.shape[1], k.shape[2]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    cu_q, cu_k, n_seg, max_q, max_k = _bounds(cu_seqlens_q, cu_seqlens_k, tq, tk, q.device)
    cfg = _config(q)
    block, block_d, warps = cfg["block"], cfg["BLOCK_D"], cfg["num_warps"]
    common = {"CAUSAL": causal, "PRECISION": cfg["PRECISION"], "BLOCK_M": block, "BLOCK_N": block,
              "BLOCK_D": block_d, "num_warps": warps}

    delta = torch.empty(b, n_heads, tq, dtype=torch.float32, device=q.device)
    _delta_kernel[(triton.cdiv(tq, block), n_heads, b)](
        out, grad_out, delta, *_strides(out, grad_out), tq, d, BLOCK_M=block, BLOCK_D=block_d, num_warps=warps)
    inputs = (q, k, v, grad_out, lse, delta)
    strides = _strides(q, k, v, grad_out, lse)
    sizes = (n_seg, n_heads // n_kv, d, tq, n_heads, scale, scale * _LOG2E.value)
    _dkdv_kernel[(b * n_seg, triton.cdiv(max_k, block), n_kv)](
        *inputs, dk, dv, cu_q, cu_k, *strides, *_strides(dk, dv), *sizes, **common)
    _dq_kernel[(b * n_seg, triton.cdiv(max_q, block), n_heads)](
        *inputs, dq, cu_q, cu_k, *strides, *_strides(dq), *sizes, **common)
    return dq, dk, dv
