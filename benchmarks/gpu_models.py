"""What `benchmarks/gpu.py`'s trainer tables share: the Llama-3-8B shape, the variable-length global batches,
model FLOPs, step timing and where a step's device time goes.

The batches are the simulator's Byted-like and GitHub-like length distributions (`sim/lengths.py`), drawn with a
fixed seed and capped at a context length, so every path in the tables trains the very same sequences.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from bytescale_compile.engine.protocol import packed_row as protocol_row

GIB = 2**30
DATASETS = ("byted", "github")
LAYERS_ENV = "BSC_GPU_BENCH_LAYERS"
"""The layer count `profile_target` builds: the profiler CLI takes a factory without arguments."""

ATTENTION_KERNELS = ("attn", "attention", "flash", "flex", "fmha", "sdpa")
"""Substrings of kernel names that are attention (ours, flash, flex's generated kernels, cuDNN's)."""


def llama3_config(layers: int, smoke: bool, attn_implementation: str | None = None) -> Any:
    """Llama-3-8B's shape (hidden 4096, 32/8 heads, MLP 14336, vocab 128256) with `layers` layers, or a tiny one."""
    import transformers

    size = (
        dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
        if smoke
        else dict(
            vocab_size=128_256,
            hidden_size=4096,
            intermediate_size=14_336,
            num_attention_heads=32,
            num_key_value_heads=8,
            rope_theta=500_000.0,
        )
    )
    cfg = transformers.LlamaConfig(
        num_hidden_layers=layers, max_position_embeddings=1 << 21, use_cache=False, tie_word_embeddings=False, **size
    )
    if attn_implementation is not None:
        cfg._attn_implementation = attn_implementation
    return cfg


def llama3(layers: int, smoke: bool, device: str, attn_implementation: str | None = None) -> Any:
    """The model of `llama3_config`, fp32, random weights, initialised on `device` (a CPU init of 8B takes minutes)."""
    import transformers

    torch.manual_seed(0)
    with torch.device(device):
        return transformers.LlamaForCausalLM(llama3_config(layers, smoke, attn_implementation))


def profile_target() -> Any:
    """`bytescale-compile profile benchmarks.gpu_models:profile_target`: the benchmark's model in bf16, with the
    layer count of `$BSC_GPU_BENCH_LAYERS`."""
    layers = int(os.environ.get(LAYERS_ENV, "2"))
    smoke = not torch.cuda.is_available()
    return llama3(layers, smoke, "cuda" if not smoke else "cpu").to(torch.bfloat16)


def global_batch(dataset: str, tokens: int, max_len: int, seed: int = 0) -> list[int]:
    """One global batch's sequence lengths, summing to `tokens`, none longer than `max_len`."""
    from bytescale_compile.sim.lengths import sample_global_batch

    return [int(n) for n in sample_global_batch(dataset, tokens, seed=seed, max_len=max_len)]


def pack_rows(lengths: Sequence[int], row_tokens: int) -> list[list[int]]:
    """First-fit decreasing packing into rows of at most `row_tokens` tokens (what a packing collator does)."""
    rows: list[list[int]] = []
    free: list[int] = []
    for n in sorted(lengths, reverse=True):
        if n > row_tokens:
            raise ValueError(f"a sequence of {n} tokens does not fit a row of {row_tokens}")
        slot = next((i for i, room in enumerate(free) if room >= n), None)
        if slot is None:
            rows.append([n])
            free.append(row_tokens - n)
        else:
            rows[slot].append(n)
            free[slot] -= n
    return rows


def packed_row(lengths: Sequence[int], vocab: int, device: str) -> dict[str, Any]:
    """One packed row: token ids, restarting positions, the next-token targets (-100 at each sequence's end) and
    the varlen offsets of FlashAttention's `DataCollatorWithFlattening`."""
    row = protocol_row(torch.randint(0, vocab, (1, sum(lengths)), device=device), lengths)
    ends = torch.tensor(lengths, device=device).cumsum(0)
    cu = torch.cat([torch.zeros(1, device=device, dtype=torch.int32), ends.to(torch.int32)])
    return {
        "input_ids": row.input_ids,
        "position_ids": row.position_ids,
        "labels": row.shift_labels,
        "shift_labels": row.shift_labels,
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max(lengths),
        "max_length_k": max(lengths),
    }


def step_flops(layers: int, smoke: bool, lengths: Sequence[int]) -> float:
    """Model FLOPs of one step (matmuls, causal attention per sequence: `train/flops.py`)."""
    from bytescale_compile.planner.model_shape import shape_from_config
    from bytescale_compile.train.flops import model_flops

    return model_flops(shape_from_config(llama3_config(layers, smoke), "llama3"), lengths)


