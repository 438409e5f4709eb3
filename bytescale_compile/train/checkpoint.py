"""Training checkpoints with `torch.distributed.checkpoint` (DCP): model, optimizer and a small train state.

The directory format, its atomic commit, the manifest and finding the newest good checkpoint are in
`checkpoint_files.py`; this module decides what goes in and how it comes back.

DCP saves one `Stateful`, the model and its optimizer (`_AppState` under "app"), through DCP's own
`get_state_dict`/`set_state_dict` with the optimizer state flattened per parameter: the keys are
`app.model.<param>`, `app.optim.state.<param>.<exp_avg|exp_avg_sq|step>` and
`app.optim.param_groups.<param>.<lr|betas|...>`, where `<param>` is always the whole model's name:

- a pipeline stage (`engine/stages.py`) numbers its layers from 0, so its names go through `full_model_name`
  and no two stages' names collide;
- a ZeRO-1 `ZeroRedundancyOptimizer` holds its rank's parameters' state only: DCP's helpers run on its local
  optimizer, so each rank writes the state of its own parameters and nothing is gathered;
- the distributed optimizer writes its fp32 main weights and moments as `ShardedTensor`s of the global shapes;
- under tensor parallelism the tensors are DTensors of the global shapes, except those with a strided shard (Hugging
  Face's fused gate/up experts split by TP: a slice of each half), which DCP cannot place: they go as
  `ShardedTensor`s of their boxes, views into the local tensor (`_as_boxes`), so the saved tensor is the natural
  global one and a load writes in place.

So a checkpoint is stored by parameter name and global shape, never by rank, and loads on any number of ranks,
pipeline stages, TP size and ZeRO setting: each loading rank asks DCP for the names and pieces it holds, and DCP
reads them from whichever files hold them (resharding). The layout it was saved in is kept in the manifest and
reported on load when it differs. Checkpoints of the older format (per-shard keys, manifest version 1) do not
verify and say so. Everything also works without `torch.distributed` initialised (one process).

A `Checkpointer` saves one run's checkpoints. Its `save_async` returns once the state is copied to host memory
(`_Stager`, which also copies the distributed optimizer's ShardedTensors); DCP writes it from a background thread,
every rank hashes its own files, and rank 0 commits, with the guarantees of a synchronous save. One save is in
flight at a time: the checkpointer's next save, and its `wait`, wait for it first. What background saves share (the
save in flight, the gloo group their collectives run on, the host copy) belongs to the checkpointer, so two runs in
one process, or a test, never see each other's.

A save that fails raises `CheckpointSaveError` on every rank alike, with each failing rank's cause and traceback,
so that one rank can report it once.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import shutil
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

from ..engine.dist_optim import DistributedOptimizer, TPSplit
from ..engine.mesh import tp_size_of
from ..engine.optim import keeping_implementation
from ..engine.stages import full_model_name, stage_spec
from ..lazy import moved
from .checkpoint_files import (
    COMPLETE_MARKER,
    DCP_METADATA,
    MANIFEST_FILE,
    TRAIN_STATE_FILE,
    CheckpointChoice,
    CheckpointError,
    Rank0Error,
    SkippedCheckpoint,
    checkpoint_dir,
    commit,
    distributed,
    hash_written,
    latest_checkpoint,
    on_rank0,
    prune_checkpoints,
    rank,
    read_manifest,
    remove_stale_tmp,
    select_checkpoint,
    tmp_dir,
    verify_checkpoint,
    world_size,
)

__all__ = [
    "COMPLETE_MARKER",
    "MANIFEST_FILE",
    "TRAIN_STATE_FILE",
    "CheckpointChoice",
    "CheckpointError",
    "CheckpointSaveError",
    "Checkpointer",
    "PendingCheckpoint",
    "SaveFailure",
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

_APP = "app"
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass(frozen=True)
class Resumed:
    """What `resume_latest` restored."""

    path: Path
    train_state: dict[str, Any]
    skipped: tuple[SkippedCheckpoint, ...]
    resharded: str | None = None
    """How the saving and the loading ranks held the state, when they differ (None: the same layout)."""


warnings.filterwarnings("ignore", message=r"torch\.distributed is .*uninitialized", category=UserWarning)
"""Without a process group DCP runs in one process, which is what we want, but warns on every call (also from
the background thread of an async save, where a `catch_warnings` around the call would not reach)."""


def _model_for_dcp(model: nn.Module) -> nn.Module:
    """`get_state_dict` on the plain model: an `OptimizedModule` shares its dicts, so the FQNs are equal."""
    return getattr(model, "original_module", model)


@dataclass(frozen=True)
class _Layout:
    """How the ranks hold the model and optimizer state; recorded in the manifest, reported on a resharding load."""

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
            world_size(),
            spec.pp_size if spec is not None else 1,
            isinstance(optimizer, ZeroRedundancyOptimizer),
            isinstance(optimizer, DistributedOptimizer),
            tp_size_of(model),
        )

    def describe(self) -> str:
        split = "".join(f", {name} {size}" for name, size in (("pp", self.pp_size), ("tp", self.tp_size)) if size > 1)
        if self.distributed:
            kind = "distributed-optimizer shards (bf16 weights)"
        elif self.zero:
            kind = "ZeRO-1 optimizer shards"
        else:
            kind = "a replicated optimizer"
        return f"{self.world_size} rank(s){split}, {kind}"


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


def _strided(value: object) -> bool:
    """A DTensor with a strided shard (`_StridedShard`), whose chunks DCP's planner places wrongly."""
    return isinstance(value, DTensor) and any(isinstance(p, _StridedShard) for p in value.placements)


