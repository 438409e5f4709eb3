"""The HDP engine: the `Runtime` that runs one step of a plan (executors for the whole model and for pipeline
stages, micro-batches, collectives, the optimizers and the gradient buffer). It imports nothing of the trainer
application in `bytescale_compile.train`; the public names load on first use (PEP 562)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_getattr

if TYPE_CHECKING:
    from .dist_optim import DistributedOptimizer
    from .pipeline import pipeline_stage
    from .runtime import Runtime, StepStats

_EXPORTS = {
    "DistributedOptimizer": ".dist_optim",
    "Runtime": ".runtime",
    "StepStats": ".runtime",
    "pipeline_stage": ".pipeline",
}
"""Public name -> the module that defines it."""

__all__ = ["DistributedOptimizer", "Runtime", "StepStats", "pipeline_stage"]

__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
