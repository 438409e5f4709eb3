"""One training run, driven by a `TrainConfig`.

`setup` checks everything a run needs before any step or communication — the datasets, the model, the
vocabulary, the tokenizer for final/, the cost model, the output directory — so a bad setting fails on
every rank at once with a message that names it. `run` then trains each strategy in turn from the same
initial weights on the same batches (drawn and planned on every rank, or with `--loader ray` by the remote
dataloader of `remote.py`, whose scheduler plans once for all ranks): AdamW with the warmup-cosine schedule, the HDP `Runtime` for every
step, evaluation, checkpoints, metrics and, for Hugging Face models, `final/`. The strategies share one
optimized model (its weights reset in place between them), so the model compiles once per run: a plan
changes only the micro-batch context, never the graphs. It works in one process without
`torch.distributed` as well as under torchrun.

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
from ..engine.dist_optim import DistributedOptimizer, restore_fp32_
from ..engine.optim import LRSchedule, build_optimizer
from ..engine.pipeline import pipeline_stage, stage_group, whole_state
from ..engine.routing import RouterTraining
from ..engine.runtime import CostModelWarning, Runtime, default_cost_model
from ..engine.stages import UnsupportedModelError, split_stages, stage_spec
from ..planner import AUTO, STATIC, CostModel, ModelShape
from ..planner.memory import MemoryBudgetError, MemoryModel, format_bytes
from ..planner.model_shape import ModelConfigError, model_shape
from .calibrate import calibrate
from .checkpoint import (
    CheckpointError,
    CheckpointSaveError,
    PendingCheckpoint,
    latest_checkpoint,
    remove_stale_tmp,
    resume_latest,
    save_checkpoint,
    save_checkpoint_async,
    wait_for_checkpoint,
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
from .remote import LoadedStep, PlanSettings, RemoteBatches, check_ray, connect_ray, scheduler_for
from .signals import Stopped, StopRequest

__all__ = [
    "CALIBRATED_COST_MODEL",
    "CHECKPOINTS_DIR",
    "CONFIG_FILE",
    "FINAL_DIR",
    "RunInputs",
    "RunResult",
    "VocabularyError",
    "evaluate",
    "run",
    "run_dir",
    "setup",
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
    """Its initial weights are every strategy's start; `run` trains it in place."""
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
    peak_tflops: float | None = None
    """The device's peak for MFU, set by `run` (None: unknown, e.g. a CPU)."""
    memory: MemoryModel | None = None
    """What a rank holds (`planner/memory.py`), set by `run` from the compiled model (None: it cannot say)."""
    memory_budget: int | None = None
    """--memory-budget, else the GPU's memory (None on a CPU without one): every plan is checked against it."""


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


