"""The attention backend table (`kernels.dispatch`) and torch's flash attention adapter (`kernels.attention_flash`).

On the CPU: each backend's predicate, one excluding condition at a time; the overrides (environment, `CompileConfig`,
the scope the op sets) and their errors; FlashAttention's mask convention, emulated in torch, against ours for
every mapping `flash_window` gives (and no mapping missed but the one documented case); the lse conventions;
and the whole torch-flash path (segments, ring blocks, GQA, batch rows) through the table with the aten ops
replaced by an emulation of FlashAttention's conventions, against the reference.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

import bytescale_compile as bsc
import bytescale_compile.ops  # noqa: F401  (registers bytescale::attention)
from bytescale_compile.config import ATTENTION_BACKEND_CHOICES, CompileConfig
from bytescale_compile.kernels import attention_flash as flash
from bytescale_compile.kernels import attention_ref as ref
from bytescale_compile.kernels import dispatch
from bytescale_compile.kernels.attention_flash import FlashWindow, flash_visible, flash_window
from bytescale_compile.kernels.attention_ref import AttentionMask
from bytescale_compile.models.llama import tiny
from bytescale_compile.runtime.layout import zigzag_layout
from bytescale_compile.runtime.ring_attention import packed_ring_attention
from tests.helpers import protocol_batch

CUDA = torch.device("cuda", 0)
CAUSAL = AttentionMask(True)


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)


@pytest.fixture
def gpu_like(monkeypatch):
    """Predicates as on an sm90 GPU with flash attention built and Triton importable (no tensor is touched)."""
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    monkeypatch.setattr(dispatch, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(dispatch, "_triton_importable", lambda: True)


def _call(
    device=CUDA,
    dtypes=(torch.bfloat16,) * 3,
    head_dim=128,
    v_dim=128,
    softcap=None,
    mask=CAUSAL,
    bounds_q=(0, 40, 100),
    bounds_k=None,
):
    return dispatch.AttentionCall(
        device, dtypes, head_dim, v_dim, softcap, mask, bounds_q, bounds_q if bounds_k is None else bounds_k
    )


# --- predicates -----------------------------------------------------------------------------------

PREDICATE_CASES = [
    # (backend, call, condition it fails on; None: it serves the call)
    ("torch-flash", _call(), None),
    ("torch-flash", _call(mask=AttentionMask(True, 7)), None),
    ("torch-flash", _call(mask=AttentionMask(False, 5, 6), bounds_q=(0, 4), bounds_k=(0, 6)), None),
    ("torch-flash", _call(device=torch.device("cpu")), "needs CUDA tensors, got cpu"),
    ("torch-flash", _call(dtypes=(torch.float32,) * 3), "one dtype among bfloat16/float16, got float32"),
    ("torch-flash", _call(dtypes=(torch.bfloat16, torch.float16, torch.bfloat16)), "one dtype"),
    ("torch-flash", _call(v_dim=64), "one head dim for q, k and v, got D=128 and Dv=64"),
    ("torch-flash", _call(head_dim=264, v_dim=264), "at most 256, got 264"),
    ("torch-flash", _call(head_dim=20, v_dim=20), "multiple of 8"),
    ("torch-flash", _call(softcap=30.0), "has no soft-cap"),
    ("torch-flash", _call(mask=AttentionMask(True, None, 2), bounds_q=(0, 10), bounds_k=(0, 20)), "above"),
    ("torch-flash", _call(mask=AttentionMask(False, 20, 10), bounds_q=(0, 19), bounds_k=(0, 3)), "one query more"),
    ("triton", _call(), None),
    ("triton", _call(dtypes=(torch.float32,) * 3, softcap=30.0, v_dim=64), None),
    ("triton", _call(device=torch.device("meta")), "runs on CUDA tensors"),
    ("triton", _call(device=torch.device("cpu")), "only when asked for by name"),
    ("triton", _call(dtypes=(torch.float64,) * 3), "one dtype among float32/bfloat16/float16, got float64"),
    ("triton", _call(head_dim=512, v_dim=512), "head dims up to 256"),
    ("reference", _call(device=torch.device("cpu"), dtypes=(torch.float64,) * 3, head_dim=512, softcap=1.0), None),
]


@pytest.mark.parametrize(("name", "call", "unmet"), PREDICATE_CASES)
def test_each_condition_excludes_its_backend(name, call, unmet, gpu_like):
    got = dispatch._BY_NAME[name].unmet(call, False)
    if unmet is None:
        assert got is None
    else:
        assert got is not None and unmet in got


def test_predicates_need_the_build_the_gpu_and_triton(monkeypatch, gpu_like):
    flash_backend, triton_backend = dispatch._BY_NAME["torch-flash"], dispatch._BY_NAME["triton"]
    monkeypatch.setattr(dispatch, "_capability", lambda device: (7, 5))
    assert "sm80 or newer GPU, got sm75" in flash_backend.unmet(_call(), False)
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: False)
    assert "no flash attention" in flash_backend.unmet(_call(), False)
    monkeypatch.setattr(dispatch, "_triton_importable", lambda: False)
    assert "Triton is not importable" in triton_backend.unmet(_call(), False)


def test_triton_on_cpu_when_asked_needs_the_interpreter(monkeypatch):
    from bytescale_compile.kernels import attention_triton

    monkeypatch.setattr(attention_triton, "INTERPRETED", False)
    assert "TRITON_INTERPRET=1" in dispatch._BY_NAME["triton"].unmet(_call(device=torch.device("cpu")), True)
    monkeypatch.setattr(attention_triton, "INTERPRETED", True)
    assert dispatch._BY_NAME["triton"].unmet(_call(device=torch.device("cpu")), True) is None


def test_auto_takes_the_first_backend_that_serves(gpu_like):
    assert dispatch.explain_attention(_call()) == dispatch.AttentionChoice("torch-flash")
    assert dispatch.explain_attention(_call(softcap=30.0)) == dispatch.AttentionChoice(
        "triton", (("torch-flash", "has no soft-cap"),)
    )
    choice = dispatch.explain_attention(_call(dtypes=(torch.float64,) * 3))
    assert choice.backend == "reference" and [name for name, _ in choice.passed_over] == ["torch-flash", "triton"]
    assert choice.describe().startswith("reference (torch-flash: needs q/k/v of one dtype")
    cpu = dispatch.explain_attention(_call(device=torch.device("cpu")))
    assert cpu.backend == "reference"  # the interpreter is never chosen on its own


def test_the_table_names_what_config_may_ask_for():
    assert tuple(b.name for b in dispatch.ATTENTION_BACKENDS) == ATTENTION_BACKEND_CHOICES[1:]
    assert ATTENTION_BACKEND_CHOICES[0] == "auto" and dispatch.KERNEL_CHOICES == ATTENTION_BACKEND_CHOICES


def test_a_call_of_several_segments_is_self_attention():
    with pytest.raises(ValueError, match="self-attention ones"):
        _call(mask=AttentionMask(True, None, 3))
    with pytest.raises(ValueError, match="self-attention ones"):
        _call(bounds_q=(0, 4, 9), bounds_k=(0, 5, 9))


# --- overrides ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ATTENTION_BACKEND_CHOICES[1:])
def test_environment_names_the_backend(monkeypatch, gpu_like, name):
    monkeypatch.setenv(dispatch.ENV_VAR, name.upper())
    assert dispatch.requested_attention_backend() == (name, f"{dispatch.ENV_VAR}={name}")
    assert dispatch.choose_attention(_call()).name == name


def test_torch_flash_in_the_environment_leaves_the_loss_on_auto(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "torch-flash")
    assert dispatch.choose(torch.device("cpu")) == "reference"


def test_bad_names_are_refused_with_the_choices(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "flash3")
    with pytest.raises(ValueError, match=r"BYTESCALE_KERNELS must be one of \('auto', 'torch-flash'.*got 'flash3'"):
        dispatch.requested_attention_backend()
    with pytest.raises(ValueError, match="CompileConfig.attention_backend must be one of .* got 'flash'"):
        CompileConfig(attention_backend="flash")
    with pytest.raises(ValueError, match="the scope must be one of"):
        with dispatch.attention_backend("fast", source="the scope"):
            pass
    assert CompileConfig().attention_backend == "auto"


def test_a_scope_wins_over_the_environment_and_nests(monkeypatch, gpu_like):
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    with dispatch.attention_backend("triton", source="CompileConfig.attention_backend"):
        assert dispatch.requested_attention_backend() == ("triton", "CompileConfig.attention_backend")
        with dispatch.attention_backend("auto"):  # auto leaves the outer choice alone
            assert dispatch.choose_attention(_call()).name == "triton"
        with dispatch.attention_backend("torch-flash"):
            assert dispatch.choose_attention(_call()).name == "torch-flash"
    assert dispatch.choose_attention(_call()).name == "reference"


def test_a_forced_backend_that_cannot_serve_raises_and_never_falls_back(monkeypatch, gpu_like):
    monkeypatch.setenv(dispatch.ENV_VAR, "torch-flash")
    with pytest.raises(dispatch.KernelUnavailableError, match=r"'torch-flash' was asked for .* has no soft-cap"):
        dispatch.choose_attention(_call(softcap=30.0))
    monkeypatch.delenv(dispatch.ENV_VAR)
    q = k = v = torch.randn(1, 2, 8, 16)
    with dispatch.attention_backend("torch-flash", source="CompileConfig.attention_backend"):
        with pytest.raises(
            dispatch.KernelUnavailableError, match=r"\(CompileConfig.attention_backend\) .* needs CUDA tensors, got cpu"
        ):
            dispatch.segment_causal_attention_fwd(q, k, v, [0, 3, 8], 0.25)
    out, _ = dispatch.segment_causal_attention_fwd(q, k, v, [0, 3, 8], 0.25)  # auto: the reference
    assert torch.equal(out, ref.segment_causal_attention_fwd(q, k, v, [0, 3, 8], 0.25)[0])


def test_the_op_runs_on_the_backend_it_is_given(monkeypatch):
    from bytescale_compile.kernels import attention_triton

    monkeypatch.setattr(attention_triton, "INTERPRETED", False)
    q = k = v = torch.randn(1, 2, 8, 16)
    with pytest.raises(
        dispatch.KernelUnavailableError, match=r"'triton' .*CompileConfig.attention_backend.*TRITON_INTERPRET"
    ):
        torch.ops.bytescale.attention(q, k, v, 0.25, backend="triton")
    out, lse = torch.ops.bytescale.attention(q, k, v, 0.25, backend="reference")
    want = ref.causal_attention_fwd(q, k, v, 0.25)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


def test_one_packed_row_is_returned_as_the_kernels_give_it(monkeypatch):
    """The op hands back the table's out/lse and gradients of a single packed row: no copy into a second buffer."""
    from bytescale_compile.ops import attention as op
    from bytescale_compile.runtime.context import micro_batch

    given = []

    def spy(fn):
        def call(*args, **kwargs):
            given.append(fn(*args, **kwargs))
            return given[-1]

        return call

    monkeypatch.setattr(op, "segment_causal_attention_fwd", spy(op.segment_causal_attention_fwd))
    monkeypatch.setattr(op, "segment_causal_attention_bwd", spy(op.segment_causal_attention_bwd))
    q, k, v = (x.requires_grad_() for x in _qkv(8, 8, seed=5))
    with micro_batch(cu_seqlens=[0, 3, 8]):
        out, lse = torch.ops.bytescale.attention(q, k, v, 0.25)
        grads = torch.ops.bytescale.attention_backward(torch.ones_like(out), q, k, v, out, lse, 0.25)
    assert [t.data_ptr() for t in (out, lse, *grads)] == [t.data_ptr() for t in (*given[0], *given[1])]
    assert torch.equal(out, ref.segment_causal_attention_fwd(q, k, v, [0, 3, 8], 0.25)[0])


