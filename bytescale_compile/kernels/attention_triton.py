"""Triton flash attention over packed sequences: segment-causal, sliding window, soft-cap, GQA, LSE (paper §6).

Layout and conventions are those of `attention_ref` (SDPA's `[B, H, T, D]`, any strides, V's head dim
Dv free to differ from D): a row holds segments given by `cu_seqlens_q`/`cu_seqlens_k` (the same
boundaries for every row; one segment spanning the row without them), query i of a segment sees key j
of the same segment when `(not causal or j <= i + offset) and (window is None or i + offset - j <
window)` (`attention_ref.AttentionMask`; offset 0 is top-left aligned, as SDPA's `is_causal`), scores
are soft-capped to `c * tanh(s / c)` with `softcap=c`, query head h reads kv head `h // (Hq // Hkv)`.
The forward returns `out` `[B, Hq, Tq, Dv]` in q's dimension order and the natural-log `lse`
contiguous fp32 `[B, Hq, Tq]` (out 0 and lse -inf for a query that sees no key); the backward takes
the *final* out/lse of the queries, so one key block of a ring gets its exact partial gradients.

Key blocks the mask empties (past the diagonal, before the window, other segments) are never visited:
every loop runs over the key (or query) blocks that hold a visible pair only, and it is cut in three
(`_split`): masked boundary blocks, unmasked interior blocks (every pair visible, both blocks inside
the segment), masked boundary blocks again. The backward is FlashAttention-2's: one program owns a key
block and walks the query blocks of every query head of its kv group, five GEMMs per block pair; dk/dv
stay in registers (summed over the group) and dq is added atomically into an fp32 buffer, cast once
(so dq is not bit-reproducible run to run on the GPU). Each tile's origin in q/k/v is an int64 offset
(tensors may pass 2^31 elements), the offsets within a tile stay int32.

Launches: the grid's first axis is a flat (segment, block) table built on the host once per packing
and cached with its single device copy (`segment_table`, a pinned non-blocking copy), so only blocks
that exist get a program and no call copies boundaries again. Tiles are sized per head dims and dtype to the device's shared
memory (`tile_config`), fp32 dots use tf32 when torch's float32 matmul precision allows it, and on
the GPU the autotuner picks warps and pipeline stages per head dims, dtypes and mask.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from .attention_ref import (
    AttentionMask,
    _segments,
    check_attention_options,
    check_attention_shapes,
    empty_attention_out,
)
from .transfer import to_device
from .triton_mode import built_for_interpreter

__all__ = [
    "INTERPRETED",
    "SegmentTable",
    "TileConfig",
    "attention_fwd",
    "attention_bwd",
    "fp32_precision",
    "segment_table",
    "tile_config",
]

_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _program(CU_Q, CU_K, SEGS, STARTS):
    """This program's batch row, head, block start within its segment, and the segment's query and key
    (start, length). Axis 0 of the grid runs over the (segment, block) table SEGS/STARTS (only blocks
    that exist), axis 1 over heads, axis 2 over rows. Row, head and segment starts are int64 (they
    build tile origins); the block start and lengths int32 (they bound the loops: int64 there would
    make every index within a tile int64, which costs time)."""
    b = tl.program_id(2).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    seg = tl.load(SEGS + tl.program_id(0))
    start = tl.load(STARTS + tl.program_id(0))
    q_start = tl.load(CU_Q + seg)
    k_start = tl.load(CU_K + seg)
    q_len = tl.load(CU_Q + seg + 1) - q_start
    k_len = tl.load(CU_K + seg + 1) - k_start
    return b, h, start, q_start.to(tl.int64), q_len, k_start.to(tl.int64), k_len


@triton.jit
def _origin(b, h, row, stride_b, stride_h, stride_t):
    """Element offset of (row b, head h, token `row`): int64 when b, h and row are (a 590K-token row
    of 32 heads of 128 passes 2^31 elements), whatever the strides' integer width."""
    return b * stride_b + h * stride_h + row * stride_t


