"""What a checkpoint directory is on disk: its files, the atomic commit, the manifest that verifies it, and how
the newest good one is found.

Layout of one checkpoint:

    <root>/step_00000042/
        .metadata            DCP metadata (written by the coordinator, rank 0)
        __<rank>_0.distcp    DCP data files (a tensor several ranks hold alike is written once)
        train_state.json     the caller's JSON-able dict (sampler state, step, seeds, run config), rank 0
        MANIFEST.json        format version, the layout the ranks held the state in (world size, pipeline
                             stages, TP, ZeRO) and the size and sha256 of every file above, rank 0
        COMPLETE             the commit marker: a directory without it is not a checkpoint

Every rank writes into `<root>/step_<step>.tmp/` and hashes the data files it wrote itself, so the hashing runs
on all ranks at once. Rank 0 then writes `train_state.json`, the manifest (its own hashes and every rank's) and
the `COMPLETE` marker there, and renames the directory to its final name: one `rename`, so the final name only
ever exists complete. A crash mid-save leaves a `.tmp` directory that `latest_checkpoint` ignores, so the
previous checkpoint stays the latest; `remove_stale_tmp` deletes it.

Loading verifies the manifest first, so a truncated, missing or overwritten file is an error naming it instead
of silently different weights; `select_checkpoint` takes the newest checkpoint that verifies and reports each
newer one it skipped and why. The root must be on a file system every rank sees (one machine, or a shared mount).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import torch.distributed as dist

__all__ = [
    "COMPLETE_MARKER",
    "DCP_METADATA",
    "MANIFEST_FILE",
    "TRAIN_STATE_FILE",
    "CheckpointChoice",
    "CheckpointError",
    "Rank0Error",
    "SkippedCheckpoint",
    "checkpoint_dir",
    "commit",
    "hash_written",
    "latest_checkpoint",
    "on_rank0",
    "prune_checkpoints",
    "read_manifest",
    "remove_stale_tmp",
    "select_checkpoint",
    "tmp_dir",
    "verify_checkpoint",
]

logger = logging.getLogger(__name__)

COMPLETE_MARKER = "COMPLETE"
TRAIN_STATE_FILE = "train_state.json"
MANIFEST_FILE = "MANIFEST.json"
DCP_METADATA = ".metadata"
_MANIFEST_VERSION = 2
"""Format 2: optimizer state by parameter name (DCP's flattened state dicts) and the layout in the manifest."""
_PREFIX = "step_"
_TMP_SUFFIX = ".tmp"

T = TypeVar("T")
FileEntries = dict[str, dict[str, Any]]
"""File name -> {"size": bytes, "sha256": hex digest}, as the manifest lists them."""


class CheckpointError(RuntimeError):
    """A checkpoint directory that is corrupt or incomplete (the message names it and what is missing)."""


class Rank0Error(CheckpointError):
    """What failed on rank 0 in `on_rank0`, raised on every rank alike with rank 0's `cause` (one line) and
    `trace` (its formatted traceback)."""

    def __init__(self, message: str, cause: str, trace: str) -> None:
        super().__init__(message)
        self.cause, self.trace = cause, trace


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


def checkpoint_dir(root: str | Path, step: int) -> Path:
    """The final directory of the checkpoint of `step` under `root`: `<root>/step_<step:08d>`."""
    return Path(root) / f"{_PREFIX}{step:08d}"


def tmp_dir(final: Path) -> Path:
    """Where the ranks write the checkpoint that becomes `final` when committed."""
    return final.with_name(final.name + _TMP_SUFFIX)


# -- across ranks ---------------------------------------------------------------------------------------


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def on_rank0(what: str, fn: Callable[[], T], group: dist.ProcessGroup | None = None) -> T:
    """Run `fn()` on rank 0 and share its outcome over `group` (every rank), so a failure raises on every rank
    (`Rank0Error`) instead of hanging them."""
    result: Any = None
    error: tuple[str, str, str] | None = None
    if rank() == 0:
        try:
            result = fn()
        except Exception as e:
            if not distributed():
                raise
            cause = f"{type(e).__name__}: {e}"
            error = (f"{what} failed on rank 0: {cause}", cause, "".join(traceback.format_exception(e)))
    if distributed():
        box = [(result, error)]
        dist.broadcast_object_list(box, src=0, group=group)
        result, error = box[0]
        if error is not None:
            raise Rank0Error(*error)
    return cast(T, result)


# -- files ----------------------------------------------------------------------------------------------


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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _entries(files: list[Path], directory: Path) -> FileEntries:
    return {f.relative_to(directory).as_posix(): {"size": f.stat().st_size, "sha256": _sha256(f)} for f in files}


def hash_written(directory: Path, group_rank: int) -> FileEntries:
    """Size and sha256 of the data files this rank wrote into `directory`: DCP's file system writer names them
    `__<rank in the saving group>_<n>.distcp`. A file no rank reports is hashed by rank 0 at the commit."""
    return _entries(sorted(directory.glob(f"__{group_rank}_*.distcp")), directory)


def commit(
    tmp: Path, final: Path, step: int, state_text: str, layout: dict[str, Any], hashed: FileEntries, keep_last: int
) -> Path:
    """On rank 0, once every rank's files are written and `hashed` holds their entries: write the train state,
    the manifest (hashing the rest itself) and the COMPLETE marker, rename `tmp` to `final`, then delete the
    checkpoints beyond the newest `keep_last` (0: keep all)."""
    _write_file(tmp / TRAIN_STATE_FILE, state_text)
    present = sorted(f for f in tmp.rglob("*") if f.is_file() and f.name not in (MANIFEST_FILE, COMPLETE_MARKER))
    unreported = [f for f in present if f.relative_to(tmp).as_posix() not in hashed]
    files = {**hashed, **_entries(unreported, tmp)}
    missing = sorted(set(files) - {f.relative_to(tmp).as_posix() for f in present})
    if missing:
        raise CheckpointError(f"{tmp}: {', '.join(missing)} hashed by its writer but gone before the commit")
    manifest = {"version": _MANIFEST_VERSION, **layout, "files": dict(sorted(files.items()))}
    _write_file(tmp / MANIFEST_FILE, json.dumps(manifest, indent=2, sort_keys=True))
    _write_file(tmp / COMPLETE_MARKER, f"step {step}\n")
    _fsync_dir(tmp)
    old = None
    if final.exists():  # re-save of the same step: move the old one aside, then drop it after the commit
        old = final.with_name(final.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
    tmp.rename(final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    if keep_last:
        _prune(final.parent, keep_last, step)
    return final


def read_manifest(path: Path) -> dict[str, Any]:
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
    for name, entry in sorted(read_manifest(path)["files"].items()):
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


# -- find and prune -------------------------------------------------------------------------------------


def _step_of(path: Path) -> int | None:
    name = path.name
    if not name.startswith(_PREFIX):
        return None
    digits = name[len(_PREFIX) :]
    return int(digits) if digits.isdigit() else None  # ".tmp" / ".old" suffixes are not digits


def _step_dirs(root: Path) -> list[Path]:
    """Every `step_<digits>` directory under `root`, newest first (`.tmp` and `.old` are not checkpoints)."""
    if not root.is_dir():
        return []
    found = [(step, child) for child in root.iterdir() if (step := _step_of(child)) is not None and child.is_dir()]
    return [child for _, child in sorted(found, reverse=True)]


def _prune(root: Path, keep_last: int, step: int | None) -> list[Path]:
    upto = [path for path in _step_dirs(root) if step is None or cast(int, _step_of(path)) <= step]
    for path in upto[keep_last:]:
        shutil.rmtree(path)
    return upto[keep_last:]


def prune_checkpoints(root: str | Path, keep_last: int, step: int | None = None) -> list[Path]:
    """Delete the `step_*` directories under `root` older than the newest `keep_last` at or below `step` (default:
    all), on rank 0; every rank must call it and gets the list. Checkpoints after `step` are left alone: a run that
    resumed from `step` passed over them (damaged ones, which must not take the kept ones' places)."""
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last must be an int >= 1, got {keep_last!r}")
    return on_rank0(f"deleting old checkpoints under {root}", lambda: _prune(Path(root), keep_last, step))


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete `step_*` directory with the highest step under `root`, or None.

    Ignores `.tmp` directories (a save in progress or crashed) and directories without the COMPLETE marker.
    """
    return next((path for path in _step_dirs(Path(root)) if (path / COMPLETE_MARKER).is_file()), None)


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
    return on_rank0(f"choosing a checkpoint under {root}", lambda: _choose(Path(root)))


def remove_stale_tmp(root: str | Path) -> list[Path]:
    """Delete the `.tmp` directories crashed saves left under `root` (rank 0; every rank must call it and
    gets the list). Call it before any save starts: a `.tmp` is also a save in progress."""

    def remove() -> list[Path]:
        stale = sorted(p for p in Path(root).glob(f"{_PREFIX}*{_TMP_SUFFIX}") if p.is_dir())
        for path in stale:
            shutil.rmtree(path)
            logger.info("removed %s, left by an interrupted checkpoint save", path)
        return stale

    return on_rank0(f"removing stale {_TMP_SUFFIX} directories under {root}", remove)
