"""Fit the cost model's coefficients by measurement (paper §4.2: "coefficients we profiled").

One transformer layer runs forward+backward at several lengths on the current device; its time gives
T(s) = alpha1 s^2 + beta1 s + gamma and the bytes of the tensors autograd saves for backward give
Act(s) = alpha2 s + beta2, both by least squares. Every layer of a decoder is alike, so one stands for all.
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
from typing import Any

import numpy as np
import torch
from torch import nn

from .cost_model import CostModel, Hardware

__all__ = [
    "LayerInputs",
    "ModelSource",
    "ProfileResult",
    "fit_cost_model",
    "fit_time",
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

    return _fit(lengths, times, act_bytes, _device_label(device))


def _device_label(device: torch.device) -> str:
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


def fit_cost_model(
    result: ProfileResult,
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
    (the attention's) let the planner cost Ulysses splits."""
    return CostModel(
        result.alpha1,
        result.beta1,
        result.gamma,
        result.alpha2,
        result.beta2,
        layers,
        kv_bytes_per_token,
        param_bytes,
        hardware or Hardware(name=result.device),
        source="profiled",
        device=result.device,
        boundary_bytes_per_token=boundary_bytes_per_token,
        heads=heads,
        kv_heads=kv_heads,
    )


def _build(spec: ModelSource) -> nn.Module:
    if callable(spec):
        return spec()
    module_name, sep, factory = spec.partition(":")
    if not sep or not module_name or not factory:
        raise ValueError(f"model spec must be 'module:factory', got {spec!r}")
    return getattr(importlib.import_module(module_name), factory)()


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
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
    model = _build(spec)
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if ranks_per_device > 1 and device.type != "cpu":
        raise ValueError(f"ranks_per_device applies to CPU profiling (ranks sharing its cores), not {device.type}")
    model.to(device=device, dtype=dtype)
    cfg: Any = model.config
    heads = getattr(cfg, "num_attention_heads", None) or cfg.num_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or getattr(cfg, "num_kv_heads", heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    param = next(model.parameters())
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
    elem = param.element_size()
    param_bytes = float(sum(p.numel() * p.element_size() for p in model.parameters()))
    fit_cost_model(
        result,
        len(_decoder_layers(model)),
        2 * kv_heads * head_dim * elem,
        param_bytes,
        hardware,
        float(cfg.hidden_size * elem),
        heads=int(heads),
        kv_heads=int(kv_heads),
    ).save(out_path)
    return result


def _profile_first_layer(model: nn.Module, lengths: Sequence[int], device: torch.device, repeats: int) -> ProfileResult:
    param = next(model.parameters())
    config: Any = model.config
    return profile_layer(
        _decoder_layers(model)[0],
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
    model = _build(spec).to(dtype=dtype)
    return _profile_first_layer(model, lengths, torch.device("cpu"), repeats)