def _as_boxes(name: str, tensor: DTensor) -> ShardedTensor:
    """A strided DTensor as a ShardedTensor of the same global shape: the boxes of every TP rank's local tensor
    (`TPSplit.boxes`), this rank's as views into its own, so a save copies nothing and a load writes in place."""
    split = TPSplit.of(tensor, name)
    assert split is not None
    local = tensor.to_local()
    if not local.is_contiguous():
        raise CheckpointError(f"`{name}`: the local tensor of a strided shard must be contiguous to save in place")
    mesh = tensor.device_mesh
    holders = mesh.mesh.flatten().tolist()  # global ranks by TP index
    every, mine = [], []
    for index, holder in enumerate(holders):
        for at, sizes, start in split.boxes(tuple(local.shape), index, 0, local.numel()):
            meta = ShardMetadata(list(at), list(sizes), f"rank:{holder}/{local.device}")
            every.append(meta)
            if index == mesh.get_local_rank():
                count = math.prod(sizes)
                mine.append(Shard(local.view(-1)[start : start + count].view(sizes), meta))
    properties = TensorProperties(dtype=local.dtype, layout=torch.strided, requires_grad=False)
    metadata = ShardedTensorMetadata(every, tensor.shape, properties)
    return ShardedTensor._init_from_local_shards_and_global_metadata(mine, metadata)


class _AppState(Stateful):
    """The model and optimizer as DCP saves and loads them: DCP's state dicts (optimizer state per parameter)
    under the whole model's names. A ZeRO optimizer contributes its local optimizer, this rank's parameters.
    Strided DTensors go as ShardedTensors of their boxes (`_as_boxes`), read back in place."""

    def __init__(self, model: nn.Module, optimizer: Optimizer) -> None:
        self.model = _model_for_dcp(model)
        self.sharded = optimizer if isinstance(optimizer, DistributedOptimizer) else None
        self.zero = optimizer if isinstance(optimizer, ZeroRedundancyOptimizer) else None
        self.local = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
        """The torch optimizer DCP's helpers read (unused with the distributed optimizer)."""
        self.spec = stage_spec(self.model)
        self.layout = _Layout.of(self.model, optimizer)
        self._boxed: dict[int, DTensor] = {}
        """The strided DTensor behind each ShardedTensor of boxes the last `state_dict` gave, by the latter's id."""

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
        self._boxed = {}
        return {
            part: {self._saved_name(part, key): self._savable(key, value) for key, value in state.items()}
            for part, state in self._local_state().items()
        }

    def _savable(self, key: str, value: Any) -> Any:
        """`value` as DCP can save it: a strided DTensor as its boxes, remembered for the load."""
        if not _strided(value):
            return value
        boxes = _as_boxes(key, value)
        self._boxed[id(boxes)] = value
        return boxes

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        local = {
            part: {self._saved_name(part, key): key for key in state} for part, state in self._local_state().items()
        }
        model_state, optim_state = (
            {local[part][key]: self._boxed.get(id(value), value) for key, value in state_dict[part].items()}
            for part in ("model", "optim")
        )
        if self.sharded is not None:  # DCP read the main weights and moments in place
            buffers = {k: v for k, v in model_state.items() if not isinstance(v, ShardedTensor)}
            self.model.load_state_dict(buffers, strict=False)
            self.sharded.load_state_dict({"optim": optim_state})
            return
        assert isinstance(self.local, torch.optim.Optimizer)
        with _named_groups_only(self.local), keeping_implementation(self.local):
            set_state_dict(
                self.model, self.local, model_state_dict=model_state, optim_state_dict=optim_state, options=_OPTIONS
            )
        if self.zero is not None:
            _sync_hyperparameters(self.zero, to_local=False)


