"""bytescale::fused_linear_cross_entropy against eager linear -> float -> cross_entropy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from bytescale_compile.kernels.cross_entropy_ref import (
    CPU_CHUNK_BUDGET_BYTES,
    chunk_rows,
    linear_cross_entropy_token_chunks,
    logit_bytes,
)
from bytescale_compile.ops.loss import fused_linear_cross_entropy, fused_linear_cross_entropy_op
from tests.helpers import rel_err

H, V = 16, 37


def make_inputs(
    shape: tuple[int, ...], bias: bool, dtype: torch.dtype = torch.float32, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Leaf hidden [*shape, H], weight, optional bias and targets with every 3rd one ignored."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(*shape, H, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=gen) * 0.5).to(dtype).requires_grad_()
    b = (torch.randn(V, generator=gen)).to(dtype).requires_grad_() if bias else None
    target = torch.randint(0, V, shape, generator=gen)
    target.view(-1)[::3] = ignore_index
    return hidden, weight, b, target


def loss_and_grads(loss_fn, hidden, weight, bias, target) -> list[torch.Tensor]:
    """Run forward + backward; return [loss, grad_hidden, grad_weight, (grad_bias)]."""
    params = [p for p in (hidden, weight, bias) if p is not None]
    for p in params:
        p.grad = None
    loss = loss_fn(hidden, weight, bias, target)
    loss.backward()
    return [loss.detach()] + [p.grad for p in params]


def eager_loss(
    ignore_index: int, reduction: str, upcast: bool = True, scale: float = 1.0, softcap: float | None = None
):
    """The dense formula: softcap * tanh(scale * (h W^T + b) / softcap), or scale * (h W^T + b)."""

    def fn(hidden, weight, bias, target):
        logits = F.linear(hidden, weight, bias)
        logits = logits.float() if upcast else logits
        logits = scale * logits if softcap is None else softcap * torch.tanh(scale * logits / softcap)
        return F.cross_entropy(logits.view(-1, V), target.view(-1), ignore_index=ignore_index, reduction=reduction)

    return fn


def rows_cap(rows: int, dtype: torch.dtype, upcast: bool = True, softcap: float | None = None) -> int:
    """The workspace cap that gives the torch reference chunks of `rows` tokens over V."""
    return rows * V * logit_bytes(dtype, upcast, softcap)


def fused_loss(
    ignore_index: int,
    reduction: str,
    chunk_rows: int,
    upcast: bool = True,
    scale: float = 1.0,
    softcap: float | None = None,
):
    """The fused loss with its workspace capped at chunks of `chunk_rows` tokens."""

    def fn(hidden, weight, bias, target):
        cap = rows_cap(chunk_rows, hidden.dtype, upcast, softcap)
        return fused_linear_cross_entropy(
            hidden, weight, target, bias, ignore_index, reduction, upcast, cap, scale, softcap
        )

    return fn


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("scale", "softcap"), [(1.0, None), (0.5, 3.0)])
def test_opcheck(bias: bool, scale: float, softcap: float | None) -> None:
    hidden, weight, b, target = make_inputs((2, 5), bias)
    torch.library.opcheck(
        fused_linear_cross_entropy_op, (hidden, weight, b, target, -100, "mean", True, 3, scale, softcap)
    )


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("ignore_index", [-100, 0])
@pytest.mark.parametrize("chunk_size", [1, 4, 7, 13, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_eager_fp32(reduction: str, ignore_index: int, chunk_size: int, bias: bool) -> None:
    inputs = make_inputs((13,), bias, ignore_index=ignore_index)
    expected = loss_and_grads(eager_loss(ignore_index, reduction), *inputs)
    actual = loss_and_grads(fused_loss(ignore_index, reduction, chunk_size), *inputs)
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype and a.shape == e.shape
        assert rel_err(a, e) <= 1e-5


# Granite divides by 4, Cohere multiplies by 1/16, Gemma2 caps at 30; a negative scale, a cap the
# logits saturate (|z| up to ~8 against 0.5) and a scaled cap cover the rest of the formula.
SCALE_SOFTCAP = [(0.25, None), (0.0625, None), (-1.5, None), (1.0, 30.0), (1.0, 2.0), (0.7, 0.5), (-2.0, 3.0)]


@pytest.mark.parametrize(("scale", "softcap"), SCALE_SOFTCAP)
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize(("chunk_size", "bias"), [(4, True), (100, False)])
def test_scale_and_softcap_match_formula(
    scale: float, softcap: float | None, reduction: str, chunk_size: int, bias: bool
) -> None:
    inputs = make_inputs((13,), bias)
    expected = loss_and_grads(eager_loss(-100, reduction, scale=scale, softcap=softcap), *inputs)
    actual = loss_and_grads(fused_loss(-100, reduction, chunk_size, scale=scale, softcap=softcap), *inputs)
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype and a.shape == e.shape
        assert rel_err(a, e) <= 1e-5


def test_softcap_changes_the_loss() -> None:
    """The cap is applied at all: capped and uncapped losses differ (guards the test above)."""
    inputs = make_inputs((13,), bias=True)
    plain = fused_loss(-100, "sum", 4)(*inputs)
    capped = fused_loss(-100, "sum", 4, softcap=2.0)(*inputs)
    assert rel_err(capped, plain) > 1e-2


@pytest.mark.parametrize(("upcast", "tol"), [(True, 2e-2), (False, 5e-2)])
def test_bf16_softcap_close_to_eager(upcast: bool, tol: float) -> None:
    inputs = make_inputs((1, 29), bias=True, dtype=torch.bfloat16)
    expected = loss_and_grads(eager_loss(-100, "mean", upcast, scale=0.5, softcap=3.0), *inputs)
    actual = loss_and_grads(fused_loss(-100, "mean", 8, upcast, scale=0.5, softcap=3.0), *inputs)
    assert actual[0].dtype == (torch.float32 if upcast else torch.bfloat16)
    for a, e in zip(actual, expected):
        assert rel_err(a, e) <= tol


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_matches_eager_3d_hidden(reduction: str) -> None:
    inputs = make_inputs((1, 29), bias=True)
    expected = loss_and_grads(eager_loss(-100, reduction), *inputs)
    actual = loss_and_grads(fused_loss(-100, reduction, chunk_rows=8), *inputs)
    assert actual[1].shape == (1, 29, H)
    for a, e in zip(actual, expected):
        assert rel_err(a, e) <= 1e-5


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_bf16_upcast_close_to_eager(reduction: str) -> None:
    inputs = make_inputs((1, 29), bias=True, dtype=torch.bfloat16)
    expected = loss_and_grads(eager_loss(-100, reduction), *inputs)
    actual = loss_and_grads(fused_loss(-100, reduction, chunk_rows=8), *inputs)
    assert actual[0].dtype == torch.float32
    assert [a.dtype for a in actual[1:]] == [torch.bfloat16] * 3
    for a, e in zip(actual, expected):
        assert rel_err(a, e) <= 2e-2


def test_bf16_without_upcast_stays_bf16() -> None:
    inputs = make_inputs((1, 29), bias=False, dtype=torch.bfloat16)
    expected = loss_and_grads(eager_loss(-100, "mean", upcast=False), *inputs)
    actual = loss_and_grads(fused_loss(-100, "mean", chunk_rows=8, upcast=False), *inputs)
    assert all(a.dtype == torch.bfloat16 for a in actual)
    for a, e in zip(actual, expected):
        assert rel_err(a, e) <= 3e-2


def test_all_ignored_sum_is_zero() -> None:
    hidden, weight, b, target = make_inputs((6,), bias=True)
    target.fill_(-100)
    loss, *grads = loss_and_grads(fused_loss(-100, "sum", chunk_rows=4), hidden, weight, b, target)
    assert loss.item() == 0.0
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


def test_all_ignored_mean_is_nan_like_eager() -> None:
    hidden, weight, b, target = make_inputs((6,), bias=True)
    target.fill_(-100)
    expected = loss_and_grads(eager_loss(-100, "mean"), hidden, weight, b, target)
    loss, *grads = loss_and_grads(fused_loss(-100, "mean", chunk_rows=4), hidden, weight, b, target)
    assert torch.isnan(loss) and torch.isnan(expected[0])
    for g, e in zip(grads, expected[1:]):
        assert torch.equal(g, e)


@pytest.mark.parametrize("bad", [V, -1])
def test_out_of_range_target_raises(bad: int) -> None:
    hidden, weight, _, target = make_inputs((6,), bias=False)
    target[2] = bad
    with pytest.raises(ValueError, match=f"{bad}.*V={V}"):
        fused_linear_cross_entropy(hidden, weight, target)


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"reduction": "none"}, "reduction"),
        ({"max_workspace_bytes": 0}, "max_workspace_bytes"),
        ({"softcap": 0.0}, "softcap"),
        ({"softcap": -3.0}, "softcap"),
        ({"softcap": float("nan")}, "softcap"),
        ({"scale": float("inf")}, "scale"),
    ],
)
def test_bad_arguments_raise(kwargs: dict, argument: str) -> None:
    hidden, weight, _, target = make_inputs((6,), bias=False)
    with pytest.raises(ValueError, match=argument):
        fused_linear_cross_entropy(hidden, weight, target, **kwargs)


def test_mismatched_shapes_raise() -> None:
    hidden, weight, _, target = make_inputs((6,), bias=False)
    with pytest.raises(ValueError, match="target"):
        fused_linear_cross_entropy(hidden, weight, target[:5])
    with pytest.raises(ValueError, match="weight"):
        fused_linear_cross_entropy(hidden, weight[:, :-1], target)


def test_torch_compile_dynamic_matches_eager() -> None:
    def train_loss(hidden, weight, bias, target):
        return (
            fused_linear_cross_entropy(hidden, weight, target, bias, max_workspace_bytes=rows_cap(4, hidden.dtype))
            * 0.5
        )

    def reference(hidden, weight, bias, target):
        return eager_loss(-100, "mean")(hidden, weight, bias, target) * 0.5

    compiled = torch.compile(train_loss, backend="aot_eager", dynamic=True, fullgraph=True)
    for tokens in (11, 17):
        inputs = make_inputs((1, tokens), bias=True)
        expected = loss_and_grads(reference, *inputs)
        actual = loss_and_grads(compiled, *inputs)
        for a, e in zip(actual, expected):
            assert rel_err(a, e) <= 1e-5


# --- GPU-shaped behaviour, checked on the CPU -------------------------------------------------------


class _MatmulDtypes(TorchDispatchMode):
    """Records the input dtypes of every matmul that runs, the beta of every in-place addmm into a [V, H] tensor
    (grad_weight), and the most elements of any fp32 tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[torch.dtype, ...]] = []
        self.grad_weight_betas: list[float] = []
        self.largest_fp32 = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            self.seen.append(tuple(a.dtype for a in args if isinstance(a, torch.Tensor) and a.dim() == 2)[-2:])
        if func.overloadpacket is torch.ops.aten.addmm_ and tuple(args[0].shape) == (V, H):
            self.grad_weight_betas.append(kwargs.get("beta", 1))
        out = func(*args, **kwargs)
        for x in out if isinstance(out, tuple | list) else (out,):
            if isinstance(x, torch.Tensor) and x.dtype == torch.float32:
                self.largest_fp32 = max(self.largest_fp32, x.numel())
        return out


