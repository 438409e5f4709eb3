"""What a run reports per step: metrics.jsonl, TensorBoard scalars (when `tensorboard` is installed) and
the console (tqdm when installed). Only rank 0 writes; every rank computes the same figures.

Each step's record holds the measured figures next to the simulator's prediction for the same plan
(`sim/simulator.py` with the run's cost model), so a run shows how far the cost model is from the
hardware it plans for. Strategy "auto" also records which candidate each step ran and its simulated
speedup over static (the fields are left out of other strategies' lines).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..planner import CostModel
from ..sim.simulator import busy_times, p2p_bytes, simulate
from .engine import StepStats

__all__ = ["METRICS_FILE", "MetricsLog", "StepRecord", "echo", "progress"]

METRICS_FILE = "metrics.jsonl"
_SCALARS = ("loss", "tokens_per_second", "lr", "grad_norm", "eval_loss", "auto_speedup")
"""What goes to TensorBoard."""
_OPTIONAL = ("eval_loss", "auto_choice", "auto_speedup", "bubbles", "predicted_bubbles")
"""Left out of a metrics.jsonl line when None: steps without evaluation, strategies other than auto, runs
without pipelines."""


@dataclass
class StepRecord:
    """One line of metrics.jsonl."""

    step: int
    strategy: str
    loss: float
    tokens: int
    tokens_per_second: float
    lr: float
    time: float
    grad_norm: float
    skipped: bool
    busy_spread: float
    micro_batches: list[int]
    p2p_bytes: int
    offloaded_bytes: int
    predicted_time: float
    predicted_busy_spread: float
    predicted_p2p_bytes: float
    eval_loss: float | None = None
    data_wait_s: float = 0.0
    """Seconds the rank blocked waiting for this step's data (local loader: drawing the batch)."""
    plan_time_s: float = 0.0
    """Seconds spent planning the step: on the rank (local loader), or by the remote scheduler (ray), where
    prefetching keeps it off the critical path."""
    auto_choice: str | None = None
    auto_speedup: float | None = None
    stage_bytes: int = 0
    bubbles: list[float] | None = None
    """Pipelines (--pp > 1): each HDP rank's measured bubble rate (`StepStats.bubbles`)."""
    predicted_bubbles: list[float] | None = None
    """The simulator's stage-by-stage bubble rate of each pipeline for the same plan."""

    @classmethod
    def from_stats(
        cls,
        stats: StepStats,
        lr: float,
        cost_model: CostModel,
        data_wait_s: float = 0.0,
        plan_time_s: float | None = None,
    ) -> StepRecord:
        """`cost_model` must be the Runtime's: the busy spread and P2P bytes are simulated with it, next to the
        step time the Runtime predicted with it. `plan_time_s`: the scheduler's (default: the Runtime's own)."""
        timeline = simulate(stats.plan, cost_model)
        busy = busy_times(timeline)
        busy = busy[busy > 0]
        return cls(
            step=stats.step,
            strategy=stats.strategy,
            loss=stats.loss,
            tokens=stats.tokens,
            tokens_per_second=stats.tokens_per_second,
            lr=lr,
            time=stats.time,
            grad_norm=stats.grad_norm,
            skipped=stats.skipped,
            busy_spread=stats.busy_spread,
            micro_batches=stats.micro_batches,
            p2p_bytes=stats.p2p_bytes,
            offloaded_bytes=stats.offloaded_bytes,
            predicted_time=stats.predicted_time,
            predicted_busy_spread=float(busy.max() / busy.min()) if busy.size else 1.0,
            predicted_p2p_bytes=p2p_bytes(stats.plan, cost_model),
            data_wait_s=data_wait_s,
            plan_time_s=stats.plan_time if plan_time_s is None else plan_time_s,
            auto_choice=stats.auto_choice,
            auto_speedup=stats.auto_speedup,
            stage_bytes=stats.stage_bytes,
            bubbles=stats.bubbles,
            predicted_bubbles=timeline.bubbles if stats.bubbles is not None else None,
        )

    def to_dict(self) -> dict[str, Any]:
        return {key: value for key, value in asdict(self).items() if value is not None or key not in _OPTIONAL}

    def summary(self) -> str:
        line = (
            f"[{self.strategy}] step {self.step}: loss {self.loss:.4f}, lr {self.lr:.2e}, {self.tokens} tokens, "
            f"{self.tokens_per_second:,.0f} tokens/s, {self.time:.2f} s (predicted {self.predicted_time:.2f}), "
            f"busy max/min {self.busy_spread:.2f}, "
            f"micro-batches per rank {self.micro_batches}"
        )
        if self.bubbles is not None and self.predicted_bubbles is not None:
            pairs = ", ".join(f"{m:.2f}/{p:.2f}" for m, p in zip(self.bubbles, self.predicted_bubbles))
            line += f", bubble per pipeline {pairs} (measured/predicted)"
        if self.skipped:
            line += ", SKIPPED (non-finite loss or gradient)"
        if self.auto_choice is not None:
            speedup = f" ({self.auto_speedup:.2f}x static, simulated)" if self.auto_speedup is not None else ""
            line += f", ran {self.auto_choice}{speedup}"
        if self.eval_loss is not None:
            line += f", eval loss {self.eval_loss:.4f}"
        return line


