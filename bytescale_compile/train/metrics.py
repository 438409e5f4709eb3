"""What a run reports per step: metrics.jsonl, the experiment loggers asked for (TensorBoard, Weights & Biases,
MLflow; by default TensorBoard when installed) and the console (tqdm when installed). Only rank 0 writes;
every rank computes the same figures.

Each step's record holds the measured figures (the Runtime's `StepStats`) next to the simulator's prediction for the
same plan (the Runtime's `StepPrediction`, one simulation with the run's cost model, made for the steps that are
logged), so a run shows how far the cost model is from the hardware it plans for. Strategy "auto" also records which candidate each step ran and its simulated
speedup over static (the fields are left out of other strategies' lines). Given the model's shape, a record
also holds the TFLOP/s each device achieved and, where the device's peak is known, the MFU (`flops.py`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, fields
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from ..engine.diagnostics import StepPrediction, predict
from ..engine.runtime import StepStats
from ..planner import CostModel
from ..planner.memory import format_bytes
from ..planner.model_shape import ModelShape
from .flops import achieved, model_flops

__all__ = [
    "LOGGERS",
    "LOGGER_RUNS_FILE",
    "METRICS_FILE",
    "LoggerError",
    "MetricsLog",
    "StepRecord",
    "check_loggers",
    "echo",
    "progress",
]

METRICS_FILE = "metrics.jsonl"
LOGGER_RUNS_FILE = "logger_runs.json"
"""In the run directory: the Weights & Biases and MLflow run ids, so a resumed run logs to the same runs."""
LOGGERS = ("tensorboard", "wandb", "mlflow")
"""Experiment loggers by name; each needs the package of the same name (the extra of the same name)."""
WANDB_PROJECT = "bytescale_compile"
"""The Weights & Biases project unless the WANDB_PROJECT environment variable names one."""
_OPTIONAL = (
    "eval_loss",
    "auto_choice",
    "auto_speedup",
    "bubbles",
    "predicted_bubbles",
    "tflops",
    "mfu",
    "dataset_tokens",
    "predicted_peak_bytes",
    "measured_peak_bytes",
    "measured_reserved_peak_bytes",
    "splits",
    "ce_loss",
    "aux_loss",
    "expert_load",
)
"""Left out of a metrics.jsonl line when None: steps without evaluation, strategies other than auto, runs
without pipelines, models without a shape (TFLOP/s) or devices without a known peak (MFU), single-dataset runs,
models the memory model cannot describe, devices without allocator statistics (CPU), steps that share no
sequence, dense models (no router figures)."""


_MEASURED = (
    "step",
    "strategy",
    "loss",
    "tokens",
    "tokens_per_second",
    "time",
    "grad_norm",
    "skipped",
    "busy_spread",
    "micro_batches",
    "p2p_bytes",
    "offloaded_bytes",
    "auto_choice",
    "auto_speedup",
    "stage_bytes",
    "bubbles",
    "reduce_time",
    "reduce_overlap",
    "expert_load",
)
"""The fields of a line that are the step's `StepStats` figure of the same name."""
_PREDICTED = ("time", "busy_spread", "p2p_bytes")
"""`StepPrediction` figures that a line holds as `predicted_<name>`."""
_LARGEST = ("predicted_peak_bytes", "measured_peak_bytes", "measured_reserved_peak_bytes")
"""Per-rank `StepStats` lists that a line holds as their largest entry."""


