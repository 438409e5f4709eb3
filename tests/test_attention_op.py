"""`bytescale::attention` against SDPA, explicit math and per-sequence runs; opcheck; torch.compile."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import bytescale_compile.ops.attention  # noqa: F401  (registers torch.ops.bytescale.*)
from bytescale_compile.kernels.attention_ref import (
    cpu_flash_causal_attention_bwd,
    cpu_flash_causal_attention_fwd,
    math_causal_attention_bwd,
    math_causal_attention_fwd,
)
from bytescale_compile.runtime.context import ContextError, micro_batch
from tests.conftest import rel_err

attention = torch.ops.bytescale.attention
attention_backward = torch.ops.bytescale.attention_backward

D = 8
SCALE = 0.37  # not 1/sqrt(D), so a dropped or defaulted scale shows
HEADS = pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2)], ids=["mha", "gqa"])


def make_qkv(
    b: int, hq: int, hkv: int, t: int, dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, t, D, generator=gen, dtype=dtype).requires_grad_()
    k = torch.randn(b, hkv, t, D, generator=gen, dtype=dtype).requires_grad_()
    v = torch.randn(b, hkv, t, D, generator=gen, dtype=dtype).requires_grad_()
    return q, k, v


def grads_of(fn, q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor) -> tuple[Tensor, ...]:
    """(out, dq, dk, dv) of out = fn(q, k, v) under upstream gradient grad_out."""
    out = fn(q, k, v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out)
    return out.detach(), dq, dk, dv


def sdpa(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE, enable_gqa=True)


def op_out(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return attention(q, k, v, SCALE)[0]


def masked_scores(q: Tensor, k: Tensor, allowed: Tensor) -> Tensor:
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return (q @ k.transpose(-1, -2) * SCALE).masked_fill(~allowed, float("-inf"))


def segment_mask(cu: list[int]) -> Tensor:
    """allowed[i, j]: key j is at or before query i in the same packed sequence."""
    seq_id = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu).diff())
    t = cu[-1]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    return causal & (seq_id[:, None] == seq_id[None, :])


# --- opcheck ---------------------------------------------------------------------------------------


@HEADS
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_opcheck(hq: int, hkv: int, packed: bool) -> None:
    cu = [0, 5, 6, 13] if packed else None
    q, k, v = make_qkv(1 if packed else 2, hq, hkv, 13)
    with micro_batch(cu_seqlens=cu):
        torch.library.opcheck(attention.default, (q, k, v, SCALE))
        out, lse = (t.detach() for t in attention(q, k, v, SCALE))
        bwd_args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, SCALE)
        torch.library.opcheck(attention_backward.default, bwd_args)


def transposed_layout(x: Tensor) -> Tensor:
    """The same values in the layout models produce: a [B, T, H, D] tensor viewed as [B, H, T, D]."""
    return x.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(x.requires_grad)


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32-flash", "fp64-math"])
def test_opcheck_model_layout(packed: bool, dtype: torch.dtype) -> None:
    """Transposed q/k/v/grad_out: outputs keep the inputs' layout, as the fake kernels promise."""
    cu = [0, 4, 9] if packed else None
    q, k, v = (transposed_layout(x) for x in make_qkv(1 if packed else 2, 4, 2, 9, dtype))
    with micro_batch(cu_seqlens=cu):
        torch.library.opcheck(attention.default, (q, k, v, SCALE))
        out, lse = (t.detach() for t in attention(q, k, v, SCALE))
        grad_out = transposed_layout(torch.randn_like(out))
        bwd_args = (grad_out, q.detach(), k.detach(), v.detach(), out, lse, SCALE)
        torch.library.opcheck(attention_backward.default, bwd_args)
        dq, dk, dv = attention_backward(*bwd_args)
    assert out.stride() == q.stride() and lse.is_contiguous()
    assert (dq.stride(), dk.stride(), dv.stride()) == (q.stride(), k.stride(), v.stride())


# --- against SDPA and explicit math ---------------------------------------------------------------


