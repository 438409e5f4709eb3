"""One training run, driven by a `TrainConfig`, in three phases that each hand the next what they resolved.

- `setup` checks everything a run needs before any step or communication (the datasets, the model, the
  vocabulary, the tokenizer for final/, the cost model, the output directory), so a bad setting fails on every
  rank at once with a message that names it: `RunInputs`.
- `prepare` places and compiles the model on the device, fits the run to the memory budget, calibrates the cost
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
import dataclasses
import logging
import os
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from ..api import OptimizedModule, optimize
from ..capture.tensor_parallel import TensorParallelError
from ..capture.tp_plan import check_tensor_parallel, tensor_parallel
from ..data import (
    GlobalBatch,
    GlobalBatchSampler,
    LoadedTokenizer,
    MixedDataset,
    MixtureSampler,
    TokenDataset,
    TokenizerError,
    TokenizerInfo,
    batch_sources,
    eval_batches,
    eval_spec,
    load_tokenizer,
    open_data,
)
from ..engine.batch import num_targets
from ..engine.diagnostics import StepPrediction
from ..engine.dist_optim import DistributedOptimizer, restore_fp32_
from ..engine.optim import LRSchedule, build_optimizer
from ..engine.pipeline import pipeline_stage, stage_group, whole_state
from ..engine.probe import SetupProbe, probe
from ..engine.routing import RouterTraining
from ..engine.runtime import CostModelWarning, Runtime, default_cost_model
from ..engine.stages import UnsupportedModelError, split_stages, stage_spec
from ..planner import AUTO, STATIC, CostModel, ModelShape
from ..planner.memory import MemoryBudgetError, MemoryModel, format_bytes
from ..planner.model_shape import ModelConfigError, model_shape
from ..strategies import RUNTIME_STRATEGIES
from .calibrate import calibrate
from .checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointSaveError,
    PendingCheckpoint,
    latest_checkpoint,
    remove_stale_tmp,
    resume_latest,
)
from .config import (
    ALL_STRATEGIES,
    CAPACITY_AUTO,
    RESUME_AUTO,
    ConfigError,
    TrainConfig,
    check_resume_config,
    load_config,
    to_toml,
)
from .flops import peak_tflops
from .memory import TORCH_DTYPES, device_memory, memory_model
from .metrics import LoggerError, MetricsLog, StepRecord, check_loggers, echo, progress
from .models import LoadedModel, enable_gradient_checkpointing, load_model
from .preflight import check_token_ids, preflight
from .remote import LoadedStep, RemoteBatches, check_ray, connect_ray, scheduler_for
from .signals import Stopped, StopRequest

__all__ = [
    "CALIBRATED_COST_MODEL",
    "CHECKPOINTS_DIR",
    "CONFIG_FILE",
    "FINAL_DIR",
    "Prepared",
    "RunInputs",
    "RunResult",
    "Trainer",
    "VocabularyError",
    "evaluate",
    "prepare",
    "run",
    "run_dir",
    "session",
    "setup",
    "train",
]

CONFIG_FILE = "config.toml"
CALIBRATED_COST_MODEL = "calibrated_cost_model.json"
FINAL_DIR = "final"
CHECKPOINTS_DIR = "checkpoints"

logger = logging.getLogger(__name__)

BF16_BYTES, FP32_BYTES = 2, 4
TrainData = TokenDataset | MixedDataset
"""--data: one dataset, or a mixture of several."""
Sampler = GlobalBatchSampler | MixtureSampler


class VocabularyError(ConfigError):
    """The data's token ids do not fit the model's embedding."""


@dataclass(frozen=True)
class RunInputs:
    """Everything `setup` checked, ready to train."""

    config: TrainConfig
    train_data: TrainData
    eval_data: TrainData | None
    held_out: list[GlobalBatch]
    """What evaluation runs on: the first eval_tokens of the held-out split (a mixture's: each part's share)."""
    model: LoadedModel
    """Its initial weights are every strategy's start; the trainer trains it in place."""
    tokenizer: LoadedTokenizer | None
    """Saved into final/ (Hugging Face models whose data records a tokenizer, or --tokenizer)."""
    cost_model: CostModel
    config_changes: tuple[str, ...] = ()
    """On --resume: each accepted difference from config.toml, `key: saved -> now` (of the topology, or any with
    --allow-config-change)."""
    weights: list[float] | None = None
    """A --data mixture's token share per dataset (None: one dataset)."""
    loggers: tuple[str, ...] | None = None
    """--loggers (None: TensorBoard when installed)."""
    shape: ModelShape | None = None
    """The model's shape for its FLOPs per step (None: its config could not be read; no TFLOP/s then)."""


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


