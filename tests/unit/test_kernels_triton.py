"""Triton kernels against the torch references, on CPU in Triton's interpreter (fp32 and fp16).

Triton picks GPU or interpreter when a function is decorated, from TRITON_INTERPRET, and its own
helpers are decorated when triton is first imported, which torch does early; so the variable must be
set when the process starts (`kernels.triton_mode`). The kernel tests therefore run in a child pytest
started with TRITON_INTERPRET=1 (`test_kernels_in_interpreter_process`); in a process without it they
are skipped, and the variable never leaks into other test modules.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

import bytescale_compile as bsc
from bytescale_compile.kernels import attention_ref as ref
from bytescale_compile.kernels import attention_triton as attn_triton
from bytescale_compile.kernels import cross_entropy_triton as ce_triton
from bytescale_compile.kernels import dispatch
from bytescale_compile.kernels.cross_entropy_ref import linear_cross_entropy_token_chunks
from bytescale_compile.models.llama import tiny
from bytescale_compile.passes.report import CompileReport
from bytescale_compile.runtime.context import micro_batch
from bytescale_compile.runtime.layout import zigzag_layout
from bytescale_compile.runtime.ring_attention import packed_ring_attention
from tests.helpers import loss_and_grads, protocol_batch, rel_err

IN_INTERPRETER = attn_triton.INTERPRETED and ce_triton.INTERPRETED
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD_TIMEOUT_S = 600

DTYPES = [torch.float32, torch.float16]
ATTENTION_DTYPES = [torch.float32, pytest.param(torch.float16, marks=pytest.mark.slow)]
"""The interpreter runs an attention kernel in seconds: by default fp16 is checked on the loss kernels, and on
attention with --runslow."""
TOL = {torch.float32: 2e-5, torch.float16: 5e-3}
LSE_TOL = {torch.float32: 1e-5, torch.float16: 1e-4}  # the fp16 CPU flash reference rounds scores differently

needs_interpreter = pytest.mark.skipif(
    not IN_INTERPRETER, reason="runs in the TRITON_INTERPRET=1 child process of test_kernels_in_interpreter_process"
)


INTERPRETED_ELSEWHERE = [str(Path(__file__).with_name("test_kernels_cross_entropy_ref.py"))]
"""Other files whose Triton tests run in the same interpreter child (one Triton import, one process start)."""


@pytest.mark.skipif(IN_INTERPRETER, reason="this process already runs the kernel tests in the interpreter")
def test_kernels_in_interpreter_process():
    """Run this module (and `INTERPRETED_ELSEWHERE`) in a fresh pytest with TRITON_INTERPRET=1; all their tests
    but this one must pass."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop(dispatch.ENV_VAR, None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, *INTERPRETED_ELSEWHERE],
        check=False,
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-8000:]
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|skipped|failed|error)", output)}
    assert counts.get("passed", 0) > 50, output[-8000:]  # the kernel tests ran, not skipped


@pytest.fixture
def use_triton(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")


@pytest.fixture
def triton_loads(monkeypatch) -> list[str]:
    """The Triton kernel modules dispatch ran, one entry per call that chose Triton (none for the references)."""
    loads: list[str] = []
    load = dispatch._kernels

    def recording(name, device):
        loads.append(name)
        return load(name, device)

    monkeypatch.setattr(dispatch, "_kernels", recording)
    return loads


def _close(got, want, tol, what=""):
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape, want.shape)
    assert not got.isnan().any(), what
    err = rel_err(got, want)
    assert err <= tol, (what, err)


# --- cross-entropy --------------------------------------------------------------------------------


