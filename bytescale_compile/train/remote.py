"""The remote dataloader on Ray (paper §6): data servers, one scheduler, and a client per training rank.

- `DataServer` actors each own a contiguous range of the prepared dataset's sequences. They serve its
  metadata (the lengths) and token slices; they hold no state but the memory-mapped files, so an actor
  that Ray restarts (`max_restarts`) reopens its shard and answers as before.
- One `Scheduler` actor gathers the servers' lengths, draws the global batches exactly like
  `GlobalBatchSampler` (same seed, same batches), plans and validates each with the run's `PlanRequest`
  (`Runtime.plan_request()`, what the Runtime plans with itself), and keeps up to `prefetch_steps` planned
  steps ahead in a background thread. Each planned
  step is put in the object store once; every rank reads the same object (the broadcast).
- `RemoteBatches`, on each rank, fetches its step's plan and only its own micro-batches' sequences from
  the servers that own them, one step ahead in a background thread, so the rank blocks on data only when
  the loader falls behind. With `prefetch_steps = 0` neither the scheduler nor the clients work ahead:
  every step's planning and transfers are on the critical path (the baseline of the prefetch figure).

Actors are named in `NAMESPACE` from the run directory and strategy, so every torchrun rank finds the
same scheduler (`get_if_exists`). Every `ray.get` has a timeout: a server that cannot be restarted gives
every rank a `DataServerError` naming it, never a hang.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from ..data import GlobalBatchSampler, TokenDataset, open_dataset
from ..engine.runtime import BatchError
from ..planner import Plan, PlanRequest
from .config import ConfigError

__all__ = [
    "DataServerError",
    "GET_TIMEOUT_S",
    "LoadedStep",
    "NAMESPACE",
    "PlannedStep",
    "RayUnavailableError",
    "RemoteBatch",
    "RemoteBatches",
    "check_ray",
    "connect_ray",
    "scheduler_for",
    "server_bounds",
]

NAMESPACE = "bytescale_compile"
GET_TIMEOUT_S = 120.0
"""The longest a rank waits for one answer of the scheduler or a server (a restart included)."""
SERVER_MAX_RESTARTS = 3
_CONNECT_TIMEOUT_S = 5.0
INSTALL_HINT = "pip install 'bytescale_compile[ray]'"
AUTH_MODE_ENV = "RAY_AUTH_MODE"


class RayUnavailableError(ConfigError):
    """`--loader ray` cannot run: Ray is not installed, or the cluster at `--ray-address` does not answer."""


class DataServerError(RuntimeError):
    """A data server or the scheduler failed (restarts exhausted) or did not answer in time."""


@dataclass(frozen=True)
class PlannedStep:
    """One step as the scheduler publishes it: the batch's sequences, their plan, and the sampler state
    after it (what a checkpoint of this step saves)."""

    step: int
    indices: np.ndarray
    """Dataset sequence ids of the global batch."""
    lengths: np.ndarray
    plan: Plan
    plan_time_s: float
    sampler_state: dict


@dataclass
class LoadedStep:
    """What the trainer consumes per step, from either loader."""

    batch: Any
    """A `GlobalBatch` (local) or `RemoteBatch` (ray): `Runtime.step`'s BatchLike."""
    plan: Plan | None
    """None: the rank plans itself (local)."""
    data_wait_s: float
    plan_time_s: float
    sampler_state: dict


@dataclass
class RemoteBatch:
    """A global batch's lengths with the tokens of only this rank's sequences: `Runtime.step` reads no others."""

    lengths: np.ndarray
    rank: int
    sequences: dict[int, torch.Tensor] = field(repr=False)
    """Batch position -> its used tokens (int64)."""

    def tokens(self, seq: int, start: int = 0, end: int | None = None) -> torch.Tensor:
        if seq not in self.sequences:
            raise BatchError(
                f"sequence {seq} of the global batch was not sent to rank {self.rank} (it holds "
                f"{sorted(self.sequences)}): the plan it runs is not the one its data was fetched for"
            )
        return self.sequences[seq][start:end]


def server_bounds(num_sequences: int, servers: int) -> np.ndarray:
    """[servers + 1] sequence ids: server i owns [bounds[i], bounds[i + 1]); at most one server per sequence."""
    count = max(1, min(servers, num_sequences))
    return np.linspace(0, num_sequences, count + 1).round().astype(np.int64)