@HEADS
@pytest.mark.parametrize("t", [1, 7, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32-flash", "fp64-math"])
def test_matches_sdpa(hq: int, hkv: int, t: int, dtype: torch.dtype) -> None:
    q, k, v = make_qkv(2, hq, hkv, t, dtype)
    grad_out = torch.randn(2, hq, t, D, dtype=dtype)
    for got, want in zip(grads_of(op_out, q, k, v, grad_out), grads_of(sdpa, q, k, v, grad_out)):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert rel_err(got, want) <= 1e-5


def test_non_contiguous_grad_out() -> None:
    q, k, v = make_qkv(2, 4, 2, 9)
    grad_out = torch.randn(2, 9, 4, D).transpose(1, 2)
    for got, want in zip(grads_of(op_out, q, k, v, grad_out), grads_of(sdpa, q, k, v, grad_out)):
        assert rel_err(got, want) <= 1e-5


@HEADS
def test_lse_is_logsumexp_of_masked_scores(hq: int, hkv: int) -> None:
    q, k, v = make_qkv(2, hq, hkv, 11)
    _, lse = attention(q, k, v, SCALE)
    assert lse.dtype == torch.float32 and lse.shape == (2, hq, 11)
    causal = torch.ones(11, 11, dtype=torch.bool).tril()
    want = torch.logsumexp(masked_scores(q.detach(), k.detach(), causal), dim=-1)
    assert rel_err(lse, want) <= 1e-5


def test_lse_packed_is_per_sequence() -> None:
    cu = [0, 5, 6, 13]
    q, k, v = make_qkv(1, 4, 2, 13)
    with micro_batch(cu_seqlens=cu):
        _, lse = attention(q, k, v, SCALE)
    want = torch.logsumexp(masked_scores(q.detach(), k.detach(), segment_mask(cu)), dim=-1)
    assert rel_err(lse, want) <= 1e-5


def test_lse_gradient_is_ignored() -> None:
    q, k, v = make_qkv(2, 4, 2, 7)
    out, lse = attention(q, k, v, SCALE)
    (out.sum() + 1000.0 * lse.sum()).backward()
    want = grads_of(sdpa, q, k, v, torch.ones(2, 4, 7, D))
    assert rel_err(q.grad, want[1]) <= 1e-5


# --- packed (segment-causal) ----------------------------------------------------------------------


@HEADS
@pytest.mark.parametrize("cu", [[0, 5, 6, 13], [0, 0, 5, 5, 6, 13, 13]], ids=["three", "with-empty"])
def test_packed_matches_separate_sequences(hq: int, hkv: int, cu: list[int]) -> None:
    q, k, v = make_qkv(1, hq, hkv, 13)
    grad_out = torch.randn(1, hq, 13, D)
    with micro_batch(cu_seqlens=cu):
        got = grads_of(op_out, q, k, v, grad_out)

    def separate(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        pieces = [sdpa(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e]) for s, e in zip(cu[:-1], cu[1:]) if e > s]
        return torch.cat(pieces, dim=2)

    want = grads_of(separate, q, k, v, grad_out)
    for g, w in zip(got, want):
        assert rel_err(g, w) <= 1e-5
    plain = grads_of(op_out, q, k, v, grad_out)[0]
    assert rel_err(plain, got[0]) > 1e-2  # the packing really changed the answer


# --- the two kernels --------------------------------------------------------------------------------


@HEADS
@pytest.mark.parametrize(
    "dtype,tol,lse_tol", [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 2e-2, 1e-4)], ids=["fp32", "bf16"]
)
def test_cpu_flash_matches_math(hq: int, hkv: int, dtype: torch.dtype, tol: float, lse_tol: float) -> None:
    q, k, v = (x.detach() for x in make_qkv(2, hq, hkv, 17, dtype))
    grad_out = torch.randn(2, hq, 17, D, dtype=dtype)
    out, lse = cpu_flash_causal_attention_fwd(q, k, v, SCALE)
    ref_out, ref_lse = math_causal_attention_fwd(q, k, v, SCALE)
    assert lse.dtype == ref_lse.dtype == torch.float32 and lse.is_contiguous()
    assert out.dtype == ref_out.dtype == dtype
    assert rel_err(out.float(), ref_out.float()) <= tol
    assert rel_err(lse, ref_lse) <= lse_tol
    got = cpu_flash_causal_attention_bwd(grad_out, q, k, v, out, lse, SCALE)
    want = math_causal_attention_bwd(grad_out, q, k, v, SCALE)
    for g, w, x in zip(got, want, (q, k, v)):
        assert g.shape == w.shape == x.shape and g.dtype == w.dtype == dtype
        assert rel_err(g.float(), w.float()) <= tol


# --- errors -----------------------------------------------------------------------------------------


def test_cu_seqlens_not_covering_row_raises() -> None:
    q, k, v = make_qkv(1, 4, 2, 13)
    with micro_batch(cu_seqlens=[0, 5, 12]), pytest.raises(ContextError, match="12"):
        attention(q, k, v, SCALE)


def test_backward_checks_its_own_context() -> None:
    q, k, v = make_qkv(1, 4, 2, 13)
    with micro_batch(cu_seqlens=[0, 5, 13]):
        out, _ = attention(q, k, v, SCALE)
    with micro_batch(cu_seqlens=[0, 5, 12]), pytest.raises(ContextError):
        out.sum().backward()


def test_packed_with_batch_rows_raises() -> None:
    q, k, v = make_qkv(2, 4, 2, 13)
    with micro_batch(cu_seqlens=[0, 5, 13]), pytest.raises(ContextError, match="single row"):
        attention(q, k, v, SCALE)


@pytest.mark.parametrize(
    "k_shape,match",
    [((2, 3, 7, D), "multiple"), ((2, 2, 6, D), "same B, T"), ((2, 2, 7), "4-D")],
)
def test_bad_shapes_raise(k_shape: tuple[int, ...], match: str) -> None:
    q = torch.randn(2, 4, 7, D)
    k = torch.randn(k_shape)
    with pytest.raises(ValueError, match=match):
        attention(q, k, k, SCALE)


# --- torch.compile --------------------------------------------------------------------------------


def test_compiled_matches_eager_and_reads_context_at_run_time() -> None:
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    def loss(q: Tensor, k: Tensor, v: Tensor, w: Tensor) -> Tensor:
        return (attention(q, k, v, SCALE)[0] * w).sum()

    compiled = torch.compile(loss, backend=counter, dynamic=True)
    cases = [(13, [0, 5, 6, 13]), (13, None), (11, [0, 4, 11]), (13, [0, 13])]
    for t, cu in cases:
        q, k, v = make_qkv(1, 4, 2, t, seed=t)
        w = torch.randn(1, 4, t, D)
        results = []
        for fn in (compiled, loss):
            with micro_batch(cu_seqlens=cu):
                val = fn(q, k, v, w)
                results.append((val.detach(), *torch.autograd.grad(val, (q, k, v))))
        for got, want in zip(*results):
            assert rel_err(got, want) <= 1e-6, (t, cu)
    # One graph for every length and packing (Dynamo may also hand the backend an empty graph
    # when it restarts analysis to specialize the float scale; that one holds no attention).
    assert sum("bytescale.attention" in g.code for g in counter.graphs) == 1
