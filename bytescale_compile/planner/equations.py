"""Eq. 2 of the paper (§4.2) as sympy expressions over symbolic coefficients, solved once at import and
lambdified to numpy, and the communication counts and helpers the cost model charges (TP all-reduces, Ulysses
all-to-alls). Apart from `CostModel` because they hold no model's numbers: `CostModel` substitutes its own
coefficients into them (`CostModel.exprs`) and evaluates the lambdified forms on arrays of lengths.
"""

from __future__ import annotations

import math

import numpy as np
import sympy

__all__ = [
    "CEIL_RTOL",
    "EXPRS",
    "RECOMPUTE_TIME",
    "TP_ALL_REDUCES_PER_LAYER",
    "ULYSSES_ALL_TO_ALLS_PER_LAYER",
    "ULYSSES_BACKWARD_SETS",
    "ceil_forgiving",
    "real_roots",
    "substitute",
    "tp_all_reduce_time",
    "ulysses_kv_heads",
]

TP_ALL_REDUCES_PER_LAYER = 4
"""Megatron tensor parallelism's all-reduces of a layer's hidden state, fwd+bwd: forward after attention's
row-parallel o_proj and after the MLP's down_proj, backward on the inputs of the column-parallel qkv and
gate/up projections."""

ULYSSES_ALL_TO_ALLS_PER_LAYER = 4
"""All-to-alls of a Ulysses split per attention layer and step: q/k/v to head shards and the output back
(forward), the backward's inputs to head shards and dq/dk/dv back (backward). Each is charged one latency."""

ULYSSES_BACKWARD_SETS = 2
"""What the backward's all-to-alls move, in forward sets (q, k, v and the output): `runtime/ulysses.py`
sends q, k, v, out and grad_out to head shards again (it saves token shards, not head shards) and dq, dk,
dv back, so twice the forward's bytes (lse, 4 bytes per head and token, left out). 1 would charge the
gradients alone (a runtime that kept head shards from the forward)."""

RECOMPUTE_TIME = 4 / 3
"""T(s)'s compute under gradient checkpointing, in units of fwd+bwd: the forward twice and the backward, which
costs two forwards: (2 + 2) / (1 + 2). Launches (gamma) alike; the TP all-reduces add the forward's 2 of
`TP_ALL_REDUCES_PER_LAYER` (`CostModel.tp_time_per_token`)."""

CEIL_RTOL = 1e-12
"""D's ceiling forgives this relative float error, so a sequence of exactly k x Act(C) gets k ranks."""

# --- Eq. 2, symbolically -------------------------------------------------------------------------
# s: sequence length, r: offload ratio, C: capacity (tokens per rank), l: layers per rank,
# W: ranks available (max_sequence only), B: min(B_d2h, B_h2d), tau: TP seconds per token and layer.
s_, r_, C_, l_, W_ = sympy.symbols("s r C l W", positive=True)
alpha1_, beta1_, gamma_, alpha2_, beta2_, B_ = sympy.symbols("alpha1 beta1 gamma alpha2 beta2 B", positive=True)
tau_ = sympy.Symbol("tau", nonnegative=True)
COEFFS = (alpha1_, beta1_, gamma_, alpha2_, beta2_, B_, tau_)

# tp: devices per HDP rank, h: bytes of one token's hidden state, B_dev: a device's intra-node link.
tp_, h_, B_dev_ = sympy.symbols("tp h B_dev", positive=True)
TAU = TP_ALL_REDUCES_PER_LAYER * 2 * (tp_ - 1) / tp_ * h_ / B_dev_
"""Ring all-reduces over tp devices, each moving 2 (tp - 1) / tp of its h bytes per token out of (and into)
every device."""
TAU_FN = sympy.lambdify((tp_, h_, B_dev_), TAU, "numpy")

T = alpha1_ * s_**2 + beta1_ * s_ + gamma_ + tau_ * s_

# Outside the decoder layers. n: tokens of a micro-batch; P: parameter bytes the model holds; shards: the devices
# its optimizer state is sharded over (each steps P / shards of it).
n_, P_, shards_ = sympy.symbols("n P shards", positive=True)
beta_head_, beta_embed_, delta_, omega_, sigma_ = sympy.symbols(
    "beta_head beta_embed delta omega sigma", nonnegative=True
)
E = (beta_head_ + beta_embed_) * n_ + l_ * gamma_ + delta_
"""E(n): what a micro-batch of n tokens costs beyond its sequences' layer work: the LM head and loss and the
embedding per token, every layer's launches (gamma, once per micro-batch however many sequences it packs) and
delta, the rest of its fixed cost (input copies, loss launches, host work)."""
O = omega_ * P_ / shards_ + sigma_
"""O: the optimizer step, once per step: fused AdamW, the gradient norm and clipping and the bf16 weight refresh
over the rank's shard of the parameters (omega seconds per parameter byte), and the step's fixed cost sigma."""
STEP_SYMBOLS = {s.name: s for s in (beta_head_, beta_embed_, delta_, omega_, sigma_)}
"""The symbols of the terms outside the decoder layers, by name."""
E_FN = sympy.lambdify((n_, l_, gamma_, beta_head_, beta_embed_, delta_), E, "numpy")
O_FN = sympy.lambdify((P_, shards_, omega_, sigma_), O, "numpy")
ACT = alpha2_ * s_ + beta2_
D_FRAC = (2 * ACT + (1 - r_) * (l_ - 2) * ACT) / (l_ * ACT.subs(s_, C_))
R_OVERLAP = sympy.solve(sympy.Eq(T, ACT * r_ / B_), r_)[0]
"""The largest r whose offload of one layer's Act(s) still hides under T(s)."""
R_SAVES_ONE = sympy.solve(sympy.Eq(D_FRAC.subs(r_, 0) - D_FRAC, 1), r_)[0]
"""The r at which offloading frees exactly one rank's worth, l x Act(C)."""
R_NEED = sympy.solve(sympy.Eq(D_FRAC, W_), r_)[0]
"""The r at which D(s, r) reaches W ranks."""

