"""bytescale::fused_linear_cross_entropy against eager linear -> float -> cross_entropy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from bytescale_compile.kernels.cross_entropy_ref import CPU_CHUNK_BUDGET_BYTES, chunk_rows, linear_cross_entropy_chunked
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


def fused_loss(
    ignore_index: int,
    reduction: str,
    chunk_size: int,
    upcast: bool = True,
    scale: float = 1.0,
    softcap: float | None = None,
):
    def fn(hidden, weight, bias, target):
        return fused_linear_cross_entropy(
            hidden, weight, target, bias, ignore_index, reduction, upcast, chunk_size, scale, softcap
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
    actual = loss_and_grads(fused_loss(-100, reduction, chunk_size=8), *inputs)
    assert actual[1].shape == (1, 29, H)
    for a, e in zip(actual, expected):
        assert rel_err(a, e) <= 1e-5


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_bf16_upcast_close_to_eager(reduction: str) -> None:
    inputs = make_inputs((1, 29), bias=True, dtype=torch.bfloat16)
    expected = loss_and_grads(eager_loss(-100, reduction), *inputs)
    actual = loss_and_grads(fused_loss(-100, reduction, chunk_size=8), *inputs)
    assert actual[0].dtype == torch.float32
    assert [a.dtype for a in actual[1:]] == [torch.bfloat16] * 3
    for a, e in zip(actual, expected):
        assert rel_err(a, e) <= 2e-2


def test_bf16_without_upcast_stays_bf16() -> None:
    inputs = make_inputs((1, 29), bias=False, dtype=torch.bfloat16)
    expected = loss_and_grads(eager_loss(-100, "mean", upcast=False), *inputs)
    actual = loss_and_grads(fused_loss(-100, "mean", chunk_size=8, upcast=False), *inputs)
    assert all(a.dtype == torch.bfloat16 for a in actual)
    for a, e in zip(actual, expected):
        assert rel_err(a, e) <= 3e-2


def test_all_ignored_sum_is_zero() -> None:
    hidden, weight, b, target = make_inputs((6,), bias=True)
    target.fill_(-100)
    loss, *grads = loss_and_grads(fused_loss(-100, "sum", chunk_size=4), hidden, weight, b, target)
    assert loss.item() == 0.0
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


def test_all_ignored_mean_is_nan_like_eager() -> None:
    hidden, weight, b, target = make_inputs((6,), bias=True)
    target.fill_(-100)
    expected = loss_and_grads(eager_loss(-100, "mean"), hidden, weight, b, target)
    loss, *grads = loss_and_grads(fused_loss(-100, "mean", chunk_size=4), hidden, weight, b, target)
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
        ({"chunk_size": 0}, "chunk_size"),
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
        return fused_linear_cross_entropy(hidden, weight, target, bias, chunk_size=4) * 0.5

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
    """Records the input dtypes of every matmul that runs."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[torch.dtype, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            self.seen.append(tuple(a.dtype for a in args if isinstance(a, torch.Tensor) and a.dim() == 2))
        return func(*args, **(kwargs or {}))


def test_bf16_matmuls_run_in_bf16_with_fp32_weight_grad_accumulation() -> None:
    """No fp32 copy of h, W or dlogits: every matmul takes bf16 operands; the result stays close to fp32."""
    hidden, weight, bias, target = make_inputs((40,), bias=True, dtype=torch.bfloat16)
    with _MatmulDtypes() as mode:
        loss, grad_hidden, grad_weight, grad_bias = linear_cross_entropy_chunked(
            hidden.detach(), weight.detach(), bias.detach(), target, -100, "mean", True, 8
        )
    operands = {dtype for call in mode.seen for dtype in call[-2:]}
    assert len(mode.seen) >= 3 * 5 and operands == {torch.bfloat16}, mode.seen
    fp32 = [x.detach().float().requires_grad_() for x in (hidden, weight, bias)]
    expected = loss_and_grads(eager_loss(-100, "mean"), *fp32, target)
    for got, want in zip((loss, grad_hidden, grad_weight, grad_bias), expected):
        assert rel_err(got.float(), want) <= 2e-2


def test_loss_runs_without_a_host_sync_off_the_cpu() -> None:
    """On meta tensors any `.item()`/`bool()` raises, so passing shows the loss never waits for the device."""
    hidden = torch.empty(300, 64, dtype=torch.bfloat16, device="meta")
    weight = torch.empty(1000, 64, dtype=torch.bfloat16, device="meta")
    target = torch.empty(300, dtype=torch.long, device="meta")
    loss, grad_hidden, grad_weight, _ = linear_cross_entropy_chunked(
        hidden, weight, None, target, -100, "mean", True, 128
    )
    assert loss.dtype == torch.float32 and grad_hidden.shape == hidden.shape and grad_weight.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("max_rows", "tokens", "vocab", "itemsize", "want"),
    [
        (1024, 4096, 32_000, 4, 1024),  # 125 MiB fits the CPU budget
        (8192, 8192, 128_000, 6, 320),  # bf16 logits + fp32 work: the budget caps it, to a multiple of 64
        (1024, 37, 32_000, 4, 37),  # never more than the tokens
        (1024, 4096, 10**9, 4, 1),  # at least one row
    ],
)
def test_chunk_rows_from_vocab_and_budget(max_rows, tokens, vocab, itemsize, want) -> None:
    assert CPU_CHUNK_BUDGET_BYTES // (vocab * itemsize) >= want or want == 1
    assert chunk_rows(max_rows, tokens, vocab, itemsize, torch.device("cpu")) == want