def test_config_backend_reaches_the_graph_and_the_report():
    """`CompileConfig.attention_backend` is set on every attention op of the compiled graph and recorded; a backend
    that cannot serve the graph is refused when it compiles."""
    torch.manual_seed(0)
    batch = protocol_batch([13, 1, 10], vocab=128)
    report = bsc.explain(bsc.optimize(tiny(), attention_backend="reference"), **batch)
    assert report.kernels["bytescale::attention"] == "reference" and "bytescale::attention" not in report.kernel_notes
    assert "backend = 'reference'" in report.graphs[0].graph_after
    auto = bsc.explain(bsc.optimize(tiny()), **batch)
    assert "torch-flash: needs CUDA tensors" in auto.kernel_notes["bytescale::attention"]
    assert "`bytescale::attention` reference (torch-flash: needs CUDA" in auto.to_markdown()
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="'torch-flash' was asked for") as failed:
        bsc.explain(bsc.optimize(tiny(), attention_backend="torch-flash"), **batch)
    assert isinstance(failed.value.inner_exception, dispatch.KernelUnavailableError)


# --- the lse --------------------------------------------------------------------------------------


def test_lse_conventions_convert_both_ways():
    flash_lse = torch.tensor([[1.5, float("inf"), -2.0], [float("inf"), 0.0, 3.0]])
    ours = flash.lse_from_flash(flash_lse)
    assert ours is flash_lse  # in place: the forward's own output
    assert torch.equal(ours, torch.tensor([[1.5, float("-inf"), -2.0], [float("-inf"), 0.0, 3.0]]))
    merged = torch.tensor([[0.5, 9.0, float("-inf"), 9.0]] * 2)[:, ::2]  # a strided slice, as the ring's
    back = flash.lse_to_flash(merged)
    assert back.is_contiguous() and torch.isneginf(merged).any()  # the caller's lse is left alone
    assert torch.equal(back, torch.tensor([[0.5, float("inf")]] * 2))
    assert torch.equal(flash.lse_to_flash(torch.tensor([float("-inf"), 2.0])), torch.tensor([float("inf"), 2.0]))