# -- save -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SaveFailure:
    """What went wrong on one rank of a failed save."""

    rank: int
    cause: str
    """`<exception type>: <message>`, one line."""
    traceback: str
    """The rank's formatted traceback ("" where only the message travelled)."""

    @classmethod
    def of(cls, rank: int, error: BaseException) -> SaveFailure:
        return cls(rank, _one_line(error), "".join(traceback.format_exception(error)))


class CheckpointSaveError(CheckpointError):
    """The checkpoint of `step` could not be saved; raised on every rank alike, `failures` holding each failing
    rank's cause (lowest rank first), so one rank reports it. The previous checkpoint is still the newest."""

    def __init__(self, step: int, directory: Path, failures: list[SaveFailure]) -> None:
        self.step, self.directory = step, directory
        self.failures = sorted(failures, key=lambda f: f.rank)
        ranks = [f.rank for f in self.failures]
        causes = "; ".join(dict.fromkeys(f.cause for f in self.failures))
        where = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
        super().__init__(
            f"the checkpoint of step {step} failed on {where}: {causes} ({directory} is left unfinished; the "
            "previous checkpoint is still the newest that verifies)"
        )


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:500]}{'...' if len(text) > 500 else ''}"


def _failures(error: BaseException) -> list[SaveFailure]:
    """Each failing rank's cause: DCP gathers every rank's exception and stack into a `CheckpointException`; a
    `CheckpointSaveError` has them already, a `Rank0Error` rank 0's; anything else failed on this rank."""
    if isinstance(error, CheckpointSaveError):
        return error.failures
    if isinstance(error, Rank0Error):
        return [SaveFailure(0, error.cause, error.trace)]
    if isinstance(error, CheckpointException) and error.failures:
        return [
            SaveFailure(
                group_rank,
                _one_line(exc),
                "Traceback (most recent call last):\n"
                + "".join(traceback.format_list(stack) if stack is not None else [])
                + "".join(traceback.format_exception_only(type(exc), exc)),
            )
            for group_rank, (exc, stack) in error.failures.items()
        ]
    return [SaveFailure.of(rank(), error)]


def _agreed(step: int, directory: Path, error: BaseException | None) -> None:
    """Raise `CheckpointSaveError` on every rank when any rank failed the part of a save it runs alone (one
    all-gather on the default group): the others must not go on to the collective writing."""
    mine = None if error is None else SaveFailure.of(rank(), error)
    every = [mine]
    if distributed():
        every = [None] * world_size()
        dist.all_gather_object(every, mine)
    failed = [f for f in every if f is not None]
    if failed:
        raise CheckpointSaveError(step, directory, failed) from error


@dataclass
class PendingCheckpoint:
    """A checkpoint whose state is copied to host memory and is being written and committed in the background."""

    path: Path
    """Its final directory, which exists once the commit is done."""
    step: int
    staged_s: float
    """Seconds the saving call took: copying the state to host memory (and waiting for the previous save)."""
    _future: Future[Path]

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> Path:
        """Wait for the commit and return the final directory; `CheckpointSaveError` when the write or commit
        failed (the previous checkpoint is then still the newest that verifies)."""
        try:
            return self._future.result()
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            raise CheckpointSaveError(self.step, tmp_dir(self.path), _failures(e)) from e


