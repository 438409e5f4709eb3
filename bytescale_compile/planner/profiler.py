"""Fit the cost model's coefficients by measurement (paper §4.2: "coefficients we profiled").

The bytes of the tensors autograd saves for backward in one transformer layer, at several lengths, give
Act(s) = alpha2 s + beta2 by least squares; every layer of a decoder is alike, so one stands for all.

Time comes from whole training steps of the compiled model cut to 1 and 2 layers (`train/profiling.py`
measures them, `bytescale-compile profile` runs it): `fit_step_terms` separates T(s)'s alpha1, beta1 and gamma,
the LM head, loss and embedding per token, the micro-batch's and the step's fixed costs and the optimizer's
seconds per parameter byte (`StepPoint`). `profile_layer` / `profile_model` time one eager layer alone instead
(T(s) only): what `ranks_per_device` > 1 measures, ranks sharing a CPU.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from .cost_model import CostModel
from .hardware import Hardware

__all__ = [
    "LayerInputs",
    "ModelSource",
    "OptimizerPoint",
    "ProfileResult",
    "StepFit",
    "StepPoint",
    "StepProfile",
    "build_model",
    "decoder_layers",
    "device_label",
    "fit_cost_model",
    "fit_step_profile",
    "fit_step_terms",
    "fit_time",
    "layer_act_bytes",
    "model_cost",
    "profile_layer",
    "profile_model",
]

LayerInputs = tuple[tuple[Any, ...], dict[str, Any]]
"""(args, kwargs) of one layer call; tensors among the args that require grad get gradients too."""
ModelSource = str | Callable[[], nn.Module]
"""`module:factory`, or a picklable callable that builds the model (`functools.partial` of a module-level
function): each process of a `ranks_per_device` profile builds its own copy from it."""


@dataclass(frozen=True)
class ProfileResult:
    """Raw measurements of one layer and the coefficients fitted to them."""

    lengths: tuple[int, ...]
    times: tuple[float, ...]
    """Median seconds of one fwd+bwd, per length."""
    act_bytes: tuple[int, ...]
    """Bytes of the distinct storages saved for backward (parameters and buffers excluded), per length."""
    alpha1: float
    beta1: float
    gamma: float
    alpha2: float
    beta2: float
    device: str

    def layer_time(self, s) -> np.ndarray:
        s = np.asarray(s, np.float64)
        return self.alpha1 * s * s + self.beta1 * s + self.gamma

    def act(self, s) -> np.ndarray:
        return self.alpha2 * np.asarray(s, np.float64) + self.beta2

    def summary(self) -> str:
        """A table of measurement against fit, then the fitted coefficients."""
        lines = [
            f"one layer, fwd+bwd, on {self.device}",
            f"{'tokens':>8} {'time ms':>10} {'fit ms':>10} {'act MB':>10} {'fit MB':>10}",
        ]
        for s, t, a in zip(self.lengths, self.times, self.act_bytes):
            lines.append(
                f"{s:>8} {t * 1e3:>10.3f} {self.layer_time(s) * 1e3:>10.3f} {a / 1e6:>10.3f} {self.act(s) / 1e6:>10.3f}"
            )
        lines.append(f"T(s)   = {self.alpha1:.4g} s^2 + {self.beta1:.4g} s + {self.gamma:.4g}  [s]")
        lines.append(f"Act(s) = {self.alpha2:.4g} s + {self.beta2:.4g}  [bytes]")
        return "\n".join(lines)


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0. A negative coefficient is noise of short measurements
    (a negative gamma or alpha1 would make T(s) negative at short or long lengths once extrapolated, and
    Eq. 2 divides by it), so it is clamped to 0 and the remaining ones refitted. Columns are scaled to
    unit maximum first, since s^2 and 1 differ by many orders of magnitude."""
    coef = np.zeros(x.shape[1])
    active = np.ones(x.shape[1], dtype=bool)
    while active.any():
        scale = np.abs(x[:, active]).max(axis=0)
        coef[:] = 0
        coef[active] = np.linalg.lstsq(x[:, active] / scale, y, rcond=None)[0] / scale
        if (coef >= 0).all():
            break
        active &= coef > 0
    return coef


