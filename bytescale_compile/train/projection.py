"""The demo's simulated projection: the model it trained and its data's sequence lengths planned at the
paper's scale (512 HDP ranks of TP 2 on the L20 preset, `benchmarks/paper.py`) with every strategy.

Nothing here runs: the step times are the simulator's (`sim/simulator.py`) under the analytic cost model
of the model's shape on that hardware. The global batch keeps the run's tokens per rank, so at 512 ranks
it is `global_tokens x 512 / world_size` tokens, drawn with replacement from the dataset's sequence
lengths (each truncated to the run's context length, as the trainer's sampler does) until that budget is
reached: the demo's dataset alone holds fewer tokens than such a batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from torch import nn

from ..planner import AUTO, BALANCE, NAIVE, STATIC, CostModel, Hardware, ModelShape
from ..planner.model_shape import model_shape
from ..sim.experiments import run_strategy
from .config import TrainConfig

__all__ = ["PROJECTED_STRATEGIES", "ProjectedStep", "Projection", "project", "project_run", "resample_lengths"]

RANKS, TP_SIZE, HARDWARE = 512, 2, "l20"
"""The paper's cluster (benchmarks/paper.py): 512 HDP ranks of TP 2, 1024 L20 GPUs."""
PROJECTED_STRATEGIES = (STATIC, NAIVE, BALANCE, AUTO)
"""The planner's strategies in the order the projection lists them: static first, as the speedups are over it."""


@dataclass(frozen=True)
class ProjectedStep:
    strategy: str
    step_time: float
    """Simulated seconds of one step."""
    speedup: float
    """Static's simulated step time over this one."""
    chosen: str | None = None
    """Strategy "auto": the candidate it picked."""


@dataclass(frozen=True)
class Projection:
    model: str
    ranks: int
    tp_size: int
    hardware: str
    capacity: int
    context_length: int
    tokens: int
    sequences: int
    steps: list[ProjectedStep]

    def report(self) -> str:
        """The projection as printed after the demo's comparison, labelled as simulated throughout."""
        lines = [
            f"SIMULATED projection, not measured: {self.model} on {self.ranks} HDP ranks x TP {self.tp_size} "
            f"({self.ranks * self.tp_size} GPUs) of the {self.hardware} preset, C = {self.capacity}, context "
            f"{self.context_length};",
            f"one global batch of {self.tokens:,} tokens: {self.sequences} sequence lengths drawn with "
            f"replacement from this run's data",
            f"{'strategy':<22} {'simulated step s':>16} {'speedup over static':>20}",
        ]
        for s in self.steps:
            label = f"{s.strategy} ({s.chosen})" if s.chosen else s.strategy
            lines.append(f"{label:<22} {s.step_time:>16.4g} {s.speedup:>19.2f}x")
        return "\n".join(lines)


def resample_lengths(lengths: np.ndarray, tokens: int, seed: int = 0) -> np.ndarray:
    """Lengths drawn uniformly with replacement from `lengths` until their sum reaches `tokens` (the last one may
    overshoot it, as the trainer's batches do)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0 or lengths.min() < 1:
        raise ValueError(f"need a non-empty array of positive sequence lengths to resample, got {lengths!r}")
    rng = np.random.default_rng(seed)
    batch = int(np.ceil(tokens / lengths.mean())) + 1
    drawn = np.empty(0, dtype=np.int64)
    while drawn.sum() < tokens:
        drawn = np.concatenate([drawn, lengths[rng.integers(0, lengths.size, size=batch)]])
    return drawn[: int(np.searchsorted(np.cumsum(drawn), tokens)) + 1]


def project(
    shape: ModelShape,
    lengths: Sequence[int] | np.ndarray,
    tokens: int,
    capacity: int,
    context_length: int,
    strategies: Sequence[str] = PROJECTED_STRATEGIES,
    seed: int = 0,
) -> Projection:
    """Plan and simulate one global batch of `tokens` tokens, resampled from `lengths` truncated to
    `context_length`, at `RANKS` ranks of `HARDWARE` with each strategy; the speedups are over static."""
    cost_model = CostModel.analytic(shape, Hardware.preset(HARDWARE, tp_size=TP_SIZE))
    lens = resample_lengths(np.minimum(np.asarray(lengths, dtype=np.int64), context_length), tokens, seed)
    outcomes = [run_strategy(s, lens, RANKS, capacity, cost_model, context_length) for s in strategies]
    static = next((o.step_time for o in outcomes if o.name == STATIC), None)
    if static is None:
        raise ValueError(f"strategies {list(strategies)} must include static: the speedups are over it")
    steps = [
        ProjectedStep(o.name, o.step_time, static / o.step_time, o.plan.auto.chosen if o.plan.auto else None)
        for o in outcomes
    ]
    model = f"{shape.name} ({shape.layers} layers, hidden {shape.hidden})"
    return Projection(model, RANKS, TP_SIZE, HARDWARE, capacity, context_length, int(lens.sum()), len(lens), steps)


def project_run(
    config: TrainConfig, model: nn.Module, lengths: np.ndarray, world_size: int, capacity: int
) -> Projection:
    """A run's projection: its model's shape, its data's `lengths`, the `capacity` it trained with and its context
    length, and its tokens per rank (`global_tokens / world_size`) at `RANKS` ranks. `ModelConfigError` when the
    model's config does not give its shape."""
    return project(
        model_shape(model),
        lengths,
        config.global_tokens * RANKS // world_size,
        capacity,
        config.max_len,
        seed=config.seed,
    )
