"""The `bytescale-compile` command line: `main` runs one command. One module per command group registers its
sub-parsers and runs its commands (`inspection`, `planning`, `profiling`, `data`, `memory`, `export`; `commands.py`
lists them in `COMMANDS`), on `arguments` (errors, argparse types, output checks) and `targets` (the model a
command is pointed at). The commands call the library for their work; torch and the compiler load only in those
that need them (inspect, profile, memory, export)."""

from __future__ import annotations

from ..lazy import lazy_getattr
from .arguments import CLIError, UsageError
from .commands import build_parser, main

__all__ = ["CLIError", "UsageError", "build_parser", "main"]

__getattr__ = lazy_getattr(
    __name__, {}, globals(), renamed={"protocol_inputs": "bytescale_compile.engine.protocol:model_inputs"}
)