@triton.jit
def _key_range(
    start_m,
    k_len,
    offset,
    window,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """[lo, hi) of the keys that queries [start_m, start_m + BLOCK_M) may see; lo on a key block edge."""
    lo = 0
    hi = k_len
    if CAUSAL:
        hi = tl.minimum(k_len, start_m + BLOCK_M + offset)
    if WINDOW:
        lo = tl.maximum(0, start_m + offset - window + 1) // BLOCK_N * BLOCK_N
    return lo, hi


@triton.jit
def _query_range(start_n, q_len, offset, window, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """[lo, hi) of the queries that may see keys [start_n, start_n + BLOCK_N)."""
    lo = 0
    hi = q_len
    if CAUSAL:
        lo = tl.maximum(0, start_n - offset)
    if WINDOW:
        hi = tl.minimum(q_len, start_n + BLOCK_N - 1 - offset + window)
    return lo, hi


@triton.jit
def _visible(ok, rows, cols, offset, window, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """`ok` (in-bounds pairs) and the contract's visible(i, j), for broadcastable query indices `rows`
    and key indices `cols`."""
    if CAUSAL:
        ok = ok & (cols <= rows + offset)
    if WINDOW:
        ok = ok & (rows + offset - cols < window)
    return ok


@triton.jit
def _split(lo, hi, first, last, BLOCK: tl.constexpr):
    """Cut the blocks lo, lo + BLOCK, ... (those starting below hi) into masked [lo, mid_lo), interior
    [mid_lo, mid_hi) and masked [mid_hi, end), where an interior block starts at x with first <= x <= last
    (`last` < lo: none). The cut only saves work: a block sent to a masked loop is still exact."""
    n = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK)
    k_lo = tl.minimum(tl.cdiv(tl.maximum(first - lo, 0), BLOCK), n)
    k_hi = tl.maximum(tl.minimum(tl.maximum(last - lo + BLOCK, 0) // BLOCK, n), k_lo)
    return lo + k_lo * BLOCK, lo + k_hi * BLOCK, lo + n * BLOCK


@triton.jit
def _interior_keys(
    start_m,
    k_len,
    offset,
    window,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """[first, last] of the key block starts whose keys every query of [start_m, start_m + BLOCK_M) sees:
    wholly in the segment, at or before the block's first diagonal, inside its last query's window. The
    forward needs no query bound: rows past the segment read q = 0 and are never stored."""
    first = 0
    last = k_len - BLOCK_N
    if CAUSAL:
        last = tl.minimum(last, start_m + offset - BLOCK_N + 1)
    if WINDOW:
        first = start_m + BLOCK_M + offset - window
    return first, last


@triton.jit
def _interior_queries(
    start_n,
    q_len,
    k_len,
    offset,
    window,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """[first, last] of the query block starts that see every key of [start_n, start_n + BLOCK_N), both
    blocks wholly in the segment (the backward adds into dq and reads lse per row, so bounds matter)."""
    first = 0
    last = q_len - BLOCK_M
    if CAUSAL:
        first = start_n + BLOCK_N - 1 - offset
    if WINDOW:
        last = tl.minimum(last, start_n + window - offset - BLOCK_M)
    if start_n + BLOCK_N > k_len:
        last = -1
    return first, last


@triton.jit
def _tanh(x):
    """tanh from exp2 (±1 at the extremes, never NaN); Triton's interpreter has no libdevice tanh."""
    return 1.0 - 2.0 / (1.0 + tl.exp2(x * (2.0 * _LOG2E)))


@triton.jit
def _scores(qk, scale, softcap, SOFTCAP: tl.constexpr):
    """Scores in log2 units (the kernels use exp2), and tanh(s / softcap), which the cap's derivative
    needs (without a cap the second value is the raw `qk` and goes unused)."""
    if SOFTCAP:
        t = _tanh(qk * (scale / softcap))
        return t * (softcap * _LOG2E), t
    return qk * (scale * _LOG2E), qk


@triton.jit
def _fwd_step(
    acc,
    l_i,
    m_i,
    q,
    k_ptrs,
    v_ptrs,
    start_n,
    k_start,
    offs_m,
    offs_n,
    d_ok,
    dv_ok,
    k_len,
    skt,
    svt,
    scale,
    softcap,
    offset,
    window,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One key block of the online softmax; MASKED=False for an interior block (bounds and mask skipped)."""
    col0 = k_start + start_n  # int64 tile origin
    cols = start_n + offs_n
    col_ok = cols < k_len
    if MASKED:
        k_t = tl.load(k_ptrs + col0 * skt, mask=d_ok[:, None] & col_ok[None, :], other=0.0)
        v = tl.load(v_ptrs + col0 * svt, mask=col_ok[:, None] & dv_ok[None, :], other=0.0)
    else:
        k_t = tl.load(k_ptrs + col0 * skt, mask=d_ok[:, None], other=0.0)
        v = tl.load(v_ptrs + col0 * svt, mask=dv_ok[None, :], other=0.0)
    s, _ = _scores(tl.dot(q, k_t, input_precision=PRECISION), scale, softcap, SOFTCAP)
    if MASKED:
        visible = _visible(col_ok[None, :], offs_m[:, None], cols[None, :], offset, window, CAUSAL, WINDOW)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_ref = m_new
    if MASKED:
        if WINDOW:  # a row may meet its window only in a later key block: until then p = alpha = 0
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, l_i, m_new


@triton.jit
def _fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    CU_Q,
    CU_K,
    SEGS,
    STARTS,
    sqb,
    sqh,
    sqt,
    sqd,
    skb,
    skh,
    skt,
    skd,
    svb,
    svh,
    svt,
    svd,
    sob,
    soh,
    sot,
    sod,
    slb,
    slh,
    slt,
    group,
    head_dim,
    v_dim,
    scale,
    softcap,
    offset,
    window,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """One query block of one head of one segment: online softmax over its visible key blocks, the
    boundary ones masked, the interior ones not."""
    b, h, start_m, q_start, q_len, k_start, k_len = _program(CU_Q, CU_K, SEGS, STARTS)
    kvh = h // group
    tile_m = tl.arange(0, BLOCK_M)
    offs_m = start_m + tile_m
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < q_len
    d_ok = offs_d < head_dim
    dv_ok = offs_dv < v_dim
    row0 = q_start + start_m  # int64 tile origins; int32 offsets within a tile

    q = tl.load(
        Q + _origin(b, h, row0, sqb, sqh, sqt) + tile_m[:, None] * sqt + offs_d[None, :] * sqd,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    k_ptrs = K + _origin(b, kvh, 0, skb, skh, skt) + offs_n[None, :] * skt + offs_d[:, None] * skd
    v_ptrs = V + _origin(b, kvh, 0, svb, svh, svt) + offs_n[:, None] * svt + offs_dv[None, :] * svd
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    lo, hi = _key_range(start_m, k_len, offset, window, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    first, last = _interior_keys(start_m, k_len, offset, window, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    mid_lo, mid_hi, end = _split(lo, hi, first, last, BLOCK_N)
    step = (offs_m, offs_n, d_ok, dv_ok, k_len, skt, svt, scale, softcap, offset, window)
    for start_n in range(lo, mid_lo, BLOCK_N):
        acc, l_i, m_i = _fwd_step(
            acc, l_i, m_i, q, k_ptrs, v_ptrs, start_n, k_start, *step, CAUSAL, WINDOW, SOFTCAP, PRECISION, True
        )
    for start_n in range(mid_lo, mid_hi, BLOCK_N):
        acc, l_i, m_i = _fwd_step(
            acc, l_i, m_i, q, k_ptrs, v_ptrs, start_n, k_start, *step, CAUSAL, WINDOW, SOFTCAP, PRECISION, False
        )
    for start_n in range(mid_hi, end, BLOCK_N):
        acc, l_i, m_i = _fwd_step(
            acc, l_i, m_i, q, k_ptrs, v_ptrs, start_n, k_start, *step, CAUSAL, WINDOW, SOFTCAP, PRECISION, True
        )

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # a query without keys: out 0, lse -inf
    out = acc / l_safe[:, None]
    tl.store(
        O + _origin(b, h, row0, sob, soh, sot) + tile_m[:, None] * sot + offs_dv[None, :] * sod,
        out.to(O.dtype.element_ty),
        mask=row_ok[:, None] & dv_ok[None, :],
    )
    tl.store(LSE + _origin(b, h, row0, slb, slh, slt) + tile_m * slt, (m_i + tl.log2(l_safe)) * _LN2, mask=row_ok)


@triton.jit
def _delta_kernel(
    O,
    DO,
    DELTA,
    sob,
    soh,
    sot,
    sod,
    sdb,
    sdh,
    sdt,
    sdd,
    T,
    v_dim,
    BLOCK_M: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """delta = rowsum(dO * O) in fp32, laid out contiguous [B, Hq, T]."""
    b = tl.program_id(2).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    n_heads = tl.num_programs(1)
    row0 = tl.program_id(0).to(tl.int64) * BLOCK_M
    tile_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_DV)
    row_ok = row0 + tile_m < T
    mask = row_ok[:, None] & (offs_d < v_dim)[None, :]
    o = tl.load(
        O + _origin(b, h, row0, sob, soh, sot) + tile_m[:, None] * sot + offs_d[None, :] * sod, mask=mask, other=0.0
    )
    do = tl.load(
        DO + _origin(b, h, row0, sdb, sdh, sdt) + tile_m[:, None] * sdt + offs_d[None, :] * sdd, mask=mask, other=0.0
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + (b * n_heads + h) * T + row0 + tile_m, delta, mask=row_ok)


@triton.jit
def _bwd_step(
    dk,
    dv,
    k,
    v,
    q_ptrs,
    do_ptrs,
    lse_ptrs,
    delta_ptrs,
    dq_ptrs,
    q_start,
    start_m,
    tile_m,
    cols,
    col_ok,
    d_ok,
    dv_ok,
    q_len,
    sqt,
    sdot,
    slt,
    sdqt,
    scale,
    softcap,
    offset,
    window,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One (query block, key block) pair of FlashAttention-2's backward, in five GEMMs: S^T = K Q^T,
    dV += P^T dO, dP^T = V dO^T, dK += dS^T Q, and dQ = dS K added atomically into the fp32 dq.
    MASKED=False for an interior pair: no bounds, no mask."""
    row = q_start + start_m  # int64 (q_start is): row * stride may pass 2^31
    if MASKED:
        row_ok = start_m + tile_m < q_len
        q_mask = row_ok[:, None] & d_ok[None, :]
        q = tl.load(q_ptrs + row * sqt, mask=q_mask, other=0.0)
        do = tl.load(do_ptrs + row * sdot, mask=row_ok[:, None] & dv_ok[None, :], other=0.0)
        lse2 = tl.load(lse_ptrs + row * slt, mask=row_ok, other=0.0) * _LOG2E
        delta = tl.load(delta_ptrs + row, mask=row_ok, other=0.0)
    else:
        q_mask = d_ok[None, :]
        q = tl.load(q_ptrs + row * sqt, mask=q_mask, other=0.0)
        do = tl.load(do_ptrs + row * sdot, mask=dv_ok[None, :], other=0.0)
        lse2 = tl.load(lse_ptrs + row * slt) * _LOG2E
        delta = tl.load(delta_ptrs + row)
    s_t, t_t = _scores(tl.dot(k, tl.trans(q), input_precision=PRECISION), scale, softcap, SOFTCAP)
    p_t = tl.exp2(s_t - lse2[None, :])
    if MASKED:  # a row that sees nothing has lse -inf: p would be inf, the mask makes it 0
        rows = start_m + tile_m
        visible = _visible(
            col_ok[:, None] & row_ok[None, :], rows[None, :], cols[:, None], offset, window, CAUSAL, WINDOW
        )
        p_t = tl.where(visible, p_t, 0.0)
    dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    if SOFTCAP:
        ds_t = ds_t * (1.0 - t_t * t_t)
    ds_t = ds_t.to(q.dtype)
    dk += tl.dot(ds_t, q, input_precision=PRECISION)
    dq = tl.dot(tl.trans(ds_t), k, input_precision=PRECISION) * scale
    tl.atomic_add(dq_ptrs + row * sdqt, dq, mask=q_mask, sem="relaxed")
    return dk, dv


@triton.jit
def _bwd_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    DK,
    DV,
    CU_Q,
    CU_K,
    SEGS,
    STARTS,
    sqb,
    sqh,
    sqt,
    sqd,
    skb,
    skh,
    skt,
    skd,
    svb,
    svh,
    svt,
    svd,
    sdob,
    sdoh,
    sdot,
    sdod,
    slb,
    slh,
    slt,
    sdqb,
    sdqh,
    sdqt,
    sdqd,
    sdkb,
    sdkh,
    sdkt,
    sdkd,
    sdvb,
    sdvh,
    sdvt,
    sdvd,
    group,
    head_dim,
    v_dim,
    Tq,
    n_q_heads,
    scale,
    softcap,
    offset,
    window,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """One key block of one kv head walks the visible query blocks of every query head of its group:
    dk, dv accumulate in registers (summed over the group) and are stored once; dq is added atomically
    into the fp32 DQ. Boundary query blocks are masked, interior ones are not."""
    b, kvh, start_n, q_start, q_len, k_start, k_len = _program(CU_Q, CU_K, SEGS, STARTS)
    tile_n = tl.arange(0, BLOCK_N)
    tile_m = tl.arange(0, BLOCK_M)
    cols = start_n + tile_n
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    col_ok = cols < k_len
    d_ok = offs_d < head_dim
    dv_ok = offs_dv < v_dim
    k_mask = col_ok[:, None] & d_ok[None, :]
    v_mask = col_ok[:, None] & dv_ok[None, :]
    col0 = k_start + start_n  # int64 tile origins; int32 offsets within a tile
    k = tl.load(
        K + _origin(b, kvh, col0, skb, skh, skt) + tile_n[:, None] * skt + offs_d[None, :] * skd, mask=k_mask, other=0.0
    )
    v = tl.load(
        V + _origin(b, kvh, col0, svb, svh, svt) + tile_n[:, None] * svt + offs_dv[None, :] * svd,
        mask=v_mask,
        other=0.0,
    )
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    lo, hi = _query_range(start_n, q_len, offset, window, BLOCK_N, CAUSAL, WINDOW)
    first, last = _interior_queries(start_n, q_len, k_len, offset, window, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    mid_lo, mid_hi, end = _split(lo, hi, first, last, BLOCK_M)
    step = (tile_m, cols, col_ok, d_ok, dv_ok, q_len, sqt, sdot, slt, sdqt, scale, softcap, offset, window)
    for h in range(kvh * group, kvh * group + group):
        q_ptrs = Q + _origin(b, h, 0, sqb, sqh, sqt) + tile_m[:, None] * sqt + offs_d[None, :] * sqd
        do_ptrs = DO + _origin(b, h, 0, sdob, sdoh, sdot) + tile_m[:, None] * sdot + offs_dv[None, :] * sdod
        lse_ptrs = LSE + _origin(b, h, 0, slb, slh, slt) + tile_m * slt
        delta_ptrs = DELTA + (b * n_q_heads + h) * Tq + tile_m
        dq_ptrs = DQ + _origin(b, h, 0, sdqb, sdqh, sdqt) + tile_m[:, None] * sdqt + offs_d[None, :] * sdqd
        ptrs = (q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, dq_ptrs)
        for start_m in range(lo, mid_lo, BLOCK_M):
            dk, dv = _bwd_step(dk, dv, k, v, *ptrs, q_start, start_m, *step, CAUSAL, WINDOW, SOFTCAP, PRECISION, True)
        for start_m in range(mid_lo, mid_hi, BLOCK_M):
            dk, dv = _bwd_step(dk, dv, k, v, *ptrs, q_start, start_m, *step, CAUSAL, WINDOW, SOFTCAP, PRECISION, False)
        for start_m in range(mid_hi, end, BLOCK_M):
            dk, dv = _bwd_step(dk, dv, k, v, *ptrs, q_start, start_m, *step, CAUSAL, WINDOW, SOFTCAP, PRECISION, True)
    tl.store(
        DK + _origin(b, kvh, col0, sdkb, sdkh, sdkt) + tile_n[:, None] * sdkt + offs_d[None, :] * sdkd,
        (dk * scale).to(DK.dtype.element_ty),
        mask=k_mask,
    )
    tl.store(
        DV + _origin(b, kvh, col0, sdvb, sdvh, sdvt) + tile_n[:, None] * sdvt + offs_dv[None, :] * sdvd,
        dv.to(DV.dtype.element_ty),
        mask=v_mask,
    )


# --- host side ------------------------------------------------------------------------------------

INTERPRETED: bool = built_for_interpreter(_fwd_kernel, _delta_kernel, _bwd_kernel, _key_range)
"""Whether the kernels run in Triton's interpreter (CPU tensors) rather than on the GPU."""

H100_SHARED_MEMORY_BYTES = 232_448
"""Shared memory per block on an H100 (sm_90), used when the device cannot be asked (the interpreter)."""

_TUNING_KEY = ["head_dim", "v_dim", "BLOCK_M", "BLOCK_N", "CAUSAL", "WINDOW", "SOFTCAP", "PRECISION"]
_TUNING_CONFIGS = [triton.Config({}, num_warps=warps, num_stages=stages) for warps in (4, 8) for stages in (1, 2, 3)]
"""Warps and pipeline stages tried per key (the autotuner also keys on the tensors' dtypes); a config
that does not fit the shared memory is dropped by the autotuner. Tiles are fixed on the host, since
the (segment, block) table depends on them."""


def _zero_dq(args: dict[str, Any]) -> None:
    """Zero the fp32 dq the backward adds into, before every launch: the autotuner launches a kernel
    several times per config, and not every Triton release applies `reset_to_zero` before the launch
    that follows the tuning (a config's pre-hook runs before each one)."""
    args["DQ"].zero_()


def _tuned(kernel: Any, *, zeroes_dq: bool = False) -> Any:
    """`kernel` autotuned on the GPU; the interpreter runs it as is (one deterministic config)."""
    if INTERPRETED:
        return kernel
    hook = _zero_dq if zeroes_dq else None
    configs = [
        triton.Config(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages, pre_hook=hook) for c in _TUNING_CONFIGS
    ]
    return triton.autotune(configs=configs, key=_TUNING_KEY)(kernel)


_fwd = _tuned(_fwd_kernel)
_bwd = _tuned(_bwd_kernel, zeroes_dq=True)


@dataclass(frozen=True)
class TileConfig:
    """Tiles and dot precision of one call: forward query/key blocks, backward query/key blocks, padded
    head dims."""

    block_m: int
    block_n: int
    bwd_block_m: int
    bwd_block_n: int
    block_d: int
    block_dv: int
    precision: str

    def shared_memory_bytes(self, itemsize: int, stages: int = 2) -> int:
        """Shared memory the most demanding kernel needs with `stages` pipelined key (or query) tiles:
        the resident Q (or K and V) tile plus `stages` streamed K and V (or Q and dO) tiles."""
        width = self.block_d + self.block_dv
        fwd = self.block_m * self.block_d + stages * self.block_n * width
        bwd = (self.bwd_block_n + stages * self.bwd_block_m) * width
        return itemsize * max(fwd, bwd)


_GPU_TILES = (
    (128, 64, 64, 128),
    (128, 64, 64, 64),
    (64, 64, 64, 64),
    (64, 32, 32, 32),
    (32, 32, 32, 32),
    (16, 16, 16, 16),
)
"""(block_m, block_n, bwd_block_m, bwd_block_n), largest first. The backward's key block is the wider:
each (query, key) block pair adds a [bwd_block_m, D] fp32 dq atomically, so the atomic traffic per
FLOP falls as the key block grows (on an H200 at D 128 in bf16, 64 x 128 took 88 ms where 64 x 64
took 159 ms and the atomic-free 7-GEMM backward 107 ms)."""


def fp32_precision() -> str:
    """The dot precision of fp32 inputs: tf32 when torch lets fp32 matmuls use it, IEEE otherwise."""
    return "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def tile_config(head_dim: int, v_dim: int, dtype: torch.dtype, shared_memory_bytes: int) -> TileConfig:
    """The largest GPU tiles whose two-stage pipeline fits `shared_memory_bytes` (head dim 256 in fp32
    gets small tiles, 64 in bf16 large ones); the backward keeps its two fp32 accumulators
    [bwd_block_n, D] and [bwd_block_n, Dv] small when D + Dv is large, so they stay in registers."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_dv = max(16, triton.next_power_of_2(v_dim))
    precision = fp32_precision() if dtype == torch.float32 else "tf32"
    for block_m, block_n, bwd_m, bwd_n in _GPU_TILES:
        if block_d + block_dv > 256:
            bwd_m, bwd_n = min(bwd_m, 32), min(bwd_n, 32)
        cfg = TileConfig(block_m, block_n, bwd_m, bwd_n, block_d, block_dv, precision)
        if cfg.shared_memory_bytes(dtype.itemsize) <= shared_memory_bytes:
            return cfg
    raise ValueError(
        f"attention head dims D={head_dim}, Dv={v_dim} in {dtype} need more shared memory than the "
        f"device's {shared_memory_bytes} bytes even with 16-wide tiles"
    )


def _config(q: Tensor, v: Tensor) -> TileConfig:
    """GPU tiles sized to the device's shared memory; 16-wide ones in the interpreter (several tiles per test)."""
    if INTERPRETED or q.device.type != "cuda":
        block_d = max(16, triton.next_power_of_2(q.shape[-1]))
        block_dv = max(16, triton.next_power_of_2(v.shape[-1]))
        precision = fp32_precision() if q.dtype == torch.float32 else "tf32"
        return TileConfig(32, 16, 16, 16, block_d, block_dv, precision)
    return tile_config(q.shape[-1], v.shape[-1], q.dtype, _shared_memory_bytes(q.device))


@functools.cache
def _shared_memory_bytes(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]


def _launch_options() -> dict[str, int]:
    """num_warps for the interpreter's single config; on the GPU the autotuner picks it."""
    return {"num_warps": 1} if INTERPRETED else {}


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, softcap: float | None) -> None:
    """Raise ValueError unless q `[B, Hq, Tq, D]`, k `[B, Hkv, Tk, D]`, v `[B, Hkv, Tk, Dv]` of one dtype."""
    check_attention_shapes(q, k, v, same_length=False)
    check_attention_options(None, softcap)
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"attention expects q/k/v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def _host_bounds(cu: Tensor | Sequence[int] | None, tokens: int) -> tuple[int, ...]:
    """Boundaries as host ints (one transfer from a device tensor; the ops pass host ones), checked."""
    if cu is None:
        return (0, tokens)
    segs = _segments(cu.tolist() if isinstance(cu, Tensor) else cu, tokens)
    return (0, *(e for _, e in segs))


def _blocks(bounds: tuple[int, ...], block: int, *, latest_first: bool) -> tuple[Tensor, Tensor]:
    """(segment, start) of every `block`-token block of every segment, the blocks with the most work
    first so the short ones fill in: under a causal mask the latest query blocks see the most keys,
    and the earliest key blocks are seen by the most queries."""
    cu = torch.tensor(bounds, dtype=torch.int64)
    counts = (cu[1:] - cu[:-1] + block - 1) // block
    seg = torch.repeat_interleave(torch.arange(len(bounds) - 1), counts)
    first = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    start = (torch.arange(seg.numel()) - first) * block
    order = torch.argsort(start, descending=latest_first, stable=True)
    return seg[order], start[order]


@dataclass(frozen=True)
class SegmentTable:
    """The boundaries and (segment, block) tables of one packing, on the device in one int32 copy.

    `q_fwd` lists the query blocks of the forward, `k_bwd` the key blocks of the backward, each as
    (segments, starts). Programs run only for blocks that exist, so one long segment plus many short
    ones costs what their tokens cost.
    """

    cu_q: Tensor
    cu_k: Tensor
    q_fwd: tuple[Tensor, Tensor]
    k_bwd: tuple[Tensor, Tensor]


@functools.lru_cache(maxsize=256)
def segment_table(
    bounds_q: tuple[int, ...], bounds_k: tuple[int, ...], cfg: TileConfig, device: torch.device
) -> SegmentTable:
    """The `SegmentTable` of a packing, built on the host and copied once, from pinned memory without
    blocking the host: cached, so every layer, forward and backward, and every ring block of a
    micro-batch reuse one device copy."""
    if len(bounds_q) != len(bounds_k):
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must list the same number of segments, "
            f"got {len(bounds_q) - 1} and {len(bounds_k) - 1}"
        )
    parts = [
        torch.tensor(bounds_q),
        torch.tensor(bounds_k),
        *_blocks(bounds_q, cfg.block_m, latest_first=True),
        *_blocks(bounds_k, cfg.bwd_block_n, latest_first=False),
    ]
    flat = torch.cat(parts).to(torch.int32)
    views = to_device(flat, device).split([p.numel() for p in parts])
    return SegmentTable(views[0], views[1], views[2:4], views[4:6])


def _table(
    cu_q: Tensor | Sequence[int] | None,
    cu_k: Tensor | Sequence[int] | None,
    tq: int,
    tk: int,
    cfg: TileConfig,
    device: torch.device,
) -> SegmentTable:
    return segment_table(_host_bounds(cu_q, tq), _host_bounds(cu_k, tk), cfg, device)


def _mask_args(causal: bool, window: int | None, softcap: float | None, offset: int) -> dict[str, Any]:
    """The mask and cap as kernel arguments (`AttentionMask` validates the window and offset)."""
    mask = AttentionMask(causal, window, offset)
    return {
        "CAUSAL": mask.causal,
        "WINDOW": mask.window is not None,
        "SOFTCAP": softcap is not None,
        "window": mask.window or 0,
        "softcap": softcap or 1.0,
        "offset": mask.offset,
    }


def _strides(*tensors: Tensor) -> list[int]:
    return [s for t in tensors for s in t.stride()]


def attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    *,
    causal: bool,
    cu_seqlens_q: Tensor | Sequence[int] | None = None,
    cu_seqlens_k: Tensor | Sequence[int] | None = None,
    window: int | None = None,
    softcap: float | None = None,
    offset: int = 0,
) -> tuple[Tensor, Tensor]:
    """(out `[B, Hq, Tq, Dv]` in q's order, lse fp32 `[B, Hq, Tq]`) of masked GQA attention per segment."""
    _check_inputs(q, k, v, softcap)
    masking = _mask_args(causal, window, softcap, offset)
    b, n_heads, tq, d = q.shape
    out = empty_attention_out(q, v)
    lse = torch.full((b, n_heads, tq), float("-inf"), dtype=torch.float32, device=q.device)
    if out.numel() == 0 or k.shape[2] == 0:
        return out.zero_(), lse
    cfg = _config(q, v)
    table = _table(cu_seqlens_q, cu_seqlens_k, tq, k.shape[2], cfg, q.device)
    _fwd[(table.q_fwd[0].numel(), n_heads, b)](
        q,
        k,
        v,
        out,
        lse,
        table.cu_q,
        table.cu_k,
        *table.q_fwd,
        *_strides(q, k, v, out, lse),
        n_heads // k.shape[1],
        d,
        v.shape[-1],
        scale,
        **masking,
        PRECISION=cfg.precision,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_D=cfg.block_d,
        BLOCK_DV=cfg.block_dv,
        **_launch_options(),
    )
    return out, lse


def attention_bwd(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    *,
    causal: bool,
    cu_seqlens_q: Tensor | Sequence[int] | None = None,
    cu_seqlens_k: Tensor | Sequence[int] | None = None,
    window: int | None = None,
    softcap: float | None = None,
    offset: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) like `empty_like` of q, k, v, given the final out and lse of the queries."""
    _check_inputs(q, k, v, softcap)
    masking = _mask_args(causal, window, softcap, offset)
    b, n_heads, tq, d = q.shape
    n_kv, tk, d_v = k.shape[1], k.shape[2], v.shape[-1]
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0:
        return torch.zeros_like(q), dk.zero_(), dv.zero_()
    cfg = _config(q, v)
    table = _table(cu_seqlens_q, cu_seqlens_k, tq, tk, cfg, q.device)
    block = cfg.bwd_block_m
    common = {
        **masking,
        "PRECISION": cfg.precision,
        "BLOCK_M": block,
        "BLOCK_N": cfg.bwd_block_n,
        "BLOCK_D": cfg.block_d,
        "BLOCK_DV": cfg.block_dv,
        **_launch_options(),
    }

    delta = torch.empty(b, n_heads, tq, dtype=torch.float32, device=q.device)
    _delta_kernel[(triton.cdiv(tq, block), n_heads, b)](
        out,
        grad_out,
        delta,
        *_strides(out, grad_out),
        tq,
        d_v,
        BLOCK_M=block,
        BLOCK_DV=cfg.block_dv,
        num_warps=1 if INTERPRETED else 4,
    )
    dq = _dq_accumulator(q)
    _bwd[(table.k_bwd[0].numel(), n_kv, b)](
        q,
        k,
        v,
        grad_out,
        lse,
        delta,
        dq,
        dk,
        dv,
        table.cu_q,
        table.cu_k,
        *table.k_bwd,
        *_strides(q, k, v, grad_out, lse, dq, dk, dv),
        n_heads // n_kv,
        d,
        d_v,
        tq,
        n_heads,
        scale,
        **common,
    )
    return dq if dq.dtype == q.dtype else dq.to(q.dtype), dk, dv


def _dq_accumulator(q: Tensor) -> Tensor:
    """The fp32 dq the backward adds into (dq itself for fp32 q), laid out like `empty_like(q)`. Zeroed
    here in the interpreter; on the GPU each launch's config pre-hook zeroes it (`_zero_dq`)."""
    acc = torch.empty_like(q, dtype=torch.float32)
    return acc.zero_() if INTERPRETED else acc
