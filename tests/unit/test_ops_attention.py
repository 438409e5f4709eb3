"""`bytescale::attention` against SDPA, explicit math and per-sequence runs; opcheck; torch.compile.

Sliding windows are checked against SDPA with an explicit boolean mask, the soft-cap against the formula
written out here, and a V head dim other than D against SDPA (which takes it).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import bytescale_compile as bsc
import bytescale_compile.ops.attention  # noqa: F401  (registers torch.ops.bytescale.*)
from bytescale_compile.kernels.attention_ref import (
    cpu_flash_causal_attention_bwd,
    cpu_flash_causal_attention_fwd,
    math_causal_attention_bwd,
    math_causal_attention_fwd,
)
from bytescale_compile.models.llama import tiny
from bytescale_compile.runtime.context import ContextError, micro_batch
from tests.helpers import loss_and_grads, protocol_batch, rel_err

attention = torch.ops.bytescale.attention
attention_backward = torch.ops.bytescale.attention_backward

D = 8
SCALE = 0.37  # not 1/sqrt(D), so a dropped or defaulted scale shows
HEADS = pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2)], ids=["mha", "gqa"])


def make_qkv(
    b: int, hq: int, hkv: int, t: int, dtype: torch.dtype = torch.float32, seed: int = 0, dv: int = D
) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, t, D, generator=gen, dtype=dtype).requires_grad_()
    k = torch.randn(b, hkv, t, D, generator=gen, dtype=dtype).requires_grad_()
    v = torch.randn(b, hkv, t, dv, generator=gen, dtype=dtype).requires_grad_()
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
        assert rel_err(got, want, floor=1.0) <= 1e-5  # one token: dq is 0 in exact arithmetic


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
    [
        ((2, 3, 7, D), "multiple"),
        ((2, 2, 6, D), "same T"),
        ((2, 2, 7, D + 1), "same B and head dim"),
        ((2, 2, 7), "4-D"),
    ],
)
def test_bad_shapes_raise(k_shape: tuple[int, ...], match: str) -> None:
    q = torch.randn(2, 4, 7, D)
    k = torch.randn(k_shape)
    with pytest.raises(ValueError, match=match):
        attention(q, k, k, SCALE)


# --- sliding window, soft-cap, V head dim ----------------------------------------------------------

OPTIONS = pytest.mark.parametrize(
    "window,softcap,dv",
    [(3, None, D), (None, 2.5, D), (3, 2.5, 12), (None, None, 12)],
    ids=["window", "softcap", "both-dv12", "dv12"],
)


def window_mask(t: int, window: int | None, cu: list[int] | None = None) -> Tensor:
    """SDPA's boolean attn_mask: key j at or before query i, fewer than `window` back, same packed sequence."""
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    allowed = (j <= i) & (i - j < (window or t))
    return allowed & segment_mask(cu) if cu else allowed


def masked_sdpa(allowed: Tensor):
    def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=SCALE, enable_gqa=True)

    return run


def softcapped(allowed: Tensor, softcap: float):
    """Gemma2's eager attention: scores / cap, tanh, * cap, then the mask and softmax."""

    def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        rep = q.shape[1] // k.shape[1]
        scores = q @ k.repeat_interleave(rep, 1).transpose(-1, -2) * SCALE
        scores = torch.tanh(scores / softcap) * softcap
        return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v.repeat_interleave(rep, 1)

    return run


@OPTIONS
@pytest.mark.parametrize("packing", ["rows", "packed", "position_ids"])
def test_opcheck_options(window: int | None, softcap: float | None, dv: int, packing: str) -> None:
    q, k, v = make_qkv(1 if packing == "packed" else 2, 4, 2, 13, dv=dv)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 7]]) if packing == "position_ids" else None
    with micro_batch(cu_seqlens=[0, 5, 6, 13] if packing == "packed" else None):
        torch.library.opcheck(attention.default, (q, k, v, SCALE, position_ids, window, softcap))
        out, lse = (t.detach() for t in attention(q, k, v, SCALE, position_ids, window, softcap))
        assert out.shape == (q.shape[0], 4, 13, dv)
        bwd_args = (
            torch.randn_like(out),
            q.detach(),
            k.detach(),
            v.detach(),
            out,
            lse,
            SCALE,
            position_ids,
            window,
            softcap,
        )
        torch.library.opcheck(attention_backward.default, bwd_args)


@HEADS
@pytest.mark.parametrize("window", [1, 4, 16, 40])
@pytest.mark.parametrize("dv", [D, 12])
def test_window_matches_sdpa_with_mask(hq: int, hkv: int, window: int, dv: int) -> None:
    q, k, v = make_qkv(2, hq, hkv, 16, dv=dv)
    grad_out = torch.randn(2, hq, 16, dv)
    got = grads_of(lambda *x: attention(*x, SCALE, window=window)[0], q, k, v, grad_out)
    want = grads_of(masked_sdpa(window_mask(16, window)), q, k, v, grad_out)
    for g, w in zip(got, want):
        assert g.shape == w.shape and rel_err(g, w, floor=1.0) <= 1e-5  # a window of one: dq is 0
    if window < 16:
        assert rel_err(got[0], grads_of(sdpa, q, k, v, grad_out)[0]) > 1e-2  # the window really changed the answer