# --- the mask -------------------------------------------------------------------------------------


def _agrees(window, mask, lengths):
    """FlashAttention's visible pairs (forward and backward argument handling) = ours on every segment."""
    max_q, max_k = max(q for q, _ in lengths), max(k for _, k in lengths)
    for len_q, len_k in lengths:
        want = mask.visible(len_q, len_k)
        for backward in (False, True):
            got = flash_visible(window, len_q, len_k, max_q=max_q, max_k=max_k, backward=backward)
            if not torch.equal(got, want):
                return False
    return True


BLOCKS = list(itertools.product(range(1, 9), range(1, 9), range(0, 12), (True, False), (None, 1, 2, 3, 5, 8, 11)))


def test_every_mapping_gives_our_mask():
    """Every (queries, keys, offset, causal, window) block with up to 8 x 8 tokens: where `flash_window` maps
    it, FlashAttention's convention shows exactly our pairs; and it never sends one query per segment with
    neither bound (FlashAttention's single-query GQA path lays the lse out per batch entry)."""
    mapped = 0
    for len_q, len_k, offset, causal, window in BLOCKS:
        mask = AttentionMask(causal, window, offset)
        got = flash_window(mask, [(len_q, len_k)])
        if isinstance(got, FlashWindow):
            mapped += 1
            assert _agrees(got, mask, [(len_q, len_k)]), (len_q, len_k, offset, causal, window, got)
            assert not (len_q == 1 and got.left < 0 and got.right < 0)
    assert mapped > len(BLOCKS) // 3


