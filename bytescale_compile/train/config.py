"""The training run's configuration: one flat TOML table whose keys are the command line's options.

`python -m bytescale_compile.train --config run.toml --lr 1e-3` reads `run.toml`, then applies the
options given on the command line, then validates. The resolved configuration is written back as
`config.toml` in the output directory by `to_toml` (tomllib reads TOML but nothing in the standard
library writes it, and the flat table of scalars needs no more than this writer).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ..data.spec import format_data_spec, parse_data_spec
from ..strategies import BALANCE, DEFAULT_SP, EXPERT_LAYOUTS, RUNTIME_STRATEGIES, SP_MODES
from ..units import parse_size

__all__ = [
    "ALL_STRATEGIES",
    "CAPACITY_AUTO",
    "ConfigError",
    "DTYPES",
    "EXPERT_LAYOUTS",
    "LOADERS",
    "MODEL_PRESETS",
    "NEVER_CHANGED",
    "NOT_COMPARED",
    "PATHS",
    "RESUME_AUTO",
    "SIZES",
    "TrainConfig",
    "absolute_data",
    "check_one_strategy",
    "check_processes",
    "check_resume_config",
    "config_changes",
    "load_config",
    "read_config",
    "to_toml",
]

DTYPES = ("fp32", "bf16")
"""fp32: everything in fp32. bf16: bf16 weights and autocast forward; fp32 gradient buffer, sharded fp32 main
weights and optimizer (`engine/dist_optim.py`), fp32 loss."""
CAPACITY_AUTO = "auto"
"""capacity = "auto": the largest C the memory model fits in the memory budget."""
"""How --tp places a Mixture-of-Experts model's experts (`capture/tp_experts.py`): ep, whole experts per TP rank; tp,
every expert split; auto, ep where tp divides the number of experts, else tp."""
LOADERS = ("local", "ray")
"""local: every rank samples and plans; ray: the remote dataloader of train/remote.py (paper §6)."""
ALL_STRATEGIES = "all"
"""Every strategy in turn, from the same initial weights on the same batches, then a comparison."""
MODEL_PRESETS = {
    "tiny": ("bytescale_compile.models.llama:tiny", "our LLaMA: 2 layers, hidden 64, vocab 128, for tests"),
    "small": ("bytescale_compile.models.llama:small", "our LLaMA: 4 layers, hidden 256, vocab 256"),
}
"""--model names that need no directory: name -> (MODULE:FACTORY, what it is)."""
SIZES = ("global_tokens", "capacity", "max_len", "eval_tokens", "memory_budget")
"""Token counts that also accept K/M suffixes ("16K")."""
PATHS = ("model", "data", "out", "tokenizer", "cost_model")
"""Settings naming files: made absolute on load (a model or tokenizer only when it is an existing path, not a
preset or factory), so a saved config.toml works from any directory."""
RESUME_AUTO = "auto"
"""resume = "auto": continue the newest checkpoint if there is one, else start quietly."""
NOT_SAVED = ("allow_config_change", "resume")
"""Switches of one invocation, left out of config.toml."""
NOT_COMPARED = (
    "out",
    "steps",
    "resume",
    "allow_config_change",
    "checkpoint_every",
    "checkpoint_async",
    "keep_last",
    "log_every",
    "loggers",
    "peak_tflops",
    "calibrate",
    "eval_every",
    "eval_tokens",
    "loader",
    "sp",
    "ray_address",
    "ray_cpus",
    "data_servers",
    "prefetch_steps",
)
"""Settings a resume may change freely: where and how far to run, and when to checkpoint and evaluate (the
steps run so far do not depend on them, nor on the loader, which draws the same batches; a resume keeps the saved
decay_steps unless it sets one, so a longer --steps does not change the schedule)."""
NEVER_CHANGED = ("model",)
"""Refused on resume even with allow_config_change: the checkpoints hold this model's weights."""
TOPOLOGY = ("pp", "tp", "zero", "expert_layout")
"""How the ranks split the work. A resume may change them without allow_config_change, as it may the number of
ranks: checkpoints hold every tensor by parameter name and global shape and are resharded on load, and the
gradient of a step does not depend on the split (token-level loss over a global batch fixed in tokens)."""