@pytest.mark.parametrize("window", [None, 5])
def test_softcap_matches_formula(window: int | None) -> None:
    q, k, v = make_qkv(2, 4, 2, 11, dtype=torch.float64, dv=6)
    q.data *= 4  # scores well into tanh's curve
    grad_out = torch.randn(2, 4, 11, 6, dtype=torch.float64)
    got = grads_of(lambda *x: attention(*x, SCALE, window=window, softcap=2.0)[0], q, k, v, grad_out)
    want = grads_of(softcapped(window_mask(11, window), 2.0), q, k, v, grad_out)
    for g, w in zip(got, want):
        assert rel_err(g, w) <= 1e-6  # lse is float32 by contract, and the backward reads it
    uncapped = grads_of(lambda *x: attention(*x, SCALE, window=window)[0], q, k, v, grad_out)[0]
    assert rel_err(uncapped, got[0]) > 1e-2


@pytest.mark.parametrize("source", ["context", "position_ids"])
def test_packed_window_matches_separate_sequences(source: str) -> None:
    cu = [0, 5, 6, 13]
    q, k, v = make_qkv(1, 4, 2, 13, dv=12)
    grad_out = torch.randn(1, 4, 13, 12)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 0, 1, 2, 3, 4, 5, 6]]) if source == "position_ids" else None
    with micro_batch(cu_seqlens=cu if source == "context" else None):
        got = grads_of(lambda *x: attention(*x, SCALE, position_ids, 3, 2.5)[0], q, k, v, grad_out)
    want = grads_of(softcapped(window_mask(13, 3, cu), 2.5), q, k, v, grad_out)
    for g, w in zip(got, want):
        assert rel_err(g, w) <= 1e-5


@pytest.mark.parametrize(
    "window,softcap,match", [(0, None, "window must be a positive"), (None, -1.0, "softcap must be a positive")]
)
def test_bad_options_raise(window: int | None, softcap: float | None, match: str) -> None:
    q, k, v = make_qkv(1, 4, 2, 5)
    with pytest.raises(ValueError, match=match):
        attention(q, k, v, SCALE, None, window, softcap)


def test_v_with_other_length_raises() -> None:
    q, k, _ = make_qkv(1, 4, 2, 5)
    with pytest.raises(ValueError, match="k and v with the same B, Hkv and T"):
        attention(q, k, torch.randn(1, 2, 4, 12), SCALE)


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


def test_compiled_options_match_eager() -> None:
    """Window, soft-cap and Dv != D through torch.compile: the fake kernels' shapes hold, values match eager."""

    def loss(q: Tensor, k: Tensor, v: Tensor, w: Tensor) -> Tensor:
        return (attention(q, k, v, SCALE, None, 4, 2.5)[0] * w).sum()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    q, k, v = make_qkv(2, 4, 2, 13, dv=12)
    w = torch.randn(2, 4, 13, 12)
    results = []
    for fn in (compiled, loss):
        val = fn(q, k, v, w)
        results.append((val.detach(), *torch.autograd.grad(val, (q, k, v))))
    for got, want in zip(*results):
        assert rel_err(got, want) <= 1e-6


# --- autocast -------------------------------------------------------------------------------------


def test_autocast_runs_in_the_autocast_dtype():
    """Under CPU autocast mixed q/k/v dtypes (RoPE promotes q and k to fp32) run in bf16, like SDPA."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 4, 12, 16, generator=g).requires_grad_()
    k, v = (torch.randn(1, 2, 12, 16, generator=g).bfloat16().requires_grad_() for _ in range(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, lse = torch.ops.bytescale.attention(q, k, v, 0.25)
        want = F.scaled_dot_product_attention(
            q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True, scale=0.25
        )
    assert out.dtype == want.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert rel_err(out.float(), want.float()) <= 1e-2
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32 and k.grad.dtype == torch.bfloat16 and q.grad.isfinite().all()


def test_optimized_llama_under_cpu_autocast_is_close_to_fp32():
    """optimize() on our LLaMA under bf16 CPU autocast: finite loss and grads, close to the fp32 eager model."""
    torch.manual_seed(0)
    model = tiny()
    reference = copy.deepcopy(model)
    batch = protocol_batch([9, 7], vocab=128)
    ref_loss, ref_grads = loss_and_grads(reference, batch)
    optimized = bsc.optimize(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, grads = loss_and_grads(optimized, batch)
    assert loss.dtype == torch.float32 and loss.isfinite()
    assert abs(loss.item() - ref_loss.item()) <= 2e-2 * abs(ref_loss.item())
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert grad.dtype == torch.float32 and grad.isfinite().all(), name
        assert rel_err(grad, ref_grads[name]) <= 0.1, (name, rel_err(grad, ref_grads[name]))


def test_context_packing_never_reads_position_ids():
    """With the context's cu_seqlens the op does not copy position_ids to the host (meta tensors raise if it did)."""
    from bytescale_compile.ops.attention import _row_packing

    q = torch.empty(1, 2, 9, 8)
    with micro_batch(cu_seqlens=[0, 4, 9]):
        packing = _row_packing(q, torch.empty(1, 9, dtype=torch.long, device="meta"))
    assert [cu.tolist() for cu in packing] == [[0, 4, 9]]


def test_position_ids_are_read_to_the_host_once_while_unchanged(monkeypatch) -> None:
    """Every layer passes the same position_ids: one host read serves them all, until they change in place."""
    from bytescale_compile.ops import attention as op_module

    reads = []
    read = op_module.restarts
    monkeypatch.setattr(op_module, "restarts", lambda *args: reads.append(1) or read(*args))
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    first = [attention(q, k, v, SCALE, position_ids)[0] for _ in range(3)]
    assert len(reads) == 1 and all(torch.equal(out, first[0]) for out in first)
    position_ids[0, 4:] = torch.arange(4, 8)  # one sequence now: the cached boundaries must not be used
    whole = attention(q, k, v, SCALE, position_ids)[0]
    assert len(reads) == 2 and torch.equal(whole, attention(q, k, v, SCALE, None)[0])
    assert not torch.equal(whole, first[0])