class LoggerError(ValueError):
    """An experiment logger that does not exist or whose package is not installed."""


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
    tflops: float | None = None
    """Model TFLOP/s per device (`flops.model_flops` over the step time and the job's processes)."""
    mfu: float | None = None
    """`tflops` over the device's peak TFLOP/s (`flops.peak_tflops`)."""
    dataset_tokens: dict[str, int] | None = None
    """A mixed run: the step's tokens drawn from each dataset, by name."""
    reduce_time: float = 0.0
    """Seconds rank 0 waited for the gradient reduction after its backward (`StepStats.reduce_time`)."""
    reduce_overlap: float = 0.0
    """bf16 runs: the share of rank 0's gradient buckets reduce-scattered during its backward."""
    predicted_peak_bytes: int | None = None
    """The memory model's peak over the ranks for this step's plan: what the allocator reserves at most
    (`planner/memory.py`), to compare with `measured_reserved_peak_bytes`."""
    measured_peak_bytes: int | None = None
    """CUDA: the largest `max_memory_allocated` over the ranks during the step."""
    measured_reserved_peak_bytes: int | None = None
    """CUDA: the largest `max_memory_reserved` over the ranks during the step (the allocator's cache included, so
    after the first step it holds at least what earlier steps reserved)."""
    splits: dict[str, int] | None = None
    """Shared micro-batches per u × r split of the step's plan (`Plan.splits`: "1x4" a ring of 4, "2x2" Ulysses
    in pairs with a ring of 2 between them)."""
    checkpoint_stall_s: float | None = None
    """A step that saved a checkpoint: the seconds it waited for it on rank 0 (the whole save, or with
    checkpoint_async the copy to host memory and any wait for the previous save)."""
    ce_loss: float | None = None
    """MoE models: the cross-entropy part of `loss`."""
    aux_loss: float | None = None
    """MoE models: the load-balancing part of `loss` (with its coefficient; 0 when the model trains without it)."""
    expert_load: list[float] | None = None
    """MoE models: per MoE layer, tokens routed to the busiest expert over the mean per expert (1: balanced)."""

    @classmethod
    def from_stats(
        cls,
        stats: StepStats,
        lr: float,
        cost_model: CostModel,
        data_wait_s: float = 0.0,
        plan_time_s: float | None = None,
        *,
        prediction: StepPrediction | None = None,
        shape: ModelShape | None = None,
        peak: float | None = None,
        dataset_tokens: dict[str, int] | None = None,
    ) -> StepRecord:
        """`cost_model` must be the Runtime's, and `prediction` its prediction for the step (`Runtime.predict`;
        default: one simulation of the step's plan under `cost_model`). `plan_time_s`: the scheduler's (default:
        the Runtime's own).

        With the model's `shape`, the step's model FLOPs (its plan's sequences; the cost model's mixer layers
        have no attention term) give `tflops` per process of the job (one device each), and with the device's
        `peak` TFLOP/s the `mfu`."""
        prediction = prediction or predict(stats.plan, cost_model)
        routed = stats.expert_load is not None or stats.aux_loss != 0.0
        tflops, mfu = (
            achieved(
                model_flops(shape, stats.plan.sequences, cost_model.mixer_layers), stats.time, peak, len(stats.busy)
            )
            if shape is not None
            else (None, None)
        )
        figures: dict[str, Any] = {name: getattr(stats, name) for name in _MEASURED}
        figures |= {f"predicted_{name}": getattr(prediction, name) for name in _PREDICTED}
        figures |= {name: max(values) if (values := getattr(stats, name)) else None for name in _LARGEST}
        return cls(
            **figures,
            lr=lr,
            data_wait_s=data_wait_s,
            plan_time_s=stats.plan_time if plan_time_s is None else plan_time_s,
            predicted_bubbles=prediction.bubbles if stats.bubbles is not None else None,
            tflops=tflops,
            mfu=mfu,
            dataset_tokens=dataset_tokens,
            splits=stats.plan.splits() or None,
            ce_loss=stats.ce_loss if routed else None,
            aux_loss=stats.aux_loss if routed else None,
        )

    def to_dict(self) -> dict[str, Any]:
        return {key: value for key, value in asdict(self).items() if value is not None or key not in _OPTIONAL}

    def scalars(self) -> dict[str, float]:
        """The step's numbers by name, for the experiment loggers' plots: every int or float field that is set
        (not the step, flags or lists), each dataset's tokens as `dataset_tokens/<name>` and each split's
        micro-batches as `splits/<u>x<r>`."""
        values = {
            f.name: float(value)
            for f in fields(self)
            if f.name != "step"
            and isinstance(value := getattr(self, f.name), (int, float))
            and not isinstance(value, bool)
        }
        values.update({f"dataset_tokens/{name}": float(n) for name, n in (self.dataset_tokens or {}).items()})
        values.update({f"splits/{split}": float(n) for split, n in (self.splits or {}).items()})
        values.update({f"expert_load/layer{i}": load for i, load in enumerate(self.expert_load or [])})
        return values

    def summary(self, predicted: bool = True) -> str:
        """The step's console line; `predicted=False` leaves out the predicted time, for a cost model that
        cannot predict this device's (an analytic one on a CPU)."""
        prediction = f" (predicted {self.predicted_time:.2f})" if predicted else ""
        line = (
            f"[{self.strategy}] step {self.step}: loss {self.loss:.4f}, lr {self.lr:.2e}, {self.tokens} tokens, "
            f"{self.tokens_per_second:,.0f} tokens/s, {self.time:.2f} s{prediction}, "
            f"busy max/min {self.busy_spread:.2f}, "
            f"micro-batches per rank {self.micro_batches}"
        )
        if self.tflops is not None:
            line += f", {self.tflops:.3g} TFLOP/s per rank"
        if self.mfu is not None:
            line += f", MFU {self.mfu:.1%}"
        if self.predicted_peak_bytes is not None:
            line += f", peak memory {format_bytes(self.predicted_peak_bytes)} predicted"
            if self.measured_reserved_peak_bytes is not None:
                line += f" ({format_bytes(self.measured_reserved_peak_bytes)} reserved"
                if self.measured_peak_bytes is not None:
                    line += f", {format_bytes(self.measured_peak_bytes)} allocated"
                line += ")"
            elif self.measured_peak_bytes is not None:
                line += f" ({format_bytes(self.measured_peak_bytes)} allocated)"
        if self.dataset_tokens:
            line += ", tokens by dataset " + ", ".join(f"{name} {n}" for name, n in self.dataset_tokens.items())
        if self.bubbles is not None and self.predicted_bubbles is not None:
            pairs = ", ".join(f"{m:.2f}/{p:.2f}" for m, p in zip(self.bubbles, self.predicted_bubbles))
            line += f", bubble per pipeline {pairs} (measured/predicted)"
        if self.aux_loss is not None and self.ce_loss is not None:
            line += f", loss = cross-entropy {self.ce_loss:.4f} + aux {self.aux_loss:.4f}"
        if self.expert_load:
            line += f", expert load max/mean {max(self.expert_load):.2f} (busiest layer)"
        if self.skipped:
            line += ", SKIPPED (non-finite loss or gradient)"
        if self.auto_choice is not None:
            speedup = f" ({self.auto_speedup:.2f}x static, simulated)" if self.auto_speedup is not None else ""
            line += f", ran {self.auto_choice}{speedup}"
        if self.eval_loss is not None:
            line += f", eval loss {self.eval_loss:.4f}"
        return line


