"""The planner's cost model (paper §4.2, Eq. 2): per-layer time T(s), activation bytes Act(s), and the
ranks D(s) and offload ratio r a long sequence needs.

A `CostModel` holds a model's numbers in a few small records, each one kind of term: `LayerTime` (T(s)'s
fitted coefficients), `ActivationBytes` (Act(s)), `CommBytes` (what travels between ranks), `StepTerms` (the
work outside the decoder layers) and `ModelParts` (layer counts, heads, TP degree, recompute), with the
`Hardware` they run on. Every term also reads by its own name (`cost_model.alpha1`, `cost_model.layers`), and
`from_terms` / `replace` take them by name, so a caller never needs to know which record holds one.

The equations are sympy expressions over symbolic coefficients (`equations.py`), solved once at import and
lambdified to numpy, so one CostModel evaluates them on arrays of 10^5 sequence lengths in about a millisecond.
Coefficients come from a model shape and a hardware description (`CostModel.analytic`, the Table 1 presets of
`CostModel.preset`) or from the profiler (`planner/profiler.py`, source "profiled"). T(s) also charges the
tensor-parallel all-reduces of an HDP rank that is a TP group (`tp_all_reduce_time`). With `recompute`
(gradient checkpointing) every layer's forward runs twice: T(s) and the forward's P2P grow by it.

Beside the decoder layers a step runs the embedding, the LM head and its loss once per micro-batch over all its
tokens, launches every layer once per micro-batch however many sequences it packs, and ends with one optimizer
step. So the work of one sequence is `seq_time` = l x (T(s) - gamma) + (beta_head + beta_embed) s, a micro-batch
adds E's constant, l x gamma + delta, once (`micro_batch_overhead`), and a step adds O = omega x P / shards + sigma
(`optimizer_time`). The analytic models leave beta_head, beta_embed, delta, omega and
sigma at 0 (the paper's T(s), decoder layers only); `bytescale-compile profile` measures them.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import math
from dataclasses import asdict, dataclass, fields
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import sympy

from ..lazy import moved

# The names moved out of this module are used through their modules, never bound here, so that reading one
# from here goes through `__getattr__` below and warns.
from . import equations as eq
from . import hardware as _hardware
from . import model_shape as _model_shape
from .equations import (
    ACT_FN,
    BOUNDARIES_FN,
    D_FRAC_FN,
    E_FN,
    O_FN,
    R_NEED_FN,
    R_OVERLAP_FN,
    R_SAVES_ONE_FN,
    T_FN,
    ceil_forgiving,
    real_roots,
    substitute,
)

if TYPE_CHECKING:
    from .hardware import Hardware
    from .model_shape import ModelShape

__all__ = [
    "KERNELS_PER_LAYER",
    "STEP_TERMS",
    "ActivationBytes",
    "CommBytes",
    "CostModel",
    "LayerTime",
    "ModelParts",
    "StepTerms",
]

logger = logging.getLogger(__name__)

KERNELS_PER_LAYER = 20
"""Launches per layer that the analytic gamma charges `Hardware.latency` for."""

_FORMAT = "bytescale_compile.cost_model"
_COEFFICIENT_KEYS = ("alpha1", "beta1", "gamma", "alpha2", "beta2")
STEP_TERMS = ("beta_head", "beta_embed", "delta", "omega", "sigma")
"""The coefficients outside the decoder layers (E(n) and O); files written before them load with 0 for each."""

_MOVED = {
    "CEIL_RTOL": "equations",
    "EXPRS": "equations",
    "RECOMPUTE_TIME": "equations",
    "TP_ALL_REDUCES_PER_LAYER": "equations",
    "ULYSSES_ALL_TO_ALLS_PER_LAYER": "equations",
    "ULYSSES_BACKWARD_SETS": "equations",
    "tp_all_reduce_time": "equations",
    "ulysses_kv_heads": "equations",
    "HARDWARE_PRESETS": "hardware",
    "Hardware": "hardware",
    "Topology": "topology",
    "ModelShape": "model_shape",
    "PRESETS": "model_shape",
    "BF16": "model_shape",
}
"""Names this module held before it was split along its seams, and the planner module holding each now."""


if not TYPE_CHECKING:  # mypy sees only the current names

    def __getattr__(name: str) -> Any:
        """The names moved out to `equations`, `hardware`, `model_shape` and `topology`, for one release."""
        if name not in _MOVED:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        module = f"{__package__}.{_MOVED[name]}"
        moved(f"{__name__}.{name}", f"{module}.{name}")
        return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class LayerTime:
    """T(s)'s coefficients: seconds of one layer's fwd+bwd over s tokens, T(s) = alpha1 s^2 + beta1 s + gamma,
    plus tau s for the TP all-reduces (`tp_comm_time`) and what a ring step adds (`ring_overhead`)."""

    alpha1: float
    beta1: float
    gamma: float
    ring_overhead: float = 0.0
    """Seconds of compute a ring step adds per token held, per layer (merging partial attention outputs,
    zigzag gathers): `CostModel.ring_compute_time`. 0 where that work is negligible beside the layer (the
    analytic models); on a CPU, where nothing hides it, the job's calibration measures it (`train/calibrate.py`)."""
    tp_comm_time: float | None = None
    """Seconds per token and layer of the TP all-reduces, the tau of T(s). None: derived from the hardware's
    TP group (`tp_all_reduce_time`); 0 charges none, for coefficients measured on a TP group, which already
    hold them."""


