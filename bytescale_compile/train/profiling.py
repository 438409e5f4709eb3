"""`bytescale-compile profile`: time what training runs, and fit the cost model to it.

The model is cut to 1 and 2 decoder layers; each cut is compiled by `optimize()` and trained by a `Runtime` as the
trainer builds it (the distributed optimizer and bf16 autocast for a bf16 model, torch's AdamW in fp32 otherwise),
on packed micro-batches: one sequence, or sequences of one length filling the longest length's row, one or two
micro-batches per step. The difference of the depths is the layers' T(s); the rest is the LM head, loss and
embedding per token and the micro-batch's and the step's fixed costs (`planner.profiler.fit_step_terms`). The
optimizer step (clipping, AdamW, the bf16 weight refresh) is timed apart on both cuts, whose parameter bytes
differ by one layer's: omega per byte. The embedding is timed alone to tell it from the LM head. Each point
repeats steps for at least `min_time` seconds, so a GPU's clocks settle. The learning rate is 0: nothing moves.
Dynamo's caches are reset after each cut, as between independent models.
"""

from __future__ import annotations

import copy
import gc
import logging
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..api import optimize
from ..config import CompileConfig
from ..engine.optim import build_optimizer
from ..engine.runtime import CostModelWarning, ListBatch, Runtime
from ..planner import STATIC, MicroBatch, Plan
from ..planner.hardware import Hardware
from ..planner.profiler import (
    ModelSource,
    OptimizerPoint,
    StepPoint,
    StepProfile,
    build_model,
    decoder_layers,
    device_label,
    fit_step_profile,
    layer_act_bytes,
    model_cost,
)

__all__ = ["MIN_TIME", "StepShape", "profile_steps", "step_shapes"]

logger = logging.getLogger(__name__)

MIN_TIME = 1.0
"""Seconds of repeated steps each point is timed for at least: long enough for a GPU's clocks to settle."""
WARMUP_STEPS = 1
"""Untimed steps before each point: the first of a new shape compiles."""
DEPTHS = (1, 2)
"""Decoder layers of the two cuts timed."""
WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.95)


@dataclass(frozen=True)
class StepShape:
    """A step to time: `micro_batches` micro-batches, each `sequences` sequences of `seq_len` tokens packed in one row."""

    seq_len: int
    sequences: int
    micro_batches: int