class _Stager(DefaultStager):
    """DCP's synchronous stager, which also stages `ShardedTensor`s (the distributed optimizer's main weights and
    moments: rectangular pieces of flat fragments, which DCP's stager cannot copy and no DTensor placement can
    describe). Their local shards are views of a few flat tensors and go through the same host-copy cache as every
    other tensor (one host copy per storage, kept and copied into again by the next save); each ShardedTensor is
    then rebuilt around its copies, its pieces placed on the CPU."""

    def __init__(self) -> None:
        super().__init__(StagingOptions(False, False, False, False))

    def stage(self, state_dict: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        found: dict[tuple[str, ...], ShardedTensor] = {}
        staged = super().stage(_pieces_of_sharded(state_dict, found, ()), **kwargs)
        assert isinstance(staged, dict)  # synchronous staging
        for path, sharded in found.items():
            parent = staged
            for key in path[:-1]:
                parent = parent[key]
            parent[path[-1]] = _sharded_on_host(sharded, parent[path[-1]])
        return staged


def _pieces_of_sharded(tree: Any, found: dict[tuple[str, ...], ShardedTensor], path: tuple[str, ...]) -> Any:
    """`tree` (nested dicts) with each ShardedTensor replaced by the list of its local shards' tensors, which
    `found` records by path."""
    if isinstance(tree, ShardedTensor):
        found[path] = tree
        return [shard.tensor for shard in tree.local_shards()]
    if isinstance(tree, dict):
        return {key: _pieces_of_sharded(value, found, (*path, key)) for key, value in tree.items()}
    return tree


def _sharded_on_host(sharded: ShardedTensor, tensors: list[torch.Tensor]) -> ShardedTensor:
    """`sharded` with its local shards' host copies `tensors`, every piece placed on the CPU."""

    def on_host(meta: ShardMetadata) -> ShardMetadata:
        assert meta.placement is not None
        return ShardMetadata(meta.shard_offsets, meta.shard_sizes, f"rank:{meta.placement.rank()}/cpu")

    metadata = sharded.metadata()
    shards = [Shard(t, on_host(s.metadata)) for s, t in zip(sharded.local_shards(), tensors)]
    every = [on_host(meta) for meta in metadata.shards_metadata]
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, type(metadata)(every, metadata.size, metadata.tensor_properties)
    )


def _state_text(step: int, train_state: dict[str, Any]) -> str:
    """The train state's JSON, the arguments checked on every rank before any I/O (a bad value fails everywhere)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if not isinstance(train_state, dict):
        raise TypeError(f"train_state must be a dict, got {type(train_state).__name__}")
    try:
        return json.dumps(train_state, indent=2, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise TypeError(f"train_state must be JSON-serialisable: {e}") from e


def _begin(root: str | Path, step: int, train_state: dict[str, Any]) -> tuple[Path, str]:
    """Check the arguments on every rank before any I/O, then (rank 0) make an empty `.tmp` directory: a stale one
    from a crashed save must not mix its files into this one. Returns the final directory and the state's JSON."""
    state_text = _state_text(step, train_state)
    final = checkpoint_dir(root, step)
    tmp = tmp_dir(final)

    def prepare() -> None:
        final.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()

    try:
        on_rank0(f"preparing {tmp}", prepare)
    except (OSError, CheckpointError) as e:
        raise CheckpointSaveError(step, tmp, _failures(e)) from e
    return final, state_text


def _finish(
    final: Path,
    step: int,
    state_text: str,
    layout: _Layout,
    keep_last: int,
    group: dist.ProcessGroup | None,
    on_commit: Callable[[Path], None] | None,
) -> Path:
    """Every rank, once DCP has written its files: hash them, gather the hashes on rank 0 (which also waits
    for every rank this way), and let rank 0 commit, then call `on_commit`."""
    tmp = tmp_dir(final)
    hashed = hash_written(tmp, dist.get_rank(group) if distributed() else 0)
    if distributed():
        every: list[Any] | None = [None] * world_size() if rank() == 0 else None
        dist.gather_object(hashed, every, dst=0, group=group)
        hashed = {name: entry for part in every or [] for name, entry in part.items()}

    def commit_and_tell() -> Path:
        committed = commit(tmp, final, step, state_text, asdict(layout), hashed, keep_last)
        if on_commit is not None:
            on_commit(committed)
        return committed

    return on_rank0(f"committing {tmp} as {final}", commit_and_tell, group)