def test_bf16_matmuls_run_in_bf16_and_write_grad_weight_in_place_per_chunk() -> None:
    """No fp32 copy of h, W or dlogits and no fp32 [V, H] accumulator: every matmul takes bf16 operands, grad_weight
    is bf16 and written by one in-place addmm per chunk (beta 0 for the first); the result stays close to fp32."""
    hidden, weight, bias, target = make_inputs((40,), bias=True, dtype=torch.bfloat16)
    with _MatmulDtypes() as mode:
        loss, grad_hidden, grad_weight, grad_bias = linear_cross_entropy_token_chunks(
            hidden.detach(), weight.detach(), bias.detach(), target, -100, "mean", True, rows_cap(8, torch.bfloat16)
        )
    operands = {dtype for call in mode.seen for dtype in call[-2:]}
    assert len(mode.seen) == 3 * 5 and operands == {torch.bfloat16}, mode.seen
    assert mode.grad_weight_betas == [0] + [1] * 4
    assert mode.largest_fp32 < V * H and grad_weight.dtype == grad_bias.dtype == torch.bfloat16
    fp32 = [x.detach().float().requires_grad_() for x in (hidden, weight, bias)]
    expected = loss_and_grads(eager_loss(-100, "mean"), *fp32, target)
    for got, want in zip((loss, grad_hidden, grad_weight, grad_bias), expected):
        assert rel_err(got.float(), want) <= 2e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp32_grad_weight_on_request(dtype: torch.dtype) -> None:
    """grad_dtype=torch.float32 writes grad_weight and grad_bias in fp32 (of a bf16 weight too), same values."""
    hidden, weight, bias, target = (x.detach() if x.is_floating_point() else x for x in make_inputs((40,), True, dtype))
    args = (hidden, weight, bias, target, -100, "sum", True, rows_cap(8, dtype))
    own = linear_cross_entropy_token_chunks(*args)
    fp32 = linear_cross_entropy_token_chunks(*args, grad_dtype=torch.float32)
    assert [g.dtype for g in fp32[2:]] == [torch.float32] * 2 and fp32[1].dtype == dtype
    for a, b in zip(fp32, own):
        assert rel_err(a.float(), b.float()) <= (1e-2 if dtype == torch.bfloat16 else 0.0)
    with pytest.raises(ValueError, match="grad_dtype"):
        linear_cross_entropy_token_chunks(*args, grad_dtype=torch.float16)