def run_dir(config: TrainConfig, strategy: str) -> Path:
    """`out`, or `out/<strategy>` when every strategy runs."""
    out = Path(config.out)
    return out / strategy if config.strategy == ALL_STRATEGIES else out


def setup(config: TrainConfig, *, every_strategy: bool = False) -> RunInputs:
    """Open and check the datasets, build the model, resolve the tokenizer and the cost model. strategy = all
    is refused unless `every_strategy` (the comparison's entry point, `compare.py`)."""
    if not every_strategy:
        _check_one_strategy(config)
    _check_out(Path(config.out))
    train_data, weights = _open_dataset(
        config.data, "--data", "make it with `bytescale-compile data prepare --input ... --tokenizer DIR --out PREFIX`"
    )
    if weights is not None and config.loader == "ray":
        raise ConfigError("--loader ray serves one dataset: train a --data mixture with --loader local (the default)")
    eval_data = None
    if config.eval_every:
        eval_data, _ = _open_dataset(
            eval_spec(config.data),
            "the held-out split of --data",
            "prepare the data with --eval-fraction > 0, or set eval_every = 0",
        )
        _check_same_tokens(train_data, eval_data)
    model = load_model(config.model, config.seed)
    if config.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    # the routers adapted before anything compiles, and what cannot be made exact refused before any work
    RouterTraining.of(model.module, pp_size=config.pp, bias_update=config.expert_bias_update)
    _check_vocabulary(train_data, model)
    for data in (train_data, eval_data):
        if data is not None:
            check_token_ids(data, model.vocab_size, model.spec)
    _check_processes(config.pp, config.tp)
    if config.pp > 1:
        _check_pipeline(config.pp, model)
    if config.tp > 1:
        _check_tensor_parallel(config.tp, model)
    tokenizer = _final_tokenizer(config, train_data, model)
    cost = CostModel.load(config.cost_model) if config.cost_model else _analytic_cost_model(model, config.dtype)
    if config.loader == "ray":
        check_ray(config.ray_address)
    found = [c for s in config.strategies if (c := latest_checkpoint(run_dir(config, s) / CHECKPOINTS_DIR))]
    if found and not config.resume:
        raise ConfigError(
            f"{found[0]} is a checkpoint of an earlier run: pass --resume to continue it, or another --out for a "
            "new run"
        )
    if config.resume is True and not found:
        raise ConfigError(
            f"--resume: no checkpoint under {Path(config.out)} to continue; start without --resume, or pass "
            f"--resume={RESUME_AUTO} to continue when there is one and start otherwise"
        )
    loggers = _loggers(config.loggers)
    changes: tuple[str, ...] = ()
    if found:
        config, changes = _resumed_config(config)
    try:
        shape: ModelShape | None = model_shape(model.module)
    except ModelConfigError:
        shape = None
    held_out = _held_out(config, eval_data, weights)
    return RunInputs(config, train_data, eval_data, held_out, model, tokenizer, cost, changes, weights, loggers, shape)


def _held_out(config: TrainConfig, data: TrainData | None, weights: list[float] | None) -> list[GlobalBatch]:
    """The batches every evaluation runs: the first eval_tokens of the held-out split, or of each part of a
    mixture's its weight's share, so the held-out loss weighs the datasets as training does."""
    if data is None:
        return []
    tokens = config.eval_tokens or config.global_tokens
    if weights is None:
        return eval_batches(data, config.global_tokens, config.max_len, tokens)
    parts = cast(MixedDataset, data).parts
    return [
        batch
        for part, weight in zip(parts, weights)
        for batch in eval_batches(part, config.global_tokens, config.max_len, max(1, round(weight * tokens)))
    ]


def _analytic_cost_model(model: LoadedModel, dtype: str) -> CostModel:
    """The analytic cost model of the model's config, with the bytes this trainer moves: it counts bf16 K/V,
    stage boundaries and gradients, while the trainer's gradients (fp32 master weights) and, in an fp32 run,
    its K/V and boundaries are fp32, twice as many bytes."""
    cost = default_cost_model(model.module)
    activations = FP32_BYTES / BF16_BYTES if dtype == "fp32" else 1.0
    return cost.replace(
        kv_bytes_per_token=int(cost.kv_bytes_per_token * activations),
        boundary_bytes_per_token=(
            None if cost.boundary_bytes_per_token is None else cost.boundary_bytes_per_token * activations
        ),
        param_bytes=cost.param_bytes * FP32_BYTES / BF16_BYTES,
    )


