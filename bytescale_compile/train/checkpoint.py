"""Training checkpoints with `torch.distributed.checkpoint` (DCP): model, optimizer and a small train state.

Layout of one checkpoint:

    <root>/step_00000042/
        .metadata            DCP metadata (written by the coordinator, rank 0)
        __<rank>_0.distcp    DCP data files (replicated tensors are deduplicated: each is written once)
        train_state.json     the caller's JSON-able dict (sampler state, step, seeds, run config), rank 0
        MANIFEST.json        size and sha256 of every file above (all ranks' shards) and the world size, rank 0
        COMPLETE             the commit marker: a directory without it is not a checkpoint

Saving is atomic: every rank writes into `<root>/step_<step>.tmp/`; after a barrier rank 0 writes
`train_state.json`, the manifest and the `COMPLETE` marker there, then renames the directory to its final
name (one `rename`, so the final name only ever exists complete). A crash mid-save leaves a `.tmp` directory
that `latest_checkpoint` ignores, so the previous checkpoint stays the latest; `remove_stale_tmp` deletes it.

Loading verifies the manifest first (rank 0 hashes, every rank gets the verdict), so a truncated, missing or
overwritten shard is an error naming the file instead of silently different weights. `resume_latest` takes
the newest checkpoint that verifies and reports each newer one it skipped and why.

The model is replicated on every rank (data-parallel style): state dicts come from
`torch.distributed.checkpoint.state_dict.get_state_dict` (optimizer state keyed by parameter FQN) and go
back through `set_state_dict`. A ZeRO-1 `ZeroRedundancyOptimizer` holds only this rank's shard of the
optimizer state: each rank writes its shard under its own key (`zero_rank<r>_of_<W>`), so nothing is
gathered to one rank, and a resume needs the same number of ranks. Everything also works without `torch.distributed` initialised (one
process).

A pipeline stage (`train/stages.py`) saves its own tensors under the whole model's names (`full_model_name`:
a stage numbers its layers from 0), so the stages' model tensors never collide and the HDP ranks of one stage
write theirs once; its optimizer state goes under the stage's key (`stage<s>_of_<pp>`, or
`zero_stage<s>_of_<pp>_rank<r>_of_<hdp>` with ZeRO-1 over the stage's ranks). A resume needs the same pp_size
and number of ranks. The root directory must be on a file system every rank sees (one machine, or a shared mount).
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.optim import ZeroRedundancyOptimizer

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
    "remove_stale_tmp",
    "resume_latest",
    "save_checkpoint",
    "select_checkpoint",
    "verify_checkpoint",
]

logger = logging.getLogger(__name__)

COMPLETE_MARKER = "COMPLETE"
TRAIN_STATE_FILE = "train_state.json"
MANIFEST_FILE = "MANIFEST.json"
_MANIFEST_VERSION = 1
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
    return model.original_module if hasattr(model, "original_module") else model


def _shard_key(model: nn.Module, optimizer: torch.optim.Optimizer) -> str | None:
    """Where this rank's optimizer state goes when it is not the whole model's replicated state: its ZeRO
    shard and/or its pipeline stage's."""
    spec = stage_spec(model)
    stage = f"stage{spec.index}_of_{spec.pp_size}" if spec is not None else None
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        shard = f"rank{optimizer.rank}_of_{optimizer.world_size}"
        return f"zero_{stage}_{shard}" if stage else f"zero_{shard}"
    return stage


def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the state of an optimizer that never stepped (a zero-lr step on zero gradients), as DCP's
    `get_state_dict` does, so there are tensors to save and to load into."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not params or any(optimizer.state.get(p) for p in params):
        return
    lrs, grads = [group["lr"] for group in optimizer.param_groups], [p.grad for p in params]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    for p, grad in zip(params, grads):
        p.grad = grad