def _any_arguments(mask, len_q, len_k):
    """Brute force: some (is_causal, left, right) that shows exactly our pairs, or None."""
    for is_causal, left, right in itertools.product((True, False), range(-1, len_k + 2), range(-1, len_k + 2)):
        window = FlashWindow(is_causal, left, right)
        if _agrees(window, mask, [(len_q, len_k)]):
            return window
    return None


def test_no_mapping_is_missed_but_a_diagonal_at_the_key_count():
    """Brute force over FlashAttention's arguments on a sample of the blocks `flash_window` refuses: none
    expresses our mask, except a causal diagonal exactly `max_k` keys right of the bottom-right one, which
    FlashAttention's dropped-and-restored bound happens to place (left out on purpose: it rests on that quirk)."""
    refused = [b for b in BLOCKS if isinstance(flash_window(AttentionMask(*b[3:], b[2]), [b[:2]]), str)]
    for len_q, len_k, offset, causal, window in random.Random(0).sample(refused, 250):
        mask = AttentionMask(causal, window, offset)
        found = _any_arguments(mask, len_q, len_k)
        quirk = causal and offset - (len_k - len_q) == len_k
        assert found is None or quirk, (len_q, len_k, offset, causal, window, found)


def test_self_attention_segments_map_for_any_packing():
    rng = random.Random(1)
    for _ in range(200):
        lengths = [rng.choice([0, 1, 1, 2, 5, 9, 16]) for _ in range(rng.randint(1, 5))]
        window = rng.choice([None, 1, 2, 4, 7, 20])
        mask = AttentionMask(True, window)
        got = flash_window(mask)
        assert isinstance(got, FlashWindow) and got.right == 0  # never neither bound: no single-query GQA path
        segments = [(n, n) for n in lengths if n]
        if segments:
            assert _agrees(got, mask, segments), (lengths, window, got)
    assert isinstance(flash_window(AttentionMask(True, None, 2)), str)


