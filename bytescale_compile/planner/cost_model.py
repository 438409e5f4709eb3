"""The planner's cost model (paper §4.2, Eq. 2): per-layer time T(s), activation bytes Act(s), and the
ranks D(s) and offload ratio r a long sequence needs.

The equations are sympy expressions over symbolic coefficients, solved once at import and lambdified
to numpy, so one CostModel evaluates them on arrays of 10^5 sequence lengths in about a millisecond.
Coefficients come from a model shape and a hardware description (`CostModel.analytic`, the Table 1
presets of `CostModel.preset`) or from the profiler (`planner/profiler.py`, source "profiled"). T(s) also
charges the tensor-parallel all-reduces of an HDP rank that is a TP group (`tp_all_reduce_time`). With
`recompute` (gradient checkpointing) every layer's forward runs twice: T(s) and the forward's P2P grow by it.

Beside the decoder layers a step runs the embedding, the LM head and its loss once per micro-batch over all its
tokens, launches every layer once per micro-batch however many sequences it packs, and ends with one optimizer
step. So the work of one sequence is `seq_time` = l x (T(s) - gamma) + (beta_head + beta_embed) s, a micro-batch
adds E's constant, l x gamma + delta, once (`micro_batch_overhead`), and a step adds O = omega x P / shards + sigma
(`optimizer_time`). The analytic models leave beta_head, beta_embed, delta, omega and
sigma at 0 (the paper's T(s), decoder layers only); `bytescale-compile profile` measures them.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, fields
from functools import cached_property
from pathlib import Path

import numpy as np
import sympy

from .topology import Topology

__all__ = [
    "CEIL_RTOL",
    "EXPRS",
    "HARDWARE_PRESETS",
    "KERNELS_PER_LAYER",
    "PRESETS",
    "RECOMPUTE_TIME",
    "STEP_TERMS",
    "TP_ALL_REDUCES_PER_LAYER",
    "ULYSSES_ALL_TO_ALLS_PER_LAYER",
    "ULYSSES_BACKWARD_SETS",
    "ulysses_kv_heads",
    "CostModel",
    "Hardware",
    "ModelShape",
    "Topology",
    "tp_all_reduce_time",
]

logger = logging.getLogger(__name__)

BF16 = 2
"""Bytes per element of the bf16 activations, gradients and parameters the analytic model assumes."""

KERNELS_PER_LAYER = 20
"""Launches per layer that the analytic gamma charges `Hardware.latency` for."""

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

_FORMAT = "bytescale_compile.cost_model"
_COEFFICIENT_KEYS = ("alpha1", "beta1", "gamma", "alpha2", "beta2")
STEP_TERMS = ("beta_head", "beta_embed", "delta", "omega", "sigma")
"""The coefficients outside the decoder layers (E(n) and O); files written before them load with 0 for each."""


@dataclass(frozen=True)
class ModelShape:
    """What the analytic model needs of a transformer. MoE: FFN FLOPs and activations scale by top_k,
    FFN parameters by experts."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    experts: int = 1
    top_k: int = 1

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "experts", "top_k"):
            if getattr(self, f) < 1:
                raise ValueError(f"ModelShape {self.name!r}: {f} must be >= 1, got {getattr(self, f)}")
        if self.top_k > self.experts:
            raise ValueError(f"ModelShape {self.name!r}: top_k {self.top_k} > experts {self.experts}")

    @property
    def head_dim(self) -> int:
        """hidden // heads (Table 1's LLaMA-30B, 6656 over 56 heads, rounds down to 118)."""
        return self.hidden // self.heads

    @property
    def linear_flops_per_token(self) -> int:
        """Forward FLOPs of a layer's matmuls per token: qkv, o and the SwiGLU gate/up/down of top_k
        experts, 2 FLOPs per multiply-add."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        return 2 * (h * (h + 2 * kv) + h * h + 3 * h * self.ffn * self.top_k)

    @property
    def act_bytes_per_token(self) -> int:
        """bf16 bytes a layer saves for backward per token, no recompute, flash attention (which keeps
        no s x s matrix): the input-norm input, the qkv input, q (after RoPE), k and v, the attention
        output (also the o-proj input), the post-norm input and the MLP input: 6 x hidden + 2 x kv dim;
        a fused SwiGLU keeps gate and up outputs and their product (the down-proj input): 3 x ffn per
        routed expert. Per-token fp32 norm statistics and the attention log-sum-exp are left out."""
        return BF16 * (6 * self.hidden + 2 * self.kv_heads * self.head_dim + 3 * self.ffn * self.top_k)

    @property
    def params(self) -> int:
        """Parameters: per layer qkv, o, experts x SwiGLU, the router (MoE) and two norms; untied
        embedding and lm_head; the final norm."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        router = h * self.experts if self.experts > 1 else 0
        layer = h * (h + 2 * kv) + h * h + 3 * h * self.ffn * self.experts + router + 2 * h
        return self.layers * layer + 2 * self.vocab * h + h


