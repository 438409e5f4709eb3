"""bytescale_compile: ByteScale (HDP long-context training) as torch.compile passes."""

from .api import OptimizedModule, RecompileLimitError, explain, optimize
from .config import Config
from .passes.report import CompileReport
from .train.engine import Runtime, StepStats

__all__ = ["optimize", "explain", "Config", "OptimizedModule", "CompileReport", "RecompileLimitError", "Runtime", "StepStats"]
__version__ = "0.1.0"
