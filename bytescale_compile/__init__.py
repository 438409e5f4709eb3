"""bytescale_compile: ByteScale (HDP long-context training) as torch.compile passes.

The public names load on first use (PEP 562): `import bytescale_compile` and the `bytescale-compile`
CLI's planner commands do not pay for importing torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy import lazy_getattr

if TYPE_CHECKING:
    from .api import OptimizedModule, RecompileLimitError, explain, optimize
    from .capture.backend import ShardingError
    from .capture.tensor_parallel import TensorParallelError
    from .capture.tp_plan import tensor_parallel
    from .config import CompileConfig
    from .engine.runtime import Runtime, StepStats
    from .passes.report import CompileReport
    from .train.pipeline import pipeline_stage

_EXPORTS = {
    "optimize": ".api",
    "explain": ".api",
    "OptimizedModule": ".api",
    "RecompileLimitError": ".api",
    "ShardingError": ".capture.backend",
    "TensorParallelError": ".capture.tensor_parallel",
    "tensor_parallel": ".capture.tp_plan",
    "CompileConfig": ".config",
    "CompileReport": ".passes.report",
    "Runtime": ".engine.runtime",
    "StepStats": ".engine.runtime",
    "pipeline_stage": ".engine.pipeline",
}
"""Public name -> the module that defines it."""

__all__ = [
    "optimize",
    "explain",
    "CompileConfig",
    "OptimizedModule",
    "CompileReport",
    "RecompileLimitError",
    "ShardingError",
    "TensorParallelError",
    "tensor_parallel",
    "Runtime",
    "StepStats",
    "pipeline_stage",
]
__version__ = "0.1.0"


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals(), renamed={"Config": "bytescale_compile.config:CompileConfig"})
"""Import the defining module of a public name when it is first asked for, and cache the name."""


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
