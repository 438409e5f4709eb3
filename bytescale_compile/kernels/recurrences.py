"""Torch references of the linear recurrences of hybrid LLMs: Mamba2's SSD, Mamba1's selective scan, gated delta.

Each runs ONE sequence segment, token-major, from an initial state to a final state. The final state is affine
in the initial one, `h_end = apply(M, h0) + run(inputs, None)[1]` with M the segment's `transition`, so a
distributed runtime can run every rank's segment from zeros, fold the (M, h_end) summaries of the earlier
ranks into its start state and run again from there (LASP-2).

The work is chunked (`CHUNK` tokens): within a chunk in parallel, between chunks a sequential carry of the
state, so a Python loop runs T / CHUNK (+ CHUNK for the selective scan) times, not T. A segment is zero-padded
to whole chunks; a zero token (dt = 0, or g = 0 with k = 0) leaves every state unchanged.

Everything is computed in float32 (float64 stays float64) with plain differentiable torch ops. Outputs come
back in the dtype of x / v, states in the compute dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["CHUNK", "RECURRENCES", "Recurrence"]

CHUNK = 64
"""Tokens per chunk (as HF's Mamba2 and Qwen3-Next torch paths); a shorter segment is one chunk of its length."""


@dataclass(frozen=True)
class Recurrence:
    """One family of linear recurrence h_t = A_t(h_{t-1}) + u_t, y_t = read(h_t, t)."""

    name: str
    run: Callable[[Sequence[Tensor], Tensor | None], tuple[Tensor, Tensor]]
    """(inputs, h0) -> (y, h_end); h0 None means zeros."""
    transition: Callable[[Sequence[Tensor]], Tensor]
    """inputs -> M with h_end = apply(M, h0) + run(inputs, None)[1]."""
    apply: Callable[[Tensor, Tensor], Tensor]
    """(M, h) -> M applied to h."""
    state_shape: Callable[[Sequence[Tensor]], tuple[int, ...]]
    """inputs -> shape of h (for zeros and byte counts)."""
    token_inputs: tuple[int, ...]
    """Positions of `inputs` with a leading token dim; the others (A) are per-layer parameters."""


def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _chunk_len(t: Tensor) -> int:
    return min(CHUNK, t.shape[0])


def _chunked(t: Tensor, chunk: int) -> Tensor:
    """[T, ...] -> [n_chunks, chunk, ...], zero-padded at the end."""
    t = F.pad(t, (0, 0) * (t.dim() - 1) + (0, -t.shape[0] % chunk))
    return t.reshape(-1, chunk, *t.shape[1:])


def _start_state(h0: Tensor | None, shape: tuple[int, ...], like: Tensor) -> Tensor:
    return torch.zeros(shape, dtype=like.dtype, device=like.device) if h0 is None else h0.to(like.dtype)


def _segsum(a: Tensor) -> Tensor:
    """Log decays [..., L] -> [..., L, L] with [i, j] = a_{j+1} + ... + a_i for j <= i, -inf above the diagonal.

    Each entry is its own sum (HF Mamba2's `segment_sum`), not cumsum_i - cumsum_j, whose small differences of
    large sums lose digits in float32.
    """
    ones = torch.ones(a.shape[-1], a.shape[-1], dtype=torch.bool, device=a.device)
    sums = a[..., None].expand(*a.shape, a.shape[-1]).masked_fill(~ones.tril(-1), 0).cumsum(-2)
    return sums.masked_fill(~ones.tril(), -torch.inf)


def _ssd_run(inputs: Sequence[Tensor], h0: Tensor | None) -> tuple[Tensor, Tensor]:
    """Mamba2's state space duality: within a chunk y = (C B^T * decay) (dt x), an attention-like matmul."""
    x, dt, A, B, C = inputs
    T, H, P = x.shape
    dtype, L = _compute_dtype(x), _chunk_len(x)
    dt = dt.to(dtype)
    B, C = (_chunked(m.to(dtype).repeat_interleave(H // m.shape[1], dim=1), L) for m in (B, C))  # [c, l, h, n]
    xdt = _chunked(x.to(dtype) * dt[..., None], L)  # [c, l, h, p]
    log_decay = _chunked(dt * A.to(dtype), L).transpose(1, 2)  # [c, h, l]
    decay = _segsum(log_decay).exp()  # [c, h, l, s]: from after token s through token l
    y = torch.einsum("chls,cshp->clhp", torch.einsum("clhn,cshn->chls", C, B) * decay, xdt)
    to_end = decay[:, :, -1].transpose(1, 2)[..., None]  # [c, s, h, 1]
    chunk_states = torch.einsum("cshn,cshp->chpn", B * to_end, xdt)  # each chunk's end state from zeros
    from_start = log_decay.cumsum(-1).exp()  # [c, h, l]
    h = _start_state(h0, (H, P, B.shape[-1]), xdt)
    starts = []
    for c in range(xdt.shape[0]):
        starts.append(h)
        h = from_start[c, :, -1, None, None] * h + chunk_states[c]
    y = y + torch.einsum("clhn,chpn->clhp", C, torch.stack(starts)) * from_start.transpose(1, 2)[..., None]
    return y.reshape(-1, H, P)[:T].to(x.dtype), h


def _ssd_transition(inputs: Sequence[Tensor]) -> Tensor:
    _, dt, A, _, _ = inputs
    dtype = _compute_dtype(inputs[0])
    return (A.to(dtype) * dt.to(dtype).sum(0)).exp()


def _selective_run(inputs: Sequence[Tensor], h0: Tensor | None) -> tuple[Tensor, Tensor]:
    """Mamba1's selective scan. Its decay differs per (channel, state) entry, so there is no matmul form: each chunk
    runs token by token from zeros, all chunks at once, and the carried state is added with its decay."""
    dtype = _compute_dtype(inputs[0])
    x, dt, A, B, C = (t.to(dtype) for t in inputs)
    T, D = x.shape
    L = _chunk_len(x)
    log_decay = _chunked(dt[..., None] * A, L)  # [c, l, d, n]
    u = _chunked((dt * x)[..., None] * B[:, None], L)
    decay = log_decay.exp()
    local = [u[:, 0]]
    for i in range(1, L):
        local.append(decay[:, i] * local[-1] + u[:, i])
    from_start = log_decay.cumsum(1).exp()
    h = _start_state(h0, (D, A.shape[1]), x)
    starts = []
    for c in range(u.shape[0]):
        starts.append(h)
        h = from_start[c, -1] * h + local[-1][c]
    states = torch.stack(local, 1) + from_start * torch.stack(starts)[:, None]
    y = torch.einsum("cldn,cln->cld", states, _chunked(C, L))
    return y.reshape(-1, D)[:T].to(inputs[0].dtype), h


def _selective_transition(inputs: Sequence[Tensor]) -> Tensor:
    _, dt, A, _, _ = inputs
    dtype = _compute_dtype(inputs[0])
    return (A.to(dtype) * dt.to(dtype).sum(0)[:, None]).exp()


class _DeltaChunks(NamedTuple):
    """What the gated delta rule's chunks need of k, g and beta (HF's `torch_chunk_gated_delta_rule`), [h, c, ...]."""

    k: Tensor  # [h, c, l, K]
    beta: Tensor  # [h, c, l]
    decay: Tensor  # [h, c, l, s]: exp(g_{s+1} + ... + g_l), 0 above the diagonal
    ut: Tensor  # [h, c, l, s]: strictly lower part of the UT system I + tril(beta_l k_l.k_s decay)
    k_cumdecay: Tensor  # [h, c, l, K]: how much of the chunk's start state token l's update removes
    k_to_end: Tensor  # [h, c, l, K]: keys decayed to the chunk's end
    from_start: Tensor  # [h, c, l]: exp(g_0 + ... + g_l), the decay of the chunk's start state at token l


def _delta_chunks(k: Tensor, g: Tensor, beta: Tensor, dtype: torch.dtype, chunk: int) -> _DeltaChunks:
    k = _chunked(k.to(dtype), chunk).permute(2, 0, 1, 3)
    g, beta = (_chunked(t.to(dtype), chunk).permute(2, 0, 1) for t in (g, beta))
    decay = _segsum(g).exp()
    k_beta = k * beta[..., None]
    ut = (k_beta @ k.transpose(-1, -2)) * decay
    from_start = g.cumsum(-1).exp()
    k_cumdecay = _ut_solve(ut, k_beta * from_start[..., None])
    return _DeltaChunks(k, beta, decay, ut, k_cumdecay, k * decay[..., -1, :, None], from_start)


def _ut_solve(ut: Tensor, rhs: Tensor) -> Tensor:
    """(I + strictly_lower(ut))^-1 rhs: the delta rule's updates within a chunk, each against the ones before."""
    return torch.linalg.solve_triangular(ut, rhs, upper=False, unitriangular=True)


def _gated_delta_run(inputs: Sequence[Tensor], h0: Tensor | None) -> tuple[Tensor, Tensor]:
    """The gated delta rule (Qwen3-Next), chunked by the UT transform as HF's `torch_chunk_gated_delta_rule`."""
    q, k, v, g, beta = inputs
    T, H, K = k.shape
    dtype, L = _compute_dtype(v), _chunk_len(v)
    ch = _delta_chunks(k, g, beta, dtype, L)
    q, vc = (_chunked(t.to(dtype), L).permute(2, 0, 1, 3) for t in (q, v))
    new_values = _ut_solve(ch.ut, vc * ch.beta[..., None])
    attn = (q @ ch.k.transpose(-1, -2)) * ch.decay
    q = q * ch.from_start[..., None]
    S = _start_state(h0, (H, K, v.shape[-1]), new_values)
    outs = []
    for c in range(new_values.shape[1]):
        v_new = new_values[:, c] - ch.k_cumdecay[:, c] @ S
        outs.append(q[:, c] @ S + attn[:, c] @ v_new)
        S = ch.from_start[:, c, -1, None, None] * S + ch.k_to_end[:, c].transpose(-1, -2) @ v_new
    o = torch.stack(outs, 1).reshape(H, -1, v.shape[-1])[:, :T].transpose(0, 1)
    return o.to(v.dtype), S


def _gated_delta_transition(inputs: Sequence[Tensor]) -> Tensor:
    """Product over chunks of exp(sum g) I - k_to_end^T k_cumdecay: the run's state update with v = 0."""
    _, k, v, g, beta = inputs
    ch = _delta_chunks(k, g, beta, _compute_dtype(v), _chunk_len(v))
    eye = torch.eye(k.shape[-1], dtype=ch.k.dtype, device=k.device)
    M = eye.expand(k.shape[1], -1, -1)
    for c in range(ch.k.shape[1]):
        M = (ch.from_start[:, c, -1, None, None] * eye - ch.k_to_end[:, c].transpose(-1, -2) @ ch.k_cumdecay[:, c]) @ M
    return M


def _scale_heads(M: Tensor, h: Tensor) -> Tensor:
    return M[:, None, None] * h


def _scale_entries(M: Tensor, h: Tensor) -> Tensor:
    return M * h


def _matmul(M: Tensor, h: Tensor) -> Tensor:
    return M @ h


RECURRENCES: dict[str, Recurrence] = {
    r.name: r
    for r in (
        Recurrence(
            name="ssd",
            run=_ssd_run,
            transition=_ssd_transition,
            apply=_scale_heads,
            state_shape=lambda inputs: (*inputs[0].shape[1:], inputs[3].shape[-1]),
            token_inputs=(0, 1, 3, 4),
        ),
        Recurrence(
            name="selective",
            run=_selective_run,
            transition=_selective_transition,
            apply=_scale_entries,
            state_shape=lambda inputs: tuple(inputs[2].shape),
            token_inputs=(0, 1, 3, 4),
        ),
        Recurrence(
            name="gated_delta",
            run=_gated_delta_run,
            transition=_gated_delta_transition,
            apply=_matmul,
            state_shape=lambda inputs: (*inputs[1].shape[1:], inputs[2].shape[-1]),
            token_inputs=(0, 1, 2, 3, 4),
        ),
    )
}
"""The recurrences by name. Inputs (token-major, one segment):

- "ssd" (Mamba2): x [T, H, P], dt [T, H] (softplus'ed, clamped), A [H] < 0, B [T, G, N], C [T, G, N], head h
  reading group h // (H // G); state [H, P, N]; y [T, H, P] without the D skip.
- "selective" (Mamba1): x [T, D], dt [T, D] (softplus'ed), A [D, N] < 0, B [T, N], C [T, N]; state [D, N];
  y [T, D] without the D skip.
- "gated_delta" (Qwen3-Next): q [T, H, K] (l2-normalised, scaled by K**-0.5), k [T, H, K] (l2-normalised),
  v [T, H, V], g [T, H] <= 0 (log decay), beta [T, H]; GQA heads already repeated; state [H, K, V]; o [T, H, V].
"""
