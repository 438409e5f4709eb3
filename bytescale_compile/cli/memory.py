"""`bytescale-compile memory`: predict one rank's memory and the capacity C a device budget allows, from a
meta-device compilation (`train/memory.py`): no weights, no device memory."""

from __future__ import annotations

import argparse
import functools
from typing import TYPE_CHECKING

from .arguments import CLIError, Subparsers, int_at_least
from .targets import meta_model, sample_inputs

if TYPE_CHECKING:
    from torch import nn

    from ..planner.memory import MemoryModel

__all__ = ["register"]

_PROBE_TOKENS = 32
"""Tokens of the row the memory command compiles its meta-device copy on: the report is per token, so any
short length does (the token dimension is compiled dynamic)."""


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "memory",
        help="predict one rank's memory (static bytes, activations per token, workspace) and the capacity C a "
        "device budget allows, from a meta-device compilation: no weights, no device memory",
    )
    p.add_argument(
        "target",
        metavar="MODEL",
        help="a directory with a Hugging Face config.json (compiled as a 2-layer copy), or MODULE:FACTORY",
    )
    p.add_argument("--tp", type=int_at_least(1), default=1, help="tensor-parallel degree (default 1)")
    p.add_argument("--pp", type=int_at_least(1), default=1, help="pipeline stages (default 1)")
    p.add_argument("--hdp", type=int_at_least(1), default=1, help="HDP ranks, N: what gradients and sharded state span")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="training dtype (default fp32)")
    p.add_argument("--zero", action="store_true", help="fp32: shard the Adam moments over the HDP ranks (ZeRO-1)")
    p.add_argument(
        "--grad-reduce-dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="bf16: reduce-scatter gradients in fp32 in place (default) or as a bf16 copy of each bucket",
    )
    p.add_argument(
        "--device-memory",
        "--memory-budget",
        dest="device_memory",
        default=None,
        metavar="SIZE",
        help="memory of one device, binary units: 80G, 141GiB (default: this machine's CUDA device)",
    )
    p.add_argument(
        "--offload",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the C with (--offload) or without (--no-offload) activation offloading (default: both)",
    )
    p.set_defaults(func=cmd_memory)


def cmd_memory(args: argparse.Namespace) -> int:
    from ..planner.memory import MemoryBudgetError, format_bytes

    budget = _budget(args.device_memory)
    _check_options(args)
    model, total_layers = meta_model(args.target, args.dtype)
    if args.pp > total_layers:
        raise CLIError(f"--pp {args.pp} is larger than the model's {total_layers} decoder layers")
    memory = _memory_model(args, model, total_layers=total_layers, budget=budget)
    where = f"tp {args.tp}, pp {args.pp}, {args.hdp} HDP ranks"
    print(f"{args.target}: {total_layers} decoder layers, {args.dtype}, {where}, budget {format_bytes(budget)}")
    print(memory.describe())
    modes = [args.offload] if args.offload is not None else [False, True]
    try:
        for offload in modes:
            c = memory.capacity(budget, offload)
            peak = format_bytes(memory.worst_peak(c, offload))
            print(f"C {'with' if offload else 'without'} offload: {c:,} tokens (peak {peak})")
        if True in modes:
            print(f"longest per rank with offload (r = 1): {memory.longest_per_rank(budget):,} tokens")
    except MemoryBudgetError as e:
        raise CLIError(f"--device-memory: {e}") from e
    return 0


def _budget(device_memory: str | None) -> int:
    """--device-memory in bytes, or this machine's CUDA device's (its free memory plus what torch reserves)."""
    import torch

    from ..train.memory import device_memory as read_device_memory
    from ..train.memory import parse_memory

    if device_memory is None and not torch.cuda.is_available():
        raise CLIError("no CUDA device here to read the memory of: pass --device-memory SIZE (e.g. 80G)")
    try:
        return parse_memory(device_memory) if device_memory else read_device_memory("cuda")
    except ValueError as e:
        raise CLIError(f"--device-memory: {e}") from e


def _check_options(args: argparse.Namespace) -> None:
    if args.zero and args.dtype != "fp32":
        raise CLIError("--zero applies to --dtype fp32 (bf16's distributed optimizer always shards)")
    if args.grad_reduce_dtype != "fp32" and args.dtype != "bf16":
        raise CLIError("--grad-reduce-dtype bf16 applies to --dtype bf16")


def _memory_model(args: argparse.Namespace, model: nn.Module, *, total_layers: int, budget: int) -> MemoryModel:
    """The memory model of `model` (on the meta device) in the run's layout: its static bytes checked against
    `budget` first, then its activations from a compilation of one short row."""
    from ..planner.memory import MemoryBudgetError
    from ..train.memory import compile_on_meta, memory_model, trainer_expandable_segments

    layout = functools.partial(
        memory_model,
        total_layers=total_layers,
        hdp=args.hdp,
        dtype=args.dtype,
        pp=args.pp,
        tp=args.tp,
        zero=args.zero,
        grad_reduce_dtype=args.grad_reduce_dtype,
        budget=budget,
        expandable=trainer_expandable_segments(),
    )
    inputs = sample_inputs(model, _PROBE_TOKENS)
    try:
        layout(model, activations=False).available(budget)  # budget and tp refused before compiling
        return layout(compile_on_meta(model, inputs))
    except MemoryBudgetError as e:
        raise CLIError(f"--device-memory: {e}") from e
    except ValueError as e:
        raise CLIError(str(e)) from e
    except Exception as e:  # compiling someone's model on the meta device: name what failed, not a traceback
        raise CLIError(f"compiling {args.target} on the meta device failed: {type(e).__name__}: {e}") from e