EXPRS: dict[str, sympy.Expr] = {
    "T": T,
    "Act": ACT,
    "D": sympy.ceiling(D_FRAC),
    "r_overlap": R_OVERLAP,
    "r_low": sympy.Min(1, R_SAVES_ONE),
    "E": E,
    "O": O,
}
"""Eq. 2 over symbolic coefficients; `CostModel.exprs` has them with a model's numbers substituted."""

ARGS = (s_, r_, C_, l_, *COEFFS)
T_FN = sympy.lambdify(ARGS, T, "numpy")
ACT_FN = sympy.lambdify(ARGS, ACT, "numpy")
D_FRAC_FN = sympy.lambdify(ARGS, D_FRAC, "numpy")
R_OVERLAP_FN = sympy.lambdify(ARGS, R_OVERLAP, "numpy")
R_SAVES_ONE_FN = sympy.lambdify(ARGS, R_SAVES_ONE, "numpy")
R_NEED_FN = sympy.lambdify((*ARGS, W_), R_NEED, "numpy")

# Where, along s, D(s) <= W can switch: r_overlap crossing 1, r_low or r_need; r_low reaching 1;
# r_need reaching 0 (s = W x C without offload) or 1 (s = W x C x l / 2 with full offload). Numerators
# of the differences, as polynomials in s, lambdified to their coefficient lists.
BOUNDARIES = [
    sympy.Poly(sympy.fraction(sympy.together(e))[0], s_).all_coeffs()
    for e in (R_OVERLAP - 1, R_OVERLAP - R_SAVES_ONE, R_SAVES_ONE - 1, R_OVERLAP - R_NEED, R_NEED - 1, R_NEED)
]
BOUNDARIES_FN = sympy.lambdify((C_, l_, W_, *COEFFS), BOUNDARIES, "numpy")


def tp_all_reduce_time(tp_size: int, bytes_per_token: float, link_bandwidth: float) -> float:
    """Seconds per token and layer, fwd+bwd, that an HDP rank of `tp_size` devices spends in Megatron TP's
    `TP_ALL_REDUCES_PER_LAYER` ring all-reduces of its tokens' hidden states (`bytes_per_token` each),
    every device sending at `link_bandwidth` bytes/s (its own intra-node link, not the group's). With
    sequence parallelism each all-reduce becomes a reduce-scatter plus an all-gather of the same bytes,
    so the same time. Exactly 0 at tp_size 1."""
    if tp_size == 1:
        return 0.0
    return float(TAU_FN(tp_size, bytes_per_token, link_bandwidth))


def ulysses_kv_heads(heads: int, kv_heads: int, ulysses: int) -> int:
    """K/V heads all Ulysses members hold together after the all-to-all (`runtime/ulysses.py`'s `HeadSplit`):
    member m gets the K/V heads of its H/u query heads, as few as keep GQA's grouping uniform,
    (H/u) / gcd(H/u, H/H_kv) each. H_kv when u divides H_kv; u when u > H_kv (each K/V head replicated
    to the members reading it); up to H otherwise."""
    per_member = heads // ulysses
    return ulysses * (per_member // math.gcd(per_member, heads // kv_heads))


def ceil_forgiving(x: np.ndarray) -> np.ndarray:
    """The ceiling, forgiving `CEIL_RTOL` of float error: a sequence of exactly k x Act(C) gets k ranks."""
    return np.ceil(x * (1 - CEIL_RTOL))


def real_roots(poly: list[float]) -> list[float]:
    """Real roots of a polynomial (highest degree first). Coefficients below 1e-60 of the largest are
    dropped from the front: their roots lie beyond 1e30, and np.roots would overflow dividing by them."""
    p = np.asarray(poly, np.float64)
    top = np.abs(p).max()
    if top == 0:
        return []
    p = p / top
    p = p[np.argmax(np.abs(p) >= 1e-60) :]
    return [x.real for x in np.roots(p) if abs(x.imag) <= 1e-9 * max(1.0, abs(x.real))]


def substitute(coefficients: tuple[float, ...], step_terms: dict[str, float]) -> dict[str, sympy.Expr]:
    """`EXPRS` with a model's numbers: `coefficients` in the order of `COEFFS`, `step_terms` by name
    (beta_head, beta_embed, delta, omega, sigma)."""
    values: dict[sympy.Symbol, float] = dict(zip(COEFFS, coefficients))
    values.update({STEP_SYMBOLS[name]: value for name, value in step_terms.items()})
    return {k: e.subs(values) for k, e in EXPRS.items()}