def _loggers(setting: str | None) -> tuple[str, ...] | None:
    """--loggers as names, each known and installed (None: the default)."""
    if setting is None:
        return None
    names = tuple(name.strip() for name in setting.split(",") if name.strip())
    try:
        check_loggers(names)
    except LoggerError as e:
        raise ConfigError(f"loggers: {e}") from e
    return names


def _check_out(out: Path) -> None:
    """--out must be a directory (or not exist yet), so that nothing fails on it after the run started."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file: pass a directory (it is created if missing)")


def _resumed_config(config: TrainConfig) -> tuple[TrainConfig, tuple[str, ...]]:
    """The config with the saved run's schedule kept (unless set now), and its accepted differences from the
    config.toml the run being resumed saved (none when that file is missing)."""
    saved_path = Path(config.out) / CONFIG_FILE
    if not saved_path.is_file():
        logger.warning("%s is missing: the settings of this resume cannot be compared with the saved run's", saved_path)
        return config, ()
    try:
        saved = load_config(saved_path)
    except ConfigError as e:
        raise ConfigError(f"cannot compare this resume's settings with {saved_path}: {e}") from e
    if config.decay_steps is None:
        config = dataclasses.replace(config, decay_steps=saved.schedule_steps)
    return config, tuple(check_resume_config(saved, config, saved_path))


def _open_dataset(spec: str, what: str, hint: str) -> tuple[TrainData, list[float] | None]:
    try:
        return open_data(spec)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{what} {spec}: {e}; {hint}") from e


def _check_same_tokens(train: TrainData, held_out: TrainData) -> None:
    if (train.tokenizer, train.vocab_size) != (held_out.tokenizer, held_out.vocab_size):
        raise VocabularyError(
            f"{held_out.prefix} (vocab {held_out.vocab_size}, tokenizer {held_out.tokenizer}) was "
            f"not tokenized like {train.prefix} (vocab {train.vocab_size}, tokenizer "
            f"{train.tokenizer}): prepare both with the same tokenizer"
        )


def _check_processes(pp: int, tp: int) -> None:
    """The job's processes (torchrun's WORLD_SIZE, 1 without it) are pp x HDP ranks x tp."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % (pp * tp):
        what = " and ".join(f"{name} = {size}" for name, size in (("pp", pp), ("tp", tp)) if size > 1)
        raise ConfigError(
            f"{what} needs a multiple of {pp * tp} processes (pp x HDP ranks x tp), but the job has {world}: "
            f"run torchrun --nproc_per_node with a multiple of {pp * tp}"
        )


def _check_pipeline(pp: int, model: LoadedModel) -> None:
    """The model splits into pipelines of `pp` stages."""
    try:
        split_stages(model.module, pp)
    except (UnsupportedModelError, ValueError) as e:
        raise ConfigError(f"pp = {pp}: model {model.spec} cannot be split into pipeline stages: {e}") from e


def _check_tensor_parallel(tp: int, model: LoadedModel) -> None:
    """The model has a tensor-parallel plan that splits its heads evenly over `tp`."""
    try:
        check_tensor_parallel(model.module, tp)
    except TensorParallelError as e:
        raise ConfigError(f"tp = {tp}: model {model.spec}: {e}") from e


def _check_vocabulary(data: TrainData, model: LoadedModel) -> None:
    if data.vocab_size > model.vocab_size:
        source = data.tokenizer.name_or_path if data.tokenizer else "bytes"
        raise VocabularyError(
            f"dataset {data.prefix} has a vocabulary of {data.vocab_size} ({source}), more than "
            f"model {model.spec}'s vocab_size of {model.vocab_size}: its token ids would index past "
            f"the embedding. Use a model with vocab_size >= {data.vocab_size}, or data tokenized "
            f"for this model"
        )


