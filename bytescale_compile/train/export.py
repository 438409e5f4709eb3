"""A training checkpoint as a Hugging Face model directory (`bytescale-compile export`).

A run writes `final/` only when it ends; a checkpoint (`checkpoint.py`) is there for every
`--checkpoint-every` steps, also of a run still going or cut short. Exporting one verifies its sha256
manifest, rebuilds the run's model from the config the checkpoint saved, reads only the model's tensors in
one process (pipeline stages and ZeRO ranks save them under the whole model's names, so no optimizer and no
process group are needed) and writes `save_pretrained` output in fp32 with the tokenizer the run's data was
prepared with, as `final/` has them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from ..data import DatasetError, LoadedTokenizer, TokenizerError, TokenizerInfo, load_tokenizer, open_data
from .checkpoint import (
    COMPLETE_MARKER,
    MANIFEST_FILE,
    TRAIN_STATE_FILE,
    CheckpointError,
    SkippedCheckpoint,
    load_model_weights,
    select_checkpoint,
    verify_checkpoint,
)
from .inputs import CHECKPOINTS_DIR
from .models import ModelSourceError, load_model

__all__ = ["ExportError", "ExportResult", "export_checkpoint"]


class ExportError(ValueError):
    """A checkpoint that cannot be exported, or an output directory that cannot be written; says what to pass."""


@dataclass(frozen=True)
class ExportResult:
    """What `export_checkpoint` wrote, and from where."""

    step: int
    checkpoint: Path
    out: Path
    model: str
    """The run's model directory, whose config the weights were loaded into."""
    tokenizer: Path | None
    """Saved beside the weights; None for byte-level data."""
    skipped: tuple[SkippedCheckpoint, ...] = ()
    """Newer checkpoints of a run directory passed over because they do not verify."""

    def summary(self) -> str:
        lines = [f"skipped {s.path}: {s.reason}" for s in self.skipped]
        tokenizer = f"the tokenizer of {self.tokenizer}" if self.tokenizer else "no tokenizer (byte-level data)"
        lines.append(f"exported step {self.step} from {self.checkpoint} to {self.out}:")
        lines.append(f"  fp32 weights in the config of {self.model}, and {tokenizer}")
        lines.append(f'  load with AutoModelForCausalLM.from_pretrained("{self.out}")')
        return "\n".join(lines)


def export_checkpoint(
    path: str | Path, out: str | Path, tokenizer: str | Path | None = None, overwrite: bool = False
) -> ExportResult:
    """Write the model of the checkpoint at `path` to `out` with `save_pretrained` (fp32) and a tokenizer.

    `path` is a checkpoint directory (`RUN/checkpoints/step_N`) or a run's output directory, whose newest
    checkpoint that verifies is taken. `tokenizer` overrides the run's (its `tokenizer` setting, else the one
    its data records, checked unchanged since). `out` must not be a file, nor a directory with files in it
    unless `overwrite`. Everything is checked before anything is written; `ExportError` names what to fix.
    """
    out = _check_out(Path(out), overwrite)
    checkpoint, skipped = _find_checkpoint(Path(path))
    step, config = _train_state(checkpoint)
    bases = _config_dirs(checkpoint)
    model, spec = _hf_model(config, bases, checkpoint)
    vocab_size = model.config.vocab_size
    loaded = _tokenizer(config, tokenizer, bases, vocab_size)
    _load_weights(checkpoint, model, spec)
    try:
        model.save_pretrained(out)
        if loaded is not None:
            loaded.tokenizer.save_pretrained(out)
    except OSError as e:
        raise ExportError(f"cannot write the export to {out}: {e}") from e
    return ExportResult(step, checkpoint, out, spec, Path(loaded.info.name_or_path) if loaded else None, skipped)