def peak_tflops() -> float | None:
    from bytescale_compile.train.flops import peak_tflops as table

    return table(torch.device("cuda"), "bf16") if torch.cuda.is_available() else None


@dataclass
class Measured:
    """A path's figures on one global batch."""

    tokens: int
    step_s: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    peak_gib: float | None = None
    """Allocated."""
    reserved_gib: float | None = None
    """Reserved by the caching allocator: what the process holds of the device."""
    shares: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(
    step: Callable[[], Any], warmup: int, steps: int, reset_peak: bool = True
) -> tuple[list[float], float | None, float | None]:
    """Seconds of each of `steps` steps after `warmup` ones, and the peak GiB allocated and reserved over them (the
    peaks are also read after every step, for a step function that resets them itself)."""
    for _ in range(warmup):
        step()
    synchronize()
    if torch.cuda.is_available() and reset_peak:
        torch.cuda.reset_peak_memory_stats()
    times, peak, reserved = [], 0, 0
    for _ in range(steps):
        start = time.perf_counter()
        step()
        synchronize()
        times.append(time.perf_counter() - start)
        if torch.cuda.is_available():
            peak = max(peak, torch.cuda.max_memory_allocated())
            reserved = max(reserved, torch.cuda.max_memory_reserved())
    if not torch.cuda.is_available():
        return times, None, None
    return times, peak / GIB, reserved / GIB


def figures(
    tokens: int, flops: float, times: list[float], peak_gib: float | None, reserved_gib: float | None = None
) -> Measured:
    """Median step, tokens/s and MFU against the device's dense bf16 peak."""
    step = statistics.median(times)
    peak = peak_tflops()
    mfu = flops / step / (peak * 1e12) if peak else None
    return Measured(
        tokens=tokens, step_s=step, tokens_per_s=tokens / step, mfu=mfu, peak_gib=peak_gib, reserved_gib=reserved_gib
    )


def measure(
    tokens: int,
    flops: float,
    step: Callable[[], Any],
    warmup: int,
    steps: int,
    ops: dict[str, tuple[str, ...]],
    reset_peak: bool = True,
) -> Measured:
    """`figures` of `step`, and the shares of one more, profiled; a step that fails gives a row that says why, so
    the other rows still run."""
    try:
        times, peak, reserved = timed(step, warmup, steps, reset_peak)
        m = figures(tokens, flops, times, peak, reserved)
        m.shares = device_shares(step, ops)
        return m
    except Exception as e:
        error = "out of memory" if out_of_memory(e) else f"{type(e).__name__}: {e}"[:300]
        return Measured(tokens=tokens, error=error)
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def device_shares(step: Callable[[], Any], ops: dict[str, tuple[str, ...]]) -> dict[str, float]:
    """Where one profiled step's time goes, as shares of its wall time: each of `ops` (name -> operator names
    whose device time counts, e.g. our custom ops), attention kernels by name (`ATTENTION_KERNELS`) where `ops`
    names no attention, host-device copies, and the time the compute stream sat idle (launch gaps, host work,
    waits on copies)."""
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return {}
    synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        synchronize()
    wall_us = (time.perf_counter() - start) * 1e6
    events = prof.key_averages()

    def device_total(e: Any) -> float:
        return float(getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0.0)))

    def device_self(e: Any) -> float:
        return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)))

    kernels = [e for e in events if device_self(e) > 0 and e.key != "" and _is_kernel(e)]
    copies = sum(device_self(e) for e in kernels if e.key.startswith("Memcpy"))
    compute = sum(device_self(e) for e in kernels if not e.key.startswith("Memcpy"))
    shares = {name: sum(device_total(e) for e in events if e.key in names) / wall_us for name, names in ops.items()}
    if "attention" not in ops:
        attention = sum(device_self(e) for e in kernels if any(s in e.key.lower() for s in ATTENTION_KERNELS))
        shares["attention"] = attention / wall_us
    shares["host-device copies"] = copies / wall_us
    shares["compute stream idle"] = max(0.0, 1.0 - compute / wall_us)
    return shares


def _is_kernel(event: Any) -> bool:
    device_type = getattr(event, "device_type", None)
    return device_type is not None and "CUDA" in str(device_type)


def out_of_memory(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def rng_tokens(lengths: Sequence[int], vocab: int, device: str) -> list[torch.Tensor]:
    """The batch as the Runtime takes it: one tensor of random token ids per sequence."""
    generator = np.random.default_rng(0)
    return [torch.as_tensor(generator.integers(0, vocab, n), device=device) for n in lengths]