def _final_tokenizer(config: TrainConfig, data: TrainData, model: LoadedModel) -> LoadedTokenizer | None:
    """The tokenizer final/ gets: --tokenizer or the dataset's, which must be the one the data was made with."""
    if model.hf_directory is None or (config.tokenizer is None and data.tokenizer is None):
        return None
    path = config.tokenizer or cast(TokenizerInfo, data.tokenizer).name_or_path
    try:
        loaded = load_tokenizer(path)
    except TokenizerError as e:
        raise TokenizerError(
            f"{e} (the tokenizer final/ gets: pass --tokenizer DIR with the one {data.prefix} was prepared with)"
        ) from e
    if data.tokenizer is not None and loaded.info.sha256 != data.tokenizer.sha256:
        raise TokenizerError(
            f"tokenizer {path} is not the one {data.prefix} was prepared with "
            f"({data.tokenizer.name_or_path}, sha256 {data.tokenizer.sha256[:12]}..., found "
            f"{loaded.info.sha256[:12]}...): pass --tokenizer with that tokenizer"
        )
    if loaded.vocab_size > model.vocab_size:
        raise VocabularyError(
            f"tokenizer {path} has {loaded.vocab_size} tokens, more than model {model.spec}'s "
            f"vocab_size of {model.vocab_size}"
        )
    return loaded


@dataclass(frozen=True)
class Prepared:
    """The run on its device, resolved once by `prepare` before step 1 and the same for every strategy."""

    config: TrainConfig
    """The run's config, with --capacity auto replaced by the C the memory model fitted."""
    model: OptimizedModule
    """The whole model or, with pipelines, this rank's stage, compiled: a plan changes only the micro-batch
    context, never the graphs, so every strategy trains it."""
    initial: dict[str, torch.Tensor]
    """The model's weights before any step (tensor-parallel shards once sharded): each strategy's start."""
    cost_model: CostModel
    """As given, or refitted on every rank at once (`--calibrate`)."""
    memory: MemoryModel | None
    """What a rank holds (`planner/memory.py`), from the compiled model (None: it cannot say)."""
    memory_budget: int | None
    """--memory-budget, else the GPU's memory (None on a CPU without one): every plan is checked against it."""
    peak_tflops: float | None
    """The device's peak for MFU (None: unknown, e.g. a CPU)."""
    settings_at_commit: TrainConfig | None
    """A resume's settings as given (`--capacity auto`, not the C it resolved to), written as config.toml when its
    first checkpoint commits, so a resume that fails before keeps the saved run's (None: written already)."""


@dataclass(frozen=True)
class _MemoryFit:
    """What the memory model of the compiled model says of the run: its peaks, the budget, and C."""

    memory: MemoryModel | None
    budget: int | None
    capacity: int | None
    """The C `--capacity auto` fitted (None: the run gave one)."""

    def resolve(self, config: TrainConfig) -> TrainConfig:
        return config if self.capacity is None else dataclasses.replace(config, capacity=self.capacity)


def run(inputs: RunInputs, device: torch.device | None = None) -> RunResult:
    """Train the config's strategy on `device` (default: the CPU); rank 0 writes config.toml first, or on a resume
    once the first checkpoint commits. Every strategy from the same weights is `compare.py`'s."""
    _check_one_strategy(inputs.config)
    prepared = prepare(inputs, device or torch.device("cpu"))
    with session(inputs.config) as stop:
        return train(inputs, prepared, inputs.config.strategy, stop)


def _check_one_strategy(config: TrainConfig) -> None:
    if config.strategy == ALL_STRATEGIES:
        raise ConfigError(
            f"strategy = {ALL_STRATEGIES} retrains every strategy from the same weights to compare them, which the "
            "trainer does not: run `torchrun --nproc_per_node=N -m bytescale_compile.train.compare` with the same "
            f"options for that, or give one of {', '.join(RUNTIME_STRATEGIES)}"
        )


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


def prepare(inputs: RunInputs, device: torch.device) -> Prepared:
    """Place and compile the model on `device`, fit the run to the memory budget, check every strategy of the
    config against the data, and write config.toml once the run is known to fit (a refused run leaves the saved
    settings alone)."""
    config = inputs.config
    for change in inputs.config_changes:
        echo(f"resuming with a changed setting: {change}", _is_rank0())
    if config.capacity == CAPACITY_AUTO and config.memory_budget is None and device.type != "cuda":
        raise ConfigError(
            f"--capacity auto fits C to a device's memory, and this {device.type} reports none: pass "
            "--memory-budget (e.g. 16G) or a --capacity in tokens"
        )
    model = inputs.model.module
    if config.tp > 1:  # the user's model object, sharded in place: final/ is saved from it
        tensor_parallel(model.to(device), config.tp)
    initial = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    optimized, fit, cost = _compiled(inputs, device)
    resuming = any(latest_checkpoint(run_dir(config, s) / CHECKPOINTS_DIR) for s in config.strategies)
    if _is_rank0() and not resuming:
        _write_config(config)
    prepared = Prepared(
        config=fit.resolve(config),
        model=optimized,
        initial=initial,
        cost_model=cost,
        memory=fit.memory,
        memory_budget=fit.budget,
        peak_tflops=peak_tflops(device, config.dtype, config.peak_tflops),
        settings_at_commit=config if resuming else None,
    )
    _notes(inputs, prepared, device)
    return prepared