class MetricsLog:
    """`<run_dir>/metrics.jsonl` plus TensorBoard events under `<run_dir>/tensorboard`, on rank 0.

    A resumed run keeps the lines of the steps up to its checkpoint and drops later ones (those of a
    run that crashed after the checkpoint), so the file always describes one run, step by step.
    """

    def __init__(self, run_dir: Path, enabled: bool, resumed_step: int = 0) -> None:
        self.path = run_dir / METRICS_FILE
        self.enabled = enabled
        self._board = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        kept = _lines_through(self.path, resumed_step) if resumed_step else []
        self.path.write_text("".join(kept))
        self._board = _tensorboard(run_dir / "tensorboard", resumed_step + 1)

    def write(self, record: StepRecord) -> None:
        if not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as out:
            out.write(json.dumps(record.to_dict()) + "\n")
        if self._board is not None:
            for key in _SCALARS:
                if (value := getattr(record, key)) is not None:
                    self._board.add_scalar(key, value, record.step)
            self._board.flush()

    def close(self) -> None:
        if self._board is not None:
            self._board.close()


def _lines_through(path: Path, step: int) -> list[str]:
    if not path.is_file():
        return []
    return [
        line
        for line in path.read_text(encoding="utf-8").splitlines(keepends=True)
        if line.strip() and json.loads(line)["step"] <= step
    ]


def _tensorboard(log_dir: Path, first_step: int) -> Any:
    """A SummaryWriter, or None without the optional `tensorboard` package; `purge_step` drops the events of
    steps a crashed run wrote after the checkpoint this run resumes from."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(log_dir=str(log_dir), purge_step=first_step)


def progress(steps: range, description: str, enabled: bool) -> Iterator[int]:
    """The 1-based `steps` with a tqdm bar on stderr when enabled, tqdm is installed and stderr is a terminal;
    a resumed run's bar starts where the checkpoint left off."""
    if not enabled:
        return iter(steps)
    try:
        from tqdm import tqdm
    except ImportError:
        return iter(steps)
    return iter(
        tqdm(
            steps,
            desc=description,
            initial=steps.start - 1,
            total=steps.stop - 1,
            file=sys.stderr,
            leave=False,
            dynamic_ncols=True,
            disable=None,
        )
    )


def echo(line: str, enabled: bool) -> None:
    """Print a line above a running tqdm bar (or plainly), on rank 0 only."""
    if not enabled:
        return
    try:
        from tqdm import tqdm
    except ImportError:
        print(line, flush=True)
        return
    tqdm.write(line, file=sys.stdout)