def _torch_ce(logits, target, ignore_index, reduction, z_loss_weight, scale=1.0, softcap=None):
    """Per-row loss and d(reduced loss)/d(logits), by autograd on an fp32 copy; the loss is that of
    softcap * tanh(scale * logits / softcap) (scale * logits without a cap)."""
    z = logits.float().requires_grad_()
    x = scale * z if softcap is None else softcap * torch.tanh(scale * z / softcap)
    valid = target != ignore_index
    lse = x.logsumexp(dim=1)
    picked = x.gather(1, torch.where(valid, target, 0)[:, None])[:, 0]
    rows = torch.where(valid, lse - picked + z_loss_weight * lse**2, 0.0)
    mean = 1 / valid.sum().clamp(min=1) if reduction == "mean" else 1.0
    (rows.sum() * mean).backward()
    return rows.detach(), z.grad.to(logits.dtype)


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("z_loss_weight", [0.0, 1e-2])
@pytest.mark.parametrize("vocab", [300, 8192 + 77], ids=["one_block", "several_blocks"])
def test_cross_entropy_kernel_matches_torch(dtype, reduction, z_loss_weight, vocab):
    g = torch.Generator().manual_seed(0)
    rows = 9 if vocab < 1000 else 3
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    target = torch.randint(0, vocab, (rows,), generator=g)
    target[1] = -100
    want_loss, want_grad = _torch_ce(logits, target, -100, reduction, z_loss_weight)
    n_valid = int((target != -100).sum())
    weight = torch.tensor([1.0 / n_valid if reduction == "mean" else 1.0])
    work = logits.clone()
    loss = ce_triton.cross_entropy_grad_(work, target, -100, weight, z_loss_weight)
    _close(loss, want_loss, 1e-5, "loss")
    _close(work, want_grad, TOL[dtype], "grad")
    assert loss[1] == 0 and not work[1].any()


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("scale", "softcap"), [(0.25, None), (1.0, 30.0), (0.7, 0.5), (-2.0, 3.0)])
@pytest.mark.parametrize("vocab", [300, 8192 + 77], ids=["one_block", "several_blocks"])
def test_cross_entropy_kernel_scale_and_softcap_match_torch(dtype, scale, softcap, vocab):
    """Granite/Cohere scale, Gemma2's cap of 30, a cap the logits saturate, a negative scale under a cap."""
    g = torch.Generator().manual_seed(3)
    rows = 7 if vocab < 1000 else 2
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
    target = torch.randint(0, vocab, (rows,), generator=g)
    target[0] = -100
    want_loss, want_grad = _torch_ce(logits, target, -100, "sum", 1e-2, scale, softcap)
    work = logits.clone()
    loss = ce_triton.cross_entropy_grad_(work, target, -100, torch.ones(1), 1e-2, scale, softcap)
    _close(loss, want_loss, 1e-5, "loss")
    _close(work, want_grad, TOL[dtype], "grad")
    assert loss[0] == 0 and not work[0].any()


@needs_interpreter
def test_cross_entropy_kernel_all_ignored_rows_are_zero():
    logits = torch.randn(4, 50) * 100
    work = logits.clone()
    loss = ce_triton.cross_entropy_grad_(work, torch.full((4,), -1), -1, torch.ones(1), 0.1)
    assert not loss.any() and not work.any() and not work.isnan().any()


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize(("with_bias", "chunk"), [(False, 5), (True, 8), (True, 21)])
@pytest.mark.parametrize(("scale", "softcap"), [(1.0, None), (0.25, None), (0.7, 2.0)])
def test_linear_cross_entropy_matches_reference(dtype, reduction, with_bias, chunk, scale, softcap):
    """5 chunks of 5 tokens (the last of 1), 3 of 8, or one of all 21, with the cap holding `chunk` rows of logits
    in the inputs' dtype (the Triton kernel's only [chunk, V] buffer)."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(21, 16, generator=g).to(dtype)
    weight = (torch.randn(70, 16, generator=g) * 0.5).to(dtype)
    bias = torch.randn(70, generator=g).to(dtype) if with_bias else None
    target = torch.randint(0, 70, (21,), generator=g)
    target[::4] = -100
    args = (hidden, weight, bias, target, -100, reduction, True, chunk * 70 * dtype.itemsize, scale, softcap)
    got = ce_triton.linear_cross_entropy_token_chunks_triton(*args)
    want = linear_cross_entropy_token_chunks(*args)
    for name, a, b in zip(("loss", "grad_hidden", "grad_weight", "grad_bias"), got, want):
        if b is None:
            assert a is None
        else:
            _close(a, b, 1e-5 if name == "loss" else TOL[dtype], name)


@needs_interpreter
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_linear_cross_entropy_all_ignored(reduction):
    """Like the reference (and eager): sum gives 0, mean gives nan; gradients are zero either way."""
    hidden, weight = torch.randn(5, 8), torch.randn(30, 8)
    target = torch.full((5,), -100)
    loss, gh, gw, _ = ce_triton.linear_cross_entropy_token_chunks_triton(
        hidden, weight, None, target, -100, reduction, True, 2 * 30 * 4
    )
    assert loss.isnan() if reduction == "mean" else loss == 0
    assert not gh.any() and not gw.any() and not gh.isnan().any()


@needs_interpreter
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_linear_cross_entropy_fp32_grad_weight_of_fp16_inputs(reduction):
    """grad_dtype=torch.float32: grad_weight and grad_bias in fp32 from fp16 matmuls, over 3 chunks, equal to the
    reference's and within fp16 rounding of the fp32 formula."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(19, 16, generator=g)
    weight = torch.randn(60, 16, generator=g) * 0.5
    bias = torch.randn(60, generator=g)
    target = torch.randint(0, 60, (19,), generator=g)
    target[::5] = -100
    half = [x.half() for x in (hidden, weight, bias)]
    args = (*half, target, -100, reduction, True, 8 * 60 * 2)
    got = ce_triton.linear_cross_entropy_token_chunks_triton(*args, grad_dtype=torch.float32)
    want = linear_cross_entropy_token_chunks(*args, grad_dtype=torch.float32)
    assert [x.dtype for x in got] == [torch.float32, torch.float16, torch.float32, torch.float32]
    for name, a, b in zip(("loss", "grad_hidden", "grad_weight", "grad_bias"), got, want):
        _close(a, b, 1e-5 if name == "loss" else TOL[torch.float16], name)
    exact = [x.float().requires_grad_() for x in half]
    F.cross_entropy(F.linear(*exact), target, reduction=reduction).backward()
    _close(got[2], exact[1].grad, TOL[torch.float16], "grad_weight against fp32")