def test_backward_scales_the_saved_gradients_in_place_once() -> None:
    """The op's backward multiplies its saved gradients by the incoming gradient in place (its outputs [1:] are
    those tensors), matching eager for a scaled loss; a second backward through it raises (autograd sees them modified) instead of rescaling."""
    inputs = make_inputs((13,), bias=True)
    expected = loss_and_grads(lambda *a: eager_loss(-100, "sum")(*a) * 3.0, *inputs)
    hidden, weight, bias, target = inputs
    for p in (hidden, weight, bias):
        p.grad = None
    loss, saved_hidden, saved_weight, saved_bias = fused_linear_cross_entropy_op(
        hidden, weight, bias, target, -100, "sum", True, rows_cap(4, torch.float32)
    )
    (loss * 3.0).backward(retain_graph=True)
    for got, saved, want in zip(
        (hidden.grad, weight.grad, bias.grad), (saved_hidden, saved_weight, saved_bias), expected[1:]
    ):
        assert rel_err(got, want) <= 1e-5 and rel_err(saved, want) <= 1e-5
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_loss_runs_without_a_host_sync_off_the_cpu() -> None:
    """On meta tensors any `.item()`/`bool()` raises, so passing shows the loss never waits for the device; the fp32
    grad_weight of bf16 operands takes the matmul's fp32 output (`out_dtype`) there."""
    hidden = torch.empty(300, 64, dtype=torch.bfloat16, device="meta")
    weight = torch.empty(1000, 64, dtype=torch.bfloat16, device="meta")
    target = torch.empty(300, dtype=torch.long, device="meta")
    for grad_dtype in (None, torch.float32):
        loss, grad_hidden, grad_weight, _ = linear_cross_entropy_token_chunks(
            hidden, weight, None, target, -100, "mean", True, 128 * 1000 * 6, grad_dtype=grad_dtype
        )
        assert loss.dtype == torch.float32 and grad_hidden.shape == hidden.shape
        assert grad_weight.dtype == (grad_dtype or torch.bfloat16)