@dataclass(frozen=True)
class Hardware:
    """One HDP rank: a GPU, or a TP group seen as one rank. With a `topology`, ring P2P runs at the
    bandwidth of the links a ring crosses (`Topology`); without one, every rank has its own
    `network_bandwidth` link and rings never meet."""

    name: str = "h100"
    matmul_flops: float = 989e12
    """Dense bf16 peak, FLOP/s."""
    mfu: float = 0.45
    """Fraction of the peak that training achieves."""
    hbm_bytes: float = 80e9
    d2h_bandwidth: float = 25e9
    """Bytes/s, PCIe device to host (offload)."""
    h2d_bandwidth: float = 25e9
    """Bytes/s, PCIe host to device (reload)."""
    network_bandwidth: float = 25e9
    """Bytes/s per rank, for ring P2P (without a topology) and the gradient all-reduce."""
    latency: float = 10e-6
    """Seconds per message or kernel launch (the gamma of T(s))."""
    topology: Topology | None = None
    compute_slots: float | None = None
    """Ranks that compute at full speed at once when every rank of the job shares one machine (CPU ranks
    oversubscribing its cores: cores / threads per rank); more busy ranks than that slow each one down in
    proportion (`sim/simulator.py`). None: every rank has its own device."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "compute_slots" and value is None:
                continue
            if f.name not in ("name", "topology") and not (math.isfinite(value) and value > 0):
                raise ValueError(f"Hardware {self.name!r}: {f.name} must be a positive number, got {value}")
        if self.mfu > 1:
            raise ValueError(f"Hardware {self.name!r}: mfu must be <= 1, got {self.mfu}")
        if self.topology is not None and not isinstance(self.topology, Topology):
            raise TypeError(f"Hardware {self.name!r}: topology must be a Topology, got {type(self.topology).__name__}")

    @classmethod
    def preset(cls, name: str, tp_size: int = 1) -> Hardware:
        """One HDP rank of TP `tp_size` devices on a cluster of `HARDWARE_PRESETS`: peak FLOPs, HBM, PCIe and
        NIC shares scale with the rank's devices."""
        if name not in HARDWARE_PRESETS:
            raise ValueError(f"unknown hardware preset {name!r}; presets: {', '.join(HARDWARE_PRESETS)}")
        return HARDWARE_PRESETS[name](tp_size)

    @classmethod
    def from_dict(cls, data: dict) -> Hardware:
        """The inverse of `dataclasses.asdict` (what `CostModel.save` writes)."""
        topology = data.get("topology")
        return cls(**{**data, "topology": Topology(**topology) if topology is not None else None})

    @property
    def tp_size(self) -> int:
        """Devices per HDP rank: the topology's TP size. Without a topology 1, so no TP communication is
        charged (a rank is one device, or a TP group whose coefficients already hold its all-reduces)."""
        return 1 if self.topology is None else self.topology.tp_size

    @property
    def tp_link(self) -> float:
        """Bytes/s per direction of one device's intra-node link, which the TP all-reduces run on (NVLink,
        or PCIe through the switch on the L20 servers); infinite without a topology (no TP traffic)."""
        return math.inf if self.topology is None else self.topology.device_link

    def ring_bandwidth(self, group_size) -> np.ndarray:
        """Bytes/s per rank of a ring of `group_size` adjacent ranks (vectorised)."""
        if self.topology is None:
            return np.full(np.shape(group_size), self.network_bandwidth)
        return self.topology.aligned_ring_bandwidth(group_size)

    def split_ring_bandwidth(self, ranks: tuple[int, ...], ulysses: int) -> float:
        """Bytes/s per rank of the `ulysses` rings of a u × r split over `ranks` (`Topology.split_ring_bandwidth`);
        `network_bandwidth` without a topology."""
        if self.topology is None:
            return self.network_bandwidth
        return self.topology.split_ring_bandwidth(ranks, ulysses)

    def all_to_all_bandwidth(self, ranks: tuple[int, ...], ulysses: int) -> float:
        """Bytes/s per rank of the Ulysses all-to-alls of groups of `ulysses` consecutive `ranks`
        (`Topology.all_to_all_bandwidth`); `network_bandwidth` without a topology."""
        if self.topology is None:
            return self.network_bandwidth if ulysses > 1 else math.inf
        return self.topology.all_to_all_bandwidth(ranks, ulysses)


def _l20_cluster(tp_size: int) -> Hardware:
    """The paper's cluster (the draft text of §6.1): 16 L20s per server (119.5 TFLOP/s dense bf16, 48 GB), 4
    PCIe switches each linking 4 GPUs and 2 NICs, PCIe 64 GB/s bidirectional (32 per direction), 8 x 400
    Gbps RDMA per server. Assumed: a switch's uplink to the host is one x16 link (32 GB/s per direction), and
    the offload copies of the switch's GPUs share it."""
    topology = Topology(
        devices_per_node=16,
        devices_per_switch=4,
        tp_size=tp_size,
        device_link=32e9,
        switch_uplink=32e9,
        nic_bandwidth=50e9,
        nics_per_node=8,
    )
    offload = topology.switch_uplink / topology.ranks_per_switch
    return Hardware(
        name=f"l20-tp{tp_size}",
        matmul_flops=tp_size * 119.5e12,
        hbm_bytes=tp_size * 48e9,
        d2h_bandwidth=offload,
        h2d_bandwidth=offload,
        network_bandwidth=topology.rank_rail,
        topology=topology,
    )


def _h100_nvlink(tp_size: int) -> Hardware:
    """8 H100 SXM per node on one NVSwitch (NVLink 450 GB/s per direction), one 400 Gbps NIC per GPU, each
    GPU with its own PCIe x16 Gen5 link to the host (about 50 GB/s per direction for offload)."""
    topology = Topology(
        devices_per_node=8,
        devices_per_switch=8,
        tp_size=tp_size,
        device_link=450e9,
        switch_uplink=450e9,
        nic_bandwidth=50e9,
        nics_per_node=8,
    )
    return Hardware(
        name=f"h100-nvlink-tp{tp_size}",
        matmul_flops=tp_size * 989e12,
        hbm_bytes=tp_size * 80e9,
        d2h_bandwidth=tp_size * 50e9,
        h2d_bandwidth=tp_size * 50e9,
        network_bandwidth=topology.rank_rail,
        topology=topology,
    )


HARDWARE_PRESETS = {"l20": _l20_cluster, "h100-nvlink": _h100_nvlink}
"""Clusters by name; each builds the Hardware of one HDP rank for a TP size."""


PRESETS: dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        ModelShape("llama-7b", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=11008, vocab=32000),
        ModelShape("llama-13b", layers=40, hidden=5120, heads=40, kv_heads=8, ffn=13824, vocab=32000),
        ModelShape("llama-30b", layers=60, hidden=6656, heads=56, kv_heads=8, ffn=17920, vocab=32000),
        ModelShape("llama-70b", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=32000),
        ModelShape(
            "mistral-8x7b", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=32000, experts=8, top_k=2
        ),
        ModelShape(
            "mistral-8x22b", layers=56, hidden=6144, heads=48, kv_heads=8, ffn=16384, vocab=32000, experts=8, top_k=2
        ),
    )
}
"""The paper's Table 1 models (vocab 32000 throughout)."""


