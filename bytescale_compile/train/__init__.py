"""The training side: the HDP engine (`Runtime`), micro-batch building, checkpoints, optimizer and schedule,
metrics, launch, and the `python -m bytescale_compile.train` entry point with its TOML config."""

from .config import ConfigError, TrainConfig, load_config
from .engine import Runtime, StepStats
from .trainer import RunResult, run, setup

__all__ = ["ConfigError", "Runtime", "RunResult", "StepStats", "TrainConfig", "load_config", "run", "setup"]
