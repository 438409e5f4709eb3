"""One training run, driven by a `TrainConfig`, in three phases that each hand the next what they resolved.

- `setup` (`inputs.py`) checks everything a run needs before any step or communication (the datasets, the model, the
  vocabulary, the tokenizer for final/, the cost model, the output directory), so a bad setting fails on every
  rank at once with a message that names it: `RunInputs`.
- `prepare` (`prepared.py`) places and compiles the model on the device, fits the run to the memory budget, calibrates the cost
  model and checks the data against the cluster: `Prepared`.
- A `Trainer` runs one strategy's steps (drawn and planned on every rank, or with `--loader ray` by the remote
  dataloader of `remote.py`, whose scheduler plans once for all ranks): the optimizer of `build_optimizer` with
  the warmup-cosine schedule, the HDP `Runtime` for every step, evaluation, checkpoints, metrics and, for Hugging
  Face models, `final/`.

`run` does the three for the config's one strategy. `compare.py` trains every strategy from the same prepared
model (its weights reset in place between them), so the model compiles once: a plan changes only the
micro-batch context, never the graphs. It works in one process without `torch.distributed` as well as under
torchrun.

With `--pp N` every rank builds the whole model on the host, moves only its pipeline stage to the device
(`pipeline_stage`: stage-major, rank // HDP ranks), compiles and optimizes that stage alone (ZeRO-1 over the
stage's HDP ranks), checkpoints it under the whole model's names, and before final/ gathers every stage's
weights into rank 0's model. Calibration times the whole model on the device over all ranks (the cost model
is per layer, whatever the split), so it needs the whole model to fit one device.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from ..api import OptimizedModule
from ..data import (
    GlobalBatch,
    GlobalBatchSampler,
    MixedDataset,
    MixtureSampler,
    TokenDataset,
    batch_sources,
)
from ..engine.batch import num_targets
from ..engine.diagnostics import StepPrediction
from ..engine.dist_optim import DistributedOptimizer, restore_fp32_
from ..engine.optim import LRSchedule, build_optimizer
from ..engine.pipeline import stage_group, whole_state
from ..engine.runtime import CostModelWarning, Runtime
from ..engine.stages import stage_spec
from ..planner import AUTO, STATIC
from .checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointSaveError,
    PendingCheckpoint,
    remove_stale_tmp,
    resume_latest,
)
from .config import (
    TrainConfig,
    check_one_strategy,
)
from .inputs import (
    CHECKPOINTS_DIR,
    FINAL_DIR,
    RunInputs,
    is_rank0,
    run_dir,
)
from .memory import TORCH_DTYPES
from .metrics import MetricsLog, StepRecord, echo, progress
from .prepared import Prepared, predicts, prepare, unpredicted, write_config
from .remote import LoadedStep, RemoteBatches, connect_ray, scheduler_for
from .signals import Stopped, StopRequest

__all__ = [
    "RunResult",
    "Trainer",
    "evaluate",
    "run",
    "session",
    "train",
]

logger = logging.getLogger(__name__)

Sampler = GlobalBatchSampler | MixtureSampler


@dataclass
class RunResult:
    strategy: str
    run_dir: Path
    records: list[StepRecord]
    """The steps this process ran (a resumed run's earlier steps are in metrics.jsonl)."""
    eval_loss: float | None
    """After the last step, when evaluation is on."""
    final_dir: Path | None
    capacity: int
    """The C it trained with (--capacity auto: the one the memory model fitted)."""
    unpredicted: str | None = None
    """Why its records' predictions are not of this device (the end-of-run table then prints none); None: they are."""


def run(inputs: RunInputs, device: torch.device | None = None) -> RunResult:
    """Train the config's strategy on `device` (default: the CPU); rank 0 writes config.toml first, or on a resume
    once the first checkpoint commits. Every strategy from the same weights is `compare.py`'s."""
    check_one_strategy(inputs.config)
    prepared = prepare(inputs, device or torch.device("cpu"))
    with session(inputs.config) as stop:
        return train(inputs, prepared, inputs.config.strategy, stop)


def train(inputs: RunInputs, prepared: Prepared, strategy: str, stop: StopRequest) -> RunResult:
    """One strategy's run from the model's initial weights; with pipelines on this rank's stage."""
    model = inputs.model.module
    restore_fp32_(model)  # a previous bf16 run's distributed optimizer left them views of its bf16 buffer
    model.zero_grad(set_to_none=True)
    model.load_state_dict(prepared.initial)
    return Trainer(inputs, prepared, strategy, stop).fit()


@contextlib.contextmanager
def session(config: TrainConfig) -> Iterator[StopRequest]:
    """Around the training: the Ray connection of `--loader ray`, and SIGTERM and Ctrl-C as requests to stop."""
    with _ray_session(config), StopRequest() as stop:
        yield stop


@contextlib.contextmanager
def _ray_session(config: TrainConfig) -> Iterator[None]:
    """--loader ray: join --ray-address, or the local head rank 0 starts (its address broadcast to the other
    ranks); disconnect at the end, after every rank is done, if this run connected."""
    if config.loader != "ray":
        yield
        return
    import ray

    if config.ray_address is None and dist.is_initialized():
        connected = connect_ray(None, config.ray_cpus) if is_rank0() else False
        head = [ray.get_runtime_context().gcs_address if is_rank0() else None]
        dist.broadcast_object_list(head, src=0)
        connected = connected or connect_ray(head[0], None)
    else:
        connected = connect_ray(config.ray_address, config.ray_cpus)
    try:
        yield
        if dist.is_initialized():
            dist.barrier()
    finally:
        if connected:
            ray.shutdown()


class Trainer:
    """One strategy's run on a prepared model: it holds the runtime, the optimizer and its schedule, the sampler,
    the metrics log and the checkpointer, and `fit` runs steps `first_step`..`steps`, each `train_step`, then
    `maybe_evaluate` and `maybe_checkpoint`, then a stop with a checkpoint when any rank got SIGTERM or SIGINT."""

    def __init__(self, inputs: RunInputs, prepared: Prepared, strategy: str, stop: StopRequest) -> None:
        config = prepared.config
        self.inputs, self.prepared, self.config, self.stop = inputs, prepared, config, stop
        self.directory = run_dir(config, strategy)
        self.rank0 = is_rank0()
        self.optimizer = build_optimizer(
            prepared.model.original_module,
            config.lr,
            config.weight_decay,
            (config.beta1, config.beta2),
            config.zero,
            _optimizer_group(config, prepared.model),
            dtype=TORCH_DTYPES[config.dtype],
            grad_reduce_dtype=TORCH_DTYPES[config.grad_reduce_dtype],
        )
        self.schedule = LRSchedule(config.lr, config.warmup, config.schedule_steps, config.min_lr_ratio)
        self.runtime = Runtime(
            prepared.model,
            self.optimizer,
            cost_model=prepared.cost_model,
            strategy=strategy,
            capacity=config.capacity_tokens,
            max_grad_norm=config.max_grad_norm,
            context_length=config.max_len if strategy in (STATIC, AUTO) else None,
            mixed_precision=torch.bfloat16 if config.dtype == "bf16" else None,
            memory=prepared.memory,
            memory_budget=prepared.memory_budget,
            sp=config.sp,
            expert_bias_update=config.expert_bias_update,
            probe=prepared.probe,
        )
        self.sampler = _sampler(inputs, config)
        """The local loader's, and in either case what a checkpoint's batch position is checked against."""
        self.checkpointer = Checkpointer()
        self.predicts = predicts(config, self.runtime.device)
        for stale in remove_stale_tmp(self.directory / CHECKPOINTS_DIR):
            echo(f"[{strategy}] removed {stale}, left by an interrupted checkpoint save", self.rank0)
        done = self._resume() if config.resume else 0
        self.first_step = done + 1
        self.metrics = MetricsLog(
            self.directory,
            self.rank0,
            resumed_step=done,
            loggers=inputs.loggers,
            run_name=f"{Path(config.out).name}-{strategy}",
            config=config.to_dict(),
        )

    @property
    def strategy(self) -> str:
        return self.runtime.strategy

    def fit(self) -> RunResult:
        """Train to --steps, then save final/ (Hugging Face models)."""
        try:
            with self._batches() as batches:
                records, eval_loss = self._train_steps(batches)
        finally:
            self.metrics.close()
            # the next strategy's optimizer hooks the same parameters
            if isinstance(self.optimizer, DistributedOptimizer):
                self.optimizer.remove_hooks()
        final = None
        if self.inputs.model.hf_directory:
            final = _save_final(self.prepared.model, self.inputs, self.directory / FINAL_DIR)
        why = unpredicted(self.config, self.runtime.cost_model, self.runtime.device)
        return RunResult(self.strategy, self.directory, records, eval_loss, final, self.runtime.capacity, why)

    def _train_steps(self, batches: Iterator[LoadedStep]) -> tuple[list[StepRecord], float | None]:
        records, eval_loss = [], None
        with warnings.catch_warnings():
            if not self.predicts:  # steps are not held against predictions the run says it cannot make
                warnings.simplefilter("ignore", CostModelWarning)
            for step in progress(range(self.first_step, self.config.steps + 1), self.strategy, self.rank0):
                loaded = next(batches)
                record = self.train_step(step, loaded)
                if (evaluated := self.maybe_evaluate(step, record)) is not None:
                    eval_loss = evaluated
                saved = self.maybe_checkpoint(step, loaded.sampler_state, record)
                self._log(step, record)
                records.append(record)
                self._stop_if_asked(step, loaded.sampler_state, record, saved)
        self.checkpointer.wait()
        return records, eval_loss

    def train_step(self, step: int, loaded: LoadedStep) -> StepRecord:
        """Optimizer step `step` on `loaded`'s batch (and plan, when the remote loader made one)."""
        lr = self.schedule.apply(self.optimizer, step)
        stats = self.runtime.step(loaded.batch, plan=loaded.plan)
        return StepRecord.from_stats(
            stats,
            lr,
            self.runtime.cost_model,
            loaded.data_wait_s,
            loaded.plan_time_s if loaded.plan is not None else None,
            prediction=self.runtime.predict(stats) if self.rank0 else StepPrediction.unpredicted(),
            shape=self.inputs.shape,
            peak=self.prepared.peak_tflops,
            dataset_tokens=batch_sources(loaded.batch) if self.inputs.weights is not None else None,
        )

    def maybe_evaluate(self, step: int, record: StepRecord) -> float | None:
        """The held-out loss every --eval-every steps and after the last, recorded in `record`."""
        config = self.config
        if self.inputs.held_out and (step % config.eval_every == 0 or step == config.steps):
            record.eval_loss = evaluate(self.runtime, self.inputs.held_out)
        return record.eval_loss

    def maybe_checkpoint(self, step: int, sampler_state: dict, record: StepRecord) -> Path | None:
        """A checkpoint every --checkpoint-every steps and after the last; its directory (None: not saved)."""
        every = self.config.checkpoint_every
        if every and (step % every == 0 or step == self.config.steps):
            return self._save(step, sampler_state, record)
        return None

    def _save(self, step: int, sampler_state: dict, record: StepRecord) -> Path:
        """Save `step` (in the background with --checkpoint-async), recording in `record` how long the step
        waited for it; a resume's settings become config.toml once it commits."""
        began = time.perf_counter()
        settings = self.prepared.settings_at_commit
        save = self.checkpointer.save_async if self.config.checkpoint_async else self.checkpointer.save
        saved = save(
            self.directory / CHECKPOINTS_DIR,
            step,
            self.runtime.model,
            self.optimizer,
            {"step": step, "sampler": sampler_state, "config": self.config.to_dict()},
            keep_last=self.config.keep_last,
            on_commit=None if settings is None else lambda _: write_config(settings),
        )
        record.checkpoint_stall_s = time.perf_counter() - began
        return saved.path if isinstance(saved, PendingCheckpoint) else saved

    def _log(self, step: int, record: StepRecord) -> None:
        self.metrics.write(record)
        if step % self.config.log_every == 0 or step == self.config.steps or record.eval_loss is not None:
            echo(record.summary(predicted=self.predicts), self.rank0)

    def _stop_if_asked(self, step: int, sampler_state: dict, record: StepRecord, saved: Path | None) -> None:
        """Raise `Stopped` when any rank got SIGTERM or SIGINT, once `step` is saved (when checkpoints are on)
        and the save in flight is written; a save that fails says so in `Stopped`."""
        signal_name = self.stop.agreed(self.runtime.device)
        if signal_name is None:
            return
        try:
            if self.config.checkpoint_every and saved is None:
                saved = self._save(step, sampler_state, record)
            self.checkpointer.wait()
        except CheckpointSaveError as e:
            raise Stopped(signal_name, step, None, save_error=e) from e
        raise Stopped(signal_name, step, str(saved) if saved else None)

    def _resume(self) -> int:
        """Restore the newest checkpoint of this run that verifies, if any; returns its step (0: none). The
        settings were compared with config.toml in `setup`; a checkpoint past --steps is refused."""
        runtime, steps = self.runtime, self.config.steps
        resumed = resume_latest(self.directory / CHECKPOINTS_DIR, runtime.model, self.optimizer)
        if resumed is None:
            return 0
        for skipped in resumed.skipped:
            echo(f"[{runtime.strategy}] skipped checkpoint {skipped.path}: {skipped.reason}", self.rank0)
        if resumed.resharded is not None:
            echo(f"[{runtime.strategy}] resharding {resumed.path.name}: {resumed.resharded}", self.rank0)
        state = resumed.train_state
        if state["step"] > steps:
            raise CheckpointError(
                f"{resumed.path} is of step {state['step']}, past --steps {steps}: pass --steps {state['step']} or "
                f"more to continue it (final/ is written from the last step), or another --out for a shorter run"
            )
        try:
            self.sampler.load_state_dict(state["sampler"])
        except (ValueError, KeyError) as e:  # possible after --allow-config-change of data
            raise CheckpointError(f"{resumed.path}: its batch position does not fit this run's data: {e}") from e
        runtime.steps = state["step"]
        echo(f"[{runtime.strategy}] resumed from {resumed.path} at step {state['step']}", self.rank0)
        return state["step"]

    @contextlib.contextmanager
    def _batches(self) -> Iterator[Iterator[LoadedStep]]:
        """The steps from `first_step` on: drawn and planned on this rank (local), or by the scheduler actor with
        only this rank's tokens fetched (ray), which rank 0 stops once every rank is done."""
        config, runtime = self.config, self.runtime
        if config.loader == "local":
            yield _local_steps(self.sampler)
            return
        import ray

        scheduler = scheduler_for(
            self.directory,
            cast(TokenDataset, self.inputs.train_data),  # setup refuses a mixture with --loader ray
            config.data_servers,
            config.global_tokens,
            config.seed,
            config.max_len,
            self.sampler.state_dict(),
            self.first_step,
            runtime.plan_request(),
            config.prefetch_steps,
        )
        batches = RemoteBatches(
            scheduler,
            runtime.rank,
            self.first_step,
            pin_memory=runtime.device.type == "cuda",
            prefetch=config.prefetch_steps > 0,
        )
        try:
            yield batches
            batches.close()
            if dist.is_initialized():
                dist.barrier()
        finally:
            batches.close()
            if self.rank0:
                ray.kill(scheduler)


def _optimizer_group(config: TrainConfig, optimized: OptimizedModule) -> dist.ProcessGroup | None:
    """The ranks an optimizer shards over when they are not its default: a pipeline stage's HDP ranks. With TP,
    those of this rank's TP index, which the optimizers find themselves (None)."""
    spec = stage_spec(optimized)
    return stage_group(spec) if spec is not None and config.tp == 1 else None


def _sampler(inputs: RunInputs, config: TrainConfig) -> Sampler:
    """Global batches of the data, or of a mixture by the token shares of its weights."""
    if inputs.weights is None:
        return GlobalBatchSampler(inputs.train_data, config.global_tokens, seed=config.seed, max_len=config.max_len)
    return MixtureSampler(
        cast(MixedDataset, inputs.train_data), inputs.weights, config.global_tokens, config.seed, config.max_len
    )


def _local_steps(sampler: Sampler) -> Iterator[LoadedStep]:
    """The sampler's batches; the wait is the time to draw one, and the rank plans it itself."""
    batches = iter(sampler)
    while True:
        began = time.perf_counter()
        batch = next(batches)
        yield LoadedStep(batch, None, time.perf_counter() - began, 0.0, sampler.state_dict())


def evaluate(runtime: Runtime, batches: list[GlobalBatch]) -> float:
    """The token-level loss over all `batches`: each batch's mean weighted by its targets."""
    targets = [num_targets(b.lengths) for b in batches]
    return sum(runtime.evaluate(b) * n for b, n in zip(batches, targets)) / sum(targets)


def _save_final(optimized: OptimizedModule, inputs: RunInputs, path: Path) -> Path:
    """`save_pretrained` of the trained weights in the run's dtype and the tokenizer, on rank 0 (every pipeline
    stage's weights, tensor-parallel shards gathered); every rank waits for it."""
    model: Any = inputs.model.module  # from a Hugging Face directory: it has save_pretrained
    weights = whole_state(model, optimized)
    if weights is not None:
        dtype = TORCH_DTYPES[inputs.config.dtype]  # a pipeline's other stages are on the host in fp32
        model.save_pretrained(
            path, state_dict={k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()}
        )
        if inputs.tokenizer is not None:
            inputs.tokenizer.tokenizer.save_pretrained(path)
    if dist.is_initialized():
        dist.barrier()
    return path
