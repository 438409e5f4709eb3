"""Process-group set-up for scripts launched by `torchrun`, safe across elastic restarts."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

__all__ = ["init_distributed"]


def init_distributed(backend: str | None = None, timeout: datetime.timedelta | None = None) -> str:
    """`init_process_group` for this rank; returns the backend (NCCL with CUDA, else gloo).

    Under torchrun the ranks meet in the elastic agent's store, which outlives a restart: a restarted
    worker group would read the gloo addresses the crashed one published there and fail to connect
    ("Connection refused") or hang. Every restart attempt therefore gets its own key prefix.
    """
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    timeout = timeout or datetime.timedelta(minutes=10)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout)
        return backend
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                                is_master=False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"bytescale/attempt_{attempt}", agent_store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    return backend
