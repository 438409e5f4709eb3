"""bytescale_compile: ByteScale (HDP long-context training) as torch.compile passes."""

from .api import OptimizedModule, explain, optimize
from .config import Config
from .passes.report import CompileReport

__all__ = ["optimize", "explain", "Config", "OptimizedModule", "CompileReport"]
__version__ = "0.1.0"