@needs_interpreter
def test_linear_cross_entropy_z_loss_matches_torch():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(13, 16, generator=g).requires_grad_()
    weight = (torch.randn(40, 16, generator=g) * 0.5).requires_grad_()
    target = torch.randint(0, 40, (13,), generator=g)
    target[3] = -100
    logits = F.linear(hidden, weight)
    valid = target != -100
    lse = logits.logsumexp(dim=1)
    want = F.cross_entropy(logits, target, reduction="mean") + 1e-3 * (lse[valid] ** 2).mean()
    want.backward()
    loss, gh, gw, _ = ce_triton.linear_cross_entropy_token_chunks_triton(
        hidden.detach(), weight.detach(), None, target, -100, "mean", True, 5 * 40 * 4, z_loss_weight=1e-3
    )
    _close(loss, want.detach(), 1e-6, "loss")
    _close(gh, hidden.grad, 1e-5, "grad_hidden")
    _close(gw, weight.grad, 1e-5, "grad_weight")


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_cross_entropy_softcap_matches_formula(dtype, use_triton, triton_loads):
    """The op through dispatch, against the dense formula on fp32 copies: loss, grad of h, W and b."""
    from bytescale_compile.ops.loss import fused_linear_cross_entropy

    g = torch.Generator().manual_seed(4)
    leaves = [
        x.to(dtype).requires_grad_()
        for x in (
            torch.randn(1, 11, 16, generator=g),
            torch.randn(50, 16, generator=g) * 0.5,
            torch.randn(50, generator=g),
        )
    ]
    target = torch.randint(0, 50, (1, 11), generator=g)
    target[0, 2] = -100
    loss = fused_linear_cross_entropy(
        *leaves[:2], target, leaves[2], reduction="mean", max_workspace_bytes=4 * 50 * 4, scale=0.6, softcap=2.5
    )
    loss.backward()
    assert triton_loads == ["cross_entropy_triton"]
    exact = [x.detach().float().requires_grad_() for x in leaves]
    logits = 2.5 * torch.tanh(0.6 * F.linear(*exact) / 2.5)
    want = F.cross_entropy(logits.view(-1, 50), target.view(-1))
    want.backward()
    _close(loss, want.detach(), 1e-6 if dtype == torch.float32 else TOL[dtype], "loss")  # fp16 rounds z
    for name, got, want_leaf in zip(("grad_hidden", "grad_weight", "grad_bias"), leaves, exact):
        _close(got.grad, want_leaf.grad.to(dtype), TOL[dtype], name)


# --- attention ------------------------------------------------------------------------------------


def _qkv(dtype, t_q, t_k, hq=4, hkv=2, d=24, batch=1, seed=0, tokens_first=False, dv=None):
    """q/k/v (v's head dim `dv`, default d); `tokens_first` gives the transposed [B, T, H, D] views models pass."""
    g = torch.Generator().manual_seed(seed)

    def make(h, t, width):
        if tokens_first:
            return torch.randn(batch, t, h, width, generator=g).to(dtype).transpose(1, 2)
        return torch.randn(batch, h, t, width, generator=g).to(dtype)

    return make(hq, t_q, d), make(hkv, t_k, d), make(hkv, t_k, dv or d)


def _same_layout(a, b) -> bool:
    """Equal strides where they matter: a dimension of size 1 may have any stride."""
    return [s for s, n in zip(a.stride(), a.shape) if n > 1] == [s for s, n in zip(b.stride(), b.shape) if n > 1]


def _check_attention(got_fwd, want_fwd, got_bwd, want_bwd, dtype):
    (out, lse), (want_out, want_lse) = got_fwd, want_fwd
    _close(out, want_out, TOL[dtype], "out")
    assert _same_layout(out, want_out), (out.stride(), want_out.stride())
    _close(lse, want_lse, LSE_TOL[dtype], "lse")
    assert lse.is_contiguous()
    for name, a, b in zip(("dq", "dk", "dv"), got_bwd, want_bwd):
        _close(a, b, TOL[dtype], name)
        assert _same_layout(a, b), (name, a.stride(), b.stride())


