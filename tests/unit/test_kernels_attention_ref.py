"""Torch reference attention (window, soft-cap, Dv != D, block offset) against a dense formula written here."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from bytescale_compile.kernels import attention_ref as ref
from tests.helpers import rel_err

SCALE = 0.37
D = 16


def err(got: Tensor, want: Tensor) -> float:
    """max |got - want| relative to max(max |want|, 1): gradients that are exactly 0 (a window of 1) stay testable."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    assert not got.isnan().any()
    return rel_err(got, want, floor=1.0)


def allowed_pairs(
    tq: int, tk: int, causal: bool = True, window: int | None = None, offset: int = 0, cu: list[int] | None = None
) -> Tensor:
    """The contract's visible(i, j) from token positions; with `cu`, only within a packed sequence (offset 0 there)."""
    seq_q = seq_k = torch.zeros(max(tq, tk), dtype=torch.long)
    pos_q, pos_k = torch.arange(tq) + offset, torch.arange(tk)
    if cu is not None:
        seq_q = seq_k = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu).diff())
        pos_q = pos_k = torch.arange(tq) - torch.tensor(cu)[seq_q]
    i, j = pos_q[:, None], pos_k[None, :]
    allowed = seq_q[:tq, None] == seq_k[None, :tk]
    if causal:
        allowed &= j <= i
    if window is not None:
        allowed &= i - j < window
    return allowed


def dense(q: Tensor, k: Tensor, v: Tensor, grad: Tensor, allowed: Tensor, softcap: float | None = None):
    """(out, lse, dq, dk, dv) by autograd in fp64 through scores, cap, mask and softmax; rows without keys give 0."""
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    qd, kd, vd = leaves
    rep = q.shape[1] // k.shape[1]
    scores = qd @ kd.repeat_interleave(rep, 1).transpose(-1, -2) * SCALE
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed, float("-inf"))
    has_key = allowed.any(-1, keepdim=True)
    probs = torch.softmax(torch.where(has_key, scores, 0.0), dim=-1) * allowed
    out = probs @ vd.repeat_interleave(rep, 1)
    lse = torch.where(has_key[..., 0], torch.logsumexp(scores, dim=-1), float("-inf"))
    out.backward(grad.double())
    return (out.to(q.dtype), lse.float(), *(x.grad.to(x0.dtype) for x, x0 in zip(leaves, (q, k, v))))


