"""The `bytescale-compile` parser, assembled from the command modules, and `main`, which runs one command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from types import ModuleType

from . import data, export, inspection, memory, planning, profiling
from .arguments import CLIError, Parser, UsageError

__all__ = ["COMMANDS", "DESCRIPTION", "build_parser", "main"]

DESCRIPTION = """`bytescale-compile`: inspect a model's compilation, plan and simulate HDP steps, profile a cost model,
predict a rank's memory and capacity, train a tokenizer, prepare token datasets from your own text and export
training checkpoints as Hugging Face models.

Usage errors print one line and exit with status 2; `bytescale-compile --debug COMMAND ...` shows the
traceback instead. torch and the compiler load only in the commands that need them (inspect, profile,
memory, export)."""

COMMANDS: tuple[ModuleType, ...] = (inspection, planning, profiling, data, memory, export)
"""The command modules, in the order `--help` lists their commands; each adds its own with `register(subparsers)`."""


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="bytescale-compile", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one line")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; a usage error prints `bytescale-compile COMMAND: error: ...` and returns 2 (with
    --debug, the traceback of a command's error is shown instead; argparse's own errors name the nested
    command, `bytescale-compile data prepare: error: ...`, as they always did)."""
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:
        print(f"{e.prog}: error: {e}", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except CLIError as e:
        if args.debug:
            raise
        print(f"bytescale-compile {args.command}: error: {e}", file=sys.stderr)
        return 2