@dataclass(frozen=True)
class ActivationBytes:
    """Act(s) = alpha2 s + beta2: bytes one layer saves for backward over s tokens."""

    alpha2: float
    beta2: float


@dataclass(frozen=True)
class CommBytes:
    """What travels between ranks, per token or per chunk boundary."""

    kv_bytes_per_token: int
    """K/V bytes a ring step moves per token and attention layer."""
    boundary_bytes_per_token: float | None = None
    """Bytes of one token's hidden state at a pipeline-stage boundary (hidden x activation bytes), what a
    stage sends on per token; None: read back from alpha1, exact for analytic models only
    (`CostModel.hidden_bytes_per_token`)."""
    mixer_state_bytes: float = 0.0
    """Bytes one chunk boundary of a shared sequence moves forward, over all mixer layers: halos and state
    summaries, whatever the sequence's length."""


@dataclass(frozen=True)
class StepTerms:
    """The work outside the decoder layers: E(n) per micro-batch and O per step (`equations.E`, `equations.O`)."""

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


@dataclass(frozen=True)
class ModelParts:
    """What the cost model knows of the model itself: its layers and parameters, heads and TP degree."""

    layers: int
    param_bytes: float
    mixer_layers: int = 0
    """Of `layers`, those whose token mixer is a convolution or a scan (hybrid models) rather than attention: no
    K/V travels for them, only `CommBytes.mixer_state_bytes` per chunk boundary (the compile report's
    `mixer_costs`)."""
    heads: int | None = None
    """Query heads of an attention layer: the Ulysses degrees a split may take divide it. None: unknown
    (files written before it was recorded), so no micro-batch is split by heads."""
    kv_heads: int | None = None
    """K/V heads of an attention layer (GQA); `kv_bytes_per_token` is 2 x kv_heads x head_dim x element bytes."""
    tp_size: int | None = None
    """The tensor-parallel degree the heads are sharded over (each device attends `CostModel.device_heads`);
    None: the hardware's TP size. Ulysses splits each device's heads, not the rank's."""
    recompute: bool = False
    """Gradient checkpointing: the backward recomputes each layer's forward, so T(s) charges `RECOMPUTE_TIME`
    and the forward's ring P2P and all-to-alls are sent twice. Set by the Runtime for a checkpointed model;
    coefficients measured on one (`train/calibrate.py` refits T on the model it trains) already hold the
    recompute's time."""


