"""SIGTERM and Ctrl-C as requests to stop at the next step boundary, with a checkpoint.

A cluster preempts a job with SIGTERM and a grace period; a user stops one with Ctrl-C, which torchrun (or the
trainer's own launcher) passes on to the workers. Either way a
rank must not die mid-step: the signal only records the request, and at the end of each step every rank
learns (one all-reduce of a flag) whether any rank was asked to stop, so all of them stop after the same
step, save it and leave together. A signal repeated later than `FORCE_AFTER_S` after the first means "stop
now": it raises KeyboardInterrupt where the process is.
"""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType

import torch
import torch.distributed as dist

__all__ = ["FORCE_AFTER_S", "SAVE_FAILED_EXIT", "StopRequest", "Stopped"]

FORCE_AFTER_S = 2.0
"""A second signal sooner than this is the same request arriving twice (a key held, or sent to a whole group)."""
_HANDLED = (signal.SIGTERM, signal.SIGINT)
SAVE_FAILED_EXIT = 3
"""The exit status of a run whose checkpoint could not be saved (at a stop on a signal, or any other): a
scheduler must not take it for a preemption handled as asked, which exits 0."""


class Stopped(Exception):
    """The run stopped early on a signal, after `step` (its checkpoint saved when checkpoints are on, unless
    `save_error` says why that save failed)."""

    def __init__(
        self, signal_name: str, step: int, checkpoint: str | None, *, save_error: Exception | None = None
    ) -> None:
        self.signal_name, self.step, self.checkpoint, self.save_error = signal_name, step, checkpoint, save_error
        if save_error is not None:
            saved = f" without a checkpoint: {save_error}"
        elif checkpoint:
            saved = f": checkpoint {checkpoint} saved; continue with --resume"
        else:
            saved = ": no checkpoint saved"
        super().__init__(f"stopped by {signal_name} after step {step}{saved}")

    @property
    def exit_code(self) -> int:
        """0 for SIGTERM (a preemption handled as asked), 130 for Ctrl-C, as shells report an interrupt;
        `SAVE_FAILED_EXIT` for either when the checkpoint failed."""
        if self.save_error is not None:
            return SAVE_FAILED_EXIT
        return 0 if self.signal_name == "SIGTERM" else 128 + signal.SIGINT


class StopRequest:
    """Installed for the duration of a run (a context manager; only the main thread can take signals, so
    elsewhere nothing is installed and no rank stops early); `agreed()` at each step boundary."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._first = 0.0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is not threading.main_thread():
            return self
        for number in _HANDLED:
            self._previous[number] = signal.signal(number, self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _record(self, number: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self.signal_name is None:
            self.signal_name, self._first = signal.Signals(number).name, now
        elif now - self._first > FORCE_AFTER_S:
            raise KeyboardInterrupt

    def agreed(self, device: torch.device) -> str | None:
        """The signal to stop on when any rank received one (every rank must call it at the same boundary);
        SIGTERM wins over SIGINT, so a preempted job exits 0."""
        code = {None: 0, "SIGINT": 1, "SIGTERM": 2}[self.signal_name]
        if dist.is_initialized():
            flag = torch.tensor([code], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            code = int(flag.item())
        return {0: None, 1: "SIGINT", 2: "SIGTERM"}[code]