class MetricsLog:
    """`<run_dir>/metrics.jsonl` plus the experiment `loggers` (a subset of `LOGGERS`; None: TensorBoard when
    installed, () none), on rank 0 (`enabled`). `run_name` and `config` name and describe the run to
    Weights & Biases and MLflow.

    A resumed run keeps the lines of the steps up to its checkpoint and drops later ones (those of a
    run that crashed after the checkpoint), so the file always describes one run, step by step; TensorBoard
    drops their events too, and Weights & Biases and MLflow continue the runs whose ids the first run stored
    in `<run_dir>/logger_runs.json`.
    """

    def __init__(
        self,
        run_dir: Path,
        enabled: bool,
        resumed_step: int = 0,
        loggers: Sequence[str] | None = None,
        run_name: str | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.path = run_dir / METRICS_FILE
        self.enabled = enabled
        self._loggers: dict[str, _Logger] = {}
        if not enabled:
            return
        names = [name for name in ("tensorboard",) if _installed(name)] if loggers is None else list(loggers)
        check_loggers(names)
        run_dir.mkdir(parents=True, exist_ok=True)
        kept = _lines_through(self.path, resumed_step) if resumed_step else []
        self.path.write_text("".join(kept))
        run = _Run(run_dir, resumed_step, run_name, config or {})
        for name in dict.fromkeys(names):
            self._guarded(name, partial(self._start, name, run))

    def write(self, record: StepRecord) -> None:
        if not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as out:
            out.write(json.dumps(record.to_dict()) + "\n")
        for name, logger in list(self._loggers.items()):
            self._guarded(name, partial(logger.log, record))

    def close(self) -> None:
        for name, logger in list(self._loggers.items()):
            self._guarded(name, logger.close)
        self._loggers = {}

    def _start(self, name: str, run: _Run) -> None:
        self._loggers[name] = _BACKENDS[name](run)

    def _guarded(self, name: str, call: Callable[[], object]) -> None:
        """Run a call into an experiment logger; if it fails (a service down, a full disk), warn and drop that
        logger. Only rank 0 logs, so an exception here would leave the other ranks waiting in the next step's
        collectives; metrics.jsonl keeps every step either way."""
        try:
            call()
        except Exception as e:
            warnings.warn(
                f"the {name} logger failed and is off for the rest of the run: {type(e).__name__}: {e}", stacklevel=3
            )
            self._loggers.pop(name, None)


def check_loggers(names: Sequence[str]) -> None:
    """Raise LoggerError for a name not in `LOGGERS` or whose package is not installed: run it on every rank
    before training, so a run does not fail (or rank 0 alone) after its setup."""
    for name in names:
        if name not in LOGGERS:
            raise LoggerError(f"unknown experiment logger {name!r}; known: {', '.join(LOGGERS)}")
        if not _installed(name):
            raise LoggerError(f"the {name} logger needs the {name} package: pip install 'bytescale_compile[{name}]'")


def _installed(package: str) -> bool:
    """Without importing it (wandb and mlflow are slow to import); a None in sys.modules blocks an import."""
    if package in sys.modules:
        return sys.modules[package] is not None
    return importlib.util.find_spec(package) is not None


@dataclass(frozen=True)
class _Run:
    """What the loggers know of the run, and the run ids they keep in its directory."""

    directory: Path
    resumed_step: int
    name: str | None
    config: dict[str, Any]

    @property
    def _ids_path(self) -> Path:
        return self.directory / LOGGER_RUNS_FILE

    def stored_id(self, logger: str) -> str | None:
        """The id of the run a resumed run continues; None for a fresh run, which starts a new one."""
        if not self.resumed_step or not self._ids_path.is_file():
            return None
        return json.loads(self._ids_path.read_text(encoding="utf-8")).get(logger)

    def store_id(self, logger: str, run_id: str) -> None:
        ids = json.loads(self._ids_path.read_text(encoding="utf-8")) if self._ids_path.is_file() else {}
        self._ids_path.write_text(json.dumps({**ids, logger: run_id}, indent=2) + "\n", encoding="utf-8")


class _Logger(Protocol):
    def log(self, record: StepRecord) -> None: ...

    def close(self) -> None: ...


class _TensorBoard:
    """Events under `<run_dir>/tensorboard`; `purge_step` drops those of steps a crashed run wrote after the
    checkpoint this run resumes from."""

    def __init__(self, run: _Run) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(run.directory / "tensorboard"), purge_step=run.resumed_step + 1)

    def log(self, record: StepRecord) -> None:
        for key, value in record.scalars().items():
            self._writer.add_scalar(key, value, record.step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class _Wandb:
    """A Weights & Biases run in project WANDB_PROJECT (environment, else `WANDB_PROJECT`), its files under
    `<run_dir>/wandb`. A resumed run continues it; wandb drops what is logged again for steps it already has
    (those a crashed run ran after its checkpoint), keeping the first values."""

    def __init__(self, run: _Run) -> None:
        import wandb

        run_id = run.stored_id("wandb") or secrets.token_hex(8)
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", WANDB_PROJECT),
            name=run.name,
            config=run.config,
            dir=str(run.directory),
            id=run_id,
            resume="allow",
        )
        run.store_id("wandb", run_id)

    def log(self, record: StepRecord) -> None:
        self._run.log(record.scalars(), step=record.step)

    def close(self) -> None:
        self._run.finish()


