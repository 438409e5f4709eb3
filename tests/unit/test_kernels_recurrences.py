"""The chunked recurrences against per-token loops written here and Hugging Face's torch paths, and their
transitions: a segment cut into pieces and folded as the distributed runtime does gives the whole segment."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from bytescale_compile.kernels.recurrences import RECURRENCES
from tests.helpers import rel_err

H, P, N, G = 4, 8, 6, 2  # ssd: heads, head dim, state, groups
D = 10  # selective: channels (state N)
K, V = 8, 6  # gated delta: key and value dims (H heads)
NAMES = list(RECURRENCES)


def make_inputs(name: str, T: int, dtype: torch.dtype = torch.float64, seed: int = 0) -> list[Tensor]:
    """Random inputs in each family's realistic ranges: decays exp(dt A) or exp(g) in (0, 1), l2-normalised q, k."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    if name == "ssd":
        A = -0.5 - torch.rand(H, generator=gen, dtype=torch.float64)
        inputs = [randn(T, H, P), F.softplus(randn(T, H) - 1), A, randn(T, G, N), randn(T, G, N)]
    elif name == "selective":
        A = -torch.arange(1.0, N + 1, dtype=torch.float64) * torch.rand(D, 1, generator=gen, dtype=torch.float64)
        inputs = [randn(T, D), F.softplus(randn(T, D) - 1), A, randn(T, N), randn(T, N)]
    else:
        q, k = F.normalize(randn(T, H, K), dim=-1) * K**-0.5, F.normalize(randn(T, H, K), dim=-1)
        g, beta = -F.softplus(randn(T, H) - 1), torch.sigmoid(randn(T, H))
        inputs = [q, k, randn(T, H, V), g, beta]
    return [t.to(dtype) for t in inputs]


def make_h0(name: str, inputs: Sequence[Tensor], seed: int = 1) -> Tensor:
    shape = RECURRENCES[name].state_shape(inputs)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(inputs[0].dtype)


