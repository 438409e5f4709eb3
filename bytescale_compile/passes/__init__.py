"""Graph passes, the pass manager and the compile report."""

from .manager import Pass, PassContext, PassManager
from .report import CompileReport, GraphReport, PassResult, Rewrite, SavedActivation, Skipped

__all__ = [
    "Pass",
    "PassContext",
    "PassManager",
    "CompileReport",
    "GraphReport",
    "PassResult",
    "Rewrite",
    "SavedActivation",
    "Skipped",
]
