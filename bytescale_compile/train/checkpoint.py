"""Training checkpoints with `torch.distributed.checkpoint` (DCP): model, optimizer and a small train state.

Layout of one checkpoint:

    <root>/step_00000042/
        .metadata            DCP metadata (written by the coordinator, rank 0)
        __<rank>_0.distcp    DCP data files (a tensor several ranks hold alike is written once)
        train_state.json     the caller's JSON-able dict (sampler state, step, seeds, run config), rank 0
        MANIFEST.json        format version, the layout the ranks held the state in (world size, pipeline
                             stages, ZeRO) and the size and sha256 of every file above, rank 0
        COMPLETE             the commit marker: a directory without it is not a checkpoint

Saving is atomic: every rank writes into `<root>/step_<step>.tmp/`; after a barrier rank 0 writes
`train_state.json`, the manifest and the `COMPLETE` marker there, then renames the directory to its final
name (one `rename`, so the final name only ever exists complete). A crash mid-save leaves a `.tmp` directory
that `latest_checkpoint` ignores, so the previous checkpoint stays the latest; `remove_stale_tmp` deletes it.

Loading verifies the manifest first (rank 0 hashes, every rank gets the verdict), so a truncated, missing or
overwritten shard is an error naming the file instead of silently different weights. `resume_latest` takes
the newest checkpoint that verifies and reports each newer one it skipped and why.

DCP saves one `Stateful`, the model and its optimizer (`_AppState` under "app"), through DCP's own
`get_state_dict`/`set_state_dict` with the optimizer state flattened per parameter: the keys are
`app.model.<param>`, `app.optim.state.<param>.<exp_avg|exp_avg_sq|step>` and
`app.optim.param_groups.<param>.<lr|betas|...>`, where `<param>` is always the whole model's name:

- a pipeline stage (`train/stages.py`) numbers its layers from 0, so its names go through `full_model_name`
  and no two stages' names collide;
- a ZeRO-1 `ZeroRedundancyOptimizer` holds its rank's parameters' state only: DCP's helpers run on its local
  optimizer, so each rank writes the state of its own parameters and nothing is gathered (with tensor
  parallelism, DTensors of its TP shards).

Tensors several ranks hold alike (the model, a replicated optimizer) are written once. The names do not
depend on how the ranks split the state, but a resume still needs the layout it was saved with (resharding
is not implemented): another world size, pp_size or ZeRO setting is refused naming both. Checkpoints of the
older format (per-shard keys, manifest version 1) do not verify and say so. Everything also works without
`torch.distributed` initialised (one process). The root directory must be on a file system every rank sees
(one machine, or a shared mount).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.optim import ZeroRedundancyOptimizer

from .dist_optim import DistributedOptimizer
from .mesh import tp_size_of
from .stages import full_model_name, stage_spec

__all__ = [
    "COMPLETE_MARKER",
    "MANIFEST_FILE",
    "TRAIN_STATE_FILE",
    "CheckpointChoice",
    "CheckpointError",
    "Resumed",
    "SkippedCheckpoint",
    "checkpoint_dir",
    "latest_checkpoint",
    "load_checkpoint",
    "load_model_weights",
    "prune_checkpoints",
    "remove_stale_tmp",
    "resume_latest",
    "save_checkpoint",
    "select_checkpoint",
    "verify_checkpoint",
]

logger = logging.getLogger(__name__)

Optimizer = torch.optim.Optimizer | DistributedOptimizer
"""What a checkpoint holds the state of: a torch optimizer (or ZeRO-1's), or the distributed optimizer."""

COMPLETE_MARKER = "COMPLETE"
TRAIN_STATE_FILE = "train_state.json"
MANIFEST_FILE = "MANIFEST.json"
_MANIFEST_VERSION = 2
"""Format 2: optimizer state by parameter name (DCP's flattened state dicts) and the layout in the manifest."""
_APP = "app"
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_DCP_METADATA = ".metadata"
_PREFIX = "step_"
_TMP_SUFFIX = ".tmp"


class CheckpointError(RuntimeError):
    """A checkpoint directory that is corrupt or incomplete (the message names it and what is missing)."""


@dataclass(frozen=True)
class SkippedCheckpoint:
    """A checkpoint directory passed over on resume, and why."""

    path: Path
    reason: str


@dataclass(frozen=True)
class CheckpointChoice:
    """The newest checkpoint that verifies (None: there are none at all) and the newer ones skipped."""

    path: Path | None
    skipped: tuple[SkippedCheckpoint, ...]


@dataclass(frozen=True)
class Resumed:
    """What `resume_latest` restored."""

    path: Path
    train_state: dict[str, Any]
    skipped: tuple[SkippedCheckpoint, ...]


def checkpoint_dir(root: str | Path, step: int) -> Path:
    """The final directory of the checkpoint of `step` under `root`: `<root>/step_<step:08d>`."""
    return Path(root) / f"{_PREFIX}{step:08d}"


# -- distributed helpers --------------------------------------------------------------------------------


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _on_rank0(what: str, fn: Any) -> Any:
    """Run `fn()` on rank 0 and share its outcome, so a failure raises on every rank instead of hanging them."""
    result: Any = None
    error: str | None = None
    if _rank() == 0:
        try:
            result = fn()
        except Exception as e:
            if not _distributed():
                raise
            error = f"{what} failed on rank 0: {type(e).__name__}: {e}"
    if _distributed():
        box = [(result, error)]
        dist.broadcast_object_list(box, src=0)
        result, error = box[0]
        if error is not None:
            raise CheckpointError(error)
    return result


@contextmanager
def _quiet_single_process() -> Iterator[None]:
    """Without a process group DCP runs in one process (what we want) but warns on every call."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is .*uninitialized", category=UserWarning)
        yield


def _model_for_dcp(model: nn.Module) -> nn.Module:
    """`get_state_dict` on the plain model: an `OptimizedModule` shares its dicts, so the FQNs are equal."""
    return getattr(model, "original_module", model)


@dataclass(frozen=True)
class _Layout:
    """How the ranks hold the model and optimizer state; a resume needs the one it was saved with."""

    world_size: int
    pp_size: int
    zero: bool
    distributed: bool = False
    """The distributed optimizer's shards (bf16 weights, fp32 main weights sharded)."""
    tp_size: int = 1
    """Ranks of a TP group (DTensor parameters)."""

    @classmethod
    def of(cls, model: nn.Module, optimizer: Optimizer) -> _Layout:
        spec = stage_spec(model)
        return cls(
            _world_size(),
            spec.pp_size if spec is not None else 1,
            isinstance(optimizer, ZeroRedundancyOptimizer),
            isinstance(optimizer, DistributedOptimizer),
            tp_size_of(model),
        )

    def describe(self) -> str:
        if self.distributed or self.zero:
            kind = "distributed-optimizer shards (bf16 weights)" if self.distributed else "ZeRO optimizer shards"
            stages = f" in each of {self.pp_size} pipeline stages" if self.pp_size > 1 else ""
            tp = f" at each of {self.tp_size} TP indices" if self.tp_size > 1 else ""
            return f"{kind} over {self.world_size // (self.pp_size * self.tp_size)} rank(s){stages}{tp}"
        if self.pp_size > 1:
            return f"the optimizer states of {self.pp_size} pipeline stages"
        return "a replicated optimizer state"


@contextmanager
def _named_groups_only(optimizer: Optimizer) -> Iterator[None]:
    """Hide the parameter groups without parameters from DCP's helpers: the flattened state names a group's
    hyperparameters by its parameters, so it can neither save nor restore an empty group (a ZeRO rank's
    share of a small group may be empty)."""
    groups = optimizer.param_groups
    optimizer.param_groups = [group for group in groups if group["params"]]
    try:
        yield
    finally:  # `load_state_dict` replaces the groups it was shown
        shown = iter(optimizer.param_groups)
        optimizer.param_groups = [next(shown) if group["params"] else group for group in groups]


def _sync_hyperparameters(zero: ZeroRedundancyOptimizer, to_local: bool) -> None:
    """Copy the ZeRO wrapper's hyperparameters (what a schedule sets) to its local optimizer, as its `step`
    does first, or back after a load. This rank saves no group it holds no parameter of, so the wrapper keeps
    its own values there: they reach no parameter on this rank."""
    for group, local in zip(zero.param_groups, zero.optim.param_groups):
        keys = [key for key in group if key != "params"]
        if to_local:
            local.update({key: group[key] for key in keys})
        elif local["params"]:
            group.update({key: local[key] for key in keys})


class _AppState(Stateful):
    """The model and optimizer as DCP saves and loads them: DCP's state dicts (optimizer state per parameter)
    under the whole model's names. A ZeRO optimizer contributes its local optimizer, this rank's parameters."""

    def __init__(self, model: nn.Module, optimizer: Optimizer) -> None:
        self.model = _model_for_dcp(model)
        self.sharded = optimizer if isinstance(optimizer, DistributedOptimizer) else None
        self.zero = optimizer if isinstance(optimizer, ZeroRedundancyOptimizer) else None
        self.local = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
        """The torch optimizer DCP's helpers read (unused with the distributed optimizer)."""
        self.spec = stage_spec(self.model)
        self.layout = _Layout.of(self.model, optimizer)

    def _local_state(self) -> dict[str, dict[str, Any]]:
        """DCP's state dicts under this module's names (a stage's layers from 0). `get_state_dict`
        initialises an optimizer that never stepped (a zero-lr step), so there are tensors to load into.
        The distributed optimizer gives its fp32 main weights in place of the bf16 parameters (under every name
        a tied parameter has), beside the model's buffers."""
        if self.sharded is not None:
            state = self.sharded.state_dict()
            mains = dict(zip(self.sharded.names, state["model"].values()))
            names = {id(p): name for name, p in zip(self.sharded.names, self.sharded.params)}
            aliases = {
                alias: names[id(p)]
                for alias, p in self.model.named_parameters(remove_duplicate=False)
                if id(p) in names
            }
            buffers = {k: v for k, v in get_model_state_dict(self.model).items() if k not in aliases}
            return {
                "model": {**buffers, **{alias: mains[name] for alias, name in aliases.items()}},
                "optim": state["optim"],
            }
        assert isinstance(self.local, torch.optim.Optimizer)
        with _named_groups_only(self.local):
            model_state, optim_state = get_state_dict(self.model, self.local, options=_OPTIONS)
        return {"model": model_state, "optim": optim_state}

    def _saved_name(self, part: str, key: str) -> str:
        """The whole model's name of a key; an optimizer key reads `<state|param_groups>.<param>.<what>`."""
        if self.spec is None:
            return key
        if part == "model":
            return full_model_name(self.spec, key)
        section, rest = key.split(".", 1)
        return f"{section}.{full_model_name(self.spec, rest)}"

    def state_dict(self) -> dict[str, Any]:
        if self.zero is not None:
            _sync_hyperparameters(self.zero, to_local=True)
        return {
            part: {self._saved_name(part, key): value for key, value in state.items()}
            for part, state in self._local_state().items()
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        local = {
            part: {self._saved_name(part, key): key for key in state} for part, state in self._local_state().items()
        }
        model_state, optim_state = (
            {local[part][key]: value for key, value in state_dict[part].items()} for part in ("model", "optim")
        )
        if self.sharded is not None:  # DCP read the main weights and moments in place
            buffers = {k: v for k, v in model_state.items() if not isinstance(v, ShardedTensor)}
            self.model.load_state_dict(buffers, strict=False)
            self.sharded.load_state_dict({"optim": optim_state})
            return
        assert isinstance(self.local, torch.optim.Optimizer)
        with _named_groups_only(self.local):
            set_state_dict(
                self.model, self.local, model_state_dict=model_state, optim_state_dict=optim_state, options=_OPTIONS
            )
        if self.zero is not None:
            _sync_hyperparameters(self.zero, to_local=False)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_file(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


# -- manifest -------------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _write_manifest(directory: Path, layout: _Layout) -> None:
    """Record every file's size and sha256 (all ranks' shards: the caller saw them all written) and the
    layout; the manifest and the COMPLETE marker themselves are not listed."""
    files = {
        f.relative_to(directory).as_posix(): {"size": f.stat().st_size, "sha256": _sha256(f)}
        for f in sorted(directory.rglob("*"))
        if f.is_file() and f.name not in (MANIFEST_FILE, COMPLETE_MARKER)
    }
    manifest = {"version": _MANIFEST_VERSION, **asdict(layout), "files": files}
    _write_file(directory / MANIFEST_FILE, json.dumps(manifest, indent=2, sort_keys=True))


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise CheckpointError(
            f"checkpoint directory {path}: manifest {MANIFEST_FILE} missing (saved by an older "
            "version, or damaged): its files cannot be verified"
        ) from e
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint directory {path}: unreadable {MANIFEST_FILE}: {e}") from e
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"checkpoint directory {path}: {MANIFEST_FILE} lists no files")
    if manifest.get("version") != _MANIFEST_VERSION:
        raise CheckpointError(
            f"checkpoint directory {path} is in checkpoint format {manifest.get('version')}, this "
            f"version reads format {_MANIFEST_VERSION} only (optimizer state by parameter name): "
            "continue that run with the version that saved it, or start a new run in another --out"
        )
    return manifest


def verify_checkpoint(path: str | Path) -> None:
    """Raise `CheckpointError` naming the first problem: no COMPLETE marker, no manifest (or one of another
    format), or a listed file missing, of another size, or whose sha256 differs."""
    path = Path(path)
    if not (path / COMPLETE_MARKER).is_file():
        raise CheckpointError(f"checkpoint directory {path} has no {COMPLETE_MARKER} marker (an interrupted save?)")
    for name, entry in sorted(_read_manifest(path)["files"].items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint directory {path}: file {name} is missing")
        size = file.stat().st_size
        if size != entry["size"]:
            raise CheckpointError(
                f"checkpoint directory {path}: file {name} has {size} bytes, the manifest says {entry['size']}"
            )
        if _sha256(file) != entry["sha256"]:
            raise CheckpointError(
                f"checkpoint directory {path}: file {name} checksum differs from the manifest "
                "(sha256): it was modified or corrupted after the save"
            )


# -- save -----------------------------------------------------------------------------------------------


def save_checkpoint(
    root: str | Path,
    step: int,
    model: nn.Module,
    optimizer: Optimizer,
    train_state: dict[str, Any],
    keep_last: int = 0,
) -> Path:
    """Save model, optimizer and `train_state` as `<root>/step_<step:08d>/`; every rank must call it.

    Returns the final directory; with `keep_last` > 0, older checkpoints beyond the newest `keep_last` are
    then deleted (`prune_checkpoints`). `train_state` must be JSON-able (it is checked on every rank before any
    I/O, so a bad value fails everywhere at once). Re-saving a step that already has a checkpoint
    replaces it. Note: DCP's `get_state_dict` initialises an optimizer that has never stepped (one zero-lr
    step with zero gradients), so save after the first optimizer step to keep Adam's step count untouched.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if not isinstance(train_state, dict):
        raise TypeError(f"train_state must be a dict, got {type(train_state).__name__}")
    try:
        state_text = json.dumps(train_state, indent=2, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise TypeError(f"train_state must be JSON-serialisable: {e}") from e

    root = Path(root)
    final = checkpoint_dir(root, step)
    tmp = final.with_name(final.name + _TMP_SUFFIX)

    def prepare() -> None:  # a stale .tmp from a crashed save must not mix its files into this one
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()

    _on_rank0(f"preparing {tmp}", prepare)

    app = _AppState(model, optimizer)
    with _quiet_single_process():  # collective when distributed; replicated tensors are written once
        dcp.save({_APP: app}, checkpoint_id=str(tmp))
    if _distributed():
        dist.barrier()

    def commit() -> None:
        _write_file(tmp / TRAIN_STATE_FILE, state_text)
        _write_manifest(tmp, app.layout)
        _write_file(tmp / COMPLETE_MARKER, f"step {step}\n")
        _fsync_dir(tmp)
        old = None
        if final.exists():  # re-save of the same step: move the old one aside, then drop it after the commit
            old = final.with_name(final.name + ".old")
            if old.exists():
                shutil.rmtree(old)
            final.rename(old)
        tmp.rename(final)
        _fsync_dir(root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    _on_rank0(f"committing {tmp} as {final}", commit)  # the broadcast doubles as the final barrier
    if keep_last:
        prune_checkpoints(root, keep_last, step)
    return final


def prune_checkpoints(root: str | Path, keep_last: int, step: int | None = None) -> list[Path]:
    """Delete the `step_*` directories under `root` older than the newest `keep_last` at or below `step` (default:
    all), on rank 0; every rank must call it and gets the list. Checkpoints after `step` are left alone: a run that
    resumed from `step` passed over them (damaged ones, which must not take the kept ones' places)."""
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last must be an int >= 1, got {keep_last!r}")

    def prune() -> list[Path]:
        upto = [path for path in _step_dirs(Path(root)) if step is None or cast(int, _step_of(path)) <= step]
        for path in upto[keep_last:]:
            shutil.rmtree(path)
        return upto[keep_last:]

    return _on_rank0(f"deleting old checkpoints under {root}", prune)


# -- find -----------------------------------------------------------------------------------------------


def _step_of(path: Path) -> int | None:
    name = path.name
    if not name.startswith(_PREFIX):
        return None
    digits = name[len(_PREFIX) :]
    return int(digits) if digits.isdigit() else None  # ".tmp" / ".old" suffixes are not digits


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete `step_*` directory with the highest step under `root`, or None.

    Ignores `.tmp` directories (a save in progress or crashed) and directories without the COMPLETE marker.
    """
    root = Path(root)
    if not root.is_dir():
        return None
    best: tuple[int, Path] | None = None
    for child in root.iterdir():
        step = _step_of(child)
        if step is None or not child.is_dir() or not (child / COMPLETE_MARKER).is_file():
            continue
        if best is None or step > best[0]:
            best = (step, child)
    return None if best is None else best[1]


def _step_dirs(root: Path) -> list[Path]:
    """Every `step_<digits>` directory under `root`, newest first (`.tmp` and `.old` are not checkpoints)."""
    if not root.is_dir():
        return []
    found = [(step, child) for child in root.iterdir() if (step := _step_of(child)) is not None and child.is_dir()]
    return [child for _, child in sorted(found, reverse=True)]


def _choose(root: Path) -> CheckpointChoice:
    skipped: list[SkippedCheckpoint] = []
    for path in _step_dirs(root):
        try:
            verify_checkpoint(path)
        except CheckpointError as e:
            skipped.append(SkippedCheckpoint(path, str(e)))
            logger.info("skipping checkpoint %s: %s", path, e)
            continue
        return CheckpointChoice(path, tuple(skipped))
    if skipped:
        tried = "; ".join(f"{s.path.name}: {s.reason}" for s in skipped)
        raise CheckpointError(
            f"no checkpoint under {root} verifies, tried {len(skipped)}: {tried}. Delete the "
            "damaged ones to start over, or restore them from a copy"
        )
    return CheckpointChoice(None, ())


def select_checkpoint(root: str | Path) -> CheckpointChoice:
    """The newest `step_*` directory under `root` that is complete and matches its manifest; every rank must
    call it and gets rank 0's choice. Each newer one skipped is logged with its reason; `CheckpointError`
    (naming every directory tried) when checkpoints exist but none verifies."""
    return _on_rank0(f"choosing a checkpoint under {root}", lambda: _choose(Path(root)))


def remove_stale_tmp(root: str | Path) -> list[Path]:
    """Delete the `.tmp` directories crashed saves left under `root` (rank 0; every rank must call it and
    gets the list). Call it before any save starts: a `.tmp` is also a save in progress."""

    def remove() -> list[Path]:
        stale = sorted(p for p in Path(root).glob(f"{_PREFIX}*{_TMP_SUFFIX}") if p.is_dir())
        for path in stale:
            shutil.rmtree(path)
            logger.info("removed %s, left by an interrupted checkpoint save", path)
        return stale

    return _on_rank0(f"removing stale {_TMP_SUFFIX} directories under {root}", remove)


# -- load -----------------------------------------------------------------------------------------------


def _short(e: BaseException) -> str:
    """One line per failing rank instead of DCP's tracebacks (the chained exception keeps them)."""
    if isinstance(e, CheckpointException) and e.failures:
        causes = {f"{type(exc).__name__}: {exc}" for exc, _ in e.failures.values()}
        return f"on rank(s) {sorted(e.failures)}: " + "; ".join(sorted(causes))
    return f"{type(e).__name__}: {e}"


def _check_complete(path: Path) -> None:
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    missing = [name for name in (COMPLETE_MARKER, _DCP_METADATA, TRAIN_STATE_FILE) if not (path / name).is_file()]
    if missing:
        what = ", ".join(missing)
        hint = " (an interrupted save?)" if COMPLETE_MARKER in missing else ""
        raise CheckpointError(f"checkpoint directory {path} is incomplete: missing {what}{hint}")


def _check_layout(path: Path, now: _Layout) -> None:
    """The same number of ranks, TP size, pipeline stages and ZeRO setting as the save (resharding is not
    implemented); a manifest written before the distributed optimizer or tensor parallelism existed used neither."""
    manifest = _read_manifest(path)
    missing = [f.name for f in fields(_Layout) if f.name not in manifest and f.name not in ("distributed", "tp_size")]
    if missing:
        raise CheckpointError(f"checkpoint directory {path}: {MANIFEST_FILE} lacks {missing} (damaged?)")
    saved = _Layout(**{f.name: manifest[f.name] for f in fields(_Layout) if f.name in manifest})
    if saved.tp_size != now.tp_size:
        raise CheckpointError(
            f"checkpoint directory {path} was saved with tensor parallelism tp {saved.tp_size}, this run has tp "
            f"{now.tp_size}: resume with --tp {saved.tp_size} (resharding to another tp is not implemented), or "
            "start a new run in another --out"
        )
    if saved.world_size != now.world_size:
        raise CheckpointError(
            f"checkpoint directory {path} was saved by {saved.world_size} rank(s), this run has "
            f"{now.world_size}: resume with {saved.world_size} (torchrun --nproc_per_node), or "
            "start a new run in another --out"
        )
    if saved != now:
        raise CheckpointError(
            f"checkpoint directory {path} holds {saved.describe()}, but this run has "
            f"{now.describe()}: resume with the --dtype, ZeRO setting (--zero), pipeline stages (--pp) and "
            "number of ranks it was saved with"
        )


def _check_model_shapes(path: Path, model_state: dict[str, Any], whole: bool = True) -> None:
    """The checkpoint's model tensors must be this model's, by name and shape (DCP's metadata has both); a
    pipeline stage (`whole=False`) checks its own tensors only."""
    prefix = f"{_APP}.model."
    saved = {
        key[len(prefix) :]: list(meta.size)
        for key, meta in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata.items()
        if key.startswith(prefix) and hasattr(meta, "size")
    }
    now = {name: list(t.shape) for name, t in model_state.items() if isinstance(t, torch.Tensor)}
    names = saved.keys() | now.keys() if whole else now.keys()
    differences = [
        f"{name}: saved {saved.get(name, 'absent')}, this model {now.get(name, 'absent')}"
        for name in sorted(names)
        if saved.get(name) != now.get(name)
    ]
    if differences:
        shown = "; ".join(differences[:5]) + (f"; and {len(differences) - 5} more" if len(differences) > 5 else "")
        raise CheckpointError(
            f"checkpoint directory {path} holds another model ({len(differences)} tensor(s) "
            f"differ: {shown}): resume with the model it was saved with"
        )


def load_model_weights(path: str | Path, model: nn.Module) -> None:
    """Read only the model tensors of the checkpoint `path` into the whole `model`, in one process and without
    an optimizer (what an export needs), after checking their names and shapes; call `verify_checkpoint` first."""
    path = Path(path)
    state = get_model_state_dict(model)
    _check_model_shapes(path, state)
    try:
        with _quiet_single_process():
            dcp.load({f"{_APP}.model.{name}": tensor for name, tensor in state.items()}, checkpoint_id=str(path))
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise CheckpointError(f"cannot read the model's tensors from {path}: {type(e).__name__}: {e}") from e


def _load(path: Path, model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """Restore from a checkpoint directory `verify_checkpoint` passed."""
    try:
        train_state = json.loads((path / TRAIN_STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint directory {path}: unreadable {TRAIN_STATE_FILE}: {e}") from e

    app = _AppState(model, optimizer)
    _check_layout(path, app.layout)
    _check_model_shapes(path, app.state_dict()["model"], whole=app.spec is None)
    try:
        with _quiet_single_process():
            dcp.load({_APP: app}, checkpoint_id=str(path))
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise CheckpointError(f"checkpoint directory {path}: could not load model/optimizer state: {_short(e)}") from e
    return train_state


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """Restore `model` and `optimizer` in place from the checkpoint at `path`; return its train_state.

    Every rank must call it. A directory without the COMPLETE marker, DCP metadata, train state or manifest,
    a file that does not match the manifest, a checkpoint saved by another number of ranks, pipeline stages
    or ZeRO setting, or contents that do not match the model/optimizer raise `CheckpointError` naming the
    directory (and the file).
    """
    path = Path(path)
    _check_complete(path)
    _on_rank0(f"verifying {path}", lambda: verify_checkpoint(path))
    return _load(path, model, optimizer)


def resume_latest(root: str | Path, model: nn.Module, optimizer: Optimizer) -> Resumed | None:
    """Restore the newest checkpoint under `root` that verifies (see `select_checkpoint`); None if there are
    no checkpoints. Every rank must call it."""
    choice = select_checkpoint(root)
    if choice.path is None:
        return None
    return Resumed(choice.path, _load(choice.path, model, optimizer), choice.skipped)