_RECORDS = {"time": LayerTime, "memory": ActivationBytes, "comm": CommBytes, "step": StepTerms, "model": ModelParts}
_RECORD_OF = {f.name: record for record, cls in _RECORDS.items() for f in fields(cls)}
"""Each term's name -> the CostModel field (record) holding it."""
_TOP_LEVEL = ("hardware", "source", "device", *_RECORDS)


def _grouped(terms: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Terms by name, sorted into their records; a name no record holds raises TypeError naming them all."""
    if "head_shards" in terms:
        moved("CostModel.head_shards", "CostModel.tp_size")
        terms = {**{k: v for k, v in terms.items() if k != "head_shards"}, "tp_size": terms["head_shards"]}
    unknown = sorted(set(terms) - set(_RECORD_OF))
    if unknown:
        raise TypeError(f"CostModel has no term(s) {unknown}; terms: {sorted(_RECORD_OF)}")
    grouped: dict[str, dict[str, Any]] = {}
    for name, value in terms.items():
        grouped.setdefault(_RECORD_OF[name], {})[name] = value
    return grouped


def _check_capacity(capacity: int) -> None:
    if not (isinstance(capacity, (int, np.integer)) and capacity >= 1):
        raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")


@dataclass(frozen=True)
class CostModel:
    """T(s) = alpha1 s^2 + beta1 s + gamma + tau s (seconds, one layer, fwd+bwd; tau s the TP all-reduces,
    `tp_all_reduce_time`), Act(s) = alpha2 s + beta2 (bytes, one layer), plus what the planner needs beside
    them: total layers, the K/V bytes a ring step moves per token and layer, the parameter bytes, the
    hardware's bandwidths and latency. Build one with `from_terms` (terms by name), `analytic`, `preset` or
    `load`; change one with `replace`."""

    time: LayerTime
    memory: ActivationBytes
    comm: CommBytes
    model: ModelParts
    hardware: Hardware
    source: str
    step: StepTerms = StepTerms()
    device: str | None = None
    """Where the coefficients were measured ("cpu", "cuda:0 (NVIDIA H100 80GB HBM3)"); None for analytic ones."""

    def __getattr__(self, name: str) -> Any:
        """A term by its own name (`alpha1`, `layers`, `kv_bytes_per_token`...), from the record holding it;
        `head_shards`, the former name of `tp_size`, for one release."""
        if name == "head_shards":
            moved("CostModel.head_shards", "CostModel.model.tp_size")
            return self.model.tp_size
        record = _RECORD_OF.get(name)
        if record is None or record not in self.__dict__:  # never recurses: unpickling asks before fields exist
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self.__dict__[record], name)

    @property
    def tp_size(self) -> int:
        """The tensor-parallel degree the heads are sharded over: `ModelParts.tp_size`, else the hardware's."""
        return self.hardware.tp_size if self.model.tp_size is None else self.model.tp_size

    @property
    def device_heads(self) -> tuple[int, int] | None:
        """(query heads, K/V heads) that each device of an HDP rank attends under tensor parallelism (K/V heads
        at least one: Megatron copies them where the shards outnumber them); None where the heads are unknown."""
        heads, kv_heads = self.model.heads, self.model.kv_heads
        if heads is None or kv_heads is None:
            return None
        tp_size = self.tp_size
        return heads // tp_size, max(1, kv_heads // tp_size)

    @property
    def ring_layers(self) -> int:
        """Layers whose K/V travel around the ring: the attention layers."""
        return self.model.layers - self.model.mixer_layers

    def __post_init__(self) -> None:
        for record, cls in _RECORDS.items():
            if not isinstance(getattr(self, record), cls):
                raise TypeError(
                    f"CostModel ({self.source}): {record} must be a {cls.__name__}, got "
                    f"{type(getattr(self, record)).__name__}; CostModel.from_terms takes the terms by name"
                )
        for name in ("alpha1", "beta1", "gamma", "alpha2", "beta2", "param_bytes", "ring_overhead", *STEP_TERMS):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"CostModel ({self.source}): {name} must be a finite number >= 0, got {value!r}")
        if self.memory.alpha2 <= 0:
            raise ValueError(
                f"CostModel ({self.source}): alpha2 must be > 0 (activations grow with tokens), got {self.memory.alpha2}"
            )
        self._check_model()
        self._check_comm()
        if not isinstance(self.hardware, _hardware.Hardware):
            raise TypeError(
                f"CostModel ({self.source}): hardware must be a Hardware, got {type(self.hardware).__name__}"
            )
        tp_comm = self.time.tp_comm_time
        if tp_comm is not None and not (isinstance(tp_comm, (int, float)) and math.isfinite(tp_comm) and tp_comm >= 0):
            raise ValueError(
                f"CostModel ({self.source}): tp_comm_time must be None or a finite number >= 0, got {tp_comm!r}"
            )
        self._check_heads()

    def _check_model(self) -> None:
        m = self.model
        if not (isinstance(m.layers, int) and m.layers >= 1):
            raise ValueError(f"CostModel ({self.source}): layers must be an int >= 1, got {m.layers!r}")
        if not (isinstance(m.mixer_layers, int) and 0 <= m.mixer_layers <= m.layers):
            raise ValueError(
                f"CostModel ({self.source}): mixer_layers must be an int in [0, layers={m.layers}], "
                f"got {m.mixer_layers!r}"
            )
        if not isinstance(m.recompute, bool):
            raise ValueError(f"CostModel ({self.source}): recompute must be a bool, got {m.recompute!r}")

    def _check_comm(self) -> None:
        c = self.comm
        if not (isinstance(c.kv_bytes_per_token, int) and c.kv_bytes_per_token >= 0):
            raise ValueError(
                f"CostModel ({self.source}): kv_bytes_per_token must be an int >= 0, got {c.kv_bytes_per_token!r}"
            )
        if not (math.isfinite(c.mixer_state_bytes) and c.mixer_state_bytes >= 0):
            raise ValueError(f"CostModel ({self.source}): mixer_state_bytes must be >= 0, got {c.mixer_state_bytes!r}")
        boundary = c.boundary_bytes_per_token
        if boundary is not None and not (
            isinstance(boundary, (int, float)) and math.isfinite(boundary) and boundary > 0
        ):
            raise ValueError(
                f"CostModel ({self.source}): boundary_bytes_per_token must be None or a finite number "
                f"> 0, got {boundary!r}"
            )

    def _check_heads(self) -> None:
        m = self.model
        for name in ("heads", "kv_heads"):
            value = getattr(m, name)
            if value is not None and not (isinstance(value, int) and value >= 1):
                raise ValueError(f"CostModel ({self.source}): {name} must be None or an int >= 1, got {value!r}")
        if (m.heads is None) != (m.kv_heads is None) or (m.heads and m.kv_heads and m.heads % m.kv_heads):
            raise ValueError(
                f"CostModel ({self.source}): heads {m.heads} and kv_heads {m.kv_heads} must both be given, "
                f"kv_heads dividing heads, or both None"
            )
        if m.tp_size is not None and not (isinstance(m.tp_size, int) and m.tp_size >= 1):
            raise ValueError(f"CostModel ({self.source}): tp_size must be None or an int >= 1, got {m.tp_size!r}")
        if m.heads is not None and m.heads % self.tp_size:
            raise ValueError(
                f"CostModel ({self.source}): {m.heads} query heads cannot be split over {self.tp_size} "
                f"tensor-parallel devices (tp_size, or the hardware's)"
            )

    # --- construction ----------------------------------------------------------------------------
    @classmethod
    def from_terms(cls, *, hardware: Hardware, source: str, device: str | None = None, **terms: Any) -> CostModel:
        """A model from its terms by name (alpha1=..., layers=..., kv_bytes_per_token=...), each put in the record
        holding it; unknown names raise TypeError listing the known ones."""
        grouped = _grouped(terms)
        records = {name: cls_(**grouped.get(name, {})) for name, cls_ in _RECORDS.items()}
        return cls(hardware=hardware, source=source, device=device, **records)

    def replace(self, **changes: Any) -> CostModel:
        """A copy with some terms changed, by name (`recompute=True`, `tp_size=2`, `hardware=...`): each goes to
        the record holding it. `dataclasses.replace` takes whole records only."""
        top = {k: changes.pop(k) for k in _TOP_LEVEL if k in changes}
        for record, values in _grouped(changes).items():
            top[record] = dataclasses.replace(top.get(record, getattr(self, record)), **values)
        return dataclasses.replace(self, **top)

    @classmethod
    def preset(cls, name: str, hardware: Hardware | None = None) -> CostModel:
        """The analytic model of a Table 1 model by name."""
        if name not in _model_shape.PRESETS:
            raise ValueError(f"unknown cost-model preset {name!r}; presets: {', '.join(_model_shape.PRESETS)}")
        return cls.analytic(_model_shape.PRESETS[name], hardware)

    @classmethod
    def analytic(cls, shape: ModelShape, hardware: Hardware | None = None) -> CostModel:
        """Coefficients from FLOP and byte counts. Backward costs twice the forward, so a layer's fwd+bwd is
        3 x its forward FLOPs, run at matmul_flops x mfu: alpha1 = 3 x 2 hidden / rate (causal attention's
        QK^T and PV, 4 s^2 hidden halved by the mask), beta1 = 3 x linear_flops_per_token / rate,
        gamma = KERNELS_PER_LAYER launches of `latency`. alpha2 = act_bytes_per_token, beta2 = 0."""
        hw = hardware or _hardware.Hardware()
        rate = hw.matmul_flops * hw.mfu
        return cls(
            time=LayerTime(
                alpha1=3 * 2 * shape.hidden / rate,
                beta1=3 * shape.linear_flops_per_token / rate,
                gamma=KERNELS_PER_LAYER * hw.latency,
            ),
            memory=ActivationBytes(alpha2=float(shape.act_bytes_per_token), beta2=0.0),
            comm=CommBytes(
                kv_bytes_per_token=2 * shape.kv_heads * shape.head_dim * _model_shape.BF16,
                boundary_bytes_per_token=float(_model_shape.BF16 * shape.hidden),
            ),
            model=ModelParts(
                layers=shape.layers,
                param_bytes=float(_model_shape.BF16 * shape.params),
                heads=shape.heads,
                kv_heads=shape.kv_heads,
            ),
            hardware=hw,
            source=f"analytic:{shape.name}",
        )

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        """A model written by `save` (the profiler's output); errors name the file and a missing key. Files
        written before `device` was recorded load with device None; before `tp_comm_time`, with tau derived
        from the hardware (0 without a topology, whose rank is one device); before `STEP_TERMS`, with each 0
        (decoder layers only: a warning names them and says how to measure them). A `head_shards` key (the
        former name of `tp_size`) loads as `tp_size`."""
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise FileNotFoundError(f"cost model file {path} does not exist") from None
        try:
            return cls._from_json(json.loads(text), path)
        except KeyError as e:
            raise ValueError(
                f"cost model file {path} lacks the key {e.args[0]!r}: write it again with "
                f"`bytescale-compile profile` or CostModel.save"
            ) from None
        except (ValueError, TypeError, AttributeError) as e:
            raise ValueError(f"cost model file {path} is not a valid cost model: {type(e).__name__}: {e}") from None

    @classmethod
    def _from_json(cls, data: dict[str, Any], path: Path) -> CostModel:
        if data.get("format") != _FORMAT:
            raise ValueError(f"'format' is {data.get('format')!r}, expected {_FORMAT!r}")
        coefficients = data["coefficients"]
        missing = [k for k in STEP_TERMS if k not in coefficients]
        if missing:
            logger.warning(
                "cost model file %s has no %s: it predicts the decoder layers only (no LM head, loss, "
                "embedding, per-micro-batch cost or optimizer step); profile again with `bytescale-compile "
                "profile` to measure them",
                path,
                ", ".join(missing),
            )
        return cls(
            time=LayerTime(
                alpha1=coefficients["alpha1"],
                beta1=coefficients["beta1"],
                gamma=coefficients["gamma"],
                ring_overhead=coefficients.get("ring_overhead", 0.0),
                tp_comm_time=coefficients.get("tp_comm_time"),
            ),
            memory=ActivationBytes(alpha2=coefficients["alpha2"], beta2=coefficients["beta2"]),
            comm=CommBytes(
                kv_bytes_per_token=data["kv_bytes_per_token"],
                boundary_bytes_per_token=data.get("boundary_bytes_per_token"),
                mixer_state_bytes=data.get("mixer_state_bytes", 0.0),
            ),
            step=StepTerms(**{k: coefficients.get(k, 0.0) for k in STEP_TERMS}),
            model=ModelParts(
                layers=data["layers"],
                param_bytes=data["param_bytes"],
                mixer_layers=data.get("mixer_layers", 0),
                heads=data.get("heads"),
                kv_heads=data.get("kv_heads"),
                tp_size=data.get("tp_size", data.get("head_shards")),
                recompute=data.get("recompute", False),
            ),
            hardware=_hardware.Hardware.from_dict(data["hardware"]),
            source=data["source"],
            device=data.get("device"),
        )

    def save(self, path: str | Path) -> None:
        """JSON: coefficients, layers, byte counts, hardware and source; `load` reads it back exactly (the TP
        degree aside: the Runtime sets it for its run)."""
        data = {
            "format": _FORMAT,
            "source": self.source,
            "coefficients": {
                k: getattr(self, k) for k in (*_COEFFICIENT_KEYS, "ring_overhead", "tp_comm_time", *STEP_TERMS)
            },
            "layers": self.model.layers,
            "kv_bytes_per_token": self.comm.kv_bytes_per_token,
            "param_bytes": self.model.param_bytes,
            "hardware": asdict(self.hardware),
            "device": self.device,
            "boundary_bytes_per_token": self.comm.boundary_bytes_per_token,
            "mixer_layers": self.model.mixer_layers,
            "mixer_state_bytes": self.comm.mixer_state_bytes,
            "heads": self.model.heads,
            "kv_heads": self.model.kv_heads,
            "recompute": self.model.recompute,
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
        if self.comm.boundary_bytes_per_token is not None:
            return self.comm.boundary_bytes_per_token
        hw = self.hardware
        return float(_model_shape.BF16 * round(self.time.alpha1 * hw.matmul_flops * hw.mfu / 6))

    @cached_property
    def tp_time_per_token(self) -> float:
        """tau: seconds per token and layer, fwd+bwd, of the rank's TP all-reduces (`tp_comm_time` when
        given, else `tp_all_reduce_time` of the hardware's TP group and link); 0 at TP 1."""
        if self.time.tp_comm_time is not None:
            tau = float(self.time.tp_comm_time)
        else:
            hw = self.hardware
            tau = eq.tp_all_reduce_time(hw.tp_size, self.hidden_bytes_per_token, hw.tp_link)
        return tau * (eq.TP_ALL_REDUCES_PER_LAYER + 2) / eq.TP_ALL_REDUCES_PER_LAYER if self.model.recompute else tau

    @cached_property
    def exprs(self) -> dict[str, sympy.Expr]:
        """`equations.EXPRS` with this model's coefficients; free symbols s, r, C, l (and n, P, shards of E and O)."""
        return substitute(self._coeffs(), asdict(self.step))

    def _coeffs(self) -> tuple[float, ...]:
        compute = eq.RECOMPUTE_TIME if self.model.recompute else 1.0
        return (
            compute * self.time.alpha1,
            compute * self.time.beta1,
            compute * self.time.gamma,
            self.memory.alpha2,
            self.memory.beta2,
            self.offload_bandwidth,
            self.tp_time_per_token,
        )

    # --- evaluations (vectorised) ----------------------------------------------------------------
    def layer_time(self, s) -> np.ndarray:
        """T(s): seconds, fwd+bwd of one layer over s tokens, the TP all-reduces included."""
        return np.asarray(T_FN(np.asarray(s, np.float64), 0, 0, 0, *self._coeffs()), np.float64)

    def act(self, s) -> np.ndarray:
        """Act(s): bytes one layer saves for backward over s tokens."""
        return np.asarray(ACT_FN(np.asarray(s, np.float64), 0, 0, 0, *self._coeffs()), np.float64)

    def seq_time(self, s) -> np.ndarray:
        """The work of one sequence in a micro-batch, fwd+bwd: layers x (T(s) - gamma), plus its tokens' share of
        the LM head, loss and embedding. Additive over the sequences a micro-batch packs; the micro-batch's
        fixed cost is `micro_batch_overhead`. So a micro-batch of one sequence takes layers x T(s) + E(s)'s
        per-token part + E's constant."""
        s = np.asarray(s, np.float64)
        compute = eq.RECOMPUTE_TIME if self.model.recompute else 1.0
        return (
            self.model.layers * (self.layer_time(s) - compute * self.time.gamma)
            + (self.step.beta_head + self.step.beta_embed) * s
        )

    @property
    def micro_batch_overhead(self) -> float:
        """Seconds a micro-batch costs once, whatever it packs: E(n)'s constant, every layer's launches (gamma,
        on each rank of a shared micro-batch alike) and delta."""
        compute = eq.RECOMPUTE_TIME if self.model.recompute else 1.0
        return float(
            E_FN(
                0.0,
                self.model.layers,
                compute * self.time.gamma,
                self.step.beta_head,
                self.step.beta_embed,
                self.step.delta,
            )
        )

    def micro_batch_time(self, s) -> float:
        """E(n) plus the layers: seconds of one micro-batch packing sequences of lengths `s` on one rank."""
        return float(self.seq_time(s).sum()) + self.micro_batch_overhead

    def optimizer_time(self, shards: int) -> float:
        """O: seconds of the optimizer step on a rank holding 1/`shards` of the parameters' state (the
        distributed optimizer shards it over every device: HDP ranks x pipeline stages x TP)."""
        if not (isinstance(shards, (int, np.integer)) and shards >= 1):
            raise ValueError(f"shards must be an int >= 1, got {shards!r}")
        return float(O_FN(self.model.param_bytes, shards, self.step.omega, self.step.sigma))

    def flops(self, s) -> np.ndarray:
        """Model FLOPs of a sequence, fwd+bwd, all layers: the compute part of T (gamma, the launch
        overhead, and tau, the TP all-reduces, left out) at matmul_flops x mfu. Exact for analytic models;
        for profiled ones the FLOPs this hardware would need for the measured time, which is what FLOP-equal
        buckets balance."""
        s = np.asarray(s, np.float64)
        return (
            self.model.layers
            * (self.time.alpha1 * s * s + self.time.beta1 * s)
            * (self.hardware.matmul_flops * self.hardware.mfu)
        )

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
            r_star = np.minimum(1.0, R_OVERLAP_FN(*args))
            r_long = np.where(r_star >= np.minimum(1.0, R_SAVES_ONE_FN(*args)), r_star, 0.0)
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
        r = np.maximum(R_NEED_FN(s, 0, capacity, l, *self._coeffs(), w), 0.0)
        return np.where(self.ranks_needed(s, r, capacity, l) <= w, r, np.nextafter(r, np.inf) + eq.CEIL_RTOL)

    def _ranks_long(self, s: np.ndarray, r: np.ndarray, capacity: int, l: int) -> np.ndarray:
        """D(s, r) for s > C: the ceiling of Eq. 2's fraction, at least 1."""
        return np.maximum(ceil_forgiving(D_FRAC_FN(s, r, capacity, l, *self._coeffs())), 1)

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
        hi = (world_size * max(l, 2) * act_c / 2 - self.memory.beta2) / self.memory.alpha2
        points = [float(capacity), hi]
        for poly in BOUNDARIES_FN(capacity, l, world_size, *self._coeffs()):
            points += [x for x in real_roots(poly) if capacity <= x <= hi + 1]
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
        sends = self.ring_transfers
        attention = (
            self.ring_layers * sends * (g - 1) * np.asarray(tokens_per_rank, np.float64) * self.comm.kv_bytes_per_token
        )
        return attention + sends * 2 * (g - 1) * self.comm.mixer_state_bytes

    @property
    def ring_transfers(self) -> int:
        """Ring transfers per step and layer: the forward's (twice with `recompute`), 2 in the backward."""
        return 4 if self.model.recompute else 3

    def ring_latency(self, group_size) -> np.ndarray:
        """Seconds of P2P latency per rank for one micro-batch: a transfer per ring step and attention layer, and
        one batch per mixer layer, each `ring_transfers` times (forward, backward); 0 for a group of one."""
        g = np.asarray(group_size, np.float64)
        sends = self.ring_transfers
        transfers = self.ring_layers * sends * (g - 1) + np.where(g > 1, sends * self.model.mixer_layers, 0)
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
        return steps * np.asarray(tokens_per_rank, np.float64) * self.time.ring_overhead

    # --- Ulysses (head-parallel) splits: u x r = D(s) -------------------------------------------------
    @property
    def head_bytes_per_token(self) -> float:
        """Bytes of one head of one token (head_dim x element bytes): `kv_bytes_per_token` / (2 kv_heads);
        0 where the heads are unknown."""
        return self.comm.kv_bytes_per_token / (2 * self.model.kv_heads) if self.model.kv_heads else 0.0

    def _ulysses_heads(self, ulysses: int) -> tuple[int, int]:
        """(query heads, K/V heads) an HDP rank's devices hold together after the all-to-all: each device's
        query heads, and `ulysses_kv_heads` of each device's heads."""
        device = self.device_heads
        if device is None:
            raise ValueError(f"CostModel ({self.source}) does not know the heads: it cannot cost a Ulysses split")
        return self.tp_size * device[0], self.tp_size * eq.ulysses_kv_heads(*device, ulysses)

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
        sets = (2 if self.model.recompute else 1) + eq.ULYSSES_BACKWARD_SETS
        return self.ring_layers * sets * share * np.asarray(tokens_per_rank, np.float64) * per_token

    def ulysses_latency(self, ulysses: int) -> float:
        """Seconds of message latency of the all-to-alls: `ULYSSES_ALL_TO_ALLS_PER_LAYER` per attention layer, 2
        more (the forward's) with `recompute`."""
        calls = eq.ULYSSES_ALL_TO_ALLS_PER_LAYER + (2 if self.model.recompute else 0)
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
        return self.ring_layers * self.ring_transfers * (ring - 1) * np.asarray(virtual_tokens, np.float64) * kv_bytes

    def split_ring_compute_time(self, virtual_tokens, ulysses: int, ring: int) -> np.ndarray:
        """`ring_compute_time` of a u × r split: r - 1 steps over the virtual rank's tokens on H/u heads."""
        return self.ring_compute_time(np.asarray(virtual_tokens, np.float64) / ulysses, ring)

    def offload_time(self, s, r) -> np.ndarray:
        """Seconds to move a fraction r of s tokens' activations over PCIe, all layers."""
        return self.model.layers * self.act(s) * np.asarray(r, np.float64) / self.offload_bandwidth

    def allreduce_time(self) -> float:
        """Ring all-reduce of the gradients (param_bytes of them): each rank sends and receives 2x."""
        return 2 * self.model.param_bytes / self.network_bandwidth

    def _layers_per_rank(self, layers_per_rank: int | None) -> int:
        l = self.model.layers if layers_per_rank is None else layers_per_rank
        if not (isinstance(l, (int, np.integer)) and l >= 1):
            raise ValueError(f"layers_per_rank must be an int >= 1, got {layers_per_rank!r}")
        return int(l)