@needs_interpreter
@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
@pytest.mark.parametrize("cu", [[0, 1, 18, 19, 20, 45], [0, 45], [0, 7, 7, 45]], ids=["ragged", "one", "empty_segment"])
@pytest.mark.parametrize("hkv", [1, 2, 4])
def test_segment_causal_attention_matches_reference(dtype, cu, hkv, use_triton, triton_loads):
    q, k, v = _qkv(dtype, 45, 45, hkv=hkv, tokens_first=True)
    scale = 24**-0.5
    got = dispatch.segment_causal_attention_fwd(q, k, v, torch.tensor(cu), scale)
    want = ref.segment_causal_attention_fwd(q, k, v, cu, scale)
    grad = torch.randn_like(want[0])
    got_bwd = dispatch.segment_causal_attention_bwd(grad, q, k, v, *got, cu, scale)
    want_bwd = ref.segment_causal_attention_bwd(grad, q, k, v, *want, cu, scale)
    _check_attention(got, want, got_bwd, want_bwd, dtype)
    assert triton_loads == ["attention_triton"] * 2  # the forward and the backward


@needs_interpreter
@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
@pytest.mark.parametrize(
    "causal,t_q,t_k", [(True, 40, 40), (False, 23, 50), (False, 50, 17), (True, 20, 37), (True, 37, 20)]
)
def test_block_attention_matches_reference(dtype, causal, t_q, t_k, use_triton):
    q, k, v = _qkv(dtype, t_q, t_k, hq=6, hkv=2, d=16, seed=1)
    got = dispatch.block_attention_fwd(q, k, v, 0.3, causal)
    want = ref.math_causal_attention_fwd(q, k, v, 0.3, causal)
    grad = torch.randn_like(want[0])
    got_bwd = dispatch.block_attention_bwd(grad, q, k, v, *want, 0.3, causal)
    want_bwd = ref.math_attention_bwd_from_lse(grad, q, k, v, *want, 0.3, causal)
    _check_attention(got, want, got_bwd, want_bwd, dtype)


@needs_interpreter
def test_block_backward_with_merged_lse_matches_reference(use_triton):
    """Ring use: an off-diagonal and a diagonal block merged by lse; each block's backward is exact alone."""
    q, k, v = _qkv(torch.float32, 20, 36, seed=2)
    blocks = ((slice(0, 16), False), (slice(16, 36), True))
    parts = [ref.math_causal_attention_fwd(q, k[:, :, keys], v[:, :, keys], 0.2, causal) for keys, causal in blocks]
    lse = torch.logaddexp(parts[0][1], parts[1][1])
    out = sum(o * (l - lse).exp().unsqueeze(-1) for o, l in parts)
    grad = torch.randn_like(out)
    for keys, causal in blocks:
        got = dispatch.block_attention_bwd(grad, q, k[:, :, keys], v[:, :, keys], out, lse, 0.2, causal)
        want = ref.math_attention_bwd_from_lse(grad, q, k[:, :, keys], v[:, :, keys], out, lse, 0.2, causal)
        for name, a, b in zip(("dq", "dk", "dv"), got, want):
            _close(a, b, 2e-5, name)


@needs_interpreter
@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
def test_causal_attention_batch_rows_match_reference(dtype, use_triton):
    q, k, v = _qkv(dtype, 33, 33, batch=2, d=32, tokens_first=True, seed=3)
    got = dispatch.causal_attention_fwd(q, k, v, 0.2)
    want = ref.causal_attention_fwd(q, k, v, 0.2)
    grad = torch.randn_like(want[0])
    _check_attention(
        got,
        want,
        dispatch.causal_attention_bwd(grad, q, k, v, *got, 0.2),
        ref.causal_attention_bwd(grad, q, k, v, *want, 0.2),
        dtype,
    )


@needs_interpreter
@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
@pytest.mark.parametrize("window,softcap", [(5, None), (None, 2.0), (5, 2.0)], ids=["window", "softcap", "both"])
def test_segment_window_softcap_other_v_dim_match_reference(dtype, window, softcap, use_triton):
    """Sliding window and soft-cap within packed sequences, GQA, Dv = 8 != D = 16, the model's layout."""
    cu = [0, 3, 21, 37]
    q, k, v = _qkv(dtype, 37, 37, hq=2, hkv=1, d=16, dv=8, tokens_first=True, seed=5)
    q = q * 3  # scores well into tanh's curve
    opts = {"window": window, "softcap": softcap}
    got = dispatch.segment_causal_attention_fwd(q, k, v, torch.tensor(cu), 0.3, **opts)
    want = ref.segment_causal_attention_fwd(q, k, v, cu, 0.3, **opts)
    grad = torch.randn_like(want[0])
    got_bwd = dispatch.segment_causal_attention_bwd(grad, q, k, v, *got, cu, 0.3, **opts)
    want_bwd = ref.segment_causal_attention_bwd(grad, q, k, v, *want, cu, 0.3, **opts)
    _check_attention(got, want, got_bwd, want_bwd, dtype)
    assert got[0].shape == (1, 2, 37, 8)