def _compiled(inputs: RunInputs, device: torch.device) -> tuple[OptimizedModule, _MemoryFit, CostModel]:
    """The model the steps train (the whole model, or with pipelines this rank's stage), compiled; the memory fit
    of the whole model where it runs or calibrates, else of the stage; and the cost model, calibrated with the
    whole model on every rank at once (`--calibrate`). The data is checked against both cost models: the
    calibrated T(s) decides where offloading pays."""
    config, model, cost = inputs.config, inputs.model.module, inputs.cost_model
    whole = optimize(model.to(device)) if config.pp == 1 or config.calibrates else None
    fit = None
    if whole is not None:
        probed = probe(whole, cost)  # compiles the whole model (fp32) for its memory model
        fit = _fit_memory(inputs, whole, probed.hdp, device)
        _preflight(inputs, fit.resolve(config), probed, cost)
        if config.calibrates:
            cost = _calibrated(fit.resolve(config), whole, cost)
            _preflight(inputs, fit.resolve(config), probed, cost)
        if config.pp == 1:
            return whole, fit, cost
    model.to("cpu")
    stage = optimize(pipeline_stage(model, config.pp).to(device))
    if fit is None:
        probed = probe(stage, cost)  # every rank at once: the stages' shard blockers are gathered
        fit = _fit_memory(inputs, stage, probed.hdp, device)
        _preflight(inputs, fit.resolve(config), probed, cost)
    return stage, fit, cost


def _write_config(config: TrainConfig) -> None:
    """config.toml, the settings of the run whose checkpoints --out holds: what a resume compares its own with."""
    Path(config.out).mkdir(parents=True, exist_ok=True)
    (Path(config.out) / CONFIG_FILE).write_text(to_toml(config), encoding="utf-8")


def _fit_memory(inputs: RunInputs, optimized: OptimizedModule, hdp: int, device: torch.device) -> _MemoryFit:
    """The memory model of `optimized` (the whole model, or this rank's stage, compiled by the probe) on `hdp`
    ranks, the memory budget, and with --capacity auto the C it fits; every rank takes the same, the one of the
    fullest rank (stages differ). A model the memory model cannot describe records no peaks, and refuses
    --capacity auto."""
    config = inputs.config
    budget = config.memory_budget or (device_memory(device) if device.type == "cuda" else None)
    try:
        if inputs.shape is None:
            raise ValueError(f"the layer count of {inputs.model.spec} cannot be read from its config")
        mine: MemoryModel | None = memory_model(
            optimized,
            total_layers=inputs.shape.layers,
            hdp=hdp,
            dtype=config.dtype,
            pp=config.pp,
            zero=config.zero,
            grad_reduce_dtype=config.grad_reduce_dtype,
            budget=budget,
        )
    except ValueError as e:
        if config.capacity == CAPACITY_AUTO:
            raise ConfigError(f"--capacity auto: {e}; pass a --capacity in tokens") from e
        echo(f"steps record no predicted peak memory: {e}", _is_rank0())
        mine = None
    every = [mine]
    if dist.is_initialized():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    models = [m for m in every if m is not None]
    memory = max(models, key=lambda m: m.peak(1)) if len(models) == len(every) else None
    if memory is None or config.capacity != CAPACITY_AUTO:
        if memory is not None and budget is not None and memory.peak(config.capacity_tokens) > budget:
            raise ConfigError(
                f"--capacity {config.capacity_tokens}: a micro-batch of that many tokens per rank has a predicted "
                f"peak of {format_bytes(memory.peak(config.capacity_tokens))} (static "
                f"{format_bytes(memory.static.total)}, workspace {format_bytes(memory.workspace_bytes)}), over the "
                f"budget of {format_bytes(budget)}: pass --capacity auto, a smaller --capacity or a larger "
                "--memory-budget"
            )
        return _MemoryFit(memory, budget, None)
    assert budget is not None  # prepare() refused --capacity auto without one
    try:
        capacity = memory.capacity(budget, offload=optimized.compile_config.offload == "auto")
    except MemoryBudgetError as e:
        raise ConfigError(f"--capacity auto: {e}") from e
    echo(
        f"--capacity auto: C = {capacity:,} tokens per rank, from a budget of {format_bytes(budget)} less "
        f"{format_bytes(memory.static.total)} of weights, gradients and optimizer state "
        f"({memory.bytes_per_param:.2f} bytes per parameter) and {format_bytes(memory.workspace_bytes)} of "
        f"workspace, at {memory.layers * memory.layer_bytes_per_token + memory.other_bytes_per_token + memory.recomputed_bytes_per_token:,.0f} "
        "activation bytes per token",
        _is_rank0(),
    )
    return _MemoryFit(memory, budget, capacity)