def setup(config: TrainConfig) -> RunInputs:
    """Open and check the datasets, build the model, resolve the tokenizer and the cost model."""
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
    return dataclasses.replace(
        cost,
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


def run(inputs: RunInputs, device: torch.device | None = None) -> list[RunResult]:
    """Train every strategy of the config in turn on `device` (default: the CPU), each from the model's
    initial weights; rank 0 writes config.toml first, or on a resume once the first checkpoint commits."""
    config = inputs.config
    for change in inputs.config_changes:
        echo(f"resuming with a changed setting: {change}", _is_rank0())
    device = device or torch.device("cpu")
    if config.capacity == CAPACITY_AUTO and config.memory_budget is None and device.type != "cuda":
        raise ConfigError(
            f"--capacity auto fits C to a device's memory, and this {device.type} reports none: pass "
            "--memory-budget (e.g. 16G) or a --capacity in tokens"
        )
    model = inputs.model.module
    if config.tp > 1:  # the user's model object, sharded in place: final/ is saved from it
        tensor_parallel(model.to(device), config.tp)
    initial = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    # the whole model for one process per HDP rank, or to calibrate on (then only this rank's pipeline stage)
    whole = optimize(model.to(device)) if config.pp == 1 or config.calibrates else None
    if whole is not None:
        inputs = _with_memory(inputs, whole, device)
        _preflight(inputs, whole)
        if config.calibrates:  # the calibrated T(s) decides where offloading pays: check again with it
            inputs = dataclasses.replace(inputs, cost_model=_calibrated(inputs, whole))
            _preflight(inputs, whole)
    if config.pp == 1:
        optimized = cast(OptimizedModule, whole)
    else:
        model.to("cpu")
        optimized = optimize(pipeline_stage(model, config.pp).to(device))
        if whole is None:
            inputs = _with_memory(inputs, optimized, device)
            _preflight(inputs, optimized)
    resuming = any(latest_checkpoint(run_dir(config, s) / CHECKPOINTS_DIR) for s in config.strategies)
    if _is_rank0() and not resuming:  # once the run is known to fit: a refused run leaves the saved settings alone
        _write_config(config)
    # a resume's settings (as given: `--capacity auto`, not the C it resolved to) replace the saved ones only once
    # its first checkpoint commits, so a resume that fails before keeps the saved run's
    settings_at_commit = config if resuming else None
    inputs = dataclasses.replace(inputs, peak_tflops=peak_tflops(device, config.dtype, config.peak_tflops))
    _notes(inputs, device)
    results = []
    with _ray_session(config), StopRequest() as stop:
        for strategy in config.strategies:
            restore_fp32_(model)  # a bf16 run's distributed optimizer left them views of its bf16 buffer
            model.zero_grad(set_to_none=True)
            model.load_state_dict(initial)
            results.append(_train(inputs, strategy, optimized, stop, settings_at_commit))
    return results


def _write_config(config: TrainConfig) -> None:
    """config.toml, the settings of the run whose checkpoints --out holds: what a resume compares its own with."""
    Path(config.out).mkdir(parents=True, exist_ok=True)
    (Path(config.out) / CONFIG_FILE).write_text(to_toml(config), encoding="utf-8")


def _with_memory(inputs: RunInputs, optimized: OptimizedModule, device: torch.device) -> RunInputs:
    """`inputs` with the memory model of `optimized` (the whole model, or this rank's stage, which compiles here),
    the memory budget, and with --capacity auto the C it fits; every rank takes the same, the one of the
    fullest rank (stages differ). A model the memory model cannot describe records no peaks, and refuses
    --capacity auto."""
    config = inputs.config
    budget = config.memory_budget or (device_memory(device) if device.type == "cuda" else None)
    runtime = Runtime(optimized, torch.optim.SGD(optimized.parameters(), lr=0.0), cost_model=inputs.cost_model)
    runtime.shard_blockers()
    hdp = runtime.world_size
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
        return dataclasses.replace(inputs, memory=memory, memory_budget=budget)
    assert budget is not None  # run() refused --capacity auto without one
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
    return dataclasses.replace(
        inputs, config=dataclasses.replace(config, capacity=capacity), memory=memory, memory_budget=budget
    )


def _preflight(inputs: RunInputs, optimized: OptimizedModule) -> None:
    """Every strategy of the run checked against the data before anything runs (`preflight.py`), with the cost
    model as given and the shard blockers of `optimized` (the whole model or this rank's stage)."""
    config = inputs.config
    runtime = Runtime(optimized, torch.optim.SGD(optimized.parameters(), lr=0.0), cost_model=inputs.cost_model)
    blockers = runtime.shard_blockers()
    hdp = runtime.world_size
    for strategy in config.strategies:
        preflight(config, inputs.train_data, inputs.held_out, hdp, config.pp, strategy, runtime.cost_model, blockers)


def _notes(inputs: RunInputs, device: torch.device) -> None:
    """What the step lines leave out, and why: said once, before the first step."""
    if inputs.peak_tflops is None and inputs.shape is not None:
        echo(f"steps print no MFU: no known peak TFLOP/s of this {device.type}; pass --peak-tflops", _is_rank0())
    if not _predicts(inputs.config, device):
        echo(
            f"steps print no predicted time: the cost model is the analytic one of "
            f"{inputs.cost_model.hardware.name}, not of this {device.type}, and the run does not calibrate it: "
            "pass --calibrate (the default without --pp) or --cost-model from `bytescale-compile profile`",
            _is_rank0(),
        )


def _predicts(config: TrainConfig, device: torch.device) -> bool:
    """Whether the run's cost model can predict its step times: profiled, calibrated, or analytic on a GPU
    (an analytic model describes a GPU, never a CPU)."""
    return config.calibrates or config.cost_model is not None or device.type == "cuda"


def _calibrated(inputs: RunInputs, optimized: OptimizedModule) -> CostModel:
    """The cost model refitted on every rank at once (`train/calibrate.py`), printed and saved by rank 0.
    Its runtime steps no optimizer: a plain SGD stands in for the one each strategy builds."""
    config = inputs.config
    runtime = Runtime(
        optimized,
        torch.optim.SGD(optimized.parameters(), lr=0.0),
        cost_model=inputs.cost_model,
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


def _train(
    inputs: RunInputs,
    strategy: str,
    optimized: OptimizedModule,
    stop: StopRequest,
    settings_at_commit: TrainConfig | None,
) -> RunResult:
    """One strategy's run; `optimized` is the whole model or, with pipelines, this rank's stage."""
    config, directory, rank0 = inputs.config, run_dir(inputs.config, strategy), _is_rank0()
    spec = stage_spec(optimized)
    # a stage's HDP ranks; with TP those of this rank's TP index, which the optimizers find themselves (None)
    group = stage_group(spec) if spec is not None and config.tp == 1 else None
    betas = (config.beta1, config.beta2)
    optimizer: torch.optim.Optimizer | DistributedOptimizer
    if config.dtype == "bf16":
        optimizer = DistributedOptimizer(
            optimized.original_module,
            config.lr,
            config.weight_decay,
            betas,
            group=group,
            grad_reduce_dtype=TORCH_DTYPES[config.grad_reduce_dtype],
        )
    else:
        optimizer = build_optimizer(
            optimized.original_module, config.lr, config.weight_decay, betas, config.zero, group
        )
    schedule = LRSchedule(config.lr, config.warmup, config.schedule_steps, config.min_lr_ratio)
    runtime = Runtime(
        optimized,
        optimizer,
        cost_model=inputs.cost_model,
        strategy=strategy,
        capacity=config.capacity_tokens,
        max_grad_norm=config.max_grad_norm,
        context_length=config.max_len if strategy in (STATIC, AUTO) else None,
        mixed_precision=torch.bfloat16 if config.dtype == "bf16" else None,
        memory=inputs.memory,
        memory_budget=inputs.memory_budget,
        sp=config.sp,
        expert_bias_update=config.expert_bias_update,
    )
    sampler = _sampler(inputs)
    """The local loader's, and in either case what a checkpoint's batch position is checked against."""
    for stale in remove_stale_tmp(directory / CHECKPOINTS_DIR):
        echo(f"[{strategy}] removed {stale}, left by an interrupted checkpoint save", rank0)
    done = _resume(runtime, sampler, directory / CHECKPOINTS_DIR, config.steps) if config.resume else 0
    log = MetricsLog(
        directory,
        rank0,
        resumed_step=done,
        loggers=inputs.loggers,
        run_name=f"{Path(config.out).name}-{strategy}",
        config=config.to_dict(),
    )
    try:
        with _steps(inputs, runtime, sampler, directory, done + 1) as batches:
            records, eval_loss = _train_steps(
                inputs, runtime, schedule, batches, log, stop, done + 1, settings_at_commit
            )
    finally:
        log.close()
        if isinstance(optimizer, DistributedOptimizer):  # the next strategy's optimizer hooks the same parameters
            optimizer.remove_hooks()
    final = _save_final(optimized, inputs, directory / FINAL_DIR) if inputs.model.hf_directory else None
    return RunResult(strategy, directory, records, eval_loss, final, runtime.capacity)


def _train_steps(
    inputs: RunInputs,
    runtime: Runtime,
    schedule: LRSchedule,
    batches: Iterator[LoadedStep],
    log: MetricsLog,
    stop: StopRequest,
    first_step: int,
    settings_at_commit: TrainConfig | None,
) -> tuple[list[StepRecord], float | None]:
    """Steps `first_step`..`steps`: train, evaluate, log, checkpoint; after each, stop with a checkpoint when
    any rank got SIGTERM or SIGINT. `settings_at_commit` (a resume's) is written as config.toml at each commit."""
    config, rank0 = inputs.config, _is_rank0()
    directory = run_dir(config, runtime.strategy)
    predicts = _predicts(config, runtime.device)
    records, eval_loss = [], None

    def save(step: int, sampler_state: dict, record: StepRecord) -> Path:
        began = time.perf_counter()
        write = save_checkpoint_async if config.checkpoint_async else save_checkpoint
        saved = write(
            directory / CHECKPOINTS_DIR,
            step,
            runtime.model,
            runtime.optimizer,
            {"step": step, "sampler": sampler_state, "config": config.to_dict()},
            keep_last=config.keep_last,
            on_commit=None if settings_at_commit is None else lambda _: _write_config(settings_at_commit),
        )
        record.checkpoint_stall_s = time.perf_counter() - began
        return saved.path if isinstance(saved, PendingCheckpoint) else saved

    with warnings.catch_warnings():
        if not predicts:  # steps are not held against predictions the run says it cannot make
            warnings.simplefilter("ignore", CostModelWarning)
        for step in progress(range(first_step, config.steps + 1), runtime.strategy, rank0):
            lr = schedule.apply(runtime.optimizer, step)
            loaded = next(batches)
            record = StepRecord.from_stats(
                runtime.step(loaded.batch, plan=loaded.plan),
                lr,
                runtime.cost_model,
                loaded.data_wait_s,
                loaded.plan_time_s if loaded.plan is not None else None,
                shape=inputs.shape,
                peak=inputs.peak_tflops,
                dataset_tokens=batch_sources(loaded.batch) if inputs.weights is not None else None,
            )
            if inputs.held_out and (step % config.eval_every == 0 or step == config.steps):
                record.eval_loss = eval_loss = evaluate(runtime, inputs.held_out)
            saved = None
            if config.checkpoint_every and (step % config.checkpoint_every == 0 or step == config.steps):
                saved = save(step, loaded.sampler_state, record)
            log.write(record)
            records.append(record)
            if step % config.log_every == 0 or step == config.steps or record.eval_loss is not None:
                echo(record.summary(predicted=predicts), rank0)
            if (signal_name := stop.agreed(runtime.device)) is not None:
                try:
                    if config.checkpoint_every and saved is None:
                        saved = save(step, loaded.sampler_state, record)
                    wait_for_checkpoint()
                except CheckpointSaveError as e:
                    raise Stopped(signal_name, step, None, save_error=e) from e
                raise Stopped(signal_name, step, str(saved) if saved else None)
    wait_for_checkpoint()
    return records, eval_loss


@contextlib.contextmanager
def _steps(
    inputs: RunInputs, runtime: Runtime, sampler: Sampler, directory: Path, first_step: int
) -> Iterator[Iterator[LoadedStep]]:
    """The steps from `first_step` on: drawn and planned on this rank (local), or by the scheduler actor with
    only this rank's tokens fetched (ray), which rank 0 stops once every rank is done."""
    config = inputs.config
    if config.loader == "local":
        yield _local_steps(sampler)
        return
    import ray

    settings = PlanSettings(
        runtime.world_size,
        runtime.capacity,
        runtime.cost_model,
        runtime.strategy,
        runtime.context_length,
        "; ".join(runtime.shard_blockers()) or None,
        runtime.pp_size,
        runtime.sp,
    )
    scheduler = scheduler_for(
        directory,
        cast(TokenDataset, inputs.train_data),  # setup refuses a mixture with --loader ray
        config.data_servers,
        config.global_tokens,
        config.seed,
        config.max_len,
        sampler.state_dict(),
        first_step,
        settings,
        config.prefetch_steps,
    )
    batches = RemoteBatches(
        scheduler,
        runtime.rank,
        first_step,
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
        if _is_rank0():
            ray.kill(scheduler)


def _sampler(inputs: RunInputs) -> Sampler:
    """Global batches of the data, or of a mixture by the token shares of its weights."""
    config = inputs.config
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


def _resume(runtime: Runtime, sampler: Sampler, checkpoints: Path, steps: int) -> int:
    """Restore the newest checkpoint under `checkpoints` that verifies, if any; returns its step (0: none).
    The settings were compared with config.toml in `setup`; a checkpoint past `steps` is refused."""
    resumed = resume_latest(checkpoints, runtime.model, runtime.optimizer)
    if resumed is None:
        return 0
    for skipped in resumed.skipped:
        echo(f"[{runtime.strategy}] skipped checkpoint {skipped.path}: {skipped.reason}", _is_rank0())
    if resumed.resharded is not None:
        echo(f"[{runtime.strategy}] resharding {resumed.path.name}: {resumed.resharded}", _is_rank0())
    state = resumed.train_state
    if state["step"] > steps:
        raise CheckpointError(
            f"{resumed.path} is of step {state['step']}, past --steps {steps}: pass --steps {state['step']} or "
            f"more to continue it (final/ is written from the last step), or another --out for a shorter run"
        )
    try:
        sampler.load_state_dict(state["sampler"])
    except (ValueError, KeyError) as e:  # possible after --allow-config-change of data
        raise CheckpointError(f"{resumed.path}: its batch position does not fit this run's data: {e}") from e
    runtime.steps = state["step"]
    echo(f"[{runtime.strategy}] resumed from {resumed.path} at step {state['step']}", _is_rank0())
    return state["step"]


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