# --- Eq. 2, symbolically -------------------------------------------------------------------------
# s: sequence length, r: offload ratio, C: capacity (tokens per rank), l: layers per rank,
# W: ranks available (max_sequence only), B: min(B_d2h, B_h2d), tau: TP seconds per token and layer.
s_, r_, C_, l_, W_ = sympy.symbols("s r C l W", positive=True)
alpha1_, beta1_, gamma_, alpha2_, beta2_, B_ = sympy.symbols("alpha1 beta1 gamma alpha2 beta2 B", positive=True)
tau_ = sympy.Symbol("tau", nonnegative=True)
_COEFFS = (alpha1_, beta1_, gamma_, alpha2_, beta2_, B_, tau_)

# tp: devices per HDP rank, h: bytes of one token's hidden state, B_dev: a device's intra-node link.
tp_, h_, B_dev_ = sympy.symbols("tp h B_dev", positive=True)
_TAU = TP_ALL_REDUCES_PER_LAYER * 2 * (tp_ - 1) / tp_ * h_ / B_dev_
"""Ring all-reduces over tp devices, each moving 2 (tp - 1) / tp of its h bytes per token out of (and into)
every device."""
_TAU_FN = sympy.lambdify((tp_, h_, B_dev_), _TAU, "numpy")

_T = alpha1_ * s_**2 + beta1_ * s_ + gamma_ + tau_ * s_

# Outside the decoder layers. n: tokens of a micro-batch; P: parameter bytes the model holds; shards: the devices
# its optimizer state is sharded over (each steps P / shards of it).
n_, P_, shards_ = sympy.symbols("n P shards", positive=True)
beta_head_, beta_embed_, delta_, omega_, sigma_ = sympy.symbols(
    "beta_head beta_embed delta omega sigma", nonnegative=True
)
_E = (beta_head_ + beta_embed_) * n_ + l_ * gamma_ + delta_
"""E(n): what a micro-batch of n tokens costs beyond its sequences' layer work: the LM head and loss and the
embedding per token, every layer's launches (gamma, once per micro-batch however many sequences it packs) and
delta, the rest of its fixed cost (input copies, loss launches, host work)."""
_O = omega_ * P_ / shards_ + sigma_
"""O: the optimizer step, once per step: fused AdamW, the gradient norm and clipping and the bf16 weight refresh
over the rank's shard of the parameters (omega seconds per parameter byte), and the step's fixed cost sigma."""
_E_FN = sympy.lambdify((n_, l_, gamma_, beta_head_, beta_embed_, delta_), _E, "numpy")
_O_FN = sympy.lambdify((P_, shards_, omega_, sigma_), _O, "numpy")
_ACT = alpha2_ * s_ + beta2_
_D_FRAC = (2 * _ACT + (1 - r_) * (l_ - 2) * _ACT) / (l_ * _ACT.subs(s_, C_))
_R_OVERLAP = sympy.solve(sympy.Eq(_T, _ACT * r_ / B_), r_)[0]
"""The largest r whose offload of one layer's Act(s) still hides under T(s)."""
_R_SAVES_ONE = sympy.solve(sympy.Eq(_D_FRAC.subs(r_, 0) - _D_FRAC, 1), r_)[0]
"""The r at which offloading frees exactly one rank's worth, l x Act(C)."""
_R_NEED = sympy.solve(sympy.Eq(_D_FRAC, W_), r_)[0]
"""The r at which D(s, r) reaches W ranks."""

EXPRS: dict[str, sympy.Expr] = {
    "T": _T,
    "Act": _ACT,
    "D": sympy.ceiling(_D_FRAC),
    "r_overlap": _R_OVERLAP,
    "r_low": sympy.Min(1, _R_SAVES_ONE),
    "E": _E,
    "O": _O,
}
"""Eq. 2 over symbolic coefficients; `CostModel.exprs` has them with a model's numbers substituted."""

_ARGS = (s_, r_, C_, l_, *_COEFFS)
_T_FN = sympy.lambdify(_ARGS, _T, "numpy")
_ACT_FN = sympy.lambdify(_ARGS, _ACT, "numpy")
_D_FRAC_FN = sympy.lambdify(_ARGS, _D_FRAC, "numpy")
_R_OVERLAP_FN = sympy.lambdify(_ARGS, _R_OVERLAP, "numpy")
_R_SAVES_ONE_FN = sympy.lambdify(_ARGS, _R_SAVES_ONE, "numpy")
_R_NEED_FN = sympy.lambdify((*_ARGS, W_), _R_NEED, "numpy")

# Where, along s, D(s) <= W can switch: r_overlap crossing 1, r_low or r_need; r_low reaching 1;
# r_need reaching 0 (s = W x C without offload) or 1 (s = W x C x l / 2 with full offload). Numerators
# of the differences, as polynomials in s, lambdified to their coefficient lists.
_BOUNDARIES = [
    sympy.Poly(sympy.fraction(sympy.together(e))[0], s_).all_coeffs()
    for e in (_R_OVERLAP - 1, _R_OVERLAP - _R_SAVES_ONE, _R_SAVES_ONE - 1, _R_OVERLAP - _R_NEED, _R_NEED - 1, _R_NEED)
]
_BOUNDARIES_FN = sympy.lambdify((C_, l_, W_, *_COEFFS), _BOUNDARIES, "numpy")


def tp_all_reduce_time(tp_size: int, bytes_per_token: float, link_bandwidth: float) -> float:
    """Seconds per token and layer, fwd+bwd, that an HDP rank of `tp_size` devices spends in Megatron TP's
    `TP_ALL_REDUCES_PER_LAYER` ring all-reduces of its tokens' hidden states (`bytes_per_token` each),
    every device sending at `link_bandwidth` bytes/s (its own intra-node link, not the group's). With
    sequence parallelism each all-reduce becomes a reduce-scatter plus an all-gather of the same bytes,
    so the same time. Exactly 0 at tp_size 1."""
    if tp_size == 1:
        return 0.0
    return float(_TAU_FN(tp_size, bytes_per_token, link_bandwidth))


