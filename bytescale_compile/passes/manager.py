"""`Pass` and `PassManager`: named graph rewrites run in order, each switched on or off by `CompileConfig`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import fx

from ..config import CompileConfig
from .graph import eliminate_dead_code
from .report import PassResult

__all__ = ["Pass", "PassContext", "PassManager"]


@dataclass(frozen=True)
class PassContext:
    """What a pass may know about the compilation beyond the graph itself."""

    config: CompileConfig
    training: bool


@dataclass(frozen=True)
class Pass:
    """A named rewrite over an FX graph; `enabled_by` names the CompileConfig field that switches it."""

    name: str
    run: Callable[[fx.GraphModule, PassContext], PassResult]
    enabled_by: str | None = None


class PassManager:
    def __init__(self, passes: list[Pass]) -> None:
        names = [p.name for p in passes]
        if len(set(names)) != len(names):
            raise ValueError(f"pass names must be unique, got {names}")
        self.passes = passes

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> list[PassResult]:
        """Run every enabled pass in order. After each that rewrote, clean up (keeping every mutation, nested
        graphs too) and recompile, so the next pass sees only what still runs."""
        results = []
        for p in self.passes:
            if p.enabled_by is not None and not getattr(ctx.config, p.enabled_by):
                results.append(PassResult(p.name, disabled=f"CompileConfig.{p.enabled_by}=False"))
                continue
            results.append(p.run(gm, ctx))
            if results[-1].rewrites:
                eliminate_dead_code(gm)
                gm.graph.lint()
                gm.recompile()
        return results
