"""Run a function on N gloo ranks on localhost: for the tests and the CPU benchmarks.

Training runs use `torchrun`; this is for code that needs a few ranks inside one command. The ranks are forked
from a server process that has imported torch, transformers and the package once (multiprocessing's
forkserver), so a rank starts in a fraction of a second where a spawned one imports them again (about 10 s of
CPU each on 2 cores). Each rank starts as clean as a spawned one, with the caller's environment at the call;
only what those modules read from the environment at import is the server's (it starts on the first call).
It stands outside the layers: nothing in the package imports it.
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

_PRELOAD = ["torch", "torch.distributed", "transformers", "bytescale_compile.api", "bytescale_compile.engine.runtime"]
"""What every rank imports, imported once by the fork server (one that is not installed is skipped)."""


def free_port() -> int:
    """A TCP port free on localhost now, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int,
    fn: Callable[..., None],
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    meet_at_exit: bool,
    environ: dict[str, str],
) -> None:
    os.environ.clear()
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
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
    mp.set_forkserver_preload(_PRELOAD)  # read when the server starts, at the first call
    mp.start_processes(
        _entry,
        args=(fn, world_size, free_port(), args, meet_at_exit, dict(os.environ)),
        nprocs=world_size,
        start_method="forkserver",
    )
