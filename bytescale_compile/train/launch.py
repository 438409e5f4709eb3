"""Process-group set-up for scripts launched by `torchrun`, safe across elastic restarts, and a launcher of
the trainer's ranks on one machine that reports like the ranks do."""

from __future__ import annotations

import datetime
import logging
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["DistEnv", "SHUTDOWN_TIMEOUT_S", "init_distributed", "launch_local", "local_device", "record_exit_status"]

SHUTDOWN_TIMEOUT_S = 300
"""How long `launch_local` lets the ranks finish their step and save it after a signal before killing them
(torchrun's default is 30 s)."""
_EXIT_STATUS_DIR = "BYTESCALE_EXIT_STATUS_DIR"
"""Where `launch_local` has each rank leave its exit status (`record_exit_status`): torch's launcher stops the
ranks itself on a signal and keeps their statuses to itself."""


@dataclass(frozen=True)
class DistEnv:
    """This rank's place in the run."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    """cuda:LOCAL_RANK with CUDA, else the CPU."""


def local_device(local_rank: int = 0) -> torch.device:
    """cuda:`local_rank` when CUDA is available, else the CPU."""
    return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")


def init_distributed(backend: str | None = None, timeout: datetime.timedelta | None = None) -> DistEnv:
    """Set this rank's device, then `init_process_group` (NCCL with CUDA, else gloo).

    With CUDA each rank owns `cuda:LOCAL_RANK`: `set_device` and `device_id` come before any
    communication, so NCCL never puts two ranks' communicators on GPU 0. Under torchrun the ranks
    meet in the elastic agent's store, which outlives a restart: a restarted worker group would read
    the gloo addresses the crashed one published there and fail to connect ("Connection refused") or
    hang. Every restart attempt therefore gets its own key prefix.
    """
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    timeout = timeout or datetime.timedelta(minutes=10)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = local_device(local_rank)
    options: dict = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        options["device_id"] = device
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        agent_store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False, timeout=timeout
        )
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        options.update(
            store=dist.PrefixStore(f"bytescale/attempt_{attempt}", agent_store), rank=rank, world_size=world_size
        )
    dist.init_process_group(backend, timeout=timeout, **options)
    return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, backend, device)


def launch_local(nproc: int, module: str, argv: Sequence[str]) -> int:
    """Run `python -m module ARGV` as `nproc` ranks on this machine, as `torchrun --standalone` does, and return
    their exit status without torchrun's report: the ranks print their own one-line errors, and a first-failure
    table and a traceback of the launcher would bury them. A signal (Ctrl-C, SIGTERM) is passed to the ranks,
    which stop after their step; the status is then the ranks' (0 for SIGTERM with a checkpoint, 130 for Ctrl-C,
    3 when the checkpoint failed), or 128 + the signal when a rank left none (the signal ended it before it could
    stop cleanly, or it was killed after `SHUTDOWN_TIMEOUT_S`)."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for name in list(logging.root.manager.loggerDict):  # each of torch's elastic modules sets its own level
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"bytescale-{os.getpid()}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )
    with tempfile.TemporaryDirectory(prefix="bytescale-exit-") as statuses:
        os.environ[_EXIT_STATUS_DIR] = statuses
        try:
            elastic_launch(config, sys.executable)("-m", module, *argv)
        except ChildFailedError as e:
            return e.get_first_failure()[1].exitcode or 1
        except SignalException as e:
            return _stopped_status(Path(statuses), nproc, int(e.sigval))
        finally:
            del os.environ[_EXIT_STATUS_DIR]
    return 0


def record_exit_status(status: int) -> None:
    """Leave this rank's exit status where `launch_local` reads it (nothing under another launcher)."""
    if directory := os.environ.get(_EXIT_STATUS_DIR):
        Path(directory, os.environ.get("RANK", "0")).write_text(str(status), encoding="utf-8")


def _stopped_status(statuses: Path, nproc: int, signal_number: int) -> int:
    """The first non-zero status of ranks stopped by signal `signal_number`; 128 + it for a rank that left none."""
    for rank in range(nproc):
        path = statuses / str(rank)
        status = int(path.read_text(encoding="utf-8")) if path.is_file() else 128 + signal_number
        if status:
            return status
    return 0