def test_segments_of_one_call_must_share_the_shift():
    mask = AttentionMask(True, 4, 0)
    assert "different shifts" in flash_window(mask, [(3, 3), (2, 5)])
    same = flash_window(mask, [(3, 3), (5, 5), (1, 1)])
    assert isinstance(same, FlashWindow) and _agrees(same, mask, [(3, 3), (5, 5), (1, 1)])


@pytest.mark.parametrize("window", [None, 3, 8])
def test_ring_blocks_of_a_real_layout(window):
    """Every block the zigzag layout gives 4 ranks: mapped ones agree, and without a window all map (the
    diagonal is FlashAttention's plain causal, an earlier chunk its full attention)."""
    layout = zigzag_layout([37, 5, 64, 2], 4)
    for q_rank, kv_rank in itertools.product(range(4), repeat=2):
        for block in layout.blocks(q_rank, kv_rank, window):
            lengths = [(block.q_end - block.q_start, block.k_end - block.k_start)]
            mask = AttentionMask(block.causal, block.window, block.offset)
            got = flash_window(mask, lengths)
            assert window is not None or isinstance(got, FlashWindow), block
            if isinstance(got, FlashWindow):
                assert _agrees(got, mask, lengths), (block, got)


# --- torch-flash through the table, on an emulation of the aten ops ----------------------------------


def _segments(cu_q, cu_k):
    return [(slice(a, b), slice(c, d)) for a, b, c, d in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:])]


def _emulated_scores(q, k, scale, window, rows, keys, max_q, max_k):
    """FlashAttention's masked scores `[H, rows, keys]` of one segment, from its own arguments."""
    group = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q[rows].double(), k[keys].double().repeat_interleave(group, 1)) * scale
    visible = flash_visible(window, s.shape[1], s.shape[2], max_q=max_q, max_k=max_k)
    return s.masked_fill(~visible, float("-inf"))


def _fake_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, debug, *, scale, **windows):
    """What aten._flash_attention_forward returns, in FlashAttention's conventions: bottom-right masks from
    its arguments, lse [H, total_q] with +inf (and out 0) for a query that sees no key."""
    window = FlashWindow(is_causal, windows["window_size_left"], windows["window_size_right"])
    group = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), float("inf"))
    for rows, keys in _segments(cu_q.tolist(), cu_k.tolist()):
        s = _emulated_scores(q, k, scale, window, rows, keys, max_q, max_k)
        m = torch.logsumexp(s, -1)
        p = torch.exp(s - m.unsqueeze(-1)).nan_to_num(0.0)
        out[rows] = torch.einsum("hqk,khd->qhd", p, v[keys].double().repeat_interleave(group, 1)).to(q.dtype)
        lse[:, rows] = torch.where(torch.isneginf(m), float("inf"), m).float()
    return out, lse, torch.empty(0), torch.empty(0), torch.empty(0)