def save_checkpoint(
    root: str | Path,
    step: int,
    model: nn.Module,
    optimizer: Optimizer,
    train_state: dict[str, Any],
    keep_last: int = 0,
    *,
    on_commit: Callable[[Path], None] | None = None,
) -> Path:
    """Save model, optimizer and `train_state` as `<root>/step_<step:08d>/`; every rank must call it.

    Returns the final directory; with `keep_last` > 0, older checkpoints beyond the newest `keep_last` are
    then deleted (`prune_checkpoints`), and rank 0 calls `on_commit(final)` once it is committed. `train_state`
    must be JSON-able (it is checked on every rank before any I/O, so a bad value fails everywhere at once).
    Re-saving a step that already has a checkpoint replaces it. A failed save raises `CheckpointSaveError` on
    every rank. A `Checkpointer`'s background save in flight must be waited for first (`Checkpointer.save`
    does). Note: DCP's `get_state_dict` initialises an optimizer that has never stepped (one zero-lr step
    with zero gradients), so save after the first optimizer step to keep Adam's step count untouched.
    """
    final, state_text = _begin(root, step, train_state)
    app = _AppState(model, optimizer)
    try:
        dcp.save({_APP: app}, checkpoint_id=str(tmp_dir(final)))  # collective; replicated tensors are written once
        return _finish(final, step, state_text, app.layout, keep_last, None, on_commit)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise CheckpointSaveError(step, tmp_dir(final), _failures(e)) from e


class Checkpointer:
    """Saves one run's checkpoints, one at a time: `save` before it returns, `save_async` in the background. Every
    save, and `wait`, first waits for the one in flight. It holds what background saves share: the save in flight,
    the gloo group their collectives run on (made by the first, which every rank calls at the same point), and the
    stager whose host copy each save copies into again (safe: a save stages only once the previous one is written).
    Every rank must `wait` before the process group goes away."""

    def __init__(self) -> None:
        self._in_flight: PendingCheckpoint | None = None
        self._group: tuple[Any, dist.ProcessGroup] | None = None
        """(the default process group, a gloo group of every rank for background saves) once one was made."""
        self._stager: _Stager | None = None

    def wait(self) -> Path | None:
        """Wait for the save in flight, if any, and return its final directory (`CheckpointSaveError` if it
        failed, raised once: the failed save is no longer in flight)."""
        pending, self._in_flight = self._in_flight, None
        return None if pending is None else pending.result()

    def save(
        self,
        root: str | Path,
        step: int,
        model: nn.Module,
        optimizer: Optimizer,
        train_state: dict[str, Any],
        keep_last: int = 0,
        *,
        on_commit: Callable[[Path], None] | None = None,
    ) -> Path:
        """`save_checkpoint`, once the save in flight is written."""
        _state_text(step, train_state)
        self.wait()
        return save_checkpoint(root, step, model, optimizer, train_state, keep_last, on_commit=on_commit)

    def save_async(
        self,
        root: str | Path,
        step: int,
        model: nn.Module,
        optimizer: Optimizer,
        train_state: dict[str, Any],
        keep_last: int = 0,
        *,
        on_commit: Callable[[Path], None] | None = None,
    ) -> PendingCheckpoint:
        """`save_checkpoint`, returning once the state is copied to host memory (`_Stager`): the training may
        change the weights right after. DCP writes the copy from a background thread over this checkpointer's gloo
        group, each rank hashes its files there, and rank 0 commits; `PendingCheckpoint.result()` (or the next
        save, or `wait`) waits for it. A copy that fails on any rank raises `CheckpointSaveError` here on every
        rank. Costs host memory for one copy of this rank's state, kept for the next save, which copies into it
        again."""
        began = time.perf_counter()
        _state_text(step, train_state)
        self.wait()
        final, state_text = _begin(root, step, train_state)
        tmp = tmp_dir(final)
        app = _AppState(model, optimizer)
        group = self._background_group()
        self._stager = self._stager or _Stager()
        staged: dict[str, Any] = {}
        try:
            staged = {_APP: self._stager.stage(app.state_dict())}
            error = None
        except Exception as e:
            error = e
        _agreed(step, tmp, error)

        def write() -> Path:
            dcp.save(staged, checkpoint_id=str(tmp), process_group=group, no_dist=not distributed())
            return _finish(final, step, state_text, app.layout, keep_last, group, on_commit)

        executor = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-write")
        self._in_flight = PendingCheckpoint(final, step, time.perf_counter() - began, executor.submit(write))
        executor.shutdown(wait=False)
        return self._in_flight

    def _background_group(self) -> dist.ProcessGroup | None:
        """The group a background save's collectives run on: not the default one, whose collectives the training
        issues meanwhile from the main thread."""
        if not distributed():
            return None
        world = dist.group.WORLD
        if self._group is None or self._group[0] is not world:
            self._group = (world, dist.new_group(backend="gloo"))
        return self._group[1]


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
    missing = [name for name in (COMPLETE_MARKER, DCP_METADATA, TRAIN_STATE_FILE) if not (path / name).is_file()]
    if missing:
        what = ", ".join(missing)
        hint = " (an interrupted save?)" if COMPLETE_MARKER in missing else ""
        raise CheckpointError(f"checkpoint directory {path} is incomplete: missing {what}{hint}")


