"""Our trainer on one GPU for `benchmarks/gpu.py`: tables 1 (the whole trainer), 5 (the longest sequence at
r = 0, 0.5, 1) and 6 (the profiled cost model's predicted step against the measured one), in one process so the
model compiles once.

The path is the trainer's: `bytescale-compile profile` fits the cost model on this GPU, `optimize()` compiles the
model, the memory model gives C from the device's memory (`--capacity auto`), and `Runtime` plans and runs every
step with the default strategy, offload "auto", bf16 autocast and the distributed optimizer (bf16 weights, fp32
main weights and moments).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from benchmarks.gpu_models import LAYERS_ENV, global_batch, llama3, measure, rng_tokens, step_flops

PROFILE_LENGTHS = "1K,4K,16K,32K"
SMOKE_PROFILE_LENGTHS = "32,64,128"
OUR_OPS = {
    "attention": ("bytescale::attention", "bytescale::attention_backward"),
    "loss": ("bytescale::fused_linear_cross_entropy",),
    "offload copies issued": ("bytescale::offload_saved", "bytescale::reload_saved"),
}
RATIOS = (0.0, 0.5, 1.0)


def profiled_cost_model(layers: int, smoke: bool) -> tuple[Any, str]:
    """The cost model `bytescale-compile profile` fits on this device, and the summary it prints."""
    import contextlib
    import io

    from bytescale_compile.cli import main as cli
    from bytescale_compile.planner.cost_model import CostModel

    os.environ[LAYERS_ENV] = str(layers)
    path = os.path.join(tempfile.mkdtemp(), "cost_model.json")
    lengths = SMOKE_PROFILE_LENGTHS if smoke else PROFILE_LENGTHS
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = cli(["profile", "benchmarks.gpu_models:profile_target", "--lengths", lengths, "--out", path])
    if code != 0:
        raise RuntimeError(f"bytescale-compile profile exited {code}: {printed.getvalue()}")
    return CostModel.load(path), printed.getvalue().strip()


def build_runtime(layers: int, smoke: bool, cost_model: Any) -> tuple[Any, dict[str, Any]]:
    """The trainer's Runtime for the model (see the module docstring) and what it chose: C, bytes per parameter."""
    import bytescale_compile as bsc
    from bytescale_compile.engine.dist_optim import DistributedOptimizer
    from bytescale_compile.engine.probe import probe
    from bytescale_compile.engine.runtime import Runtime
    from bytescale_compile.train.memory import device_memory, memory_model

    device = "cpu" if smoke else "cuda"
    model = llama3(layers, smoke, device)
    optimized = bsc.optimize(model)
    # compiles under autocast, so the memory model reads the graphs the steps run
    probed = probe(optimized, cost_model, mixed_precision=torch.bfloat16)
    budget = None if smoke else device_memory(device)
    memory = memory_model(optimized, total_layers=layers, hdp=1, dtype="bf16", budget=budget)
    capacity = 4096 if smoke else memory.capacity(budget, offload=True)
    optimizer = DistributedOptimizer(model, 3e-4, 0.1, (0.9, 0.95))
    runtime = Runtime(
        optimized,
        optimizer,
        cost_model=cost_model,
        capacity=capacity,
        mixed_precision=torch.bfloat16,
        memory=memory,
        memory_budget=budget,
        probe=probed,
    )
    chosen = {
        "capacity": capacity,
        "bytes_per_param": memory.bytes_per_param,
        "static_gib": memory.static.total / 2**30,
        "budget_gib": None if budget is None else budget / 2**30,
        "params": sum(p.numel() for p in model.parameters()),
    }
    return runtime, chosen