def loop_ssd(inputs: Sequence[Tensor], h: Tensor) -> tuple[Tensor, Tensor]:
    x, dt, A, B, C = inputs
    B, C = (m.repeat_interleave(H // G, dim=1) for m in (B, C))
    ys = []
    for t in range(x.shape[0]):
        h = (dt[t] * A).exp()[:, None, None] * h + (dt[t, :, None] * x[t])[:, :, None] * B[t, :, None, :]
        ys.append(torch.einsum("hpn,hn->hp", h, C[t]))
    return torch.stack(ys), h


def loop_selective(inputs: Sequence[Tensor], h: Tensor) -> tuple[Tensor, Tensor]:
    x, dt, A, B, C = inputs
    ys = []
    for t in range(x.shape[0]):
        h = (dt[t, :, None] * A).exp() * h + (dt[t] * x[t])[:, None] * B[t][None, :]
        ys.append(h @ C[t])
    return torch.stack(ys), h


def loop_gated_delta(inputs: Sequence[Tensor], S: Tensor) -> tuple[Tensor, Tensor]:
    q, k, v, g, beta = inputs
    outs = []
    for t in range(q.shape[0]):
        S = g[t].exp()[:, None, None] * S
        delta = beta[t, :, None] * (v[t] - torch.einsum("hkv,hk->hv", S, k[t]))
        S = S + k[t, :, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", S, q[t]))
    return torch.stack(outs), S


LOOPS: dict[str, Callable[[Sequence[Tensor], Tensor], tuple[Tensor, Tensor]]] = {
    "ssd": loop_ssd,
    "selective": loop_selective,
    "gated_delta": loop_gated_delta,
}


def run_loop(name: str, inputs: Sequence[Tensor], h0: Tensor | None) -> tuple[Tensor, Tensor]:
    """The loop in float64 from h0 (or zeros)."""
    inputs = [t.double() for t in inputs]
    h = torch.zeros(RECURRENCES[name].state_shape(inputs), dtype=torch.float64) if h0 is None else h0.double()
    return LOOPS[name](inputs, h)


def sliced(name: str, inputs: Sequence[Tensor], start: int, stop: int) -> list[Tensor]:
    tokens = RECURRENCES[name].token_inputs
    return [t[start:stop] if i in tokens else t for i, t in enumerate(inputs)]


def run_pieces(name: str, inputs: Sequence[Tensor], h0: Tensor, lengths: Sequence[int]) -> tuple[Tensor, Tensor]:
    """What the distributed runtime does: each piece's summary from zeros, folded into the next piece's start."""
    rec, bounds = RECURRENCES[name], [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    pieces = [sliced(name, inputs, a, b) for a, b in zip(bounds, bounds[1:])]
    starts = [h0]
    for piece in pieces[:-1]:
        starts.append(rec.apply(rec.transition(piece), starts[-1]) + rec.run(piece, None)[1])
    runs = [rec.run(piece, h) for piece, h in zip(pieces, starts)]
    return torch.cat([y for y, _ in runs]), runs[-1][1]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("T", [1, 5, 64, 65, 150])
@pytest.mark.parametrize("with_h0", [False, True])
def test_matches_loop_fp64(name: str, T: int, with_h0: bool) -> None:
    inputs = make_inputs(name, T)
    h0 = make_h0(name, inputs) if with_h0 else None
    y, h = RECURRENCES[name].run(inputs, h0)
    y_ref, h_ref = run_loop(name, inputs, h0)
    assert y.shape == y_ref.shape and h.shape == h_ref.shape
    assert y.dtype == h.dtype == torch.float64
    assert rel_err(y, y_ref) < 1e-10 and rel_err(h, h_ref) < 1e-10


@pytest.mark.parametrize("name", NAMES)
def test_fp32_and_bf16(name: str) -> None:
    """Computed in float32: fp32 inputs match the fp64 loop to 1e-5; y comes back in the inputs' dtype, h in fp32."""
    inputs = make_inputs(name, 150, torch.float32)
    h0 = make_h0(name, inputs)
    y, h = RECURRENCES[name].run(inputs, h0)
    y_ref, h_ref = run_loop(name, inputs, h0)
    assert y.dtype == h.dtype == torch.float32
    assert rel_err(y, y_ref) < 1e-5 and rel_err(h, h_ref) < 1e-5
    y16, h16 = RECURRENCES[name].run([t.bfloat16() for t in inputs], h0)
    assert y16.dtype == torch.bfloat16 and h16.dtype == torch.float32


@pytest.mark.parametrize("name", NAMES)
def test_grads_match_loop(name: str) -> None:
    inputs = [t.requires_grad_() for t in make_inputs(name, 150)]
    h0 = make_h0(name, inputs).requires_grad_()
    y, h = RECURRENCES[name].run(inputs, h0)
    y_ref, h_ref = run_loop(name, inputs, h0)
    wy, wh = torch.randn_like(y), torch.randn_like(h)
    got = torch.autograd.grad((y * wy).sum() + (h * wh).sum(), [*inputs, h0])
    want = torch.autograd.grad((y_ref * wy).sum() + (h_ref * wh).sum(), [*inputs, h0])
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-9


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("T", [1, 64, 150])
def test_transition_contract(name: str, T: int) -> None:
    """h_end = apply(transition(inputs), h0) + run(inputs, None)[1]."""
    rec = RECURRENCES[name]
    inputs = make_inputs(name, T)
    h0 = make_h0(name, inputs)
    folded = rec.apply(rec.transition(inputs), h0) + rec.run(inputs, None)[1]
    assert rel_err(folded, rec.run(inputs, h0)[1]) < 1e-10


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("lengths", [(40, 1, 109), (64, 64, 22), (1, 1, 1)])
def test_pieces_match_whole(name: str, lengths: tuple[int, ...]) -> None:
    """Outputs, final state and the gradients of all inputs and h0 through the pieced computation."""
    inputs = [t.requires_grad_() for t in make_inputs(name, sum(lengths))]
    h0 = make_h0(name, inputs).requires_grad_()
    y, h = RECURRENCES[name].run(inputs, h0)
    y_p, h_p = run_pieces(name, inputs, h0, lengths)
    assert rel_err(y_p, y) < 1e-10 and rel_err(h_p, h) < 1e-10
    wy, wh = torch.randn_like(y), torch.randn_like(h)
    got = torch.autograd.grad((y_p * wy).sum() + (h_p * wh).sum(), [*inputs, h0])
    want = torch.autograd.grad((y * wy).sum() + (h * wh).sum(), [*inputs, h0])
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-10


def test_ssd_matches_hf() -> None:
    """HF Mamba2's torch chunk scan (the `torch_forward` path; chunk 16 here) with an initial state, in fp32."""
    pytest.importorskip("transformers")
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    x, dt, A, B, C = inputs = make_inputs("ssd", 150, torch.float32)
    h0 = make_h0("ssd", inputs)
    y, h = RECURRENCES["ssd"].run(inputs, h0)
    y_hf, h_hf = mamba2_chunk_scan(
        x[None], dt[None], A, B[None], C[None], chunk_size=16, initial_states=h0[None], return_final_states=True
    )
    assert rel_err(y, y_hf[0]) < 1e-5 and rel_err(h, h_hf[0]) < 1e-5


def test_selective_matches_hf() -> None:
    """HF Mamba1's torch selective scan (the `slow_forward` loop; it has no initial state), in fp32."""
    pytest.importorskip("transformers")
    from transformers.models.mamba.modeling_mamba import mamba_selective_scan

    x, dt, A, B, C = inputs = make_inputs("selective", 150, torch.float32)
    y, h = RECURRENCES["selective"].run(inputs, None)
    y_hf, h_hf = mamba_selective_scan(x.T[None], dt.T[None], A, B.T[None], C.T[None], return_last_state=True)
    assert rel_err(y, y_hf[0].T) < 1e-5 and rel_err(h, h_hf[0]) < 1e-5


@pytest.mark.parametrize("hf_fn", ["torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"])
def test_gated_delta_matches_hf(hf_fn: str) -> None:
    """Qwen3-Next's torch paths normalise and scale q, k themselves; ours get them done, as from the caller."""
    pytest.importorskip("transformers")
    from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

    gen = torch.Generator().manual_seed(3)
    q_raw, k_raw = torch.randn(2, 150, H, K, generator=gen)
    _, _, v, g, beta = make_inputs("gated_delta", 150, torch.float32)
    h0 = make_h0("gated_delta", [q_raw, k_raw, v])
    q = qwen3_next.l2norm(q_raw, dim=-1, eps=1e-6) * K**-0.5
    k = qwen3_next.l2norm(k_raw, dim=-1, eps=1e-6)
    o, S = RECURRENCES["gated_delta"].run([q, k, v, g, beta], h0)
    o_hf, S_hf = getattr(qwen3_next, hf_fn)(
        q_raw[None],
        k_raw[None],
        v[None],
        g[None],
        beta[None],
        initial_state=h0[None],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    assert rel_err(o, o_hf[0]) < 1e-5 and rel_err(S, S_hf[0]) < 1e-5