def _fake_backward(g, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, rng, unused, **kw):
    """aten._flash_attention_backward: P = exp(S - lse) from the lse it is given (so -inf there is NaN, as in
    FlashAttention), dk/dv summed over each kv group."""
    window = FlashWindow(is_causal, kw["window_size_left"], kw["window_size_right"])
    scale, group = kw["scale"], q.shape[1] // k.shape[1]
    dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float64) for x in (q, k, v))
    for rows, keys in _segments(cu_q.tolist(), cu_k.tolist()):
        p = torch.exp(_emulated_scores(q, k, scale, window, rows, keys, max_q, max_k) - lse[:, rows, None].double())
        go, o = g[rows].double(), out[rows].double()
        vv, kk = (x[keys].double().repeat_interleave(group, 1) for x in (v, k))
        dp = torch.einsum("qhd,khd->hqk", go, vv)
        ds = p * (dp - (go * o).sum(-1).T.unsqueeze(-1)) * scale
        dq[rows] = torch.einsum("hqk,khd->qhd", ds, kk)
        dk[keys] = torch.einsum("hqk,qhd->khd", ds, q[rows].double()).unflatten(1, (-1, group)).sum(2)
        dv[keys] = torch.einsum("hqk,qhd->khd", p, go).unflatten(1, (-1, group)).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@pytest.fixture
def emulated_flash(monkeypatch):
    """torch-flash on CPU tensors: its predicate without the device and build checks, the aten ops emulated;
    the adapter, the mask mapping, the lse conversions and the layouts run as they do on the GPU."""
    monkeypatch.setattr(flash, "FLASH_DTYPES", (torch.float32,))
    monkeypatch.setattr(flash, "_FORWARD", _fake_forward)
    monkeypatch.setattr(flash, "_BACKWARD", _fake_backward)
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    monkeypatch.setattr(dispatch, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    real = dispatch._torch_flash_unmet

    def on_cpu(call, forced):
        return real(dispatch.AttentionCall(CUDA, *[getattr(call, f) for f in _CALL_FIELDS[1:]]), forced)

    calls = []
    backend = dispatch.AttentionBackend(
        "torch-flash",
        on_cpu,
        lambda *a: calls.append(("fwd", a[0], a[1], a[4])) or dispatch._torch_flash_fwd(*a),
        lambda *a: calls.append(("bwd", a[1], a[2], a[7])) or dispatch._torch_flash_bwd(*a),
    )
    monkeypatch.setitem(dispatch._BY_NAME, "torch-flash", backend)
    monkeypatch.setenv(dispatch.ENV_VAR, "torch-flash")
    return calls


_CALL_FIELDS = ("device", "dtypes", "head_dim", "v_dim", "softcap", "mask", "bounds_q", "bounds_k")


def _qkv(tq, tk, hq=4, hkv=2, d=16, seed=0, tokens_first=True):
    g = torch.Generator().manual_seed(seed)

    def make(h, t):
        x = torch.randn(1, t, h, d, generator=g)
        return x.transpose(1, 2) if tokens_first else x.transpose(1, 2).contiguous()

    return make(hq, tq), make(hkv, tk), make(hkv, tk)


def _close(got, want, what):
    """Equal up to rounding, and laid out alike (the strides of size-1 dims aside)."""
    assert got.shape == want.shape, what
    assert [s for s, n in zip(got.stride(), got.shape) if n > 1] == [
        s for s, n in zip(want.stride(), want.shape) if n > 1
    ], what
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=what)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("cu", [[0, 1, 18, 18, 45], [0, 45]], ids=["ragged", "one"])
def test_segments_on_torch_flash_match_the_reference(emulated_flash, cu, window):
    """Packed segments (an empty one, a lone token), GQA 4:2, the model's [B, T, H, D]-ordered views: forward
    out/lse and dq/dk/dv from the adapter = the reference; k/v reach it with their 2 heads, q as a view."""
    q, k, v = _qkv(45, 45)
    got = dispatch.segment_causal_attention_fwd(q, k, v, torch.tensor(cu), 0.3, window=window)
    want = ref.segment_causal_attention_fwd(q, k, v, cu, 0.3, window=window)
    grad = torch.randn_like(want[0])
    got_bwd = dispatch.segment_causal_attention_bwd(grad, q, k, v, *got, cu, 0.3, window=window)
    want_bwd = ref.segment_causal_attention_bwd(grad, q, k, v, *want, cu, 0.3, window=window)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), (*got, *got_bwd), (*want, *want_bwd)):
        _close(a, b, name)
    (_, fq, fk, call), _ = emulated_flash
    assert fq.data_ptr() == q.data_ptr() and fq.shape == (45, 4, 16) and fk.shape == (45, 2, 16)
    assert call.bounds_q == tuple(sorted(set(cu)))  # the empty segment dropped