def trainer_rows(
    runtime: Any, layers: int, smoke: bool, batches: list[tuple[str, int]], cap: int, warmup: int, steps: int
) -> list[dict[str, Any]]:
    """Table 1 (and 6's predictions): each global batch trained `warmup + steps` times, then once profiled."""
    vocab = runtime.model.original_module.config.vocab_size
    rows = []
    for dataset, tokens in batches:
        lengths = global_batch(dataset, tokens, min(cap, runtime.capacity))
        stats: list[Any] = []
        step = _step(runtime, rng_tokens(lengths, vocab, "cpu"), stats)
        m = measure(tokens, step_flops(layers, smoke, lengths), step, warmup, steps, OUR_OPS, reset_peak=False)
        if stats and m.error is None:
            last = stats[-1]
            m.extra = {
                "sequences": len(lengths),
                "longest": max(lengths),
                "micro_batches": len(last.plan.micro_batches),
                "offload_ratios": sorted({round(mb.offload_ratio, 2) for mb in last.plan.micro_batches}),
                "offloaded_gib": last.offloaded_bytes / 2**30,
                "predicted_s": runtime.predict(last).time,
                "predicted_reserved_gib": _gib_max(last.predicted_peak_bytes),
                "measured_reserved_gib": _gib_max(last.measured_reserved_peak_bytes),
                "plan_s": last.plan_time,
                "losses": [round(s.loss, 4) for s in stats[-3:]],
            }
        rows.append({"dataset": dataset, **asdict(m)})
    return rows


def _gib_max(per_rank: list[int] | None) -> float | None:
    return None if not per_rank else max(per_rank) / 2**30


def _step(runtime: Any, batch: list[torch.Tensor], stats: list[Any]) -> Callable[[], None]:
    """One Runtime step on `batch`, its StepStats appended to `stats` (the Runtime resets the peak each step)."""
    return lambda: stats.append(runtime.step(batch))


def longest_rows(runtime: Any, smoke: bool, lengths: tuple[int, int]) -> list[dict[str, Any]]:
    """Table 5: one sequence of each of `lengths` tokens at offload r = 0, 0.5, 1 (the plan's ratio replaced),
    its peak memory, and the longest sequence the line through the two peaks fits into the device's memory."""
    vocab = runtime.model.original_module.config.vocab_size
    rows = []
    for ratio in RATIOS:
        peaks = []
        for n in lengths:
            batch = rng_tokens([n], vocab, "cpu")
            plan = runtime.plan(np.asarray([n]))
            plan = dataclasses.replace(
                plan, micro_batches=[dataclasses.replace(mb, offload_ratio=ratio) for mb in plan.micro_batches]
            )
            try:
                runtime.step(batch, plan=plan)
                peaks.append(torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0)
            except Exception as e:
                peaks.append(None)
                rows.append({"ratio": ratio, "tokens": n, "error": f"{type(e).__name__}: {str(e)[:200]}"})
        rows.append({"ratio": ratio, **fit_longest(lengths, peaks, smoke)})
    return rows


def fit_longest(lengths: tuple[int, int], peaks: list[int | None], smoke: bool) -> dict[str, Any]:
    """The two peaks, and the length at which the line through them reaches the device's total memory."""
    if smoke or None in peaks:
        return {"peaks_gib": [None if p is None else p / 2**30 for p in peaks]}
    (a, b), (pa, pb) = lengths, peaks
    assert pa is not None and pb is not None
    per_token = (pb - pa) / (b - a)
    total = torch.cuda.get_device_properties(0).total_memory
    longest = int(a + (total - pa) / per_token) if per_token > 0 else None
    return {"peaks_gib": [pa / 2**30, pb / 2**30], "bytes_per_token": per_token, "longest": longest}


def run(layers: int, smoke: bool, batches: list[tuple[str, int]], cap: int, warmup: int, steps: int) -> dict[str, Any]:
    """Everything this module measures, as one JSON-able dict."""
    out: dict[str, Any] = {}
    try:
        cost_model, summary = profiled_cost_model(layers, smoke)
        out["profile"] = summary
    except Exception as e:  # the Runtime then takes its default cost model, and the predictions say so
        out["profile"] = f"failed: {type(e).__name__}: {e}"
        cost_model = None
    runtime, out["chosen"] = build_runtime(layers, smoke, cost_model)
    out["trainer"] = trainer_rows(runtime, layers, smoke, batches, cap, warmup, steps)
    out["longest"] = longest_rows(runtime, smoke, (64, 128) if smoke else (16_384, 32_768))
    return out