@needs_interpreter
@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
@pytest.mark.parametrize(
    "causal,t_q,t_k,offset,window",
    [(True, 40, 20, 5, 8), (False, 23, 40, 30, 40)],
    ids=["causal-empty-rows", "full-window"],
)
def test_block_offset_window_matches_reference(dtype, causal, t_q, t_k, offset, window, use_triton):
    """A ring block with an offset and a window, incl. queries that see no key (out 0, lse -inf, no gradient)."""
    q, k, v = _qkv(dtype, t_q, t_k, hq=2, hkv=1, d=16, dv=24, seed=6)
    opts = {"window": window, "softcap": 3.0, "offset": offset}
    got = dispatch.block_attention_fwd(q, k, v, 0.3, causal, **opts)
    want = ref.math_causal_attention_fwd(q, k, v, 0.3, causal, **opts)
    grad = torch.randn_like(want[0])
    got_bwd = dispatch.block_attention_bwd(grad, q, k, v, *want, 0.3, causal, **opts)
    want_bwd = ref.math_attention_bwd_from_lse(grad, q, k, v, *want, 0.3, causal, **opts)
    assert torch.equal(got[1].isinf(), want[1].isinf())
    finite = ~want[1].isinf()
    _check_attention(
        (got[0], got[1].where(finite, 0.0)), (want[0], want[1].where(finite, 0.0)), got_bwd, want_bwd, dtype
    )
    assert (~finite).any() == causal


@needs_interpreter
def test_kernels_never_read_blocks_outside_the_window(use_triton):
    """NaN where no query's window reaches: the forward and dq never load those key blocks, and dk/dv
    never load those query blocks, so every output the poison cannot legitimately reach stays exact."""
    t, window = 64, 4  # 16-wide tiles: forward query blocks of 32, key blocks of 16
    q, k, v = _qkv(torch.float32, t, t, hq=2, hkv=1, d=16, seed=7)
    grad = torch.randn(1, 2, t, 16)
    want = ref.causal_attention_fwd(q, k, v, 0.3, window=window)
    want_bwd = ref.causal_attention_bwd(grad, q, k, v, *want, 0.3, window=window)
    v_bad = v.clone()
    v_bad[:, :, :16] = float("nan")  # keys 0..15: seen by queries 0..18 only
    q_bad, grad_bad = q.clone(), grad.clone()
    q_bad[:, :, 48:] = float("nan")  # queries 48..63: see keys 45..63 only
    grad_bad[:, :, 48:] = float("nan")
    out, lse = dispatch.causal_attention_fwd(q, k, v_bad, 0.3, window=window)
    _close(out[:, :, 32:], want[0][:, :, 32:], 2e-5, "out")
    dq, _, _ = dispatch.causal_attention_bwd(grad, q, k, v_bad, *want, 0.3, window=window)
    _close(dq[:, :, 32:], want_bwd[0][:, :, 32:], 2e-5, "dq")
    _, dk, dv = dispatch.causal_attention_bwd(grad_bad, q_bad, k, v, *want, 0.3, window=window)
    _close(dk[:, :, :32], want_bwd[1][:, :, :32], 2e-5, "dk")
    _close(dv[:, :, :32], want_bwd[2][:, :, :32], 2e-5, "dv")


@needs_interpreter
@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
@pytest.mark.parametrize(
    ("cu", "window", "softcap"),
    [([0, 1, 67, 100], None, 2.0), ([0, 80, 81, 100], 37, None), ([0, 100], 40, 3.0)],
    ids=["causal-softcap", "window", "window-softcap"],
)
def test_segments_with_interior_blocks_match_reference(dtype, cu, window, softcap, use_triton):
    """Segments long enough for unmasked interior tiles between masked boundary ones (16-wide tiles),
    next to a lone token and a segment that is no multiple of the tile; GQA, Dv = 8 != D = 16."""
    q, k, v = _qkv(dtype, 100, 100, hq=4, hkv=2, d=16, dv=8, tokens_first=True, seed=8)
    opts = {"window": window, "softcap": softcap}
    got = dispatch.segment_causal_attention_fwd(q, k, v, torch.tensor(cu), 0.3, **opts)
    want = ref.segment_causal_attention_fwd(q, k, v, cu, 0.3, **opts)
    grad = torch.randn_like(want[0])
    got_bwd = dispatch.segment_causal_attention_bwd(grad, q, k, v, *got, cu, 0.3, **opts)
    want_bwd = ref.segment_causal_attention_bwd(grad, q, k, v, *want, cu, 0.3, **opts)
    _check_attention(got, want, got_bwd, want_bwd, dtype)


