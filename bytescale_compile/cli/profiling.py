"""`bytescale-compile profile`: fit the cost model to training steps of the compiled model cut to 1 and 2 layers
on this device (`train/profiling.py`), or to one eager layer as ranks sharing the CPU run it."""

from __future__ import annotations

import argparse
from typing import Any

from .arguments import CLIError, Subparsers, created, int_at_least, output_file, seconds_at_least_0, sizes
from .targets import profile_target

__all__ = ["register"]


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "profile",
        help="fit the cost model to training steps of the compiled model cut to 1 and 2 layers on this device",
    )
    p.add_argument(
        "target",
        help="MODULE:FACTORY, e.g. bytescale_compile.models.llama:small, or a directory with a Hugging Face "
        "config.json (random init from it, as the trainer builds --model)",
    )
    p.add_argument(
        "--lengths",
        type=sizes,
        default="256,512,1K,2K",
        help="at least 3 distinct sequence lengths; shorter ones are also packed into rows of the longest",
    )
    p.add_argument(
        "--min-time",
        type=seconds_at_least_0,
        default=1.0,
        help="seconds of repeated steps timed per point, at least (GPU clocks settle in about one)",
    )
    p.add_argument("--repeats", type=int_at_least(1), default=3, help="timed calls per length, --ranks-per-device > 1")
    p.add_argument("--out", default="cost_model.json", help="the cost-model JSON to write (records the device)")
    p.add_argument(
        "--ranks-per-device",
        type=int_at_least(1),
        default=1,
        help="CPU: profile one eager layer as this many ranks sharing the cores would run it (that many processes "
        "at once; T(s) and Act(s) only)",
    )
    p.set_defaults(func=cmd_profile)


def cmd_profile(args: argparse.Namespace) -> int:
    """Training steps of the compiled model cut to 1 and 2 layers (`train/profiling.py`); with
    --ranks-per-device > 1, one eager layer as that many ranks sharing the CPU run it (T(s) and Act(s) only)."""
    from ..planner.profiler import profile_model
    from ..train.profiling import profile_steps

    out = output_file(args.out, "--out")
    target = profile_target(args.target)
    try:
        if args.ranks_per_device > 1:
            result: Any = profile_model(
                target, args.lengths, created(out), repeats=args.repeats, ranks_per_device=args.ranks_per_device
            )
        else:
            result = profile_steps(target, args.lengths, created(out), min_time=args.min_time)
    except ValueError as e:
        raise CLIError(str(e)) from e
    print(result.summary())
    print(f"cost model of {result.device} written to {out}")
    return 0