class _MLflow:
    """An MLflow run at the tracking URI and experiment of MLFLOW_TRACKING_URI and MLFLOW_EXPERIMENT_NAME (as
    mlflow reads them). A fresh run logs `config` as parameters; a resumed one continues the stored run, whose
    parameters are already there."""

    def __init__(self, run: _Run) -> None:
        import mlflow

        self._mlflow = mlflow
        run_id = run.stored_id("mlflow")
        active = mlflow.start_run(run_id=run_id) if run_id else mlflow.start_run(run_name=run.name)
        if run_id is None and run.config:
            mlflow.log_params(run.config)
        run.store_id("mlflow", active.info.run_id)

    def log(self, record: StepRecord) -> None:
        metrics = {_MLFLOW_KEY.sub("_", key): value for key, value in record.scalars().items()}
        self._mlflow.log_metrics(metrics, step=record.step)

    def close(self) -> None:
        self._mlflow.end_run()


_MLFLOW_KEY = re.compile(r"[^\w\-. /]")
"""What MLflow refuses in a metric name (a dataset's file name may hold it)."""

_BACKENDS: dict[str, Callable[[_Run], _Logger]] = {
    "tensorboard": _TensorBoard,
    "wandb": _Wandb,
    "mlflow": _MLflow,
}


def _lines_through(path: Path, step: int) -> list[str]:
    if not path.is_file():
        return []
    return [
        line
        for line in path.read_text(encoding="utf-8").splitlines(keepends=True)
        if line.strip() and json.loads(line)["step"] <= step
    ]


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