def _state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What DCP saves and loads in place: {"model": ..., "optim": ...}."""
    key = _shard_key(model, optimizer)
    if key is None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        return {"model": model_sd, "optim": optim_sd}
    spec = stage_spec(model)
    full = (lambda name: full_model_name(spec, name)) if spec is not None else (lambda name: name)
    local = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    _init_optimizer_state(local)
    names = {p: full(name) for name, p in model.named_parameters()}
    shard: dict[str, Any] = {
        f"{names[p]}.{key}": value
        for group in local.param_groups for p in group["params"] for key, value in local.state[p].items()
    }
    shard["param_groups"] = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    model_sd = ({full(name): t for name, t in model.state_dict().items()} if spec is not None
                else get_model_state_dict(model))
    return {"model": model_sd, "optim": {key: shard}}


def _restore(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    key = _shard_key(model, optimizer)
    if key is None:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return
    if stage_spec(model) is None:  # a stage's model tensors, like every shard's, are the live ones, loaded in place
        set_model_state_dict(model, state["model"])
    for group, saved in zip(optimizer.param_groups, state["optim"][key]["param_groups"]):
        group.update(saved)


def _check_optimizer_kind(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A checkpoint of ZeRO shards or pipeline stages needs the same ZeRO and stages over as many ranks, and a
    replicated one a replicated one."""
    keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    saved = sorted({k.split(".")[1] for k in keys if k.startswith(("optim.zero_", "optim.stage"))})
    wanted = _shard_key(model, optimizer)
    if wanted is None and saved:
        kind = "ZeRO optimizer shards" if saved[0].startswith("zero_") else "the optimizer states of pipeline stages"
        raise CheckpointError(f"checkpoint directory {path} holds {kind} ({saved[0]}..): resume it with the ZeRO "
                              "setting (--zero), pipeline stages (--pp) and number of ranks it was saved with")
    if wanted is not None and not any(k.startswith(f"optim.{wanted}.") for k in keys):
        found = f"optimizer shards {saved[0]}..{saved[-1]}" if saved else "a replicated optimizer state"
        raise CheckpointError(f"checkpoint directory {path} holds {found}, but this run needs {wanted}: resume with "
                              "the ZeRO setting (--zero), pipeline stages (--pp) and number of ranks it was saved with")


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


def _write_manifest(directory: Path) -> None:
    """Record every file's size and sha256 (all ranks' shards: the caller saw them all written) and the world
    size; the manifest and the COMPLETE marker themselves are not listed."""
    files = {
        f.relative_to(directory).as_posix(): {"size": f.stat().st_size, "sha256": _sha256(f)}
        for f in sorted(directory.rglob("*")) if f.is_file() and f.name not in (MANIFEST_FILE, COMPLETE_MARKER)
    }
    manifest = {"version": _MANIFEST_VERSION, "world_size": _world_size(), "files": files}
    _write_file(directory / MANIFEST_FILE, json.dumps(manifest, indent=2, sort_keys=True))


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise CheckpointError(f"checkpoint directory {path}: manifest {MANIFEST_FILE} missing (saved by an older "
                              "version, or damaged): its files cannot be verified") from e
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint directory {path}: unreadable {MANIFEST_FILE}: {e}") from e
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"checkpoint directory {path}: {MANIFEST_FILE} lists no files")
    return manifest


