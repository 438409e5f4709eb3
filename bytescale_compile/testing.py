"""Run a function on N gloo ranks on localhost (spawned processes): for the tests and the CPU benchmarks.

Training runs use `torchrun`; this is for code that needs a few ranks inside one command. It stands outside
the layers: nothing in the package imports it.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_distributed", "free_port"]


def free_port() -> int:
    """A TCP port free on localhost now, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int, fn: Callable[..., None], world_size: int, port: int, args: tuple[Any, ...], meet_at_exit: bool
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120))
    try:
        fn(rank, world_size, *args)
        if meet_at_exit:
            dist.barrier()  # no rank tears the groups down while another may still use them
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable[..., None], world_size: int, *args: Any, meet_at_exit: bool = True) -> None:
    """Run `fn(rank, world_size, *args)` on every rank; an exception on any rank fails the caller. The ranks meet
    at a barrier before tearing down, unless `meet_at_exit=False`: for a test where a rank leaves on purpose and
    the others must see it gone."""
    mp.start_processes(
        _entry, args=(fn, world_size, free_port(), args, meet_at_exit), nprocs=world_size, start_method="spawn"
    )