GIB = 2**30


@pytest.mark.parametrize(
    ("tokens", "vocab", "hidden", "per_logit", "cap", "device", "want"),
    [
        (131_072, 131_072, 4096, 2, GIB, "meta", 4096),  # T·H/V: the logits as large as hidden
        (100_000, 128_256, 4096, 2, GIB, "meta", 4096),  # 3194 rounded up to a power of two
        (131_072, 131_072, 4096, 2, GIB // 2, "meta", 2048),  # the cap halves it
        (32_768, 131_072, 4096, 2, GIB, "meta", 1024),  # 1024 at least ...
        (32_768, 131_072, 4096, 6, 100 * 131_072 * 6, "meta", 64),  # ... unless the cap allows fewer: 64 | chunk
        (8192, 128_000, 4096, 6, GIB, "cpu", 320),  # the CPU budget caps it, to a multiple of 64
        (1000, 32_000, 4096, 4, GIB, "cpu", 1000),  # never more than the tokens, nor a multiple of 64 then
        (37, 32_000, 64, 4, GIB, "cpu", 37),
        (4096, 10**9, 64, 4, GIB, "cpu", 1),  # at least one row
    ],
)
def test_chunk_rows_follow_the_data_within_the_cap(tokens, vocab, hidden, per_logit, cap, device, want) -> None:
    assert device != "cpu" or CPU_CHUNK_BUDGET_BYTES // (vocab * per_logit) >= want or want == 1
    got = chunk_rows(
        n_tokens=tokens,
        vocab=vocab,
        hidden=hidden,
        bytes_per_logit=per_logit,
        max_workspace_bytes=cap,
        device=torch.device(device),
    )
    assert got == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("grad_dtype", [None, torch.float32], ids=["bf16-grad", "fp32-grad"])
def test_cuda_bf16_chunks_match_the_fp32_loss_without_a_host_sync(grad_dtype):
    """On the GPU's kernel: eight chunks of bf16 logits, dW written into the gradient chunk by chunk, ignored
    targets; the loss and every gradient near fp32 linear + cross_entropy, and nothing reads the device."""
    from bytescale_compile.kernels import dispatch

    torch.manual_seed(0)
    tokens, hidden, vocab = 8192, 1024, 32_000
    h = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(vocab, hidden, device="cuda") * hidden**-0.5).to(torch.bfloat16)
    target = torch.randint(0, vocab, (tokens,), device="cuda")
    target[::7] = -100
    cap = 2**26  # 1,024 tokens of 32K bf16 logits: eight chunks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, grad_h, grad_w, _ = dispatch.linear_cross_entropy(
            h, w, None, target, -100, "mean", True, cap, 1.0, None, grad_dtype=grad_dtype
        )
    finally:
        torch.cuda.set_sync_debug_mode(0)
    h32, w32 = h.float().requires_grad_(), w.float().requires_grad_()
    ref = F.cross_entropy(F.linear(h32, w32), target)
    ref.backward()
    assert grad_w.dtype == (grad_dtype or torch.bfloat16)
    assert rel_err(loss, ref.detach()) <= 1e-3
    assert rel_err(grad_h.float(), h32.grad) <= 2e-2
    assert rel_err(grad_w.float(), w32.grad) <= 2e-2
