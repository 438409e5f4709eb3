"""The one ambient object the custom ops read: the current micro-batch.

The compiled graph never changes between micro-batches; what changes (how sequences are packed
into the row, later the ring group and offload ratio) is read from here at run time. Forward and
backward of a micro-batch must run under the same context, as in the paper's Listing 1.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = ["MicroBatchContext", "current_context", "micro_batch", "ContextError"]


class ContextError(RuntimeError):
    """A micro-batch context is missing, malformed or does not fit the tensors it is used with."""


@dataclass(frozen=True)
class MicroBatchContext:
    """Run-time description of one micro-batch.

    cu_seqlens: int32/int64 1-D tensor [n_seq + 1] of cumulative sequence lengths of the packed
        row (starts at 0, ends at the row's token count). None means one causal sequence per row.
    micro_batch_id: the micro-batch's index in the step (for counters and error messages).
    """

    cu_seqlens: torch.Tensor | None = None
    micro_batch_id: int = 0

    def __post_init__(self) -> None:
        cu = self.cu_seqlens
        if cu is None:
            return
        if cu.dim() != 1 or cu.numel() < 2 or cu.dtype not in (torch.int32, torch.int64):
            raise ContextError(
                f"cu_seqlens must be a 1-D int32/int64 tensor with at least 2 entries, got "
                f"shape {tuple(cu.shape)} dtype {cu.dtype}"
            )
        cpu = cu.detach().cpu()
        if int(cpu[0]) != 0 or bool((cpu[1:] < cpu[:-1]).any()):
            raise ContextError(f"cu_seqlens must start at 0 and never decrease, got {cpu.tolist()}")
        object.__setattr__(self, "cu_seqlens", cpu.to(torch.int64))

    @property
    def seq_lens(self) -> list[int]:
        """Lengths of the packed sequences (empty when the row is one sequence)."""
        if self.cu_seqlens is None:
            return []
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    def check_tokens(self, num_tokens: int) -> None:
        """Raise unless the packed sequences cover exactly `num_tokens` tokens."""
        if self.cu_seqlens is not None and int(self.cu_seqlens[-1]) != num_tokens:
            raise ContextError(
                f"micro-batch {self.micro_batch_id}: cu_seqlens covers {int(self.cu_seqlens[-1])} "
                f"tokens but the attention input has {num_tokens}"
            )


_local = threading.local()


def current_context() -> MicroBatchContext | None:
    """The innermost active context of this thread, or None (plain causal attention)."""
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def micro_batch(cu_seqlens: torch.Tensor | list[int] | None = None, micro_batch_id: int = 0) -> Iterator[MicroBatchContext]:
    """Run forward or backward of one micro-batch: `with micro_batch(cu_seqlens=[0, 5, 9]): ...`."""
    if isinstance(cu_seqlens, list):
        cu_seqlens = torch.tensor(cu_seqlens, dtype=torch.int64)
    ctx = MicroBatchContext(cu_seqlens=cu_seqlens, micro_batch_id=micro_batch_id)
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(ctx)
    try:
        yield ctx
    finally:
        stack.pop()