def check_ray(address: str | None) -> None:
    """Raise `RayUnavailableError` unless Ray imports and, with an `address`, its head accepts a connection.

    Without an `address` the run starts its own head, with token authentication: RAY_AUTH_MODE=token is set
    (unless given) before Ray is first imported, since Ray reads it then, so that the ranks joining the head
    by address present the token it saved in ~/.ray."""
    if address is None:
        os.environ.setdefault(AUTH_MODE_ENV, "token")
    try:
        import ray  # noqa: F401
    except ImportError as e:
        raise RayUnavailableError(f"--loader ray needs Ray, which is not installed ({e}): {INSTALL_HINT}") from e
    if address is None or address == "auto" or "://" in address:
        return
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=_CONNECT_TIMEOUT_S):
            pass
    except (OSError, ValueError) as e:
        raise RayUnavailableError(
            f"--ray-address {address}: no Ray cluster answers there ({e}); start one with "
            f"`ray start --head` or leave --ray-address out to start one on this machine"
        ) from e


def connect_ray(address: str | None, num_cpus: int | None) -> bool:
    """Join the cluster at `address`, else the one this process already runs, else start a local head
    (dashboard off). Returns whether this call connected (the caller shuts down what it connected)."""
    import ray

    if ray.is_initialized():
        return False
    options: dict[str, Any] = {"namespace": NAMESPACE, "log_to_driver": False, "logging_level": logging.ERROR}
    if address is None:
        options.update(num_cpus=num_cpus, include_dashboard=False)
    ray.init(address=address, **options)
    return True


@functools.cache
def _remote_classes() -> tuple[Any, Any]:
    """The actor classes, made once when first needed so that importing this module does not need Ray."""
    import ray

    server = ray.remote(num_cpus=0, max_restarts=SERVER_MAX_RESTARTS, max_task_retries=SERVER_MAX_RESTARTS)(DataServer)
    # ray's overloads of remote() omit the actor options (max_concurrency) that it takes
    scheduler = ray.remote(num_cpus=0, max_concurrency=16)(Scheduler)  # type: ignore[call-overload]
    return server, scheduler


class DataServer:
    """Sequences [lo, hi) of a dataset (a `--data` item, `TokenDataset.spec`): their lengths, and token slices on
    request."""

    def __init__(self, spec: str, lo: int, hi: int) -> None:
        self.dataset = open_dataset(spec)
        self.lo, self.hi = lo, hi

    def lengths(self) -> np.ndarray:
        return np.array(self.dataset.lengths[self.lo : self.hi])

    def read(self, requests: list[tuple[int, int]]) -> np.ndarray:
        """The first `used` tokens of each (sequence id, used) concatenated, int64: one zero-copy object."""
        for index, _ in requests:
            if not self.lo <= index < self.hi:
                raise IndexError(f"sequence {index} is not in this server's range [{self.lo}, {self.hi})")
        if not requests:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([self.dataset.tokens(index, 0, used).numpy() for index, used in requests])


@dataclass
class _Metadata:
    """The global metadata the scheduler samples from: what `GlobalBatchSampler` reads of a dataset."""

    prefix: Path
    lengths: np.ndarray


class Scheduler:
    """Starts the servers, gathers their lengths, draws and plans steps ahead; see the module docstring."""

    def __init__(
        self,
        name: str,
        spec: str,
        servers: int,
        global_tokens: int,
        seed: int,
        max_len: int | None,
        sampler_state: dict,
        first_step: int,
        request: PlanRequest,
        prefetch_steps: int,
    ) -> None:
        import ray

        server_class, _ = _remote_classes()
        num_sequences = len(open_dataset(spec))
        bounds = server_bounds(num_sequences, servers)
        self.bounds = bounds
        self.servers = [
            server_class.options(name=f"{name}-server-{i}").remote(spec, int(lo), int(hi))
            for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:]))
        ]
        lengths = np.concatenate(ray.get([s.lengths.remote() for s in self.servers], timeout=GET_TIMEOUT_S))
        metadata = cast(TokenDataset, _Metadata(Path(spec), lengths))  # no batch's tokens are read here
        self.sampler = GlobalBatchSampler(metadata, global_tokens, seed=seed, max_len=max_len)
        self.sampler.load_state_dict(sampler_state)
        self.request, self.prefetch_steps = request, prefetch_steps
        self._batches = iter(self.sampler)
        self._planned: dict[int, Any] = {}
        self._next, self._wanted = first_step, first_step
        self._error: Exception | None = None
        self._ready = threading.Condition()
        threading.Thread(target=self._plan_ahead, daemon=True, name="scheduler-planner").start()

    def layout(self) -> tuple[list[Any], np.ndarray]:
        """The server handles and their sequence ranges, for the clients."""
        return self.servers, self.bounds

    def step(self, step: int) -> list[Any]:
        """[ref] of step `step`'s `PlannedStep` (a list, so Ray hands back the reference, not the object)."""
        with self._ready:
            self._wanted = max(self._wanted, step)
            self._ready.notify_all()
            self._ready.wait_for(lambda: step in self._planned or self._error is not None)
            if step not in self._planned:
                assert self._error is not None  # what the wait ended on
                raise self._error
            for old in [s for s in self._planned if s < step - 4]:
                del self._planned[old]
            return [self._planned[step]]

    def _plan_ahead(self) -> None:
        import ray

        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._next <= self._wanted + self.prefetch_steps)
                step = self._next
            try:
                planned = ray.put(self._plan(step))
            except Exception as e:  # handed to every rank that asks, as the error of its ray.get
                with self._ready:
                    self._error = e
                    self._ready.notify_all()
                return
            with self._ready:
                self._planned[step] = planned
                self._next += 1
                self._ready.notify_all()

    def _plan(self, step: int) -> PlannedStep:
        batch = next(self._batches)
        began = time.perf_counter()
        step_plan = self.request.plan(batch.lengths)
        return PlannedStep(
            step, batch.indices, batch.lengths, step_plan, time.perf_counter() - began, self.sampler.state_dict()
        )


