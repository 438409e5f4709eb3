"""The vocabulary-sliced fused linear cross-entropy against eager linear -> float -> cross_entropy.

The torch reference runs here; the Triton version runs in the child pytest that `test_kernels_triton.py` starts
with TRITON_INTERPRET=1 (the variable must be set when the process starts). Also: the rule that picks slices or
token chunks, and that neither holds an fp32 [V, H] buffer for a bf16 weight.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

triton = pytest.importorskip("triton")

from bytescale_compile.kernels import cross_entropy_ref as ref  # noqa: E402
from bytescale_compile.kernels import cross_entropy_triton as ce_triton  # noqa: E402
from bytescale_compile.kernels import dispatch  # noqa: E402
from tests.helpers import rel_err  # noqa: E402

IN_INTERPRETER = ce_triton.INTERPRETED

T, V, H = 37, 101, 16
CAP = 10 * T * 8
"""The workspace cap: slices of 10 vocabulary rows of all tokens at 8 bytes per logit (fp32 with tanh's derivative),
20 rows at 4; chunks of 2 or 7 tokens for the torch reference, 7 for Triton (fp32 logits only)."""
TRANSFORMS = [(1.0, None), (0.5, None), (0.7, 2.0)]
TOL = {torch.float32: 1e-5, torch.float16: 5e-3}

needs_interpreter = pytest.mark.skipif(
    not IN_INTERPRETER,
    reason="runs in the TRITON_INTERPRET=1 child process of test_kernels_triton.py::test_kernels_in_interpreter_process",
)


def make_inputs(
    dtype: torch.dtype = torch.float32,
    bias: bool = True,
    n_tokens: int = T,
    vocab: int = V,
    ignore_index: int = -100,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """hidden [n_tokens, H], weight [vocab, H], optional bias and targets with every 3rd one ignored."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n_tokens, H, generator=g).to(dtype)
    weight = (torch.randn(vocab, H, generator=g) * 0.5).to(dtype)
    b = torch.randn(vocab, generator=g).to(dtype) if bias else None
    target = torch.randint(0, vocab, (n_tokens,), generator=g)
    target[::3] = ignore_index
    return hidden, weight, b, target


def eager(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    ignore_index: int,
    reduction: str,
    scale: float = 1.0,
    softcap: float | None = None,
    z_loss_weight: float = 0.0,
) -> list[torch.Tensor | None]:
    """Loss and gradients of hidden, weight and bias by autograd on fp32 copies, with the logits transformed."""
    leaves = [None if x is None else x.detach().float().requires_grad_() for x in (hidden, weight, bias)]
    z = F.linear(*leaves).float()
    logits = scale * z if softcap is None else softcap * torch.tanh(scale * z / softcap)
    loss = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)
    if z_loss_weight:
        valid = target != ignore_index
        loss = loss + z_loss_weight * (logits.logsumexp(dim=1)[valid] ** 2).mean()
    loss.backward()
    return [loss.detach()] + [None if x is None else x.grad for x in leaves]


def assert_matches(got: tuple, want: list, dtype: torch.dtype, loss_dtype: torch.dtype = torch.float32) -> None:
    """Each output has its dtype (the loss `loss_dtype`, the gradients their input's) and is within TOL of eager."""
    for name, a, b in zip(("loss", "grad_hidden", "grad_weight", "grad_bias"), got, want):
        if b is None:
            assert a is None, name
            continue
        assert a.shape == b.shape and a.dtype == (loss_dtype if name == "loss" else dtype), (name, a.dtype)
        assert not a.isnan().any(), name
        err = rel_err(a, b)
        assert err <= TOL[dtype], (name, err)


@pytest.fixture
def slice_widths(monkeypatch) -> list[int]:
    """The vocabulary rows of every slice the reference's shared loop computes."""
    widths: list[int] = []
    outputs = ref._slice_outputs

    def recording(*args):
        for cols, z in outputs(*args):
            widths.append(z.shape[1])
            yield cols, z

    monkeypatch.setattr(ref, "_slice_outputs", recording)
    return widths