@pytest.mark.parametrize(
    ("causal", "t_q", "t_k", "offset", "window"),
    [(True, 20, 20, 0, None), (False, 23, 30, 40, None), (True, 20, 37, 17, 9), (False, 12, 11, 15, 20)],
    ids=["diagonal", "earlier", "offset-window", "window-edge-at-key-count"],
)
def test_ring_blocks_on_torch_flash_match_the_reference(emulated_flash, causal, t_q, t_k, offset, window):
    """One ring block each way FlashAttention is told its mask (plain causal, none, a shifted local window, a
    right edge it drops and puts back at the key count); the backward from the out and lse given."""
    q, k, v = _qkv(t_q, t_k, seed=2, tokens_first=False)
    opts = {"window": window, "offset": offset}
    got = dispatch.block_attention_fwd(q, k, v, 0.3, causal, **opts)
    want = ref.math_causal_attention_fwd(q, k, v, 0.3, causal, **opts)
    grad = torch.randn_like(want[0])
    got_bwd = dispatch.block_attention_bwd(grad, q, k, v, *want, 0.3, causal, **opts)
    want_bwd = ref.math_attention_bwd_from_lse(grad, q, k, v, *want, 0.3, causal, **opts)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), (*got, *got_bwd), (*want, *want_bwd)):
        _close(a, b, name)
    assert [kind for kind, *_ in emulated_flash] == ["fwd", "bwd"]


