"""`setup`: everything a training run needs, checked before any step or communication (the datasets, the model,
the vocabulary, the tokenizer for final/, the cost model, the output directory), so a bad setting fails on every rank
at once with a message that names it. It returns the `RunInputs` that `prepared.prepare` and the `Trainer` take."""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import torch.distributed as dist

from ..capture.tensor_parallel import TensorParallelError
from ..capture.tp_plan import check_tensor_parallel
from ..data import (
    GlobalBatch,
    GlobalBatchSampler,
    LoadedTokenizer,
    MixedDataset,
    MixtureSampler,
    TokenDataset,
    TokenizerError,
    TokenizerInfo,
    eval_batches,
    eval_spec,
    load_tokenizer,
    open_data,
)
from ..engine.routing import RouterTraining
from ..engine.runtime import default_cost_model
from ..engine.stages import UnsupportedModelError, split_stages
from ..planner import CostModel, ModelShape
from ..planner.model_shape import ModelConfigError, model_shape
from ..strategies import ExpertLayout
from .checkpoint import (
    latest_checkpoint,
)
from .config import (
    ALL_STRATEGIES,
    RESUME_AUTO,
    ConfigError,
    TrainConfig,
    check_one_strategy,
    check_processes,
    check_resume_config,
    load_config,
)
from .metrics import LoggerError, check_loggers
from .models import LoadedModel, enable_gradient_checkpointing, load_model
from .preflight import check_token_ids
from .remote import check_ray

__all__ = [
    "CALIBRATED_COST_MODEL",
    "CHECKPOINTS_DIR",
    "CONFIG_FILE",
    "FINAL_DIR",
    "GlobalTokensWarning",
    "RunInputs",
    "TrainData",
    "VocabularyError",
    "is_rank0",
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


def run_dir(config: TrainConfig, strategy: str) -> Path:
    """`out`, or `out/<strategy>` when every strategy runs."""
    out = Path(config.out)
    return out / strategy if config.strategy == ALL_STRATEGIES else out


def setup(config: TrainConfig, *, every_strategy: bool = False) -> RunInputs:
    """Open and check the datasets, build the model, resolve the tokenizer and the cost model. strategy = all
    is refused unless `every_strategy` (the comparison's entry point, `compare.py`)."""
    if not every_strategy:
        check_one_strategy(config)
    check_processes(config, int(os.environ.get("WORLD_SIZE", "1")))  # before any file is read
    _check_out(Path(config.out))
    train_data, weights = _open_dataset(
        config.data, "--data", "make it with `bytescale-compile data prepare --input ... --tokenizer DIR --out PREFIX`"
    )
    _warn_short_global_batch(config, train_data.lengths)
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
    if config.pp > 1:
        _check_pipeline(config.pp, model)
    if config.tp > 1:
        _check_tensor_parallel(config.tp, model, config.expert_layout)
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


class GlobalTokensWarning(UserWarning):
    """--global-tokens is below the longest sequence: steps train more tokens than it says."""


def _warn_short_global_batch(config: TrainConfig, lengths: np.ndarray) -> None:
    """Warn once when a step would train more than --global-tokens: a batch takes whole sequences (never a
    part of one) until it holds global_tokens, so a global_tokens below the longest sequence is not the step's
    size. The figures are of the data as truncated to max_len."""
    if not len(lengths):
        return
    used = np.minimum(lengths, config.max_len)
    longest = int(used.max())
    if config.global_tokens >= longest:
        return
    warnings.warn(
        f"--global-tokens {config.global_tokens:,} is below the longest sequence ({longest:,} tokens at max_len "
        f"{config.max_len:,}): a step takes whole sequences until it holds {config.global_tokens:,} tokens, so "
        f"steps train up to {longest:,} tokens (the mean sequence has {float(used.mean()):,.0f}); pass "
        f"--global-tokens {longest:,} or more for steps of the size you set",
        GlobalTokensWarning,
        stacklevel=2,
    )


def _check_pipeline(pp: int, model: LoadedModel) -> None:
    """The model splits into pipelines of `pp` stages."""
    try:
        split_stages(model.module, pp)
    except (UnsupportedModelError, ValueError) as e:
        raise ConfigError(f"pp = {pp}: model {model.spec} cannot be split into pipeline stages: {e}") from e


def _check_tensor_parallel(tp: int, model: LoadedModel, expert_layout: str) -> None:
    """The model has a tensor-parallel plan that splits its heads, and its experts in `expert_layout`, evenly over
    `tp`."""
    try:
        check_tensor_parallel(model.module, tp, expert_layout=cast(ExpertLayout, expert_layout))
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


def is_rank0() -> bool:
    """Whether this process prints and writes for the job: rank 0, or the only process."""
    return not dist.is_initialized() or dist.get_rank() == 0