@needs_interpreter
@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
@pytest.mark.parametrize(
    ("causal", "t_q", "t_k", "offset", "window"),
    [(True, 48, 70, 22, None), (True, 64, 64, 64, 50), (False, 40, 70, 0, None)],
    ids=["causal-offset", "causal-offset-window", "full"],
)
def test_ring_blocks_with_interior_tiles_match_reference(dtype, causal, t_q, t_k, offset, window, use_triton):
    """Ring blocks (offset, window, causal or not) large enough for interior tiles, backward from the
    lse; with the window, the last queries see no key (lse -inf)."""
    q, k, v = _qkv(dtype, t_q, t_k, hq=4, hkv=1, d=16, dv=24, seed=9)
    opts = {"window": window, "offset": offset}
    got = dispatch.block_attention_fwd(q, k, v, 0.3, causal, **opts)
    want = ref.math_causal_attention_fwd(q, k, v, 0.3, causal, **opts)
    grad = torch.randn_like(want[0])
    got_bwd = dispatch.block_attention_bwd(grad, q, k, v, *want, 0.3, causal, **opts)
    want_bwd = ref.math_attention_bwd_from_lse(grad, q, k, v, *want, 0.3, causal, **opts)
    finite = ~want[1].isinf()
    assert torch.equal(got[1].isinf(), ~finite) and (~finite).any() == (window is not None)
    _check_attention(
        (got[0], got[1].where(finite, 0.0)), (want[0], want[1].where(finite, 0.0)), got_bwd, want_bwd, dtype
    )


@triton.jit
def _split_probe(
    OUT, start, q_len, k_len, offset, window, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, FWD: tl.constexpr
):
    """Store the kernels' cut (lo, mid_lo, mid_hi, end) of the blocks one program walks: the forward's
    key blocks of query block `start` (32 x 16 tiles), or the backward's query blocks of key block `start`
    (16 x 16)."""
    if FWD:
        lo, hi = attn_triton._key_range(start, k_len, offset, window, 32, 16, CAUSAL, WINDOW)
        first, last = attn_triton._interior_keys(start, k_len, offset, window, 32, 16, CAUSAL, WINDOW)
    else:
        lo, hi = attn_triton._query_range(start, q_len, offset, window, 16, CAUSAL, WINDOW)
        first, last = attn_triton._interior_queries(start, q_len, k_len, offset, window, 16, 16, CAUSAL, WINDOW)
    mid_lo, mid_hi, end = attn_triton._split(lo, hi, first, last, 16)
    tl.store(OUT, lo)
    tl.store(OUT + 1, mid_lo)
    tl.store(OUT + 2, mid_hi)
    tl.store(OUT + 3, end)


def _sees_all(mask, rows: range, cols: range, q_len: int | None, k_len: int) -> bool:
    """Whether every query of `rows` sees every key of `cols`, both within the segment (rows unbounded
    when q_len is None: the forward never stores rows past the segment)."""
    if cols.stop > k_len or (q_len is not None and rows.stop > q_len):
        return False
    return bool(mask.visible(rows.stop, cols.stop)[rows.start :, cols.start :].all())


@needs_interpreter
@pytest.mark.parametrize("fwd", [True, False], ids=["forward", "backward"])
def test_interior_blocks_are_exactly_the_fully_visible_ones(fwd):
    """A block goes to the unmasked loop exactly when all its (query, key) pairs are visible and in the
    segment (one wrongly unmasked would read past the segment or the mask, one wrongly masked costs
    time), and the three loops together walk every block that holds a visible pair."""
    out = torch.zeros(4, dtype=torch.int32)
    block, step = (32, 16) if fwd else (16, 16)
    cases = itertools.product([17, 70], [1, 70], [0, 5, 40], [None, 9, 33], [True, False])
    for q_len, k_len, offset, window, causal in cases:
        mask = ref.AttentionMask(causal, window, offset)
        visible = mask.visible(q_len, k_len)
        for start in range(0, q_len if fwd else k_len, block):
            _split_probe[(1,)](out, start, q_len, k_len, offset, window or 0, causal, window is not None, fwd)
            lo, mid_lo, mid_hi, end = out.tolist()
            what = (q_len, k_len, offset, window, causal, start, (lo, mid_lo, mid_hi, end))
            assert lo <= mid_lo <= mid_hi <= end and (end - lo) % step == 0, what
            walked = range(lo, end, step)
            if fwd:
                interior = [
                    _sees_all(mask, range(start, start + block), range(n, n + step), None, k_len) for n in walked
                ]
                seen = visible[start : start + block].any(0).nonzero().flatten().tolist()
            else:
                interior = [
                    _sees_all(mask, range(m, m + step), range(start, start + block), q_len, k_len) for m in walked
                ]
                seen = visible[:, start : start + block].any(1).nonzero().flatten().tolist()
            assert interior == [mid_lo <= x < mid_hi for x in walked], what
            assert not seen or lo <= seen[0] and seen[-1] < end, what