def make(
    tq: int, tk: int, hq: int = 4, hkv: int = 2, dv: int = D, dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(1, hq, tq, D, generator=g), torch.randn(1, hkv, tk, D, generator=g)
    v, grad = torch.randn(1, hkv, tk, dv, generator=g), torch.randn(1, hq, tq, dv, generator=g)
    return tuple(x.to(dtype) for x in (q, k, v, grad))


def check(got_fwd, got_bwd, want, tol: float) -> None:
    (out, lse), (want_out, want_lse, *want_grads) = got_fwd, want
    assert err(out, want_out) <= tol
    assert lse.dtype == torch.float32 and lse.is_contiguous()
    assert torch.equal(lse.isinf(), want_lse.isinf())
    assert err(lse.nan_to_num(neginf=0.0), want_lse.nan_to_num(neginf=0.0)) <= tol
    for name, g, w in zip(("dq", "dk", "dv"), got_bwd, want_grads):
        assert err(g, w) <= tol, name


# --- entry points against the dense formula --------------------------------------------------------


@pytest.mark.parametrize("window", [None, 1, 5, 130, 200], ids=lambda w: f"w{w}")
@pytest.mark.parametrize("softcap", [None, 2.0], ids=["nocap", "cap"])
@pytest.mark.parametrize("hq,hkv,dv", [(4, 4, D), (4, 2, D), (4, 2, 24), (2, 1, 8)], ids=["mha", "gqa", "dv24", "dv8"])
def test_causal_matches_dense(window: int | None, softcap: float | None, hq: int, hkv: int, dv: int) -> None:
    """T = 200 spans two query tiles, so windowed runs cover the tiling."""
    q, k, v, grad = make(200, 200, hq, hkv, dv)
    fwd = ref.causal_attention_fwd(q, k, v, SCALE, window=window, softcap=softcap)
    bwd = ref.causal_attention_bwd(grad, q, k, v, *fwd, SCALE, window=window, softcap=softcap)
    check(fwd, bwd, dense(q, k, v, grad, allowed_pairs(200, 200, window=window), softcap), 1e-5)


@pytest.mark.parametrize("window,softcap", [(7, None), (7, 2.0), (None, 2.0)])
def test_segment_causal_matches_dense(window: int | None, softcap: float | None) -> None:
    cu = [0, 5, 5, 150, 151, 300]
    q, k, v, grad = make(300, 300, dv=24)
    fwd = ref.segment_causal_attention_fwd(q, k, v, cu, SCALE, window=window, softcap=softcap)
    bwd = ref.segment_causal_attention_bwd(grad, q, k, v, *fwd, cu, SCALE, window=window, softcap=softcap)
    check(fwd, bwd, dense(q, k, v, grad, allowed_pairs(300, 300, window=window, cu=cu), softcap), 1e-5)


@pytest.mark.parametrize(
    "causal,tq,tk,offset,window",
    [
        (True, 40, 30, 0, None),
        (True, 40, 30, 6, None),
        (True, 140, 30, 5, 20),
        (False, 140, 60, 20, 40),
        (True, 30, 50, 60, 9),
        (True, 30, 170, 10, 200),
    ],
    ids=["diagonal", "offset", "empty-rows", "full-window-empty-rows", "all-empty", "window-covers"],
)
@pytest.mark.parametrize("softcap", [None, 3.0], ids=["nocap", "cap"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32-flash", "fp64-math"])
def test_block_matches_dense(
    causal: bool, tq: int, tk: int, offset: int, window: int | None, softcap: float | None, dtype: torch.dtype
) -> None:
    """Blocks of a ring: any Tq/Tk, an offset, queries that see no key (out 0, lse -inf, no gradient)."""
    q, k, v, grad = make(tq, tk, dv=24, dtype=dtype)
    mask = dict(window=window, softcap=softcap, offset=offset)
    fwd = ref.block_attention_fwd(q, k, v, SCALE, causal, **mask)
    bwd = ref.block_attention_bwd(grad, q, k, v, *fwd, SCALE, causal, **mask)
    want = dense(q, k, v, grad, allowed_pairs(tq, tk, causal, window, offset), softcap)
    check(fwd, bwd, want, 1e-5)
    empty = ~allowed_pairs(tq, tk, causal, window, offset).any(-1)
    assert not fwd[0][:, :, empty].any() and not bwd[0][:, :, empty].any()


def test_block_backward_with_merged_lse_matches_dense() -> None:
    """Ring use with a window: queries at positions 40..89 against two key blocks (positions 0..39 and
    40..89), merged by lse; each block's backward, given the merged out/lse, is exact on its own."""
    q, k, v, grad = make(50, 90, dv=24)
    window = 45
    blocks = [(slice(0, 40), 40), (slice(40, 90), 0)]  # (keys, first query position - first key position)
    fwds = [
        ref.block_attention_fwd(q, k[:, :, keys], v[:, :, keys], SCALE, True, window=window, offset=offset)
        for keys, offset in blocks
    ]
    lse = torch.logaddexp(fwds[0][1], fwds[1][1])
    out = sum(o * (part - lse).exp().unsqueeze(-1) for o, part in fwds)
    want_out, want_lse, want_dq, want_dk, want_dv = dense(q, k, v, grad, allowed_pairs(50, 90, True, window, 40))
    assert err(out, want_out) <= 1e-5 and err(lse, want_lse) <= 1e-5
    dq = torch.zeros_like(q)
    for keys, offset in blocks:
        got = ref.block_attention_bwd(
            grad, q, k[:, :, keys], v[:, :, keys], out, lse, SCALE, True, window=window, offset=offset
        )
        dq += got[0]
        assert err(got[1], want_dk[:, :, keys]) <= 1e-5 and err(got[2], want_dv[:, :, keys]) <= 1e-5
    assert err(dq, want_dq) <= 1e-5


def test_math_tiles_match_dense(monkeypatch: pytest.MonkeyPatch) -> None:
    """The unfused path (soft-cap) split into several query tiles by the scores budget."""
    monkeypatch.setattr(ref, "_TILE_ELEMENTS", 4 * 40 * 60)  # 4 heads x 40 rows x 60 keys
    q, k, v, grad = make(150, 150, dv=24, dtype=torch.float64)
    rows = [t[0] for t in ref._tiles(q, k, v, ref.AttentionMask(window=20), 3.0)]
    assert len(rows) > 3
    fwd = ref.causal_attention_fwd(q, k, v, SCALE, window=20, softcap=3.0)
    bwd = ref.causal_attention_bwd(grad, q, k, v, *fwd, SCALE, window=20, softcap=3.0)
    check(fwd, bwd, dense(q, k, v, grad, allowed_pairs(150, 150, window=20), 3.0), 1e-6)  # lse is fp32


@pytest.mark.parametrize("softcap", [None, 2.0], ids=["fused", "math"])
def test_window_computes_only_the_window(monkeypatch: pytest.MonkeyPatch, softcap: float | None) -> None:
    """Forward and backward hand the kernels only the keys each query tile's window reaches: O(T * w) pairs."""
    areas = []

    def spy(impl, q_arg: int):
        def run(*args):
            areas.append(args[q_arg].shape[2] * args[q_arg + 1].shape[2])  # queries x keys of the call
            return impl(*args)

        return run

    monkeypatch.setattr(ref, "_block_fwd", spy(ref._block_fwd, 0))
    monkeypatch.setattr(ref, "_block_bwd", spy(ref._block_bwd, 1))
    t, window = 2048, 32
    q, k, v, grad = make(t, t, hq=2, hkv=1, dv=8)
    fwd = ref.causal_attention_fwd(q, k, v, SCALE, window=window, softcap=softcap)
    ref.causal_attention_bwd(grad, q, k, v, *fwd, SCALE, window=window, softcap=softcap)
    tile = ref._TILE_ROWS
    assert len(areas) == 2 * t // tile
    assert sum(areas) <= 2 * t * (tile + window) < t * t // 4
    i0 = t - 40  # spot check: the last queries against a dense run over their window
    want = dense(
        q[:, :, i0:],
        k[:, :, i0 - window :],
        v[:, :, i0 - window :],
        grad[:, :, i0:],
        allowed_pairs(40, 40 + window, window=window, offset=window),
        softcap,
    )
    assert err(fwd[0][:, :, i0:], want[0]) <= 1e-5 and err(fwd[1][:, :, i0:], want[1]) <= 1e-5


def test_bf16_window_matches_dense() -> None:
    q, k, v, grad = make(200, 200, dv=24, dtype=torch.bfloat16)
    fwd = ref.causal_attention_fwd(q, k, v, SCALE, window=9)
    bwd = ref.causal_attention_bwd(grad, q, k, v, *fwd, SCALE, window=9)
    assert fwd[0].dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in bwd)
    check(fwd, bwd, dense(q, k, v, grad, allowed_pairs(200, 200, window=9)), 2e-2)


@pytest.mark.parametrize("window,softcap", [(None, None), (9, None), (None, 2.0)], ids=["plain", "window", "cap"])
def test_model_layout_with_other_v_head_dim(window: int | None, softcap: float | None) -> None:
    """Transposed [B, T, H, D] views: out [B, Hq, T, Dv] and the gradients keep the inputs' dimension order."""
    q, k, v, grad = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in make(200, 200, dv=24))
    out, lse = ref.causal_attention_fwd(q, k, v, SCALE, window=window, softcap=softcap)
    dq, dk, dv = ref.causal_attention_bwd(grad, q, k, v, out, lse, SCALE, window=window, softcap=softcap)
    assert out.shape == (1, 4, 200, 24) and out.stride() == (200 * 4 * 24, 24, 4 * 24, 1)
    assert (dq.stride(), dk.stride(), dv.stride()) == (q.stride(), k.stride(), v.stride())


# --- errors -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"window": 0}, "window must be a positive"),
        ({"softcap": 0.0}, "softcap must be a positive"),
        ({"softcap": float("inf")}, "softcap must be a positive"),
        ({"offset": -1}, "offset .* must be >= 0"),
    ],
)
def test_bad_mask_arguments_raise(kwargs: dict, match: str) -> None:
    q, k, v, _ = make(8, 8)
    with pytest.raises(ValueError, match=match):
        ref.block_attention_fwd(q, k, v, SCALE, True, **kwargs)


def test_shape_check_takes_other_v_head_dim_only() -> None:
    q, k, v, _ = make(8, 8, dv=24)
    ref.check_attention_shapes(q, k, v)
    with pytest.raises(ValueError, match="k and v with the same B, Hkv and T"):
        ref.check_attention_shapes(q, k, v[:, :, :7])
    with pytest.raises(ValueError, match="q and k with the same B and head dim"):
        ref.check_attention_shapes(q, k[..., :8], v)
    with pytest.raises(ValueError, match="same T"):
        ref.check_attention_shapes(q[:, :, :7], k, v)
    ref.check_attention_shapes(q[:, :, :7], k, v, same_length=False)