def scheduler_for(
    run_dir: Path,
    dataset: TokenDataset,
    servers: int,
    global_tokens: int,
    seed: int,
    max_len: int | None,
    sampler_state: dict,
    first_step: int,
    request: PlanRequest,
    prefetch_steps: int,
) -> Any:
    """The run's scheduler actor: created by the first rank that asks, found by the others. Its name holds the run
    directory and the starting point, so a resume never finds the scheduler of an earlier, crashed attempt."""
    _, scheduler_class = _remote_classes()
    key = f"{Path(run_dir).resolve()}|{first_step}|{sorted(sampler_state.items())}"
    name = "scheduler-" + hashlib.sha256(key.encode()).hexdigest()[:12]
    return scheduler_class.options(name=name, get_if_exists=True).remote(
        name,
        dataset.spec,
        servers,
        global_tokens,
        seed,
        max_len,
        sampler_state,
        first_step,
        request,
        prefetch_steps,
    )


class RemoteBatches(Iterator[LoadedStep]):
    """This rank's steps from the scheduler, from `first_step` on, each fetched one step ahead in a background
    thread (`prefetch`; without it, when asked for)."""

    def __init__(
        self, scheduler: Any, rank: int, first_step: int, pin_memory: bool = False, prefetch: bool = True
    ) -> None:
        self.scheduler, self.rank, self.pin_memory, self.prefetch = scheduler, rank, pin_memory, prefetch
        self.servers, self.bounds = _get(scheduler.layout.remote(), "the scheduler")
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="remote-batches")
        self._step = first_step
        self._pending: Future | None = self._pool.submit(self._fetch, first_step) if prefetch else None

    def __next__(self) -> LoadedStep:
        began = time.perf_counter()
        pending = self._pending or self._pool.submit(self._fetch, self._step)
        planned, batch = pending.result()
        waited = time.perf_counter() - began
        self._step = planned.step + 1
        self._pending = self._pool.submit(self._fetch, self._step) if self.prefetch else None
        return LoadedStep(batch, planned.plan, waited, planned.plan_time_s, planned.sampler_state)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _fetch(self, step: int) -> tuple[PlannedStep, RemoteBatch]:
        [ref] = _get(self.scheduler.step.remote(step), "the scheduler")
        planned: PlannedStep = _get(ref, "the scheduler")
        mine = sorted({s for mb in planned.plan.micro_batches_of(self.rank) for s in mb.sequences})
        owners = np.searchsorted(self.bounds, planned.indices[mine], side="right") - 1 if mine else np.zeros(0, int)
        sequences: dict[int, torch.Tensor] = {}
        for server in np.unique(owners):
            seqs = [s for s, owner in zip(mine, owners) if owner == server]
            requests = [(int(planned.indices[s]), int(planned.lengths[s])) for s in seqs]
            # the object store's array is read-only: a copy, as torch tensors are writable
            flat = torch.from_numpy(_get(self.servers[server].read.remote(requests), f"data server {server}").copy())
            if self.pin_memory:
                flat = flat.pin_memory()
            sequences.update(zip(seqs, torch.split(flat, [used for _, used in requests])))
        return planned, RemoteBatch(planned.lengths, self.rank, sequences)


def _get(ref: Any, what: str) -> Any:
    """`ray.get` with a timeout; a dead or silent actor becomes a `DataServerError` naming it, and an error an
    actor raised (a `PlanError` of the scheduler) is raised here as itself, without the actor's traceback."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    try:
        return ray.get(ref, timeout=GET_TIMEOUT_S)
    except GetTimeoutError as e:
        raise DataServerError(f"{what} did not answer within {GET_TIMEOUT_S:.0f} s") from e
    except RayActorError as e:
        raise DataServerError(
            f"{what} died and could not be restarted ({SERVER_MAX_RESTARTS} restarts at most): {e}"
        ) from e
    except RayTaskError as e:
        if isinstance(e.cause, Exception):
            raise e.cause from None
        raise