def ulysses_kv_heads(heads: int, kv_heads: int, ulysses: int) -> int:
    """K/V heads all Ulysses members hold together after the all-to-all (`runtime/ulysses.py`'s `HeadSplit`):
    member m gets the K/V heads of its H/u query heads, as few as keep GQA's grouping uniform,
    (H/u) / gcd(H/u, H/H_kv) each. H_kv when u divides H_kv; u when u > H_kv (each K/V head replicated
    to the members reading it); up to H otherwise."""
    per_member = heads // ulysses
    return ulysses * (per_member // math.gcd(per_member, heads // kv_heads))


def _ceil(x: np.ndarray) -> np.ndarray:
    return np.ceil(x * (1 - CEIL_RTOL))


def _real_roots(poly: list[float]) -> list[float]:
    """Real roots of a polynomial (highest degree first). Coefficients below 1e-60 of the largest are
    dropped from the front: their roots lie beyond 1e30, and np.roots would overflow dividing by them."""
    p = np.asarray(poly, np.float64)
    top = np.abs(p).max()
    if top == 0:
        return []
    p = p / top
    p = p[np.argmax(np.abs(p) >= 1e-60) :]
    return [x.real for x in np.roots(p) if abs(x.imag) <= 1e-9 * max(1.0, abs(x.real))]


def _check_capacity(capacity: int) -> None:
    if not (isinstance(capacity, (int, np.integer)) and capacity >= 1):
        raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")


@dataclass(frozen=True)
class CostModel:
    """T(s) = alpha1 s^2 + beta1 s + gamma + tau s (seconds, one layer, fwd+bwd; tau s the TP all-reduces,
    `tp_all_reduce_time`), Act(s) = alpha2 s + beta2 (bytes, one layer), plus what the planner needs beside
    them: total layers, the K/V bytes a ring step moves per token and layer, the parameter bytes, the
    hardware's bandwidths and latency."""

    alpha1: float
    beta1: float
    gamma: float
    alpha2: float
    beta2: float
    layers: int
    kv_bytes_per_token: int
    param_bytes: float
    hardware: Hardware
    source: str
    device: str | None = None
    """Where the coefficients were measured ("cpu", "cuda:0 (NVIDIA H100 80GB HBM3)"); None for analytic ones."""
    ring_overhead: float = 0.0
    """Seconds of compute a ring step adds per token held, per layer (merging partial attention outputs,
    zigzag gathers): `ring_compute_time`. 0 where that work is negligible beside the layer (the analytic
    models); on a CPU, where nothing hides it, the job's calibration measures it (`train/calibrate.py`)."""
    boundary_bytes_per_token: float | None = None
    """Bytes of one token's hidden state at a pipeline-stage boundary (hidden x activation bytes), what a
    stage sends on per token; None: read back from alpha1, exact for analytic models only
    (`hidden_bytes_per_token`)."""
    mixer_layers: int = 0
    """Of `layers`, those whose token mixer is a convolution or a scan (hybrid models) rather than attention: no
    K/V travels for them, only `mixer_state_bytes` per chunk boundary (the compile report's `mixer_costs`)."""
    mixer_state_bytes: float = 0.0
    """Bytes one chunk boundary of a shared sequence moves forward, over all mixer layers: halos and state
    summaries, whatever the sequence's length."""
    tp_comm_time: float | None = None
    """Seconds per token and layer of the TP all-reduces, the tau of T(s). None: derived from the hardware's
    TP group (`tp_all_reduce_time`); 0 charges none, for coefficients measured on a TP group, which already
    hold them."""
    heads: int | None = None
    """Query heads of an attention layer: the Ulysses degrees a split may take divide it. None: unknown
    (files written before it was recorded), so no micro-batch is split by heads."""
    kv_heads: int | None = None
    """K/V heads of an attention layer (GQA); `kv_bytes_per_token` is 2 x kv_heads x head_dim x element bytes."""
    head_shards: int | None = None
    """Devices of an HDP rank whose tensor-parallel shards of the heads each attend `device_heads`; None: the
    hardware's TP size. Ulysses splits each device's heads, not the rank's."""
    recompute: bool = False
    """Gradient checkpointing: the backward recomputes each layer's forward, so T(s) charges `RECOMPUTE_TIME`
    and the forward's ring P2P and all-to-alls are sent twice. Set by the Runtime for a checkpointed model;
    coefficients measured on one (`train/calibrate.py` refits T on the model it trains) already hold the
    recompute's time."""
    beta_head: float = 0.0
    """Seconds per token of the LM head and its fused loss, fwd+bwd (three GEMMs of tokens x hidden x vocab): E(n)."""
    beta_embed: float = 0.0
    """Seconds per token of the embedding, fwd+bwd (a gather, and its gradient's scatter-add): E(n)."""
    delta: float = 0.0
    """Seconds per micro-batch beside its layers' launches (gamma): input copies, the loss's launches, host work."""
    omega: float = 0.0
    """Seconds per byte of `param_bytes` that a rank's optimizer step takes over its shard: fused AdamW, the
    gradient norm and clipping, the bf16 weight refresh (O)."""
    sigma: float = 0.0
    """Seconds per step beside the optimizer's work in proportion to its shard: its launches and host work (O)."""

    @property
    def _head_shards(self) -> int:
        return self.hardware.tp_size if self.head_shards is None else self.head_shards

    @property
    def device_heads(self) -> tuple[int, int] | None:
        """(query heads, K/V heads) that each device of an HDP rank attends under tensor parallelism (K/V heads
        at least one: Megatron copies them where the shards outnumber them); None where the heads are unknown."""
        if self.heads is None or self.kv_heads is None:
            return None
        shards = self._head_shards
        return self.heads // shards, max(1, self.kv_heads // shards)

    @property
    def ring_layers(self) -> int:
        """Layers whose K/V travel around the ring: the attention layers."""
        return self.layers - self.mixer_layers

    def __post_init__(self) -> None:
        for name in ("alpha1", "beta1", "gamma", "alpha2", "beta2", "param_bytes", "ring_overhead", *STEP_TERMS):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"CostModel ({self.source}): {name} must be a finite number >= 0, got {value!r}")
        if self.alpha2 <= 0:
            raise ValueError(
                f"CostModel ({self.source}): alpha2 must be > 0 (activations grow with tokens), got {self.alpha2}"
            )
        if not (isinstance(self.layers, int) and self.layers >= 1):
            raise ValueError(f"CostModel ({self.source}): layers must be an int >= 1, got {self.layers!r}")
        if not (isinstance(self.kv_bytes_per_token, int) and self.kv_bytes_per_token >= 0):
            raise ValueError(
                f"CostModel ({self.source}): kv_bytes_per_token must be an int >= 0, got {self.kv_bytes_per_token!r}"
            )
        if not isinstance(self.hardware, Hardware):
            raise TypeError(
                f"CostModel ({self.source}): hardware must be a Hardware, got {type(self.hardware).__name__}"
            )
        if not (isinstance(self.mixer_layers, int) and 0 <= self.mixer_layers <= self.layers):
            raise ValueError(
                f"CostModel ({self.source}): mixer_layers must be an int in [0, layers={self.layers}], "
                f"got {self.mixer_layers!r}"
            )
        if not (math.isfinite(self.mixer_state_bytes) and self.mixer_state_bytes >= 0):
            raise ValueError(
                f"CostModel ({self.source}): mixer_state_bytes must be >= 0, got {self.mixer_state_bytes!r}"
            )
        tp_comm = self.tp_comm_time
        if tp_comm is not None and not (isinstance(tp_comm, (int, float)) and math.isfinite(tp_comm) and tp_comm >= 0):
            raise ValueError(
                f"CostModel ({self.source}): tp_comm_time must be None or a finite number >= 0, got {tp_comm!r}"
            )
        for name in ("heads", "kv_heads"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and value >= 1):
                raise ValueError(f"CostModel ({self.source}): {name} must be None or an int >= 1, got {value!r}")
        if (self.heads is None) != (self.kv_heads is None) or (
            self.heads and self.kv_heads and self.heads % self.kv_heads
        ):
            raise ValueError(
                f"CostModel ({self.source}): heads {self.heads} and kv_heads {self.kv_heads} must both be given, "
                f"kv_heads dividing heads, or both None"
            )
        if not isinstance(self.recompute, bool):
            raise ValueError(f"CostModel ({self.source}): recompute must be a bool, got {self.recompute!r}")
        shards = self.head_shards
        if shards is not None and not (isinstance(shards, int) and shards >= 1):
            raise ValueError(f"CostModel ({self.source}): head_shards must be None or an int >= 1, got {shards!r}")
        if self.heads is not None and self.heads % self._head_shards:
            raise ValueError(
                f"CostModel ({self.source}): {self.heads} query heads cannot be split over {self._head_shards} "
                f"tensor-parallel devices (head_shards, or the hardware's tp_size)"
            )
        boundary = self.boundary_bytes_per_token
        if boundary is not None and not (
            isinstance(boundary, (int, float)) and math.isfinite(boundary) and boundary > 0
        ):
            raise ValueError(
                f"CostModel ({self.source}): boundary_bytes_per_token must be None or a finite number "
                f"> 0, got {boundary!r}"
            )

    # --- construction ----------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, hardware: Hardware | None = None) -> CostModel:
        """The analytic model of a Table 1 model by name."""
        if name not in PRESETS:
            raise ValueError(f"unknown cost-model preset {name!r}; presets: {', '.join(PRESETS)}")
        return cls.analytic(PRESETS[name], hardware)

    @classmethod
    def analytic(cls, shape: ModelShape, hardware: Hardware | None = None) -> CostModel:
        """Coefficients from FLOP and byte counts. Backward costs twice the forward, so a layer's fwd+bwd is
        3 x its forward FLOPs, run at matmul_flops x mfu: alpha1 = 3 x 2 hidden / rate (causal attention's
        QK^T and PV, 4 s^2 hidden halved by the mask), beta1 = 3 x linear_flops_per_token / rate,
        gamma = KERNELS_PER_LAYER launches of `latency`. alpha2 = act_bytes_per_token, beta2 = 0."""
        hw = hardware or Hardware()
        rate = hw.matmul_flops * hw.mfu
        return cls(
            alpha1=3 * 2 * shape.hidden / rate,
            beta1=3 * shape.linear_flops_per_token / rate,
            gamma=KERNELS_PER_LAYER * hw.latency,
            alpha2=float(shape.act_bytes_per_token),
            beta2=0.0,
            layers=shape.layers,
            kv_bytes_per_token=2 * shape.kv_heads * shape.head_dim * BF16,
            param_bytes=float(BF16 * shape.params),
            hardware=hw,
            source=f"analytic:{shape.name}",
            boundary_bytes_per_token=float(BF16 * shape.hidden),
            heads=shape.heads,
            kv_heads=shape.kv_heads,
        )

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        """A model written by `save` (the profiler's output); errors name the file and a missing key. Files
        written before `device` was recorded load with device None; before `tp_comm_time`, with tau derived
        from the hardware (0 without a topology, whose rank is one device); before `STEP_TERMS`, with each 0
        (decoder layers only: a warning names them and says how to measure them)."""
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise FileNotFoundError(f"cost model file {path} does not exist") from None
        try:
            data = json.loads(text)
            if data.get("format") != _FORMAT:
                raise ValueError(f"'format' is {data.get('format')!r}, expected {_FORMAT!r}")
            coefficients = {k: data["coefficients"][k] for k in _COEFFICIENT_KEYS}
            missing = [k for k in STEP_TERMS if k not in data["coefficients"]]
            if missing:
                logger.warning(
                    "cost model file %s has no %s: it predicts the decoder layers only (no LM head, loss, "
                    "embedding, per-micro-batch cost or optimizer step); profile again with `bytescale-compile "
                    "profile` to measure them",
                    path,
                    ", ".join(missing),
                )
            step_terms = {k: data["coefficients"].get(k, 0.0) for k in STEP_TERMS}
            return cls(
                **coefficients,
                layers=data["layers"],
                kv_bytes_per_token=data["kv_bytes_per_token"],
                param_bytes=data["param_bytes"],
                hardware=Hardware.from_dict(data["hardware"]),
                source=data["source"],
                device=data.get("device"),
                ring_overhead=data["coefficients"].get("ring_overhead", 0.0),
                boundary_bytes_per_token=data.get("boundary_bytes_per_token"),
                mixer_layers=data.get("mixer_layers", 0),
                mixer_state_bytes=data.get("mixer_state_bytes", 0.0),
                tp_comm_time=data["coefficients"].get("tp_comm_time"),
                heads=data.get("heads"),
                kv_heads=data.get("kv_heads"),
                recompute=data.get("recompute", False),
                **step_terms,
            )
        except KeyError as e:
            raise ValueError(
                f"cost model file {path} lacks the key {e.args[0]!r}: write it again with "
                f"`bytescale-compile profile` or CostModel.save"
            ) from None
        except (ValueError, TypeError, AttributeError) as e:
            raise ValueError(f"cost model file {path} is not a valid cost model: {type(e).__name__}: {e}") from None

    def save(self, path: str | Path) -> None:
        """JSON: coefficients, layers, byte counts, hardware and source; `load` reads it back exactly."""
        data = {
            "format": _FORMAT,
            "source": self.source,
            "coefficients": {
                k: getattr(self, k) for k in (*_COEFFICIENT_KEYS, "ring_overhead", "tp_comm_time", *STEP_TERMS)
            },
            "layers": self.layers,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "param_bytes": self.param_bytes,
            "hardware": asdict(self.hardware),
            "device": self.device,
            "boundary_bytes_per_token": self.boundary_bytes_per_token,
            "mixer_layers": self.mixer_layers,
            "mixer_state_bytes": self.mixer_state_bytes,
            "heads": self.heads,
            "kv_heads": self.kv_heads,
            "recompute": self.recompute,
        }
        Path(path).write_text(json.dumps(data, indent=2) + "\n")

    # --- hardware views --------------------------------------------------------------------------
    @property
    def d2h_bandwidth(self) -> float:
        return self.hardware.d2h_bandwidth

    @property
    def h2d_bandwidth(self) -> float:
        return self.hardware.h2d_bandwidth

    @property
    def network_bandwidth(self) -> float:
        return self.hardware.network_bandwidth

    @property
    def latency(self) -> float:
        return self.hardware.latency

    @property
    def offload_bandwidth(self) -> float:
        """min(B_d2h, B_h2d): an offloaded activation has to go out and come back."""
        return min(self.d2h_bandwidth, self.h2d_bandwidth)

    @property
    def hidden_bytes_per_token(self) -> float:
        """Bytes of one token's hidden state, what a stage boundary sends and a TP all-reduce reduces:
        `boundary_bytes_per_token`, else hidden x bf16 with hidden read back from attention's coefficient,
        alpha1 = 3 x 2 hidden / rate (files written before the figure was recorded)."""
        if self.boundary_bytes_per_token is not None:
            return self.boundary_bytes_per_token
        hw = self.hardware
        return float(BF16 * round(self.alpha1 * hw.matmul_flops * hw.mfu / 6))

    @cached_property
    def tp_time_per_token(self) -> float:
        """tau: seconds per token and layer, fwd+bwd, of the rank's TP all-reduces (`tp_comm_time` when
        given, else `tp_all_reduce_time` of the hardware's TP group and link); 0 at TP 1."""
        if self.tp_comm_time is not None:
            tau = float(self.tp_comm_time)
        else:
            hw = self.hardware
            tau = tp_all_reduce_time(hw.tp_size, self.hidden_bytes_per_token, hw.tp_link)
        return tau * (TP_ALL_REDUCES_PER_LAYER + 2) / TP_ALL_REDUCES_PER_LAYER if self.recompute else tau

    @cached_property
    def exprs(self) -> dict[str, sympy.Expr]:
        """EXPRS with this model's coefficients; free symbols s, r, C, l (and n, P, shards of E and O)."""
        values: dict[sympy.Symbol, float] = dict(zip(_COEFFS, self._coeffs()))
        values.update(
            {beta_head_: self.beta_head, beta_embed_: self.beta_embed, delta_: self.delta, omega_: self.omega}
        )
        values[sigma_] = self.sigma
        return {k: e.subs(values) for k, e in EXPRS.items()}

    def _coeffs(self) -> tuple[float, ...]:
        compute = RECOMPUTE_TIME if self.recompute else 1.0
        return (
            compute * self.alpha1,
            compute * self.beta1,
            compute * self.gamma,
            self.alpha2,
            self.beta2,
            self.offload_bandwidth,
            self.tp_time_per_token,
        )

    # --- evaluations (vectorised) ----------------------------------------------------------------
    def layer_time(self, s) -> np.ndarray:
        """T(s): seconds, fwd+bwd of one layer over s tokens, the TP all-reduces included."""
        return np.asarray(_T_FN(np.asarray(s, np.float64), 0, 0, 0, *self._coeffs()), np.float64)

    def act(self, s) -> np.ndarray:
        """Act(s): bytes one layer saves for backward over s tokens."""
        return np.asarray(_ACT_FN(np.asarray(s, np.float64), 0, 0, 0, *self._coeffs()), np.float64)

    def seq_time(self, s) -> np.ndarray:
        """The work of one sequence in a micro-batch, fwd+bwd: layers x (T(s) - gamma), plus its tokens' share of
        the LM head, loss and embedding. Additive over the sequences a micro-batch packs; the micro-batch's
        fixed cost is `micro_batch_overhead`. So a micro-batch of one sequence takes layers x T(s) + E(s)'s
        per-token part + E's constant."""
        s = np.asarray(s, np.float64)
        compute = RECOMPUTE_TIME if self.recompute else 1.0
        return self.layers * (self.layer_time(s) - compute * self.gamma) + (self.beta_head + self.beta_embed) * s

    @property
    def micro_batch_overhead(self) -> float:
        """Seconds a micro-batch costs once, whatever it packs: E(n)'s constant, every layer's launches (gamma,
        on each rank of a shared micro-batch alike) and delta."""
        compute = RECOMPUTE_TIME if self.recompute else 1.0
        return float(_E_FN(0.0, self.layers, compute * self.gamma, self.beta_head, self.beta_embed, self.delta))

    def micro_batch_time(self, s) -> float:
        """E(n) plus the layers: seconds of one micro-batch packing sequences of lengths `s` on one rank."""
        return float(self.seq_time(s).sum()) + self.micro_batch_overhead

    def optimizer_time(self, shards: int) -> float:
        """O: seconds of the optimizer step on a rank holding 1/`shards` of the parameters' state (the
        distributed optimizer shards it over every device: HDP ranks x pipeline stages x TP)."""
        if not (isinstance(shards, (int, np.integer)) and shards >= 1):
            raise ValueError(f"shards must be an int >= 1, got {shards!r}")
        return float(_O_FN(self.param_bytes, shards, self.omega, self.sigma))

    def flops(self, s) -> np.ndarray:
        """Model FLOPs of a sequence, fwd+bwd, all layers: the compute part of T (gamma, the launch
        overhead, and tau, the TP all-reduces, left out) at matmul_flops x mfu. Exact for analytic models;
        for profiled ones the FLOPs this hardware would need for the measured time, which is what FLOP-equal
        buckets balance."""
        s = np.asarray(s, np.float64)
        return self.layers * (self.alpha1 * s * s + self.beta1 * s) * (self.hardware.matmul_flops * self.hardware.mfu)

    def ranks_needed(self, s, r, capacity: int, layers_per_rank: int | None = None) -> np.ndarray:
        """D(s, r) of Eq. 2 at a given offload ratio r (no constraint checked): int64, 0 for s <= C (such
        sequences are packed, Alg. 1 line 3), at least 1 above it."""
        l = self._layers_per_rank(layers_per_rank)
        _check_capacity(capacity)
        s = np.asarray(s, np.float64)
        long = s > capacity
        d = np.zeros(s.shape, np.int64)
        d[long] = self._ranks_long(s[long], np.broadcast_to(np.asarray(r, np.float64), s.shape)[long], capacity, l)
        return d

    def ranks_and_ratio(
        self, s, capacity: int, layers_per_rank: int | None = None, offload: bool = True
    ) -> tuple[np.ndarray, np.ndarray]:
        """Eq. 2 per sequence: (D int64, r float64). D decreases in r, so the argmin is the largest r the
        constraints allow, r* = min(1, r_overlap) with r_overlap = T(s) x B / Act(s), B = min(B_d2h, B_h2d).
        As the paper writes it, T(s) here is ONE layer's fwd+bwd time and Act(s) one layer's activations:
        each layer's offload must hide under that layer's compute. r* must also reach
        r_low = min(1, l x Act(C) / ((l-2) x Act(s))), below which offloading frees no rank; where it does
        not (or offload=False, or l <= 2, where only 2 layers' worth ever stay on the GPU anyway), r = 0
        and D = ceil(Act(s) / Act(C)). s <= C gives D = 0, r = 0 (packed).
        Only the sequences longer than C are evaluated: in real batches they are a small minority."""
        l = self._layers_per_rank(layers_per_rank)
        _check_capacity(capacity)
        s = np.asarray(s, np.float64)
        long = s > capacity
        s_long = s[long]
        r_long = np.zeros_like(s_long)
        if offload and l > 2:
            args = (s_long, 0, capacity, l, *self._coeffs())
            r_star = np.minimum(1.0, _R_OVERLAP_FN(*args))
            r_long = np.where(r_star >= np.minimum(1.0, _R_SAVES_ONE_FN(*args)), r_star, 0.0)
        d, r = np.zeros(s.shape, np.int64), np.zeros(s.shape)
        d[long], r[long] = self._ranks_long(s_long, r_long, capacity, l), r_long
        return d, r

    def ratio_for_ranks(self, s, ranks, capacity: int, layers_per_rank: int | None = None) -> np.ndarray:
        """The least offload ratio r with D(s, r) <= `ranks` (Eq. 2 solved for r), 0 where the sequence fits
        without offloading; above 1 where no ratio does (more than l/2 x ranks x C tokens)."""
        l = self._layers_per_rank(layers_per_rank)
        _check_capacity(capacity)
        s, w = np.broadcast_arrays(np.asarray(s, np.float64), np.asarray(ranks, np.float64))
        if l <= 2:
            return np.where(self.ranks_needed(s, 0.0, capacity, l) <= w, 0.0, np.inf)
        r = np.maximum(_R_NEED_FN(s, 0, capacity, l, *self._coeffs(), w), 0.0)
        return np.where(self.ranks_needed(s, r, capacity, l) <= w, r, np.nextafter(r, np.inf) + CEIL_RTOL)

    def _ranks_long(self, s: np.ndarray, r: np.ndarray, capacity: int, l: int) -> np.ndarray:
        """D(s, r) for s > C: the ceiling of Eq. 2's fraction, at least 1."""
        return np.maximum(_ceil(_D_FRAC_FN(s, r, capacity, l, *self._coeffs())), 1)

    def max_sequence(
        self, world_size: int, capacity: int, layers_per_rank: int | None = None, offload: bool = True
    ) -> int:
        """The longest s with D(s) <= world_size, D and r as `ranks_and_ratio` chooses them. D(s) is not
        monotone (offloading becomes feasible only once T(s) is long enough to hide it), so this takes the
        real roots of Eq. 2's boundary polynomials between C and the full-offload bound
        Act(s) = world x l x Act(C) / 2, and checks the integers around each one."""
        if not (isinstance(world_size, (int, np.integer)) and world_size >= 1):
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        l = self._layers_per_rank(layers_per_rank)
        _check_capacity(capacity)
        act_c = float(self.act(capacity))
        hi = (world_size * max(l, 2) * act_c / 2 - self.beta2) / self.alpha2
        points = [float(capacity), hi]
        for poly in _BOUNDARIES_FN(capacity, l, world_size, *self._coeffs()):
            points += [x for x in _real_roots(poly) if capacity <= x <= hi + 1]
        window = np.arange(-16, 17)
        candidates = np.unique(np.clip(np.floor(np.asarray(points))[:, None] + window, capacity, np.floor(hi) + 16))
        d, _ = self.ranks_and_ratio(candidates, capacity, l, offload)
        return int(candidates[d <= world_size].max())

    def ring_bytes(self, tokens_per_rank, group_size) -> np.ndarray:
        """Ring P2P bytes one rank sends for one micro-batch, all layers, fwd+bwd: each of (group_size - 1)
        steps moves the rank's K/V once forward and K/V plus their gradients backward (3 transfers), per
        attention layer. A hybrid's mixer layers send each of the rank's 2 chunks' halos and states to the
        (up to group_size - 1) ranks holding later chunks, forward, in the backward's recompute, and as
        gradients back (3 transfers), whatever the tokens. With `recompute` the forward's transfer is made
        twice (4)."""
        g = np.asarray(group_size, np.float64)
        sends = self._transfers
        attention = (
            self.ring_layers * sends * (g - 1) * np.asarray(tokens_per_rank, np.float64) * self.kv_bytes_per_token
        )
        return attention + sends * 2 * (g - 1) * self.mixer_state_bytes

    @property
    def _transfers(self) -> int:
        """Ring transfers per step and layer: the forward's (twice with `recompute`), 2 in the backward."""
        return 4 if self.recompute else 3

    def ring_latency(self, group_size) -> np.ndarray:
        """Seconds of P2P latency per rank for one micro-batch: a transfer per ring step and attention layer, and
        one batch per mixer layer, each `_transfers` times (forward, backward); 0 for a group of one."""
        g = np.asarray(group_size, np.float64)
        sends = self._transfers
        transfers = self.ring_layers * sends * (g - 1) + np.where(g > 1, sends * self.mixer_layers, 0)
        return transfers * self.latency

    def ring_time(self, tokens_per_rank, group_size) -> np.ndarray:
        """Ring P2P seconds per rank for one micro-batch: `ring_bytes` at the ring's bandwidth (the
        hardware's topology for a group of adjacent ranks, `Hardware.ring_bandwidth`), plus `ring_latency`.
        0 for a group of one."""
        bandwidth = self.hardware.ring_bandwidth(group_size)
        return self.ring_bytes(tokens_per_rank, group_size) / bandwidth + self.ring_latency(group_size)

    def ring_compute_time(self, tokens_per_rank, group_size) -> np.ndarray:
        """Compute seconds per rank the ring adds to a micro-batch, attention layers: (group_size - 1) steps of
        `ring_overhead` per token held. 0 for a group of one."""
        steps = self.ring_layers * (np.asarray(group_size, np.float64) - 1)
        return steps * np.asarray(tokens_per_rank, np.float64) * self.ring_overhead

    # --- Ulysses (head-parallel) splits: u x r = D(s) -------------------------------------------------
    @property
    def head_bytes_per_token(self) -> float:
        """Bytes of one head of one token (head_dim x element bytes): `kv_bytes_per_token` / (2 kv_heads);
        0 where the heads are unknown."""
        return self.kv_bytes_per_token / (2 * self.kv_heads) if self.kv_heads else 0.0

    def _ulysses_heads(self, ulysses: int) -> tuple[int, int]:
        """(query heads, K/V heads) an HDP rank's devices hold together after the all-to-all: each device's
        query heads, and `ulysses_kv_heads` of each device's heads."""
        device = self.device_heads
        if device is None:
            raise ValueError(f"CostModel ({self.source}) does not know the heads: it cannot cost a Ulysses split")
        return self._head_shards * device[0], self._head_shards * ulysses_kv_heads(*device, ulysses)

    def ulysses_bytes(self, tokens_per_rank, ulysses: int) -> np.ndarray:
        """Bytes one rank sends in the all-to-alls of Ulysses degree u for one micro-batch, all attention
        layers, fwd+bwd: per layer (u - 1)/u of its tokens' q, k, v and attention output (q and the output
        at H heads, k and v at `ulysses_kv_heads`), once forward (twice with `recompute`) and
        `ULYSSES_BACKWARD_SETS` times backward. 0 at u = 1."""
        if ulysses <= 1:
            return np.zeros(np.shape(tokens_per_rank))
        heads, kv = self._ulysses_heads(ulysses)
        per_token = (2 * heads + 2 * kv) * self.head_bytes_per_token
        share = (ulysses - 1) / ulysses
        sets = (2 if self.recompute else 1) + ULYSSES_BACKWARD_SETS
        return self.ring_layers * sets * share * np.asarray(tokens_per_rank, np.float64) * per_token

    def ulysses_latency(self, ulysses: int) -> float:
        """Seconds of message latency of the all-to-alls: `ULYSSES_ALL_TO_ALLS_PER_LAYER` per attention layer, 2
        more (the forward's) with `recompute`."""
        calls = ULYSSES_ALL_TO_ALLS_PER_LAYER + (2 if self.recompute else 0)
        return self.ring_layers * calls * self.latency if ulysses > 1 else 0.0

    def ulysses_time(self, tokens_per_rank, ulysses: int, bandwidth: float) -> np.ndarray:
        """All-to-all seconds per rank for one micro-batch: `ulysses_bytes` at `bandwidth` (bytes/s per rank,
        `Hardware.all_to_all_bandwidth`) plus `ulysses_latency`. Blocking: nothing overlaps it."""
        if ulysses <= 1:
            return np.zeros(np.shape(tokens_per_rank))
        return self.ulysses_bytes(tokens_per_rank, ulysses) / bandwidth + self.ulysses_latency(ulysses)

    def split_ring_bytes(self, virtual_tokens, ulysses: int, ring: int) -> np.ndarray:
        """Ring P2P bytes per rank of a u × r split: the ring of r among the Ulysses groups moves the K/V of
        the rank's H/u query heads (`ulysses_kv_heads` / u K/V heads) for its virtual rank's tokens (the
        zigzag share of r ranks), as `ring_bytes` does. At u = 1 exactly `ring_bytes`."""
        if ulysses == 1:
            return self.ring_bytes(virtual_tokens, ring)
        kv_bytes = 2 * self._ulysses_heads(ulysses)[1] * self.head_bytes_per_token / ulysses
        return self.ring_layers * self._transfers * (ring - 1) * np.asarray(virtual_tokens, np.float64) * kv_bytes

    def split_ring_compute_time(self, virtual_tokens, ulysses: int, ring: int) -> np.ndarray:
        """`ring_compute_time` of a u × r split: r - 1 steps over the virtual rank's tokens on H/u heads."""
        return self.ring_compute_time(np.asarray(virtual_tokens, np.float64) / ulysses, ring)

    def offload_time(self, s, r) -> np.ndarray:
        """Seconds to move a fraction r of s tokens' activations over PCIe, all layers."""
        return self.layers * self.act(s) * np.asarray(r, np.float64) / self.offload_bandwidth

    def allreduce_time(self) -> float:
        """Ring all-reduce of the gradients (param_bytes of them): each rank sends and receives 2x."""
        return 2 * self.param_bytes / self.network_bandwidth

    def _layers_per_rank(self, layers_per_rank: int | None) -> int:
        l = self.layers if layers_per_rank is None else layers_per_rank
        if not (isinstance(l, (int, np.integer)) and l >= 1):
            raise ValueError(f"layers_per_rank must be an int >= 1, got {layers_per_rank!r}")
        return int(l)