def test_ring_and_batch_rows_run_through_the_table(emulated_flash):
    """The packed ring of one rank (diagonal and earlier-chunk blocks) and unpacked batch rows take torch-flash."""
    layout = zigzag_layout([9, 1, 14], 1)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(24, h, 16, generator=g) for h in (4, 2, 2))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    packed_ring_attention(*leaves, layout, [0]).backward(torch.ones(24, 4, 16))
    assert {kind for kind, *_ in emulated_flash} == {"fwd", "bwd"}
    monkeypatched = list(emulated_flash)
    emulated_flash.clear()
    with dispatch.attention_backend("reference"):
        ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        packed_ring_attention(*ref_leaves, layout, [0]).backward(torch.ones(24, 4, 16))
    assert not emulated_flash and monkeypatched
    for name, a, b in zip(("dq", "dk", "dv"), (x.grad for x in leaves), (x.grad for x in ref_leaves)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
    qb, kb, vb = (torch.randn(3, h, 11, 16, generator=g) for h in (4, 2, 2))
    out, lse = dispatch.causal_attention_fwd(qb, kb, vb, 0.25)
    want = ref.causal_attention_fwd(qb, kb, vb, 0.25)
    _close(out, want[0], "out")
    _close(lse, want[1], "lse")
    assert [kind for kind, *_ in emulated_flash] == ["fwd"] * 3  # one call per row


# --- on a GPU: torch's FlashAttention-2 itself ---------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's flash attention runs on CUDA")
GPU_TOL = 2e-2
"""bf16 inputs: FlashAttention against the fp32 reference on the same (rounded) inputs."""


def _gpu_qkv(tq, tk, hq=32, hkv=8, d=128, seed=0):
    """bf16 q/k/v as the model passes them: `[1, H, T, D]` views of `[1, T, H, D]` tensors; GQA 32:8."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(
        torch.randn(1, t, h, d, generator=g, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        for h, t in ((hq, tq), (hkv, tk), (hkv, tk))
    )


def _check_gpu(got, want, what):
    from tests.helpers import rel_err

    for name, a, b in zip(what, got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert not a.isnan().any(), name
        finite = torch.isfinite(b)
        assert torch.equal(torch.isfinite(a), finite), name
        assert rel_err(a.float().where(finite, 0), b.float().where(finite, 0), floor=1.0) <= GPU_TOL, name


def _fp32(*xs):
    return tuple(x.float() for x in xs)


@needs_cuda
@pytest.mark.parametrize("window", [None, 1000])
def test_gpu_torch_flash_segments_match_the_reference(window):
    """A random packing of 16K tokens (a lone token, an empty segment, one long sequence): out, lse and
    dq/dk/dv from torch-flash (forced, so nothing falls back) against the reference on fp32 copies."""
    rng = random.Random(0)
    lengths = [1, 0, 9000] + [rng.randint(1, 700) for _ in range(30)]
    cu = [0, *itertools.accumulate(lengths)]
    q, k, v = _gpu_qkv(cu[-1], cu[-1])
    scale = q.shape[-1] ** -0.5
    with dispatch.attention_backend("torch-flash"):
        got = dispatch.segment_causal_attention_fwd(q, k, v, cu, scale, window=window)
        grad = torch.randn_like(got[0])
        got_bwd = dispatch.segment_causal_attention_bwd(grad, q, k, v, *got, cu, scale, window=window)
    want = ref.segment_causal_attention_fwd(*_fp32(q, k, v), cu, scale, window=window)
    want_bwd = ref.segment_causal_attention_bwd(*_fp32(grad, q, k, v, *want), cu, scale, window=window)
    _check_gpu(_fp32(*got), want, ("out", "lse"))
    _check_gpu(_fp32(*got_bwd), want_bwd, ("dq", "dk", "dv"))
    assert got[0].stride() == torch.empty_like(q).stride() and got_bwd[1].shape == k.shape  # GQA: 8 kv heads


@needs_cuda
@pytest.mark.parametrize(
    ("causal", "t_q", "t_k", "offset", "window"),
    [
        (True, 3000, 3000, 0, None),
        (False, 2000, 3100, 5000, None),
        (True, 2000, 3100, 1100, 900),
        (False, 701, 700, 800, 1000),
    ],
    ids=["diagonal", "earlier", "offset-window", "window-edge-at-key-count"],
)
def test_gpu_torch_flash_ring_blocks_match_the_reference(causal, t_q, t_k, offset, window):
    """Ring blocks each way FlashAttention is told its mask; the backward from a merged out and lse (the block's
    own here plus an earlier block's, as the ring merges them)."""
    q, k, v = _gpu_qkv(t_q, t_k, seed=1)
    k0, v0 = _gpu_qkv(t_q, 500, seed=2)[1:]
    scale, opts = q.shape[-1] ** -0.5, {"window": window, "offset": offset}
    with dispatch.attention_backend("torch-flash"):
        got = dispatch.block_attention_fwd(q, k, v, scale, causal, **opts)
    want = ref.math_causal_attention_fwd(*_fp32(q, k, v), scale, causal, **opts)
    _check_gpu(_fp32(*got), want, ("out", "lse"))
    other = ref.math_causal_attention_fwd(*_fp32(q, k0, v0), scale, False)
    lse = torch.logaddexp(want[1], other[1])
    out = want[0] * (want[1] - lse).exp().unsqueeze(-1) + other[0] * (other[1] - lse).exp().unsqueeze(-1)
    grad = torch.randn_like(got[0])
    with dispatch.attention_backend("torch-flash"):
        got_bwd = dispatch.block_attention_bwd(grad, q, k, v, out.bfloat16(), lse, scale, causal, **opts)
    want_bwd = ref.math_attention_bwd_from_lse(*_fp32(grad, q, k, v, out.bfloat16()), lse, scale, causal, **opts)
    _check_gpu(_fp32(*got_bwd), want_bwd, ("dq", "dk", "dv"))


@needs_cuda
def test_gpu_auto_takes_torch_flash_for_llama_shapes_and_triton_for_softcaps():
    q, k, v = _gpu_qkv(64, 64)
    call = dispatch.AttentionCall.of(q, k, v, mask=CAUSAL, softcap=None, bounds_q=(0, 64), bounds_k=(0, 64))
    assert dispatch.explain_attention(call).backend == "torch-flash"
    capped = dispatch.AttentionCall.of(q, k, v, mask=CAUSAL, softcap=50.0, bounds_q=(0, 64), bounds_k=(0, 64))
    assert dispatch.explain_attention(capped) == dispatch.AttentionChoice(
        "triton", (("torch-flash", "has no soft-cap"),)
    )