@needs_interpreter
def test_ring_of_one_rank_runs_triton_blocks(monkeypatch, triton_loads):
    """ring_attention goes through dispatch: packed ring attention (diagonal and full blocks) on Triton = reference."""
    layout = zigzag_layout([9, 1, 14], 1)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(24, h, 16, generator=g) for h in (4, 2, 2))
    grad = torch.randn(24, 4, 16, generator=g)
    results = {}
    for impl in ("reference", "triton"):
        monkeypatch.setenv(dispatch.ENV_VAR, impl)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = packed_ring_attention(*leaves, layout, [0])
        out.backward(grad)
        results[impl] = (out.detach(), *(x.grad for x in leaves))
        assert bool(triton_loads) == (impl == "triton")
    for name, a, b in zip(("out", "dq", "dk", "dv"), results["triton"], results["reference"]):
        _close(a, b, 2e-5, name)


# --- GPU launch geometry, checked on the CPU -------------------------------------------------------


@triton.jit
def _origin_probe(CU_Q, CU_K, SEGS, STARTS, OUT, stride_b, stride_h, stride_t):
    """Each program stores the element offset of its tile's first query row, computed as the kernels do."""
    b, h, start, q_start, q_len, k_start, k_len = attn_triton._program(CU_Q, CU_K, SEGS, STARTS)
    tl.store(OUT + h, attn_triton._origin(b, h, q_start + start, stride_b, stride_h, stride_t))