def _call_grads(layer: nn.Module, inputs: LayerInputs) -> None:
    """One forward and backward, gradients returned rather than accumulated (no state to reset)."""
    args, kwargs = inputs
    out = layer(*args, **kwargs)
    out = out[0] if isinstance(out, (tuple, list)) else out
    wrt = [p for p in layer.parameters() if p.requires_grad] + [
        a for a in args if isinstance(a, torch.Tensor) and a.requires_grad
    ]
    torch.autograd.grad(out.sum(), wrt)


def _saved_bytes(layer: nn.Module, inputs: LayerInputs) -> int:
    """Bytes of the distinct storages autograd saves in one forward; views of one storage count once, and
    parameters and buffers are left out (they do not grow with s)."""
    static = {t.untyped_storage().data_ptr() for t in (*layer.parameters(), *layer.buffers())}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in static:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    args, kwargs = inputs
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(*args, **kwargs)
    del out
    return sum(saved.values())


def profile_layer(
    layer: nn.Module,
    hidden: int,
    lengths: Sequence[int],
    device: str | torch.device | None = None,
    repeats: int = 3,
    make_inputs: Callable[[int], LayerInputs] | None = None,
) -> ProfileResult:
    """Time fwd+bwd of one layer at each length (one warm-up, then the median of `repeats`) and measure
    its saved activations; fit T and Act. The layer is called as `layer(x)` with x [1, s, hidden] in the
    layer's dtype, or as `layer(*args, **kwargs)` with `make_inputs(s) -> (args, kwargs)` when it needs
    more (rotary embeddings, masks). `device` moves the layer there; default: where its parameters are."""
    lengths = [int(s) for s in lengths]
    if len(set(lengths)) < 3 or min(lengths) < 1:
        raise ValueError(f"need at least 3 distinct positive lengths to fit T(s), got {lengths}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    first = next(layer.parameters())
    device = torch.device(device) if device is not None else first.device
    layer.to(device)
    if make_inputs is None:

        def make_inputs(s: int) -> LayerInputs:
            return (torch.randn(1, s, hidden, device=device, dtype=first.dtype, requires_grad=True),), {}

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times, act_bytes = [], []
    for s in lengths:
        inputs = make_inputs(s)
        act_bytes.append(_saved_bytes(layer, inputs))
        _call_grads(layer, inputs)
        samples = []
        for _ in range(repeats):
            sync()
            start = time.perf_counter()
            _call_grads(layer, inputs)
            sync()
            samples.append(time.perf_counter() - start)
        times.append(statistics.median(samples))

    return _fit(lengths, times, act_bytes, device_label(device))


def device_label(device: torch.device) -> str:
    """ "cpu", or a CUDA device with its name ("cuda:0 (NVIDIA H100 80GB HBM3)"): which GPU a profile
    measured matters when reading it, "cuda" alone does not say."""
    if device.type != "cuda":
        return str(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"


def fit_time(lengths: Sequence[int], times: Sequence[float]) -> tuple[float, float, float]:
    """(alpha1, beta1, gamma) of T(s) = alpha1 s^2 + beta1 s + gamma fitted to `times` at `lengths`, each >= 0."""
    s = np.asarray(lengths, np.float64)
    alpha1, beta1, gamma = _nonnegative_lstsq(np.stack([s * s, s, np.ones_like(s)], 1), np.asarray(times, np.float64))
    return float(alpha1), float(beta1), float(gamma)


def _fit(lengths: Sequence[int], times: Sequence[float], act_bytes: Sequence[int], device: str) -> ProfileResult:
    """T(s) and Act(s) by non-negative least squares over the measurements."""
    s = np.asarray(lengths, np.float64)
    alpha1, beta1, gamma = fit_time(lengths, times)
    alpha2, beta2 = _nonnegative_lstsq(np.stack([s, np.ones_like(s)], 1), np.asarray(act_bytes, np.float64))
    return ProfileResult(
        tuple(int(x) for x in lengths),
        tuple(times),
        tuple(act_bytes),
        float(alpha1),
        float(beta1),
        float(gamma),
        float(alpha2),
        float(beta2),
        device,
    )


@dataclass(frozen=True)
class StepPoint:
    """One timed training step of a model cut to `layers` decoder layers: `micro_batches` micro-batches, each
    packing `sequences` sequences of `seq_len` tokens into one row."""

    layers: int
    seq_len: int
    sequences: int
    micro_batches: int
    seconds: float
    """Median seconds of the step, the optimizer's share excluded (`OptimizerPoint` times that)."""

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch."""
        return self.seq_len * self.sequences


@dataclass(frozen=True)
class OptimizerPoint:
    """The optimizer step (clipping, fused AdamW, the bf16 weight refresh) of a model holding `param_bytes`."""

    param_bytes: float
    seconds: float


@dataclass(frozen=True)
class StepFit:
    """The coefficients of `CostModel`'s T(s), E(n) and O fitted to timed steps (`fit_step_terms`): per layer
    alpha1, beta1, gamma; per token beta_out (LM head, loss and embedding together); per micro-batch delta;
    per parameter byte omega; per step the fixed costs of the step's other work and of the optimizer."""

    alpha1: float
    beta1: float
    gamma: float
    beta_out: float
    delta: float
    omega: float
    step_constant: float
    """Seconds per step outside the micro-batches and the optimizer (the steps' fit)."""
    optimizer_constant: float
    """Seconds per optimizer step that do not grow with the parameters (the optimizer's fit)."""

    @property
    def sigma(self) -> float:
        """The step's fixed cost, `CostModel.sigma`."""
        return self.step_constant + self.optimizer_constant

    def step_seconds(self, point: StepPoint) -> float:
        """What the fit predicts for `point` (its optimizer excluded, as measured)."""
        n, k, m, layers = point.seq_len, point.sequences, point.micro_batches, point.layers
        per_micro_batch = layers * (k * (self.alpha1 * n * n + self.beta1 * n) + self.gamma)
        return m * (per_micro_batch + self.beta_out * k * n + self.delta) + self.step_constant

    def optimizer_seconds(self, param_bytes: float) -> float:
        """What the fit predicts for an optimizer step over `param_bytes`."""
        return self.omega * param_bytes + self.optimizer_constant


def fit_step_terms(points: Sequence[StepPoint], optimizer: Sequence[OptimizerPoint]) -> StepFit:
    """Non-negative least squares over steps of models of 1 and 2 (or more) layers: a step of m micro-batches,
    each k sequences of s tokens, on a model of L layers takes
    m x (L x (k (alpha1 s^2 + beta1 s) + gamma) + beta_out k s + delta) + sigma_step,
    so the depths separate the layers' work and launches (alpha1, beta1, gamma) from what runs once per micro-batch
    (beta_out, delta), and the micro-batch counts the micro-batch from the step. The optimizer's
    O = omega x P + its fixed cost comes from its own timings at two parameter sizes (or more)."""
    depths = {p.layers for p in points}
    counts = {p.micro_batches for p in points}
    lengths = {p.seq_len for p in points}
    sizes = {o.param_bytes for o in optimizer}
    if len(depths) < 2 or len(counts) < 2 or len(lengths) < 3 or len(sizes) < 2:
        raise ValueError(
            f"fitting the step needs at least 2 model depths ({sorted(depths)}), 2 micro-batch counts "
            f"({sorted(counts)}), 3 sequence lengths ({sorted(lengths)}) and optimizer steps at 2 parameter sizes "
            f"({sorted(sizes)})"
        )
    s = np.array([p.seq_len for p in points], np.float64)
    k = np.array([p.sequences for p in points], np.float64)
    m = np.array([p.micro_batches for p in points], np.float64)
    layers = np.array([p.layers for p in points], np.float64)
    x = np.stack([m * layers * k * s * s, m * layers * k * s, m * layers, m * k * s, m, np.ones_like(s)], 1)
    alpha1, beta1, gamma, beta_out, delta, step_constant = _nonnegative_lstsq(
        x, np.array([p.seconds for p in points], np.float64)
    )
    size = np.array([o.param_bytes for o in optimizer], np.float64)
    omega, optimizer_constant = _nonnegative_lstsq(
        np.stack([size, np.ones_like(size)], 1), np.array([o.seconds for o in optimizer], np.float64)
    )
    return StepFit(
        float(alpha1),
        float(beta1),
        float(gamma),
        float(beta_out),
        float(delta),
        float(omega),
        float(step_constant),
        float(optimizer_constant),
    )


@dataclass(frozen=True)
class StepProfile:
    """Timed steps of the compiled model at 1 and 2 layers, its optimizer steps, the embedding alone and one
    layer's saved activations, and the coefficients fitted to them (`fit_step_profile`)."""

    points: tuple[StepPoint, ...]
    optimizer: tuple[OptimizerPoint, ...]
    embed_tokens: tuple[int, ...]
    embed_times: tuple[float, ...]
    """Median seconds of the embedding's fwd+bwd alone over `embed_tokens` tokens: what of beta_out is not the head."""
    act_lengths: tuple[int, ...]
    act_bytes: tuple[int, ...]
    fit: StepFit
    beta_embed: float
    alpha2: float
    beta2: float
    device: str

    @property
    def alpha1(self) -> float:
        return self.fit.alpha1

    @property
    def beta1(self) -> float:
        return self.fit.beta1

    @property
    def gamma(self) -> float:
        return self.fit.gamma

    @property
    def beta_head(self) -> float:
        """Seconds per token of the LM head and loss: the per-token cost outside the layers less the embedding's."""
        return max(self.fit.beta_out - self.beta_embed, 0.0)

    def summary(self) -> str:
        """Each timed step against the fit, then the coefficients."""
        f = self.fit
        lines = [
            f"training steps of the compiled model on {self.device} (optimizer step timed apart)",
            f"{'layers':>6} {'tokens':>8} {'x seqs':>6} {'x mbs':>5} {'step ms':>10} {'fit ms':>10}",
        ]
        lines += [
            f"{p.layers:>6} {p.seq_len:>8} {p.sequences:>6} {p.micro_batches:>5} {p.seconds * 1e3:>10.3f} "
            f"{f.step_seconds(p) * 1e3:>10.3f}"
            for p in self.points
        ]
        lines += [
            f"optimizer over {o.param_bytes / 1e6:.1f} MB of parameters: {o.seconds * 1e3:.3f} ms "
            f"(fit {f.optimizer_seconds(o.param_bytes) * 1e3:.3f})"
            for o in self.optimizer
        ]
        lines += [
            f"T(s)   = {f.alpha1:.4g} s^2 + {f.beta1:.4g} s + {f.gamma:.4g}  [s, one layer]",
            f"E(n)   = ({self.beta_head:.4g} head+loss + {self.beta_embed:.4g} embedding) n + l x gamma + {f.delta:.4g}"
            "  [s, one micro-batch]",
            f"O      = {f.omega:.4g} x parameter bytes / shards + {f.sigma:.4g}  [s, one step]",
            f"Act(s) = {self.alpha2:.4g} s + {self.beta2:.4g}  [bytes, one layer]",
        ]
        return "\n".join(lines)


def fit_step_profile(
    points: Sequence[StepPoint],
    optimizer: Sequence[OptimizerPoint],
    embed: tuple[Sequence[int], Sequence[float]],
    act: tuple[Sequence[int], Sequence[int]],
    device: str,
) -> StepProfile:
    """The fits of a step profile: `fit_step_terms`; the embedding's seconds per token, the slope of its timings
    (`embed`: tokens, seconds); Act(s) from one layer's saved bytes (`act`: lengths, bytes)."""
    tokens, seconds = (np.asarray(v, np.float64) for v in embed)
    beta_embed, _ = _nonnegative_lstsq(np.stack([tokens, np.ones_like(tokens)], 1), seconds)
    lengths, saved = (np.asarray(v, np.float64) for v in act)
    alpha2, beta2 = _nonnegative_lstsq(np.stack([lengths, np.ones_like(lengths)], 1), saved)
    return StepProfile(
        tuple(points),
        tuple(optimizer),
        tuple(int(n) for n in embed[0]),
        tuple(float(x) for x in embed[1]),
        tuple(int(n) for n in act[0]),
        tuple(int(b) for b in act[1]),
        fit_step_terms(points, optimizer),
        float(beta_embed),
        float(alpha2),
        float(beta2),
        device,
    )


def fit_cost_model(
    result: ProfileResult | StepProfile,
    layers: int,
    kv_bytes_per_token: int,
    param_bytes: float,
    hardware: Hardware | None = None,
    boundary_bytes_per_token: float | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
) -> CostModel:
    """The profiled coefficients as a CostModel (source "profiled", `device` where they were measured);
    bandwidths and latency come from `hardware`, which the layer profile cannot see. Without one, the
    default links are named after the measured device, not the default's "h100". `heads` and `kv_heads`
    (the attention's) let the planner cost Ulysses splits. A `StepProfile` also gives the terms outside the
    layers (LM head, loss, embedding, the micro-batch's and the step's fixed costs, the optimizer); a
    `ProfileResult` (one eager layer) leaves them 0."""
    step = result if isinstance(result, StepProfile) else None
    return CostModel.from_terms(
        alpha1=result.alpha1,
        beta1=result.beta1,
        gamma=result.gamma,
        alpha2=result.alpha2,
        beta2=result.beta2,
        layers=layers,
        kv_bytes_per_token=kv_bytes_per_token,
        param_bytes=param_bytes,
        hardware=hardware or Hardware(name=result.device),
        source="profiled",
        device=result.device,
        boundary_bytes_per_token=boundary_bytes_per_token,
        heads=heads,
        kv_heads=kv_heads,
        beta_head=step.beta_head if step is not None else 0.0,
        beta_embed=step.beta_embed if step is not None else 0.0,
        delta=step.fit.delta if step is not None else 0.0,
        omega=step.fit.omega if step is not None else 0.0,
        sigma=step.fit.sigma if step is not None else 0.0,
    )


def build_model(spec: ModelSource) -> nn.Module:
    """The model `spec` names: `module:factory`, or a builder."""
    if callable(spec):
        return spec()
    module_name, sep, factory = spec.partition(":")
    if not sep or not module_name or not factory:
        raise ValueError(f"model spec must be 'module:factory', got {spec!r}")
    return getattr(importlib.import_module(module_name), factory)()


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder's ModuleList of layers: `model.layers` or `model.model.layers` (Hugging Face)."""
    for owner in (model, getattr(model, "model", None)):
        layers = getattr(owner, "layers", None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise ValueError(f"{type(model).__name__} has neither .layers nor .model.layers (a ModuleList of decoder layers)")


def _input_maker(
    model: nn.Module, hidden: int, device: torch.device, dtype: torch.dtype
) -> Callable[[int], LayerInputs]:
    """Layer inputs for the decoders we know: `bytescale_compile/models/llama.py` (`layer(x, cos, sin)`, rotary at
    `model.rotary`), Hugging Face (`layer(x, position_embeddings=(cos, sin), position_ids=...)`, rotary at
    `model.model.rotary_emb`), else `layer(x)`."""
    hf_rotary = getattr(getattr(model, "model", None), "rotary_emb", None)

    def make_inputs(s: int) -> LayerInputs:
        x = torch.randn(1, s, hidden, device=device, dtype=dtype, requires_grad=True)
        position_ids = torch.arange(s, device=device)[None]
        with torch.no_grad():
            if hasattr(model, "rotary"):
                rotary: Any = model.rotary
                return (x, *rotary(position_ids, dtype)), {}
            if hf_rotary is not None:
                return (x,), {"position_embeddings": hf_rotary(x, position_ids), "position_ids": position_ids}
        return (x,), {}

    return make_inputs


def profile_model(
    spec: ModelSource,
    lengths: Sequence[int],
    out_path: str | Path,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    repeats: int = 3,
    hardware: Hardware | None = None,
    ranks_per_device: int = 1,
) -> ProfileResult:
    """Build the model `spec` names (`module:factory`, or a builder), profile its first decoder layer on
    `device` (default: CUDA if there is one) in `dtype` (default: as built), and save the fitted CostModel as
    JSON at `out_path`.
    K/V and parameter bytes use the model's own element size.

    `ranks_per_device` > 1 (CPU only) measures the layer as that many ranks sharing this CPU run it: as
    many processes at once, each with its share of the cores (as `python -m bytescale_compile.train`
    sets them), the median of their times per length. One process alone on every core would predict
    steps several times shorter than the ranks see.
    """
    if ranks_per_device < 1:
        raise ValueError(f"ranks_per_device must be >= 1, got {ranks_per_device}")
    model = build_model(spec)
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if ranks_per_device > 1 and device.type != "cpu":
        raise ValueError(f"ranks_per_device applies to CPU profiling (ranks sharing its cores), not {device.type}")
    model.to(device=device, dtype=dtype)
    if ranks_per_device == 1:
        result = _profile_first_layer(model, lengths, device, repeats)
    else:
        threads = max(1, (os.cpu_count() or 1) // ranks_per_device)
        with multiprocessing.get_context("spawn").Pool(ranks_per_device) as pool:
            results = pool.starmap(_profile_worker, [(spec, list(lengths), repeats, dtype, threads)] * ranks_per_device)
        times = [statistics.median(r.times[i] for r in results) for i in range(len(results[0].times))]
        result = _fit(
            results[0].lengths, times, results[0].act_bytes, f"cpu, {ranks_per_device} processes x {threads} thread(s)"
        )
    model_cost(model, result, hardware).save(out_path)
    return result


def model_cost(model: nn.Module, result: ProfileResult | StepProfile, hardware: Hardware | None = None) -> CostModel:
    """`fit_cost_model` of `result` with what `model` itself says: its decoder layers, heads, and K/V, parameter
    and hidden-state bytes at its own element size."""
    cfg: Any = model.config
    heads = getattr(cfg, "num_attention_heads", None) or cfg.num_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or getattr(cfg, "num_kv_heads", heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    elem = next(model.parameters()).element_size()
    return fit_cost_model(
        result,
        len(decoder_layers(model)),
        2 * kv_heads * head_dim * elem,
        float(sum(p.numel() * p.element_size() for p in model.parameters())),
        hardware,
        float(cfg.hidden_size * elem),
        heads=int(heads),
        kv_heads=int(kv_heads),
    )


def layer_act_bytes(model: nn.Module, lengths: Sequence[int]) -> list[int]:
    """Bytes autograd saves in one forward of `model`'s first decoder layer (eager, where its parameters are) at
    each length: Act(s)'s measurements."""
    param = next(model.parameters())
    hidden = cast(Any, model).config.hidden_size
    make_inputs = _input_maker(model, hidden, param.device, param.dtype)
    layer = decoder_layers(model)[0]
    return [_saved_bytes(layer, make_inputs(int(s))) for s in lengths]


def _profile_first_layer(model: nn.Module, lengths: Sequence[int], device: torch.device, repeats: int) -> ProfileResult:
    param = next(model.parameters())
    config: Any = model.config
    return profile_layer(
        decoder_layers(model)[0],
        config.hidden_size,
        lengths,
        device,
        repeats,
        _input_maker(model, config.hidden_size, device, param.dtype),
    )


def _profile_worker(
    spec: ModelSource, lengths: list[int], repeats: int, dtype: torch.dtype | None, threads: int
) -> ProfileResult:
    """One of `ranks_per_device` concurrent CPU profiles."""
    torch.set_num_threads(threads)
    model = build_model(spec).to(dtype=dtype)
    return _profile_first_layer(model, lengths, torch.device("cpu"), repeats)
