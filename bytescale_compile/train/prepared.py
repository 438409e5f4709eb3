"""`prepare`: the run on its device, resolved once before step 1. It places and compiles the model, fits the run to
the memory budget (`--capacity auto`), calibrates the cost model and checks every strategy against the data, with
one setup probe of the compiled model (`engine.probe`) and no throwaway Runtime: `Prepared`."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist

from ..api import OptimizedModule, optimize
from ..capture.tp_plan import tensor_parallel
from ..engine.pipeline import pipeline_stage
from ..engine.probe import SetupProbe, probe
from ..engine.runtime import Runtime
from ..planner import CostModel
from ..planner.memory import MemoryBudgetError, MemoryModel, format_bytes
from ..strategies import ExpertLayout
from .calibrate import calibrate
from .checkpoint import (
    latest_checkpoint,
)
from .config import (
    CAPACITY_AUTO,
    ConfigError,
    TrainConfig,
    to_toml,
)
from .flops import peak_tflops
from .inputs import (
    CALIBRATED_COST_MODEL,
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    RunInputs,
    is_rank0,
    run_dir,
)
from .memory import device_memory, memory_model
from .metrics import echo
from .preflight import preflight

__all__ = [
    "Prepared",
    "predicts",
    "prepare",
    "unpredicted",
    "write_config",
]

logger = logging.getLogger(__name__)


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
    probe: SetupProbe | None
    """What planning reads of `model` (`engine.probe`), taken once here for every strategy's Runtime (None: a
    pipeline stage of a calibrated run, which probed the whole model; its Runtime probes the stage)."""


@dataclass(frozen=True)
class _MemoryFit:
    """What the memory model of the compiled model says of the run: its peaks, the budget, and C."""

    memory: MemoryModel | None
    budget: int | None
    capacity: int | None
    """The C `--capacity auto` fitted (None: the run gave one)."""

    def resolve(self, config: TrainConfig) -> TrainConfig:
        return config if self.capacity is None else dataclasses.replace(config, capacity=self.capacity)


def prepare(inputs: RunInputs, device: torch.device) -> Prepared:
    """Place and compile the model on `device`, fit the run to the memory budget, check every strategy of the
    config against the data, and write config.toml once the run is known to fit (a refused run leaves the saved
    settings alone)."""
    config = inputs.config
    for change in inputs.config_changes:
        echo(f"resuming with a changed setting: {change}", is_rank0())
    if config.capacity == CAPACITY_AUTO and config.memory_budget is None and device.type != "cuda":
        raise ConfigError(
            f"--capacity auto fits C to a device's memory, and this {device.type} reports none: pass "
            "--memory-budget (e.g. 16G) or a --capacity in tokens"
        )
    model = inputs.model.module
    if config.tp > 1:  # the user's model object, sharded in place: final/ is saved from it
        tensor_parallel(model.to(device), config.tp, expert_layout=cast(ExpertLayout, config.expert_layout))
    initial = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    optimized, fit, cost, probed = _compiled(inputs, device)
    resuming = any(latest_checkpoint(run_dir(config, s) / CHECKPOINTS_DIR) for s in config.strategies)
    if is_rank0() and not resuming:
        write_config(config)
    prepared = Prepared(
        config=fit.resolve(config),
        model=optimized,
        initial=initial,
        cost_model=cost,
        memory=fit.memory,
        memory_budget=fit.budget,
        peak_tflops=peak_tflops(device, config.dtype, config.peak_tflops),
        settings_at_commit=config if resuming else None,
        probe=probed,
    )
    _notes(inputs, prepared, device)
    return prepared


def _compiled(
    inputs: RunInputs, device: torch.device
) -> tuple[OptimizedModule, _MemoryFit, CostModel, SetupProbe | None]:
    """The model the steps train (the whole model, or with pipelines this rank's stage), compiled; the memory fit
    of the whole model where it runs or calibrates, else of the stage; and the cost model, calibrated with the
    whole model on every rank at once (`--calibrate`). The data is checked against both cost models: the
    calibrated T(s) decides where offloading pays. Last, the probe of the model returned, where one was taken."""
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
            return whole, fit, cost, probed
    model.to("cpu")
    stage = optimize(pipeline_stage(model, config.pp).to(device))
    if fit is not None:
        return stage, fit, cost, None
    staged = probe(stage, cost)  # every rank at once: the stages' shard blockers are gathered
    fit = _fit_memory(inputs, stage, staged.hdp, device)
    _preflight(inputs, fit.resolve(config), staged, cost)
    return stage, fit, cost, staged


def write_config(config: TrainConfig) -> None:
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
        echo(f"steps record no predicted peak memory: {e}", is_rank0())
        mine = None
    every = [mine]
    if dist.is_initialized():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    models = [m for m in every if m is not None]
    memory = max(models, key=lambda m: m.peak(1)) if len(models) == len(every) else None
    if memory is None or config.capacity != CAPACITY_AUTO:
        if memory is not None and budget is not None and memory.peak(config.capacity_tokens) > budget:
            raise ConfigError(_over_budget(memory, config.capacity_tokens, budget, offload=_offloads(optimized)))
        return _MemoryFit(memory, budget, None)
    assert budget is not None  # prepare() refused --capacity auto without one
    try:
        capacity = memory.capacity(budget, offload=_offloads(optimized))
    except MemoryBudgetError as e:
        raise ConfigError(f"--capacity auto: {e}") from e
    echo(
        f"--capacity auto: C = {capacity:,} tokens per rank, from a budget of {format_bytes(budget)} less "
        f"{format_bytes(memory.static.total)} of weights, gradients and optimizer state "
        f"({memory.bytes_per_param:.2f} bytes per parameter) and {format_bytes(memory.workspace_bytes)} of "
        f"workspace, at {memory.layers * memory.layer_bytes_per_token + memory.other_bytes_per_token + memory.recomputed_bytes_per_token:,.0f} "
        "activation bytes per token",
        is_rank0(),
    )
    return _MemoryFit(memory, budget, capacity)


def _offloads(optimized: OptimizedModule) -> bool:
    return optimized.compile_config.offload == "auto"


def _over_budget(memory: MemoryModel, capacity: int, budget: int, *, offload: bool) -> str:
    """Why --capacity `capacity` does not fit `budget`, with only the ways out that fit: the C that does, or,
    when not even one token does, what the static bytes and workspace need (a smaller C cannot help then)."""
    peak = memory.peak(capacity)
    said = (
        f"--capacity {capacity}: a micro-batch of that many tokens per rank has a predicted peak of "
        f"{format_bytes(peak)} (static {format_bytes(memory.static.total)}, workspace "
        f"{format_bytes(memory.workspace_bytes)}), over the budget of {format_bytes(budget)}"
    )
    try:
        fits = memory.capacity(budget, offload=False)  # the peak checked above: nothing offloaded
    except MemoryBudgetError as e:
        try:
            memory.capacity(budget, offload=offload)
        except MemoryBudgetError:  # no C fits: say what the budget lacks and what would change that
            return f"{said}, and no --capacity fits it, auto neither: {e}"
        return f"{said}: pass --capacity auto (it offloads activations to fit) or a larger --memory-budget"
    return (
        f"{said}: pass --capacity {fits} or less (the largest that fits), --capacity auto, or a larger --memory-budget"
    )


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
        echo(f"steps print no MFU: no known peak TFLOP/s of this {device.type}; pass --peak-tflops", is_rank0())
    if (why := unpredicted(prepared.config, prepared.cost_model, device)) is not None:
        echo(f"steps print no predicted time: {why}", is_rank0())


def unpredicted(config: TrainConfig, cost_model: CostModel, device: torch.device) -> str | None:
    """Why the run's cost model cannot predict this device's times (None: it can), for the step lines and the
    end-of-run table, which then print no prediction rather than another device's."""
    if predicts(config, device):
        return None
    return (
        f"the cost model is the analytic one of {cost_model.hardware.name}, not of this {device.type}, and the run "
        "does not calibrate it: pass --calibrate (the default without --pp) or --cost-model from "
        "`bytescale-compile profile`"
    )


def predicts(config: TrainConfig, device: torch.device) -> bool:
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
    if is_rank0():
        Path(config.out).mkdir(parents=True, exist_ok=True)
        result.cost_model.save(Path(config.out) / CALIBRATED_COST_MODEL)
    echo(f"{result.summary()}\n  saved as {Path(config.out) / CALIBRATED_COST_MODEL}", is_rank0())
    return result.cost_model
