"""`bytescale-compile memory`: predict one rank's memory and the capacity C a device budget allows, from a
meta-device compilation (`train/memory.py`), or for a preset shape from its counts alone
(`planner.memory.shape_memory_model`): no weights, no device memory."""

from __future__ import annotations

import argparse
import functools
from typing import TYPE_CHECKING

from ..strategies import EXPERT_LAYOUTS
from .arguments import CLIError, Subparsers, int_at_least
from .targets import meta_model, sample_inputs

if TYPE_CHECKING:
    from torch import nn

    from ..planner.memory import MemoryModel
    from ..planner.model_shape import ModelShape

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
        help="a directory with a Hugging Face config.json (compiled as a 2-layer copy), MODULE:FACTORY, or a "
        "preset shape (llama-7b ... mistral-8x22b: counted, not compiled)",
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
    p.add_argument(
        "--expert-layout",
        choices=EXPERT_LAYOUTS,
        default="auto",
        help="a preset MoE's experts in the TP group: ep (E/tp whole experts per rank), tp (every expert split "
        "like a dense MLP), auto (ep where tp divides the experts; default)",
    )
    p.set_defaults(func=cmd_memory)


def cmd_memory(args: argparse.Namespace) -> int:
    from ..planner.memory import MemoryBudgetError, format_bytes

    budget = _budget(args.device_memory)
    _check_options(args)
    shape = _preset(args.target)
    if shape is not None:
        memory, total_layers, note = _shape_memory_model(args, shape, budget), shape.layers, None
    else:
        if args.expert_layout != "auto":
            raise CLIError(
                "--expert-layout applies to a preset shape (mistral-8x7b, mistral-8x22b); a compiled model is "
                "counted as it is built, every matrix split over --tp"
            )
        model, total_layers = meta_model(args.target, args.dtype)
        if args.pp > total_layers:
            raise CLIError(f"--pp {args.pp} is larger than the model's {total_layers} decoder layers")
        memory, note = _memory_model(args, model, total_layers=total_layers, budget=budget)
    print(_assumptions(args, total_layers, format_bytes(budget)))
    if shape is not None:
        print(_shape_line(args, shape))
    elif note is not None:
        print(note)
    print(memory.describe())
    modes = [args.offload] if args.offload is not None else [False, True]
    try:
        capacities = {offload: memory.capacity(budget, offload) for offload in modes}
        for offload, c in capacities.items():
            peak = format_bytes(memory.worst_peak(c, offload))
            print(f"C {'with' if offload else 'without'} offload: {c:,} tokens (peak {peak})")
        if True in modes:
            longest = memory.longest_per_rank(budget)
            print(f"longest per rank with offload (r = 1): {longest:,} tokens")
    except MemoryBudgetError as e:
        raise CLIError(f"--device-memory: {e}") from e
    if capacities.get(True, 0) < capacities.get(False, 0):
        print(
            f"  why C with offload is lower: with offloading a rank may hold a share of a long sequence of up to "
            f"l x C / 2 tokens ({longest:,} here), of which only the last 2 layers stay whole on the device; C is "
            f"sized so that share fits, so a rank holds more tokens with offload than C without (docs/memory.md)"
        )
    return 0


def _assumptions(args: argparse.Namespace, total_layers: int, budget: str) -> str:
    """Every setting the figures below assume, in one line."""
    state = "distributed optimizer" if args.dtype == "bf16" else "ZeRO-1" if args.zero else "replicated AdamW"
    reduce = f", gradients reduced in {args.grad_reduce_dtype}" if args.dtype == "bf16" else ""
    return (
        f"{args.target}: {total_layers} decoder layers, {args.dtype}, tp {args.tp}, pp {args.pp}, {args.hdp} HDP "
        f"ranks, {state}{reduce}, budget {budget}"
    )


def _preset(target: str) -> ModelShape | None:
    """The preset shape MODEL names, None for a directory or MODULE:FACTORY."""
    from pathlib import Path

    from ..planner.model_shape import PRESETS

    return PRESETS.get(target) if not Path(target).exists() else None


def _shape_memory_model(args: argparse.Namespace, shape: ModelShape, budget: int) -> MemoryModel:
    """A preset's memory model from its counts, the layout refused with the fix where it cannot split."""
    from ..planner.memory import MemoryBudgetError, ParallelLayout, shape_memory_model
    from ..train.memory import trainer_expandable_segments

    layout = ParallelLayout(tp=args.tp, pp=args.pp, hdp=args.hdp, expert_layout=args.expert_layout)
    try:
        memory = shape_memory_model(
            shape,
            layout,
            dtype=args.dtype,
            zero=args.zero,
            grad_reduce_dtype=args.grad_reduce_dtype,
            budget=budget,
            expandable=trainer_expandable_segments(),
        )
        memory.available(budget)
    except MemoryBudgetError as e:
        raise CLIError(f"--device-memory: {e}") from e
    except ValueError as e:
        raise CLIError(f"--tp {args.tp} --pp {args.pp} --expert-layout {args.expert_layout}: {e}") from e
    return memory


def _shape_line(args: argparse.Namespace, shape: ModelShape) -> str:
    """What the preset's counts give per device: parameters, and an MoE's experts."""
    tp = args.tp
    line = f"preset {shape.name}, counted: {shape.params_per_device(tp=tp, pp=args.pp):,} parameters per device"
    if not shape.moe:
        return line
    layout = shape.resolve_expert_layout(tp, args.expert_layout)
    per = shape.experts // tp
    held = f"{per} whole expert{'s' * (per > 1)}" if layout == "ep" else f"1/{tp} of each of {shape.experts} experts"
    return f"{line}; experts: {held} (layout {layout}), router replicated, top-{shape.top_k} routing"


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


def _memory_model(
    args: argparse.Namespace, model: nn.Module, *, total_layers: int, budget: int
) -> tuple[MemoryModel, str | None]:
    """The memory model of `model` (on the meta device) in the run's layout: its static bytes checked against
    `budget` first, then its activations from a compilation of one short row; and a note where the compilation
    missed an MoE's experts (`_unseen_experts`)."""
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
        compiled = compile_on_meta(model, inputs)
        return layout(compiled), _unseen_experts(compiled)
    except MemoryBudgetError as e:
        raise CLIError(f"--device-memory: {e}") from e
    except ValueError as e:
        raise CLIError(str(e)) from e
    except Exception as e:  # compiling someone's model on the meta device: name what failed, not a traceback
        raise CLIError(f"compiling {args.target} on the meta device failed: {type(e).__name__}: {e}") from e


def _unseen_experts(compiled: nn.Module) -> str | None:
    """A note for an MoE whose experts saved nothing in the compile report, so that the activations printed are
    not taken for the whole layer's."""
    from ..passes.report import CompileReport
    from ..planner.model_shape import ModelConfigError, model_shape

    try:
        shape = model_shape(compiled)
    except ModelConfigError:
        return None
    saved = CompileReport(graphs=getattr(compiled, "compiled_graphs", [])).saved_activations
    if not shape.moe or any(".experts" in a.source for a in saved):
        return None
    return (
        f"note: {shape.experts} experts, top-{shape.top_k}: the compile report lists no saved activation of the "
        f"experts (a meta-device compilation of their data-dependent routing records none), so the activations "
        f"below leave them out; a preset MODEL (mistral-8x7b, mistral-8x22b) or planner.memory.shape_memory_model "
        f"counts them"
    )