def _layout_change(path: Path, now: _Layout) -> str | None:
    """How the saving ranks held the state against how this run holds it, when they differ (a resharding load);
    a manifest written before the distributed optimizer or tensor parallelism existed used neither."""
    manifest = read_manifest(path)
    missing = [f.name for f in fields(_Layout) if f.name not in manifest and f.name not in ("distributed", "tp_size")]
    if missing:
        raise CheckpointError(f"checkpoint directory {path}: {MANIFEST_FILE} lacks {missing} (damaged?)")
    saved = _Layout(**{f.name: manifest[f.name] for f in fields(_Layout) if f.name in manifest})
    return None if saved == now else f"saved by {saved.describe()}; loaded by {now.describe()}"


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
        dcp.load({f"{_APP}.model.{name}": tensor for name, tensor in state.items()}, checkpoint_id=str(path))
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise CheckpointError(f"cannot read the model's tensors from {path}: {type(e).__name__}: {e}") from e


def _load(path: Path, model: nn.Module, optimizer: Optimizer) -> tuple[dict[str, Any], str | None]:
    """Restore from a checkpoint directory `verify_checkpoint` passed; (its train state, the layout change)."""
    try:
        train_state = json.loads((path / TRAIN_STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint directory {path}: unreadable {TRAIN_STATE_FILE}: {e}") from e

    app = _AppState(model, optimizer)
    change = _layout_change(path, app.layout)
    _check_model_shapes(path, app.state_dict()["model"], whole=app.spec is None)
    try:
        dcp.load({_APP: app}, checkpoint_id=str(path))
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise CheckpointError(f"checkpoint directory {path}: could not load model/optimizer state: {_short(e)}") from e
    if change is not None:
        logger.info("%s resharded: %s", path, change)
    return train_state, change


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """Restore `model` and `optimizer` in place from the checkpoint at `path`, whatever number of ranks, pipeline
    stages, TP size and ZeRO setting saved it; return its train_state.

    Every rank must call it. A directory without the COMPLETE marker, DCP metadata, train state or manifest,
    a file that does not match the manifest, or contents that do not match the model/optimizer by name and
    global shape raise `CheckpointError` naming the directory (and the file).
    """
    path = Path(path)
    _check_complete(path)
    on_rank0(f"verifying {path}", lambda: verify_checkpoint(path))
    return _load(path, model, optimizer)[0]


def resume_latest(root: str | Path, model: nn.Module, optimizer: Optimizer) -> Resumed | None:
    """Restore the newest checkpoint under `root` that verifies (see `select_checkpoint`); None if there are
    no checkpoints. Every rank must call it."""
    choice = select_checkpoint(root)
    if choice.path is None:
        return None
    train_state, change = _load(choice.path, model, optimizer)
    return Resumed(choice.path, train_state, choice.skipped, change)


_DEPRECATED = {"save_checkpoint_async": "save_async", "wait_for_checkpoint": "wait"}
"""The former module functions of background saves -> the `Checkpointer` method each is now."""


@functools.cache
def _deprecated_checkpointer() -> Checkpointer:
    """The one checkpointer the former module functions share, as their module state did; it goes with them."""
    return Checkpointer()


if not TYPE_CHECKING:  # mypy sees only the current names

    def __getattr__(name: str) -> Any:
        """`save_checkpoint_async` and `wait_for_checkpoint`, for one release: a `Checkpointer` holds a run's saves."""
        if name in _DEPRECATED:
            moved(f"{__name__}.{name}", f"{__name__}.Checkpointer().{_DEPRECATED[name]}")
            return getattr(_deprecated_checkpointer(), _DEPRECATED[name])
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