def verify_checkpoint(path: str | Path) -> None:
    """Raise `CheckpointError` naming the first problem: no COMPLETE marker, no manifest, or a listed file
    missing, of another size, or whose sha256 differs."""
    path = Path(path)
    if not (path / COMPLETE_MARKER).is_file():
        raise CheckpointError(f"checkpoint directory {path} has no {COMPLETE_MARKER} marker (an interrupted save?)")
    for name, entry in sorted(_read_manifest(path)["files"].items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint directory {path}: file {name} is missing")
        size = file.stat().st_size
        if size != entry["size"]:
            raise CheckpointError(f"checkpoint directory {path}: file {name} has {size} bytes, the manifest "
                                  f"says {entry['size']}")
        if _sha256(file) != entry["sha256"]:
            raise CheckpointError(f"checkpoint directory {path}: file {name} checksum differs from the manifest "
                                  "(sha256): it was modified or corrupted after the save")


# -- save -----------------------------------------------------------------------------------------------

def save_checkpoint(
    root: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_state: dict[str, Any],
) -> Path:
    """Save model, optimizer and `train_state` as `<root>/step_<step:08d>/`; every rank must call it.

    Returns the final directory. `train_state` must be JSON-able (it is checked on every rank before any
    I/O, so a bad value fails everywhere at once). Re-saving a step that already has a checkpoint
    replaces it. Note: `get_state_dict` initialises an optimizer that has never stepped (one zero-lr step
    with zero gradients), so save after the first optimizer step to keep Adam's step count untouched.
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

    state = _state_dicts(_model_for_dcp(model), optimizer)
    with _quiet_single_process():  # collective when distributed; replicated tensors are written once
        dcp.save(state, checkpoint_id=str(tmp))
    if _distributed():
        dist.barrier()

    def commit() -> None:
        _write_file(tmp / TRAIN_STATE_FILE, state_text)
        _write_manifest(tmp)
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
    return final


# -- find -----------------------------------------------------------------------------------------------

def _step_of(path: Path) -> int | None:
    name = path.name
    if not name.startswith(_PREFIX):
        return None
    digits = name[len(_PREFIX):]
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
            logger.warning("skipping checkpoint %s: %s", path, e)
            continue
        return CheckpointChoice(path, tuple(skipped))
    if skipped:
        tried = "; ".join(f"{s.path.name}: {s.reason}" for s in skipped)
        raise CheckpointError(f"no checkpoint under {root} verifies, tried {len(skipped)}: {tried}. Delete the "
                              "damaged ones to start over, or restore them from a copy")
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
            logger.warning("removed %s, left by an interrupted checkpoint save", path)
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


def _check_world_size(path: Path) -> None:
    saved = _read_manifest(path).get("world_size")
    if saved is not None and saved != _world_size():
        raise CheckpointError(f"checkpoint directory {path} was saved by {saved} rank(s), this run has "
                              f"{_world_size()}: resume with {saved} (torchrun --nproc_per_node), or start a new "
                              "run in another --out")


def _check_model_shapes(path: Path, model_state: dict[str, Any], whole: bool = True) -> None:
    """The checkpoint's model tensors must be this model's, by name and shape (DCP's metadata has both); a
    pipeline stage (`whole=False`) checks its own tensors only."""
    saved = {key[len("model."):]: list(meta.size)
             for key, meta in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata.items()
             if key.startswith("model.") and hasattr(meta, "size")}
    now = {name: list(t.shape) for name, t in model_state.items() if isinstance(t, torch.Tensor)}
    names = saved.keys() | now.keys() if whole else now.keys()
    differences = [f"{name}: saved {saved.get(name, 'absent')}, this model {now.get(name, 'absent')}"
                   for name in sorted(names) if saved.get(name) != now.get(name)]
    if differences:
        shown = "; ".join(differences[:5]) + (f"; and {len(differences) - 5} more" if len(differences) > 5 else "")
        raise CheckpointError(f"checkpoint directory {path} holds another model ({len(differences)} tensor(s) "
                              f"differ: {shown}): resume with the model it was saved with")


def _load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Restore from a checkpoint directory `verify_checkpoint` passed."""
    try:
        train_state = json.loads((path / TRAIN_STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint directory {path}: unreadable {TRAIN_STATE_FILE}: {e}") from e

    _check_world_size(path)
    target = _model_for_dcp(model)
    _check_optimizer_kind(path, target, optimizer)
    state = _state_dicts(target, optimizer)  # templates: tensors on their destination devices
    _check_model_shapes(path, state["model"], whole=stage_spec(target) is None)
    try:
        with _quiet_single_process():
            dcp.load(state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise CheckpointError(f"checkpoint directory {path}: could not load model/optimizer state: {_short(e)}") from e
    _restore(target, optimizer, state)
    return train_state


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Restore `model` and `optimizer` in place from the checkpoint at `path`; return its train_state.

    Every rank must call it. A directory without the COMPLETE marker, DCP metadata, train state or manifest,
    a file that does not match the manifest, a checkpoint saved by another number of ranks, or contents that
    do not match the model/optimizer raise `CheckpointError` naming the directory (and the file).
    """
    path = Path(path)
    _check_complete(path)
    _on_rank0(f"verifying {path}", lambda: verify_checkpoint(path))
    return _load(path, model, optimizer)


def resume_latest(root: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> Resumed | None:
    """Restore the newest checkpoint under `root` that verifies (see `select_checkpoint`); None if there are
    no checkpoints. Every rank must call it."""
    choice = select_checkpoint(root)
    if choice.path is None:
        return None
    return Resumed(choice.path, _load(choice.path, model, optimizer), choice.skipped)