class ConfigError(ValueError):
    """A configuration value, file or path the run cannot use; names the key and what it accepts."""


def _setting(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class TrainConfig:
    """Every setting of a training run (each field's help is the command line's). `model` and `data` are
    required; the rest have defaults."""

    model: str = _setting(
        "",
        "a directory with a Hugging Face config.json (weights loaded if present, else random init), MODULE:FACTORY, "
        "or a preset: " + "; ".join(f"{name} ({about})" for name, (_, about) in MODEL_PRESETS.items()),
    )
    data: str = _setting(
        "",
        "a dataset: the prefix of one from `bytescale-compile data prepare`, Megatron's PREFIX (.bin/.idx), a "
        "`datasets` save_to_disk folder, or Parquet / JSON Lines token files, the last three with their "
        "vocabulary as 'PATH?vocab_size=N' or 'PATH?tokenizer=DIR' (PATH_eval is the held-out split); or "
        "several mixed by token share: A:0.7,B:0.3",
    )
    out: str = _setting("runs/train", "output directory: metrics.jsonl, config.toml, checkpoints/, final/")
    tokenizer: str | None = _setting(None, "tokenizer saved into final/ (default: the one the dataset records)")
    steps: int = _setting(100, "optimizer steps")
    global_tokens: int = _setting(32768, "tokens per optimizer step over all ranks (K/M suffixes allowed)")
    capacity: int | str = _setting(
        4096,
        "tokens per rank per micro-batch, C; auto: the largest C whose predicted peak fits the device's memory "
        "(on a CPU: --memory-budget)",
    )
    memory_budget: int | None = _setting(
        None,
        "bytes a rank may hold (K/M/G suffixes): what --capacity auto fits and every plan is checked against "
        "(default: the GPU's memory; a CPU has none)",
    )
    max_len: int = _setting(8192, "context length: longer sequences are truncated; the static strategy's row")
    strategy: str = _setting(
        BALANCE,
        "HDP plan: balance, naive, static, auto (the fastest candidate under the "
        "cost model, per step), or all (each of them from the same weights on the "
        "same batches, then a comparison: python -m bytescale_compile.train.compare only)",
    )
    dtype: str = _setting(
        "fp32",
        "fp32, or bf16: bf16 weights and autocast forward, fp32 gradient buffer, fp32 main weights and AdamW "
        "moments sharded over the HDP ranks (a distributed optimizer: 6 + 12/N bytes per parameter)",
    )
    grad_reduce_dtype: str = _setting("fp32", "bf16 runs: reduce-scatter the gradients in fp32, or in bf16")
    lr: float = _setting(3e-4, "peak learning rate")
    min_lr_ratio: float = _setting(0.1, "the cosine ends at lr times this")
    warmup: int = _setting(0, "steps of linear warmup")
    decay_steps: int | None = _setting(
        None,
        "step where the cosine reaches lr x min_lr_ratio and stays (default: steps of the first run; a resume "
        "keeps the saved value, so a longer --steps continues at the final learning rate)",
    )
    weight_decay: float = _setting(0.1, "AdamW weight decay on matrices and embeddings (norms, biases: none)")
    beta1: float = _setting(0.9, "AdamW beta1")
    beta2: float = _setting(0.95, "AdamW beta2")
    max_grad_norm: float = _setting(1.0, "gradient clipping norm")
    eval_every: int = _setting(0, "held-out loss every N steps and after the last (0: never)")
    eval_tokens: int | None = _setting(None, "held-out tokens per evaluation (default: global_tokens)")
    checkpoint_every: int = _setting(
        50, "checkpoint every N steps and after the last one, and on SIGTERM or Ctrl-C at the next step (0: never)"
    )
    checkpoint_async: bool = _setting(
        True,
        "write checkpoints from a background thread: a step waits only for the copy of the state to host memory "
        "(which holds one copy of the rank's state meanwhile)",
    )
    keep_last: int = _setting(3, "checkpoints kept: older ones are deleted once a newer one is saved (0: all)")
    resume: bool | str = _setting(
        False,
        "continue from the newest checkpoint in the output directory that verifies (its files match their "
        'sha256 manifest); an error when there is none. --resume=auto (resume = "auto"): continue if there '
        "is one, else start",
    )
    allow_config_change: bool = _setting(
        False,
        "on --resume, accept settings that differ from the output directory's config.toml (each is printed); "
        "the model can never change, and the number of ranks, --pp, --tp and --zero may without it (the "
        "checkpoint is resharded)",
    )
    zero: bool = _setting(
        False, "fp32 runs, ZeRO-1: shard the optimizer state over the ranks (with --pp: over each stage's)"
    )
    pp: int = _setting(
        1,
        "pipeline stages per HDP rank: the job's processes are pp x HDP ranks (stage-major), the "
        "model split at decoder layers, each stage run in 1F1B",
    )
    tp: int = _setting(
        1,
        "tensor parallelism: each HDP rank is a group of tp processes (adjacent ranks, one node) sharding the "
        "model's heads and MLP columns (its Hugging Face base_model_tp_plan); processes = pp x HDP ranks x tp",
    )
    expert_layout: str = _setting(
        "auto",
        "with --tp, how a Mixture-of-Experts model's experts are split over the TP ranks: ep (expert-parallel: each "
        "TP rank holds experts/tp whole experts and computes their share for every token routed to them; tp must "
        "divide the number of experts), tp (every expert split like a dense MLP, its gate/up columns and down rows "
        "over the TP ranks; tp must divide the experts' intermediate size), auto (ep where tp divides the number of "
        "experts, else tp). Either way one all-reduce per layer sums the shares",
    )
    sp: str = _setting(
        DEFAULT_SP,
        "how a sequence shared by D(s) ranks splits them: ring (the zigzag ring), ulysses (an all-to-all over heads "
        "in groups of consecutive ranks inside a node, the ring between the groups), auto (per micro-batch, the "
        "split the cost model predicts fastest)",
    )
    gradient_checkpointing: bool = _setting(
        False,
        "recompute each decoder layer's activations in the backward (Hugging Face's gradient_checkpointing_enable, "
        "non-reentrant); the passes rewrite inside the checkpointed layers as in any other",
    )
    expert_bias_update: float | None = _setting(
        None,
        "MoE models with an expert score bias (DeepSeek-V3's e_score_correction_bias): aux-loss-free balancing, each "
        "step moving every expert's bias by this much towards the mean load of the whole step (default: off)",
    )
    seed: int = _setting(0, "initialisation and batch order")
    cost_model: str | None = _setting(
        None,
        "profiled cost model JSON (`bytescale-compile profile`; default: analytic from the model config, "
        "calibrated in the job)",
    )
    calibrate: bool | None = _setting(
        None,
        "before training, time the model on every rank at once under the job's own load and refit the cost "
        "model's T(s), ring bandwidth and latency to it (saved as calibrated_cost_model.json in --out). "
        "Default: on without --cost-model and --pp; without calibration or a profile, steps on a CPU print no "
        "predicted times",
    )
    log_every: int = _setting(1, "print a step line every N steps (metrics.jsonl and loggers get every step)")
    loggers: str | None = _setting(
        None,
        "comma-separated experiment loggers besides metrics.jsonl: tensorboard, wandb, mlflow (pip install "
        "'bytescale_compile[NAME]'; default: tensorboard when installed)",
    )
    peak_tflops: float | None = _setting(
        None, "the device's peak TFLOP/s for MFU (default: from a table of known GPUs; none on a CPU)"
    )
    loader: str = _setting(
        "local",
        "local: every rank samples and plans each batch itself; ray: data servers, one "
        "scheduler that plans, and ranks that fetch only their micro-batches' tokens, "
        "prefetched (pip install 'bytescale_compile[ray]')",
    )
    ray_address: str | None = _setting(None, "--loader ray: the Ray cluster to join (default: start a local head)")
    ray_cpus: int | None = _setting(None, "--loader ray: CPUs of the local head it starts (default: all)")
    data_servers: int = _setting(2, "--loader ray: data server actors, each owning a contiguous part of --data")
    prefetch_steps: int = _setting(
        2,
        "--loader ray: planned steps the scheduler keeps ready ahead of the ranks, "
        "which fetch one step ahead (0: no prefetching at all)",
    )

    def __post_init__(self) -> None:
        for key in ("model", "data", "out", "tokenizer", "cost_model", "ray_address", "loggers"):
            if getattr(self, key) is not None and not isinstance(getattr(self, key), str):
                raise ConfigError(f"{key} must be a string, got {getattr(self, key)!r}")
        for key in ("model", "data", "out"):
            if not getattr(self, key):
                raise ConfigError(f"{key} is required: pass --{key.replace('_', '-')} or set {key} in the config file")
        _check_choice("strategy", self.strategy, (*RUNTIME_STRATEGIES, ALL_STRATEGIES))
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("grad_reduce_dtype", self.grad_reduce_dtype, DTYPES)
        if self.dtype == "bf16" and self.zero:
            raise ConfigError(
                "zero: bf16 runs always shard the optimizer state (the distributed optimizer); drop --zero"
            )
        if self.grad_reduce_dtype == "bf16" and self.dtype != "bf16":
            raise ConfigError("grad_reduce_dtype bf16 needs dtype bf16: fp32 runs all-reduce their fp32 gradients")
        if self.capacity != CAPACITY_AUTO:
            _check_int("capacity", self.capacity, 1)
        if self.memory_budget is not None:
            _check_int("memory_budget", self.memory_budget, 1)
        _check_choice("loader", self.loader, LOADERS)
        _check_choice("sp", self.sp, SP_MODES)
        _check_choice("expert_layout", self.expert_layout, EXPERT_LAYOUTS)
        for key in ("steps", "global_tokens", "pp", "tp"):
            _check_int(key, getattr(self, key), 1)
        _check_int("max_len", self.max_len, 2)
        for key in ("warmup", "eval_every", "checkpoint_every", "keep_last", "seed", "prefetch_steps"):
            _check_int(key, getattr(self, key), 0)
        _check_int("data_servers", self.data_servers, 1)
        _check_int("log_every", self.log_every, 1)
        for key in ("decay_steps", "eval_tokens", "ray_cpus"):
            if getattr(self, key) is not None:
                _check_int(key, getattr(self, key), 1)
        if self.warmup >= self.schedule_steps:
            raise ConfigError(
                f"warmup ({self.warmup}) must be below decay_steps ({self.schedule_steps}), "
                f"so that the cosine has steps to decay over"
            )
        _check_float("lr", self.lr, 0.0, math.inf, low_open=True)
        _check_float("min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        _check_float("weight_decay", self.weight_decay, 0.0, math.inf)
        _check_float("beta1", self.beta1, 0.0, 1.0, high_open=True)
        _check_float("beta2", self.beta2, 0.0, 1.0, high_open=True)
        _check_float("max_grad_norm", self.max_grad_norm, 0.0, math.inf, low_open=True)
        if self.peak_tflops is not None:
            _check_float("peak_tflops", self.peak_tflops, 0.0, math.inf, low_open=True)
        if self.expert_bias_update is not None:
            _check_float("expert_bias_update", self.expert_bias_update, 0.0, math.inf, low_open=True)
        for key in ("allow_config_change", "zero", "gradient_checkpointing"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{key} must be true or false, got {getattr(self, key)!r}")
        if self.calibrate is not None and not isinstance(self.calibrate, bool):
            raise ConfigError(f"calibrate must be true or false, got {self.calibrate!r}")
        if not isinstance(self.resume, bool) and self.resume != RESUME_AUTO:
            raise ConfigError(f'resume must be true, false or "{RESUME_AUTO}", got {self.resume!r}')

    @property
    def capacity_tokens(self) -> int:
        """C in tokens: as set, or once the trainer has resolved "auto" (`trainer.run`) from the memory model."""
        if isinstance(self.capacity, str):
            raise ConfigError('capacity "auto" is resolved by the trainer from the compiled model; none yet')
        return self.capacity

    @property
    def schedule_steps(self) -> int:
        return self.decay_steps if self.decay_steps is not None else self.steps

    @property
    def calibrates(self) -> bool:
        """Whether the job refits the cost model: as set, else when no profile is given and the whole model runs
        on each device (calibration times the whole model, which a pipeline's device may not hold)."""
        if self.calibrate is not None:
            return self.calibrate
        return self.cost_model is None and self.pp == 1

    @property
    def strategies(self) -> tuple[str, ...]:
        return RUNTIME_STRATEGIES if self.strategy == ALL_STRATEGIES else (self.strategy,)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check_choice(key: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key} must be one of {list(choices)}, got {value!r}")


def _check_int(key: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{key} must be an integer >= {low}, got {value!r}")


def _check_float(
    key: str, value: object, low: float, high: float, low_open: bool = False, high_open: bool = False
) -> None:
    if not (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (value > low if low_open else value >= low)
        and (value < high if high_open else value <= high)
    ):
        if high == math.inf:
            bounds = f"{'>' if low_open else '>='} {low}"
        else:
            bounds = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ConfigError(f"{key} must be a finite number {bounds}, got {value!r}")


def load_config(path: str | Path | None = None, **overrides: Any) -> TrainConfig:
    """The config file at `path` (if any) with `overrides` (None: not given) applied on top, validated, every path
    absolute."""
    return absolute_data(read_config(path, **overrides))


def absolute_data(config: TrainConfig) -> TrainConfig:
    """`config` with --data's paths absolute, which parses the spec with the data package (it loads torch)."""
    return dataclasses.replace(config, data=_absolute("data", config.data))


def read_config(path: str | Path | None = None, **overrides: Any) -> TrainConfig:
    """`load_config` before --data is made absolute: every setting checked without loading torch, so that a
    mistake is reported at once."""
    values = _read_toml(Path(path)) if path is not None else {}
    values.update({key: value for key, value in overrides.items() if value is not None})
    known = {f.name for f in fields(TrainConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        where = f" in {path}" if path is not None else ""
        raise ConfigError(f"unknown setting(s) {unknown}{where}; known: {sorted(known)}")
    for key in SIZES:
        if isinstance(values.get(key), str) and not (key == "capacity" and values[key] == CAPACITY_AUTO):
            values[key] = _size(key, values[key])
    for key in PATHS:
        if key != "data" and isinstance(values.get(key), str) and values[key]:
            values[key] = _absolute(key, values[key])
    return TrainConfig(**values)


def _absolute(key: str, value: str) -> str:
    """`value` with its paths made absolute against the working directory: each prefix of --data, and a model or
    tokenizer only when it exists as a path (else it is a preset, MODULE:FACTORY or a hub name)."""
    if key == "data":
        try:
            parts = parse_data_spec(value)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        return format_data_spec([(os.path.abspath(prefix), weight) for prefix, weight in parts])
    if key in ("model", "tokenizer") and (value in MODEL_PRESETS or not Path(value).exists()):
        return value
    return os.path.abspath(value)


def _size(key: str, text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from e


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError as e:
        raise ConfigError(f"reading {path} needs Python >= 3.11 (tomllib); pass the settings as options instead") from e
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        values = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from e
    tables = sorted(k for k, v in values.items() if isinstance(v, dict))
    if tables:
        raise ConfigError(f"{path}: tables {tables} are not used: settings are top-level keys (e.g. lr = 3e-4)")
    return values


def to_toml(config: TrainConfig) -> str:
    """The configuration as a flat TOML table that `load_config` reads back (None is left out; decay_steps is
    written resolved, so that a resume with a longer --steps keeps the schedule)."""
    lines = ["# resolved by python -m bytescale_compile.train"]
    for key, value in {**config.to_dict(), "decay_steps": config.schedule_steps}.items():
        if value is not None and key not in NOT_SAVED:
            lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def config_changes(saved: TrainConfig, now: TrainConfig) -> dict[str, tuple[Any, Any]]:
    """{setting: (saved, now)} for every setting a resume compares (see NOT_COMPARED)."""

    def view(config: TrainConfig) -> dict[str, Any]:
        values = {k: v for k, v in config.to_dict().items() if k not in NOT_COMPARED}
        return {**values, "decay_steps": config.schedule_steps}

    before, after = view(saved), view(now)
    return {key: (before[key], after[key]) for key in before if before[key] != after[key]}


def check_resume_config(saved: TrainConfig, now: TrainConfig, source: str | Path) -> list[str]:
    """The differences between the config `source` saved and this resume's, one `key: saved -> now` line each.

    Raises `ConfigError` listing them unless `now.allow_config_change`, or every one is of TOPOLOGY (marked as
    such); a change of NEVER_CHANGED always."""
    changes = config_changes(saved, now)
    lines = [
        f"{key}: {before!r} -> {after!r}{' (topology: the checkpoint is resharded)' if key in TOPOLOGY else ''}"
        for key, (before, after) in changes.items()
    ]
    never = [line for key, line in zip(changes, lines) if key in NEVER_CHANGED]
    refused = [key for key in changes if key not in TOPOLOGY]
    listed = "".join(f"\n  {line}" for line in lines)
    if never:
        raise ConfigError(
            f"--resume cannot change {', '.join(never)} (saved in {source}): the checkpoints hold that "
            f"model's weights; resume with it, or start a new run in another --out. All differences:"
            f"{listed}"
        )
    if refused and not now.allow_config_change:
        raise ConfigError(
            f"--resume with settings that differ from {source}:{listed}\nresume with the saved "
            "settings, pass --allow-config-change to accept the change, or start a new run in another "
            "--out"
        )
    return lines


def _toml_value(value: bool | int | float | str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    return json.dumps(value, ensure_ascii=False)  # a JSON string is a TOML basic string


def check_one_strategy(config: TrainConfig) -> None:
    """The trainer trains one strategy; every strategy from the same weights is the comparison's entry point."""
    if config.strategy == ALL_STRATEGIES:
        raise ConfigError(
            f"strategy = {ALL_STRATEGIES} retrains every strategy from the same weights to compare them, which the "
            "trainer does not: run `torchrun --nproc_per_node=N -m bytescale_compile.train.compare` with the same "
            f"options for that, or give one of {', '.join(RUNTIME_STRATEGIES)}"
        )


def check_processes(config: TrainConfig, world_size: int, *, launcher: bool = False) -> None:
    """The job's processes (torchrun's WORLD_SIZE, --nproc-per-node's N; 1 without either) are pp x HDP ranks x
    tp: checked before any rank loads a weight. `launcher`: N came from --nproc-per-node, which the fix names."""
    group = config.pp * config.tp
    if world_size % group:
        what = " and ".join(f"{name} = {size}" for name, size in (("pp", config.pp), ("tp", config.tp)) if size > 1)
        flag = "--nproc-per-node" if launcher else "torchrun --nproc_per_node"
        raise ConfigError(
            f"{what} needs a multiple of {group} processes (pp x HDP ranks x tp), but the job has {world_size}: "
            f"run {flag} with a multiple of {group}"
        )