# --- the torch reference --------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("scale", "softcap"), TRANSFORMS)
def test_reference_matches_eager(reduction, bias, scale, softcap, slice_widths):
    inputs = make_inputs(bias=bias)
    got = ref.linear_cross_entropy_vocab_slices(*inputs, -100, reduction, True, CAP, scale, softcap)
    width = 10 if softcap is not None else 20
    assert slice_widths == [width] * (V // width) + [V % width]
    assert_matches(got, eager(*inputs, -100, reduction, scale, softcap), torch.float32)


@pytest.mark.parametrize("ignore_index", [0, 7])
def test_reference_in_range_ignore_index(ignore_index):
    """An ignore_index that is also a vocabulary row: rows targeting it are ignored, that row keeps its gradient."""
    inputs = make_inputs(ignore_index=ignore_index)
    got = ref.linear_cross_entropy_vocab_slices(*inputs, ignore_index, "mean", True, CAP, 0.5, 3.0)
    assert_matches(got, eager(*inputs, ignore_index, "mean", 0.5, 3.0), torch.float32)


def test_reference_slices_shrink_to_the_memory_budget(monkeypatch, slice_widths):
    """A CPU budget of 7 vocabulary rows of all tokens' fp32 logits and tanh's derivative gives slices of 7 rows,
    whatever the cap allows."""
    monkeypatch.setattr(ref, "CPU_CHUNK_BUDGET_BYTES", 7 * T * (4 + 4))
    inputs = make_inputs()
    got = ref.linear_cross_entropy_vocab_slices(*inputs, -100, "sum", True, 2**30, 1.0, 2.0)
    assert slice_widths == [7] * 14 + [3]
    assert_matches(got, eager(*inputs, -100, "sum", 1.0, 2.0), torch.float32)


def test_slice_rows():
    def rows(n_tokens: int, vocab: int, per_logit: int, cap: int, device: str = "cpu") -> int:
        return ref.slice_rows(
            n_tokens=n_tokens,
            vocab=vocab,
            bytes_per_logit=per_logit,
            max_workspace_bytes=cap,
            device=torch.device(device),
        )

    assert rows(T, V, 8, CAP) == 10  # the cap
    assert rows(T, 1000, 4, 2**30) == 1000  # all of V fits
    assert rows(T, 1000, 4, 100 * T * 4) == 64  # fewer than V: a multiple of 64
    assert rows(4096, 128_000, 6, 2**30) == 10880  # the CPU budget caps it, 256 MiB // (4096 * 6)
    assert rows(4096, 128_000, 6, 2**30, "meta") == 43648  # off the CPU the cap alone
    assert rows(0, V, 4, CAP) == V  # no tokens


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_reference_all_ignored(reduction):
    """Like eager: sum gives 0, mean gives nan; the gradients are zero either way."""
    hidden, weight, bias, target = make_inputs()
    target.fill_(-100)
    loss, *grads = ref.linear_cross_entropy_vocab_slices(hidden, weight, bias, target, -100, reduction, True, CAP)
    assert loss.isnan() if reduction == "mean" else loss == 0
    assert all(not g.any() for g in grads)


@pytest.mark.parametrize("bad", [V, -1])
def test_reference_out_of_range_target_raises(bad):
    hidden, weight, bias, target = make_inputs()
    target[2] = bad
    with pytest.raises(ValueError, match=f"{bad}.*V={V}"):
        ref.linear_cross_entropy_vocab_slices(hidden, weight, bias, target, -100, "mean", True, CAP)


class _Fp32AndMatmuls(TorchDispatchMode):
    """The most elements of any fp32 tensor an op returns, and the operand dtypes of every matmul."""

    def __init__(self) -> None:
        super().__init__()
        self.largest_fp32 = 0
        self.matmuls: list[tuple[torch.dtype, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            self.matmuls.append(tuple(a.dtype for a in args if isinstance(a, torch.Tensor) and a.dim() == 2)[-2:])
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, tuple | list) else (out,):
            if isinstance(x, torch.Tensor) and x.dtype == torch.float32:
                self.largest_fp32 = max(self.largest_fp32, x.numel())
        return out


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_reference_holds_no_fp32_grad_weight_of_a_bf16_weight(softcap):
    """bf16 inputs: neither implementation holds an fp32 tensor as large as grad_weight [V, H] unless asked for an
    fp32 grad_weight (which guards the measure); they hold grad_hidden's [T, H] and the logits of a chunk or slice.
    Every matmul takes bf16 operands: three per chunk; one per chunk, then three per slice. Close to eager still."""
    vocab, n_tokens = 300, 20
    inputs = make_inputs(torch.bfloat16, n_tokens=n_tokens, vocab=vocab)
    cap = 4 * vocab * ref.logit_bytes(torch.bfloat16, True, softcap)  # chunks of 4 tokens, slices of 60 rows
    modes = {}
    for name, impl, grad_dtype in [
        ("slices", ref.linear_cross_entropy_vocab_slices, None),
        ("chunks", ref.linear_cross_entropy_token_chunks, None),
        ("chunks, fp32 grad_weight", ref.linear_cross_entropy_token_chunks, torch.float32),
    ]:
        with _Fp32AndMatmuls() as modes[name]:
            got = impl(*inputs, -100, "mean", True, cap, 1.0, softcap, grad_dtype=grad_dtype)
        for a, b in zip(got, eager(*inputs, -100, "mean", 1.0, softcap)):
            assert rel_err(a.float(), b) <= 2e-2
        assert [g.dtype for g in got[2:]] == [grad_dtype or torch.bfloat16] * 2
        assert set(modes[name].matmuls) == {(torch.bfloat16, torch.bfloat16)}, modes[name].matmuls
    assert modes["slices"].largest_fp32 == modes["chunks"].largest_fp32 == 4 * vocab < vocab * H
    assert modes["chunks, fp32 grad_weight"].largest_fp32 == vocab * H
    n_chunks, n_slices = n_tokens // 4, vocab // 60
    assert len(modes["slices"].matmuls) == n_chunks + 3 * n_slices and len(modes["chunks"].matmuls) == 3 * n_chunks


# --- the rule -------------------------------------------------------------------------------------


def test_rule_picks_vocab_slices_for_short_micro_batches_below_the_vocabulary_split_in_chunks():
    limit = dispatch.VOCAB_SLICES_MAX_TOKENS
    assert dispatch.use_vocab_slices(limit, 128_000, chunk=512)
    assert not dispatch.use_vocab_slices(limit, 128_000, chunk=limit)  # one chunk of all tokens
    assert not dispatch.use_vocab_slices(limit + 1, 128_000, chunk=512)
    assert dispatch.use_vocab_slices(V - 1, V, chunk=4)
    assert not dispatch.use_vocab_slices(V, V, chunk=4)
    assert not dispatch.use_vocab_slices(131_072, 128_000, chunk=1024)


def _dispatch_runs(monkeypatch, impls: list[str]) -> None:
    """Record in `impls` the name of each loss implementation dispatch runs, torch or Triton."""

    def recording(name, impl):
        def run(*args, **kwargs):
            impls.append(name)
            return impl(*args, **kwargs)

        return run

    for module, names in [
        (ref, ["linear_cross_entropy_token_chunks", "linear_cross_entropy_vocab_slices"]),
        (ce_triton, ["linear_cross_entropy_token_chunks_triton", "linear_cross_entropy_vocab_slices_triton"]),
    ]:
        for name in names:
            monkeypatch.setattr(module, name, recording(name, getattr(module, name)))


@pytest.mark.parametrize(("n_tokens", "want"), [(T, "vocab_slices"), (150, "token_chunks")])
def test_dispatch_follows_the_rule_and_matches_eager(monkeypatch, n_tokens, want):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    impls: list[str] = []
    _dispatch_runs(monkeypatch, impls)
    inputs = make_inputs(n_tokens=n_tokens)
    got = dispatch.linear_cross_entropy(*inputs, -100, "mean", True, CAP, 0.7, 2.0)
    assert impls == [f"linear_cross_entropy_{want}"]
    assert_matches(got, eager(*inputs, -100, "mean", 0.7, 2.0), torch.float32)


def test_dispatch_exports_both_implementations(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    impls: list[str] = []
    _dispatch_runs(monkeypatch, impls)
    inputs = make_inputs()
    want = eager(*inputs, -100, "sum")
    assert_matches(dispatch.linear_cross_entropy_token_chunks(*inputs, -100, "sum", True, CAP), want, torch.float32)
    assert_matches(dispatch.linear_cross_entropy_vocab_slices(*inputs, -100, "sum", True, CAP), want, torch.float32)
    assert impls == ["linear_cross_entropy_token_chunks", "linear_cross_entropy_vocab_slices"]


# --- Triton, in the interpreter -------------------------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("reduction", ["sum", pytest.param("mean", marks=pytest.mark.slow)])
@pytest.mark.parametrize(("scale", "softcap", "bias"), [(1.0, None, True), (0.5, None, False), (0.7, 2.0, True)])
def test_triton_matches_eager_fp32(reduction, scale, softcap, bias):
    inputs = make_inputs(bias=bias)
    got = ce_triton.linear_cross_entropy_vocab_slices_triton(*inputs, -100, reduction, True, CAP, scale, softcap)
    assert_matches(got, eager(*inputs, -100, reduction, scale, softcap), torch.float32)


@needs_interpreter
@pytest.mark.parametrize(
    ("scale", "softcap", "upcast"), [(0.7, 2.0, True), pytest.param(1.0, None, False, marks=pytest.mark.slow)]
)
def test_triton_matches_eager_fp16(scale, softcap, upcast):
    """fp16 matmuls and gradients; the softmax in fp32 either way, `upcast` picks the loss dtype."""
    inputs = make_inputs(torch.float16)
    got = ce_triton.linear_cross_entropy_vocab_slices_triton(*inputs, -100, "mean", upcast, CAP, scale, softcap)
    want = eager(*inputs, -100, "mean", scale, softcap)
    assert_matches(got, want, torch.float16, torch.float32 if upcast else torch.float16)


@needs_interpreter
def test_triton_wide_slices_and_tiles(monkeypatch):
    """Slices of 256 rows (more than one tile of columns) and 96 tokens (several tiles of rows)."""
    monkeypatch.setattr(ce_triton, "_SLICE_BLOCK_V", 128)
    inputs = make_inputs(n_tokens=96, vocab=300, ignore_index=5, seed=3)
    cap = 256 * 96 * 4
    got = ce_triton.linear_cross_entropy_vocab_slices_triton(*inputs, 5, "mean", True, cap, 0.5, 3.0)
    budget = {"bytes_per_logit": 4, "max_workspace_bytes": cap, "device": torch.device("cpu")}
    assert ref.slice_rows(n_tokens=96, vocab=300, **budget) == 256
    assert_matches(got, eager(*inputs, 5, "mean", 0.5, 3.0), torch.float32)


@needs_interpreter
def test_triton_z_loss_matches_eager():
    inputs = make_inputs(bias=False)
    got = ce_triton.linear_cross_entropy_vocab_slices_triton(*inputs, -100, "mean", True, CAP, z_loss_weight=1e-2)
    assert_matches(got, eager(*inputs, -100, "mean", z_loss_weight=1e-2), torch.float32)


@needs_interpreter
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_triton_all_ignored(reduction):
    hidden, weight, bias, target = make_inputs()
    target.fill_(-100)
    loss, *grads = ce_triton.linear_cross_entropy_vocab_slices_triton(
        hidden, weight, bias, target, -100, reduction, True, CAP
    )
    assert loss.isnan() if reduction == "mean" else loss == 0
    assert all(not g.any() and not g.isnan().any() for g in grads)


@needs_interpreter
def test_triton_out_of_range_target_raises():
    hidden, weight, bias, target = make_inputs()
    target[2] = V
    with pytest.raises(ValueError, match=f"{V}.*V={V}"):
        ce_triton.linear_cross_entropy_vocab_slices_triton(hidden, weight, bias, target, -100, "mean", True, CAP)


@needs_interpreter
@pytest.mark.parametrize(("n_tokens", "want"), [(T, "vocab_slices_triton"), (150, "token_chunks_triton")])
def test_triton_dispatch_follows_the_rule_and_matches_eager(monkeypatch, n_tokens, want):
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    impls: list[str] = []
    _dispatch_runs(monkeypatch, impls)
    inputs = make_inputs(n_tokens=n_tokens)
    got = dispatch.linear_cross_entropy(*inputs, -100, "sum", True, CAP, 0.7, 2.0)
    assert impls == [f"linear_cross_entropy_{want}"]
    assert_matches(got, eager(*inputs, -100, "sum", 0.7, 2.0), torch.float32)


@pytest.mark.parametrize(
    ("module", "old", "new"),
    [
        (ref, "linear_cross_entropy_chunked", "linear_cross_entropy_token_chunks"),
        (ce_triton, "linear_cross_entropy_chunked_triton", "linear_cross_entropy_token_chunks_triton"),
        (dispatch, "linear_cross_entropy_chunked", "linear_cross_entropy"),
    ],
)
def test_the_former_loss_names_warn_and_resolve_to_the_new_ones(module, old, new):
    """`linear_cross_entropy_chunked` named both the token chunks and the choice between them and the slices."""
    with pytest.warns(DeprecationWarning, match=rf"{module.__name__}\.{old} moved to {module.__name__}\.{new};"):
        assert getattr(module, old) is getattr(module, new)
