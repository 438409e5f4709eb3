"""The trainer application over the engine (`bytescale_compile.engine`): its TOML config, setup checks, the
training loop, checkpoints, metrics and loggers, signals, launch, export, and the `python -m
bytescale_compile.train` entry point.

The public names load on first use (PEP 562), so `python -m bytescale_compile.train --help` does not pay for
importing torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import alias_moved_modules, lazy_getattr

if TYPE_CHECKING:
    from .config import ConfigError, TrainConfig, load_config
    from .inputs import setup
    from .trainer import RunResult, run

_EXPORTS = {
    "ConfigError": ".config",
    "TrainConfig": ".config",
    "load_config": ".config",
    "RunResult": ".trainer",
    "run": ".trainer",
    "setup": ".inputs",
}
"""Public name -> the module that defines it."""

__all__ = ["ConfigError", "RunResult", "TrainConfig", "load_config", "run", "setup"]

_MOVED = (
    "batch",
    "collectives",
    "dist_optim",
    "executor",
    "grad_buffer",
    "mesh",
    "optim",
    "pipeline",
    "routing",
    "stages",
)
"""The modules that moved to `bytescale_compile.engine`, with `engine` itself, now `engine.runtime`."""
alias_moved_modules(
    {
        f"{__name__}.engine": "bytescale_compile.engine.runtime",
        **{f"{__name__}.{m}": f"bytescale_compile.engine.{m}" for m in _MOVED},
    }
)


__getattr__ = lazy_getattr(
    __name__,
    _EXPORTS,
    globals(),
    renamed={
        "Runtime": "bytescale_compile.engine.runtime:Runtime",
        "StepStats": "bytescale_compile.engine.runtime:StepStats",
    },
)