def step_shapes(lengths: Sequence[int]) -> list[StepShape]:
    """One sequence of each length per step; sequences of each shorter length packed into the longest length's
    row (the attention's s^2 against the linear work at equal tokens); two micro-batches of the shortest and of
    the longest (the micro-batch's fixed cost against the step's)."""
    lengths = sorted({int(s) for s in lengths})
    if len(lengths) < 3 or lengths[0] < 1:
        raise ValueError(f"need at least 3 distinct positive lengths to fit T(s), got {lengths}")
    row = lengths[-1]
    shapes = [StepShape(s, 1, 1) for s in lengths]
    shapes += [StepShape(s, row // s, 1) for s in lengths if row // s >= 2]
    shapes += [StepShape(lengths[0], 1, 2), StepShape(row, 1, 2)]
    return shapes


def profile_steps(
    spec: ModelSource,
    lengths: Sequence[int],
    out_path: str | Path,
    *,
    device: str | torch.device | None = None,
    min_time: float = MIN_TIME,
    hardware: Hardware | None = None,
    config: CompileConfig | None = None,
) -> StepProfile:
    """Build the model `spec` names, time training steps of its compiled 1- and 2-layer cuts on `device` (default:
    CUDA if there is one) at `step_shapes(lengths)`, fit, and save the CostModel of the whole model at `out_path`."""
    if not min_time >= 0:
        raise ValueError(f"min_time must be >= 0 seconds, got {min_time}")
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    model = build_model(spec).to(device)
    shapes = step_shapes(lengths)
    act = sorted({int(s) for s in lengths})
    act_bytes = layer_act_bytes(model, act)
    dtype = next(model.parameters()).dtype
    points: list[StepPoint] = []
    optimizer: list[OptimizerPoint] = []
    for depth in DEPTHS:
        cut = _cut(model, depth)
        param_bytes = float(sum(p.numel() * p.element_size() for p in cut.parameters()))
        runtime = _runtime(cut, dtype, max(act), config)
        steps = [(shape, _seconds(_step(runtime, shape), device, min_time)) for shape in shapes]
        optimizer_seconds = _seconds(_optimizer_step(runtime), device, min_time)
        optimizer.append(OptimizerPoint(param_bytes, optimizer_seconds))
        for shape, seconds in steps:  # a step ends with its optimizer step, which ω and σ fit apart
            points.append(
                StepPoint(
                    depth, shape.seq_len, shape.sequences, shape.micro_batches, max(0.0, seconds - optimizer_seconds)
                )
            )
            logger.info(
                "%d layer(s), %s: %.3f ms a step, its optimizer left out", depth, shape, points[-1].seconds * 1e3
            )
        del runtime, cut
        _release(device)
    embed_tokens = sorted({s.seq_len * s.sequences for s in shapes})
    embed_times = [_seconds(_embedding_step(model, n), device, min_time) for n in embed_tokens]
    profile = fit_step_profile(points, optimizer, (embed_tokens, embed_times), (act, act_bytes), device_label(device))
    model_cost(model, profile, hardware).save(out_path)
    return profile


def _release(device: torch.device) -> None:
    """Drop a timed cut's compiled graphs (as between independent models: the next cut compiles its own) and, on
    CUDA, the allocator's cached blocks, so what runs after the profile finds the device's memory free."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _cut(model: nn.Module, depth: int) -> nn.Module:
    """A copy of `model` with its first `depth` decoder layers (its config says so too); `model` is left whole."""
    layers = decoder_layers(model)
    owner: Any = model if getattr(model, "layers", None) is layers else model.model
    if len(layers) < depth:
        raise ValueError(f"{type(model).__name__} has {len(layers)} decoder layer(s); profiling cuts it to {depth}")
    config: Any = getattr(model, "config", None)
    saved = {k: getattr(config, k) for k in ("num_hidden_layers", "layer_types") if hasattr(config, k)}
    try:
        owner.layers = nn.ModuleList(list(layers)[:depth])
        for key, value in saved.items():
            setattr(config, key, value[:depth] if isinstance(value, list) else depth)
        return copy.deepcopy(model)
    finally:
        owner.layers = layers
        for key, value in saved.items():
            setattr(config, key, value)


def _runtime(cut: nn.Module, dtype: torch.dtype, capacity: int, config: CompileConfig | None) -> Runtime:
    """The trainer's Runtime of `cut`: for a bf16 model the distributed optimizer over its fp32 copy and bf16
    autocast (`--dtype bf16`), else torch's AdamW (`--dtype fp32`); learning rate 0."""
    bf16 = dtype == torch.bfloat16
    optimized = optimize(cut.float() if bf16 else cut, config)
    weights = torch.bfloat16 if bf16 else torch.float32
    optimizer = build_optimizer(optimized.original_module, 0.0, WEIGHT_DECAY, BETAS, dtype=weights)
    return Runtime(
        optimized, optimizer, capacity=capacity, mixed_precision=torch.bfloat16 if bf16 else None, max_grad_norm=1.0
    )


def _step(runtime: Runtime, shape: StepShape) -> Callable[[], object]:
    """A training step of `shape` on random tokens, its plan given (one rank runs every micro-batch)."""
    k, m = shape.sequences, shape.micro_batches
    sequences = [shape.seq_len] * (k * m)
    micro_batches = [
        MicroBatch(i, (0,), tuple(range(i * k, (i + 1) * k)), 0.0, k * shape.seq_len, 0.0) for i in range(m)
    ]
    plan = Plan(STATIC, 1, max(k * shape.seq_len, runtime.capacity), 1, sequences, micro_batches, [list(range(m))])
    generator = torch.Generator().manual_seed(0)
    vocab = runtime.vocab_size or 2
    batch = ListBatch([torch.randint(vocab, (n,), generator=generator) for n in sequences], vocab)

    def step() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CostModelWarning)  # the profile is what makes the predictions right
            runtime.step(batch, plan)

    return step


def _optimizer_step(runtime: Runtime) -> Callable[[], object]:
    """Clipping and the optimizer step as `Runtime.step` runs them, over the gradients its last step left."""

    def step() -> None:
        runtime._clip_and_step(0.0)  # a finite loss: clipped and stepped as a step does, no host sync

    return step


def _embedding_step(model: nn.Module, tokens: int) -> Callable[[], object]:
    """Fwd+bwd of `model`'s (first) embedding alone over `tokens` random ids, gradients returned, not kept."""
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None:
        raise ValueError(f"{type(model).__name__} has no nn.Embedding: the profile times its embedding alone")
    weight = embedding.weight
    ids = torch.randint(embedding.num_embeddings, (1, tokens), device=weight.device)
    grad = torch.randn(1, tokens, embedding.embedding_dim, device=weight.device, dtype=weight.dtype)

    def step() -> None:
        torch.autograd.grad(embedding(ids), weight, grad)

    return step


def _seconds(call: Callable[[], object], device: torch.device, min_time: float) -> float:
    """Median seconds of `call` (the device synchronised after each), repeated for at least `min_time` seconds
    after `WARMUP_STEPS` untimed calls."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(WARMUP_STEPS):
        call()
        sync()
    samples: list[float] = []
    began = time.perf_counter()
    while not samples or time.perf_counter() - began < min_time:
        start = time.perf_counter()
        call()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)