def _check_out(out: Path, overwrite: bool) -> Path:
    """Refuse a file, and a directory with files in it unless `overwrite`, before any work."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file: give the directory to write the model to")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ExportError(
            f"--out {out} exists and is not empty: pass another directory, or overwrite (--overwrite) to write "
            "into it (files of the same names are replaced)"
        )
    return out


def _find_checkpoint(path: Path) -> tuple[Path, tuple[SkippedCheckpoint, ...]]:
    """`path` itself when it is a checkpoint, verified; else the newest checkpoint of the run at `path`."""
    if not path.is_dir():
        raise ExportError(f"{path} does not exist: give a checkpoint directory (RUN/{CHECKPOINTS_DIR}/step_N) or a run")
    marks = (COMPLETE_MARKER, MANIFEST_FILE, TRAIN_STATE_FILE)
    if path.name.startswith("step_") or any((path / name).exists() for name in marks):
        try:
            verify_checkpoint(path)
        except CheckpointError as e:
            raise ExportError(f"{e}; export another checkpoint of the run") from e
        return path, ()
    if (path / CHECKPOINTS_DIR).is_dir():
        try:
            choice = select_checkpoint(path / CHECKPOINTS_DIR)
        except CheckpointError as e:
            raise ExportError(str(e)) from e
        if choice.path is None:
            raise ExportError(
                f"{path / CHECKPOINTS_DIR} holds no checkpoint (a run saves them with --checkpoint-every N)"
            )
        return choice.path, choice.skipped
    runs = sorted(child.name for child in path.iterdir() if (child / CHECKPOINTS_DIR).is_dir())
    if runs:
        raise ExportError(f"{path} holds runs ({', '.join(runs)}), not checkpoints: give one, e.g. {path / runs[0]}")
    raise ExportError(
        f"{path} is neither a checkpoint directory (RUN/{CHECKPOINTS_DIR}/step_N) nor a run's output directory "
        f"(holding {CHECKPOINTS_DIR}/)"
    )


def _train_state(checkpoint: Path) -> tuple[int, dict[str, Any]]:
    """The step and the run's config, as the checkpoint saved them (the settings that made these weights, also
    after a resume changed config.toml, and beside a `--strategy all` run's per-strategy directories)."""
    try:
        state = json.loads((checkpoint / TRAIN_STATE_FILE).read_text(encoding="utf-8"))
        step, config = state["step"], state["config"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ExportError(f"{checkpoint / TRAIN_STATE_FILE} holds no step and run config ({e!r})") from e
    if not isinstance(step, int) or not isinstance(config, dict) or not isinstance(config.get("model"), str):
        raise ExportError(f"{checkpoint / TRAIN_STATE_FILE}: the step is not an integer or the config names no model")
    return step, config


def _config_dirs(checkpoint: Path) -> list[Path]:
    """Where a relative path of an older run's config may be relative to: the run directory, then each one
    above it (a run started as `--out runs/NAME` from a project root has its paths relative to that root)."""
    run = checkpoint.resolve().parent.parent
    return [run, *run.parents]


def _resolve(value: str, bases: Sequence[Path], suffix: str = "") -> str:
    """`value` as given when it exists (absolute, or relative to the working directory), else relative to the
    first of `bases` where it exists, else unchanged (a preset, MODULE:FACTORY, a mixture of datasets or a
    moved path: the caller reports it). A dataset prefix exists as its metadata file, `suffix` ".json"."""
    if Path(value + suffix).exists():
        return value
    return next((str(base / value) for base in bases if Path(str(base / value) + suffix).exists()), value)


def _hf_model(config: dict[str, Any], bases: Sequence[Path], checkpoint: Path) -> tuple[Any, str]:
    """The run's model, rebuilt from its Hugging Face directory (the weights are overwritten by the checkpoint's)."""
    spec = _resolve(config["model"], bases)
    try:
        loaded = load_model(spec, int(config.get("seed", 0)))
    except ModelSourceError as e:
        where = ", ".join(str(base) for base in ("the working directory", *bases))
        raise ExportError(f"the model of the run that saved {checkpoint}: {e} (looked in {where})") from e
    if loaded.hf_directory is None:
        raise ExportError(
            f"the run that saved {checkpoint} trained model {config['model']!r}, a preset or MODULE:FACTORY: "
            "export writes a Hugging Face directory (save_pretrained), which needs a run whose --model was a "
            "directory with a Hugging Face config.json"
        )
    return loaded.module, spec


def _tokenizer(
    config: dict[str, Any], given: str | Path | None, bases: Sequence[Path], vocab_size: int
) -> LoadedTokenizer | None:
    """`given`, else the run's `tokenizer` setting (the trainer checked it against the data), else the one the
    run's data records, which must still be the tokenizer the data was prepared with."""
    recorded = None
    if given is None and config.get("tokenizer"):
        given = _resolve(config["tokenizer"], bases)
    if given is None:
        recorded = _recorded_tokenizer(config, bases)
        if recorded is None:
            return None
        given = recorded.name_or_path
    try:
        loaded = load_tokenizer(given)
    except TokenizerError as e:
        raise ExportError(f"{e}: pass tokenizer (--tokenizer DIR), the one the run's data was prepared with") from e
    if recorded is not None and loaded.info.sha256 != recorded.sha256:
        raise ExportError(
            f"tokenizer {given} changed since the run's data was prepared with it (sha256 {recorded.sha256[:12]}..., "
            f"now {loaded.info.sha256[:12]}...): pass tokenizer (--tokenizer DIR) with the one it was prepared with"
        )
    if loaded.vocab_size > vocab_size:
        raise ExportError(f"tokenizer {given} has {loaded.vocab_size} tokens, more than the model's {vocab_size}")
    return loaded


def _recorded_tokenizer(config: dict[str, Any], bases: Sequence[Path]) -> TokenizerInfo | None:
    """The tokenizer the run's data (one dataset, or a mixture of datasets made alike) records."""
    data = _resolve(str(config.get("data", "")), bases, suffix=".json")
    try:
        return open_data(data)[0].tokenizer
    except (OSError, DatasetError) as e:
        raise ExportError(
            f"cannot read which tokenizer the run's data {data!r} was prepared with ({e}): pass tokenizer "
            "(--tokenizer DIR)"
        ) from e


def _load_weights(checkpoint: Path, model: nn.Module, spec: str) -> None:
    try:
        load_model_weights(checkpoint, model)
    except CheckpointError as e:
        raise ExportError(f"{e} (model {spec}: was its config.json changed after the run?)") from e
