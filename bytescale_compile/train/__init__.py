"""The training side: the HDP engine (`Runtime`), micro-batch building, checkpoints, optimizer and schedule,
metrics, launch, and the `python -m bytescale_compile.train` entry point with its TOML config.

The public names load on first use (PEP 562), so `python -m bytescale_compile.train --help` does not pay for
importing torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_getattr

if TYPE_CHECKING:
    from .config import ConfigError, TrainConfig, load_config
    from .engine import Runtime, StepStats
    from .trainer import RunResult, run, setup

_EXPORTS = {
    "ConfigError": ".config",
    "TrainConfig": ".config",
    "load_config": ".config",
    "Runtime": ".engine",
    "StepStats": ".engine",
    "RunResult": ".trainer",
    "run": ".trainer",
    "setup": ".trainer",
}
"""Public name -> the module that defines it."""

__all__ = ["ConfigError", "Runtime", "RunResult", "StepStats", "TrainConfig", "load_config", "run", "setup"]


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