def _preflight(inputs: RunInputs, config: TrainConfig, probed: SetupProbe, cost_model: CostModel) -> None:
    """Every strategy of the run checked against the data before anything runs (`preflight.py`), with
    `cost_model` fitted and charged as the probed model's steps will be, and its shard blockers (of the whole
    model or, with pipelines, every stage's)."""
    cost, blockers = probed.charged(cost_model), list(probed.shard_blockers)
    for strategy in config.strategies:
        preflight(config, inputs.train_data, inputs.held_out, probed.hdp, config.pp, strategy, cost, blockers)


def _notes(inputs: RunInputs, prepared: Prepared, device: torch.device) -> None:
    """What the step lines leave out, and why: said once, before the first step."""
    if prepared.peak_tflops is None and inputs.shape is not None:
        echo(f"steps print no MFU: no known peak TFLOP/s of this {device.type}; pass --peak-tflops", _is_rank0())
    if not _predicts(prepared.config, device):
        echo(
            f"steps print no predicted time: the cost model is the analytic one of "
            f"{prepared.cost_model.hardware.name}, not of this {device.type}, and the run does not calibrate it: "
            "pass --calibrate (the default without --pp) or --cost-model from `bytescale-compile profile`",
            _is_rank0(),
        )


def _predicts(config: TrainConfig, device: torch.device) -> bool:
    """Whether the run's cost model can predict its step times: profiled, calibrated, or analytic on a GPU
    (an analytic model describes a GPU, never a CPU)."""
    return config.calibrates or config.cost_model is not None or device.type == "cuda"


def _calibrated(config: TrainConfig, optimized: OptimizedModule, cost_model: CostModel) -> CostModel:
    """`cost_model` refitted on every rank at once (`train/calibrate.py`), printed and saved by rank 0. Its
    runtime has no optimizer: calibration times forward, backward and the gradient sync, never a step."""
    runtime = Runtime(
        optimized,
        None,
        cost_model=cost_model,
        capacity=config.capacity_tokens,
        mixed_precision=torch.bfloat16 if config.dtype == "bf16" else None,
    )
    result = calibrate(runtime, seed=config.seed)
    if _is_rank0():
        Path(config.out).mkdir(parents=True, exist_ok=True)
        result.cost_model.save(Path(config.out) / CALIBRATED_COST_MODEL)
    echo(f"{result.summary()}\n  saved as {Path(config.out) / CALIBRATED_COST_MODEL}", _is_rank0())
    return result.cost_model


@contextlib.contextmanager
def _ray_session(config: TrainConfig) -> Iterator[None]:
    """--loader ray: join --ray-address, or the local head rank 0 starts (its address broadcast to the other
    ranks); disconnect at the end, after every rank is done, if this run connected."""
    if config.loader != "ray":
        yield
        return
    import ray

    if config.ray_address is None and dist.is_initialized():
        connected = connect_ray(None, config.ray_cpus) if _is_rank0() else False
        head = [ray.get_runtime_context().gcs_address if _is_rank0() else None]
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
        self.rank0 = _is_rank0()
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
        )
        self.sampler = _sampler(inputs, config)
        """The local loader's, and in either case what a checkpoint's batch position is checked against."""
        self.checkpointer = Checkpointer()
        self.predicts = _predicts(config, self.runtime.device)
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
        return RunResult(self.strategy, self.directory, records, eval_loss, final, self.runtime.capacity)

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
            on_commit=None if settings is None else lambda _: _write_config(settings),
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


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0