@needs_interpreter
def test_tile_origins_are_int64_past_2_to_the_31():
    """A 590K-token row of 32 heads of 128 ([1, 32, T, 128] contiguous): the last query block's offsets
    pass 2^31. The interpreter cannot allocate that tensor, so the kernels' own `_program` and `_origin`
    run on a one-block table and store the offsets they would add to the base pointer; the interpreter
    computes in the kernels' integer widths (int32 wraps), so an int32 origin would come out wrong."""
    tokens, heads, dim, block = 590_000, 32, 128, 128
    cu = torch.tensor([0, 3, tokens], dtype=torch.int32)
    segs, starts = (
        torch.tensor([1], dtype=torch.int32),
        torch.tensor([(tokens - 3) // block * block], dtype=torch.int32),
    )
    out = torch.zeros(heads, dtype=torch.int64)
    strides = (heads * tokens * dim, tokens * dim, dim)
    _origin_probe[(1, heads, 1)](cu, cu, segs, starts, out, *strides)
    row = 3 + int(starts[0])
    want = torch.tensor([h * strides[1] + row * strides[2] for h in range(heads)])
    assert int(want[-1]) > 2**31 and torch.equal(out, want)


def test_segment_table_launches_only_the_blocks_that_exist():
    """One 16K sequence plus 1,000 of 16 tokens: the flat (segment, block) grid has one program per
    block, not one per (segment, longest segment's blocks); the blocks with the most causal work come
    first (the latest query blocks of the forward, the earliest key blocks of the backward)."""
    lengths = [16_384] + [16] * 1000
    bounds = tuple(torch.tensor([0] + lengths).cumsum(0).tolist())
    cfg = attn_triton.TileConfig(128, 64, 64, 128, 128, 128, "tf32")
    table = attn_triton.segment_table(bounds, bounds, cfg, torch.device("cpu"))
    assert table.q_fwd[0].numel() == table.k_bwd[0].numel() == 16_384 // 128 + 1000
    for (segs, starts), block in ((table.q_fwd, 128), (table.k_bwd, 128)):
        pairs = set(zip(segs.tolist(), starts.tolist()))
        want = {(s, start) for s, n in enumerate(lengths) for start in range(0, n, block)}
        assert pairs == want and len(pairs) == segs.numel()
        assert segs.dtype == starts.dtype == torch.int32
    assert table.q_fwd[1].tolist() == sorted(table.q_fwd[1].tolist(), reverse=True)
    assert table.k_bwd[1].tolist() == sorted(table.k_bwd[1].tolist())
    assert torch.equal(table.cu_q, torch.tensor(bounds, dtype=torch.int32))


@needs_interpreter
def test_segment_table_is_built_once_per_packing(use_triton):
    """Forward and backward of every layer under one packing share one device copy of the boundaries."""
    attn_triton.segment_table.cache_clear()
    q, k, v = _qkv(torch.float32, 24, 24, tokens_first=True)
    cu = torch.tensor([0, 5, 24])
    for _ in range(2):  # two layers
        out, lse = dispatch.segment_causal_attention_fwd(q, k, v, cu, 0.3)
        dispatch.segment_causal_attention_bwd(torch.ones_like(out), q, k, v, out, lse, cu, 0.3)
    info = attn_triton.segment_table.cache_info()
    assert (info.misses, info.hits) == (1, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("head_dim", "v_dim"), [(64, 64), (128, 128), (192, 128), (256, 256)])
def test_tile_config_fits_h100_shared_memory(dtype, head_dim, v_dim):
    cfg = attn_triton.tile_config(head_dim, v_dim, dtype, attn_triton.H100_SHARED_MEMORY_BYTES)
    assert cfg.shared_memory_bytes(dtype.itemsize) <= attn_triton.H100_SHARED_MEMORY_BYTES
    assert cfg.block_d >= head_dim and cfg.block_dv >= v_dim
    if head_dim + v_dim > 256:
        assert cfg.bwd_block_n <= 32  # the dK/dV accumulators stay in registers


def test_tile_config_shrinks_tiles_for_wide_fp32_heads():
    wide = attn_triton.tile_config(256, 256, torch.float32, attn_triton.H100_SHARED_MEMORY_BYTES)
    narrow = attn_triton.tile_config(64, 64, torch.bfloat16, attn_triton.H100_SHARED_MEMORY_BYTES)
    assert (narrow.block_m, narrow.block_n) == (128, 64) and wide.block_m * wide.block_n < 128 * 64
    with pytest.raises(ValueError, match="shared memory"):
        attn_triton.tile_config(256, 256, torch.float32, 16 * 1024)


def test_fp32_dots_follow_torchs_matmul_precision():
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert attn_triton.tile_config(64, 64, torch.float32, 2**20).precision == "tf32"
        torch.set_float32_matmul_precision("highest")
        assert attn_triton.tile_config(64, 64, torch.float32, 2**20).precision == "ieee"
    finally:
        torch.set_float32_matmul_precision(before)


# --- dispatch -------------------------------------------------------------------------------------


def test_dispatch_defaults_to_reference_on_cpu(monkeypatch, triton_loads):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    assert dispatch.choose(torch.device("cpu")) == "reference"
    q, k, v = _qkv(torch.float32, 8, 8)
    dispatch.causal_attention_fwd(q, k, v, 0.5)
    assert triton_loads == []
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    assert dispatch.choose(torch.device("cpu")) == "triton"


def test_dispatch_errors_are_actionable(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="BYTESCALE_KERNELS must be one of"):
        dispatch.choose(torch.device("cpu"))
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    monkeypatch.setattr(attn_triton, "INTERPRETED", False)
    q, k, v = _qkv(torch.float32, 8, 8)
    with pytest.raises(dispatch.KernelUnavailableError, match="TRITON_INTERPRET=1"):
        dispatch.block_attention_fwd(q, k, v, 0.5, True)


def test_report_names_the_kernels_chosen_at_compile_time(monkeypatch):
    """The report carries what dispatch chose for the example inputs' device when each graph compiled: the
    choice under which it was compiled stays, whatever later calls choose."""
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    torch.manual_seed(0)
    optimized = bsc.optimize(tiny())
    report = bsc.explain(optimized, **protocol_batch([13, 1, 10], vocab=128))
    assert report.kernels == {"bytescale::attention": "reference", "bytescale::fused_linear_cross_entropy": "reference"}
    assert report.graphs[0].kernels == report.kernels and report.to_dict()["kernels"] == report.kernels
    assert "`bytescale::attention` reference" in report.to_markdown()
    assert CompileReport().kernels == {}
    assert (
        bsc.explain(bsc.optimize(tiny(), attention=False, fused_loss=False), **protocol_batch([4], vocab=128)).kernels
        == {}
    )


# --- the compiled example model -------------------------------------------------------------------


@needs_interpreter
def test_compiled_llama_on_triton_matches_reference(monkeypatch, triton_loads):
    """tiny() optimized: loss and every gradient with the Triton kernels = with the references."""
    torch.manual_seed(0)
    opt = bsc.optimize(tiny())
    batch = protocol_batch([13, 1, 10], vocab=128, seed=5)
    results = {}
    for impl in ("reference", "triton"):
        monkeypatch.setenv(dispatch.ENV_VAR, impl)
        plain = loss_and_grads(opt, batch)
        with micro_batch(cu_seqlens=[0, 13, 14, 24]):
            packed = loss_and_grads(opt, batch)
        results[impl] = (plain, packed)
        loaded, triton_loads[:] = set(triton_loads), []
        assert loaded == ({"attention_triton", "cross_entropy_triton"} if impl == "triton" else set())
    assert set(opt.report.kernels.values()) == {"reference"}  # compiled on the first call
    for (loss, grads), (want_loss, want_grads) in zip(results["triton"], results["reference"]):
        assert rel_err(loss, want_loss) <= 1e-5
        assert grads.keys() == want_grads.keys()
        worst = max(grads, key=lambda n: rel_err(grads[n], want_grads[n]))
        assert rel_err(grads[worst], want_grads[worst]) <= 1e-5, worst
