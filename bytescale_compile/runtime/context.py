"""The one ambient state the custom ops read: the current micro-batch (and the step's act_ctx, on the same stack).

The compiled graph never changes between micro-batches; what changes (how sequences are packed
into the row, the ring group, the offload ratio) is read from here at run time. Forward and
backward of a micro-batch must run under the same context, as in the paper's Listing 1. `enter`,
`leave` and `innermost` are the only ambient-state helper of the package: the act_ctx of
`runtime/offload.py` goes on this stack too rather than on one of its own.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from .layout import UlyssesLayout, ZigzagLayout
from .p2p import DEFAULT_TIMEOUT_S, P2PStats

__all__ = [
    "MicroBatchContext",
    "current_context",
    "micro_batch",
    "ContextError",
    "enter",
    "innermost",
    "leave",
    "RowPacking",
    "row_packing",
    "restarts",
]

_T = TypeVar("_T")


class ContextError(RuntimeError):
    """A micro-batch context is missing, malformed or does not fit the tensors it is used with."""


@dataclass(frozen=True)
class MicroBatchContext:
    """Run-time description of one micro-batch.

    cu_seqlens: int32/int64 1-D tensor [n_seq + 1] of cumulative sequence lengths of the packed
        row (starts at 0, ends at the row's token count). None means one causal sequence per row.
    group: ordered global ranks sharing this micro-batch; with more than one, attention runs as a
        ring over them and the row holds this rank's zigzag tokens of `layout`.
    layout: the zigzag layout of the micro-batch's sequences over `group` (over its r = len(group) / u
        rings when `ulysses` > 1).
    ulysses: the Ulysses (head-parallel) degree u of the u × r split (`runtime/ulysses.py`); the row then
        holds this rank's tokens of `split_layout`. 1 is the plain ring.
    micro_batch_id: the micro-batch's index in the step (for counters and error messages).
    num_items: the valid next-token targets of the whole global batch (the model protocol's
        `num_items_in_batch`): a sequence's router load-balancing loss weighs its share of them, like its
        cross-entropy (`ops/router.py`). None outside a Runtime step.
    ring_stats: bytes and blocks of every ring call under this context.
    """

    cu_seqlens: torch.Tensor | None = None
    group: tuple[int, ...] | None = None
    layout: ZigzagLayout | None = None
    micro_batch_id: int = 0
    ulysses: int = 1
    ring_timeout_s: float = DEFAULT_TIMEOUT_S
    num_items: int | None = None
    ring_stats: P2PStats = field(default_factory=P2PStats, compare=False)
    _checked_shapes: set = field(default_factory=set, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._check_ulysses()
        if self.group is not None:
            object.__setattr__(self, "group", tuple(int(r) for r in self.group))
            rings = len(self.group) // self.ulysses
            if self.layout is None or self.layout.group_size != rings:
                raise ContextError(
                    f"micro-batch {self.micro_batch_id}: group {list(self.group)} with Ulysses degree {self.ulysses} "
                    f"needs a zigzag layout made for {rings} ranks, got {self.layout}"
                )
            if len(self.group) == 1 and self.cu_seqlens is None:
                bounds = [0]
                for n in self.layout.seq_lens:
                    bounds.append(bounds[-1] + n)
                object.__setattr__(self, "cu_seqlens", torch.tensor(bounds))
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

    def _check_ulysses(self) -> None:
        u = self.ulysses
        if isinstance(u, bool) or not isinstance(u, int) or u < 1:
            raise ContextError(f"micro-batch {self.micro_batch_id}: the Ulysses degree must be an int >= 1, got {u!r}")
        if u > 1 and (self.group is None or len(self.group) % u):
            size = "no group" if self.group is None else f"a group of {len(self.group)} ranks"
            raise ContextError(
                f"micro-batch {self.micro_batch_id}: Ulysses degree {u} must divide the number of ranks sharing "
                f"the micro-batch, got {size}"
            )

    @property
    def split_layout(self) -> UlyssesLayout:
        """The u × r token layout of the group (with u = 1, the zigzag layout itself)."""
        if self.layout is None:
            raise ContextError(f"micro-batch {self.micro_batch_id} is not shared by a group: it has no layout")
        return UlyssesLayout(self.layout, self.ulysses)

    @property
    def seq_lens(self) -> list[int]:
        """Lengths of the packed sequences (empty when the row is one sequence)."""
        if self.cu_seqlens is None:
            return []
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    @property
    def is_ring(self) -> bool:
        """Attention runs as a ring: the group has more than one rank."""
        return self.group is not None and len(self.group) > 1

    def first_use(self, key: tuple) -> bool:
        """True the first time `key` is seen under this context (the ring checks its group once)."""
        if key in self._checked_shapes:
            return False
        self._checked_shapes.add(key)
        return True

    def check_tokens(self, num_tokens: int) -> None:
        """Raise unless the packed sequences cover exactly `num_tokens` tokens."""
        if self.cu_seqlens is not None and int(self.cu_seqlens[-1]) != num_tokens:
            raise ContextError(
                f"micro-batch {self.micro_batch_id}: cu_seqlens covers {int(self.cu_seqlens[-1])} "
                f"tokens but the attention input has {num_tokens}"
            )


# Process-wide, not thread-local: autograd runs the backward of accelerator tensors on its own
# device threads, and `with ctx: loss.backward()` must still reach the ops there.
_stack: list[object] = []
_lock = threading.Lock()


def enter(state: object) -> None:
    """Make `state` ambient until `leave(state)`: the innermost of its type for `innermost`."""
    with _lock:
        _stack.append(state)


def leave(state: object) -> None:
    """End what `enter(state)` began (contexts may end out of order: each removes itself)."""
    with _lock:
        _stack.remove(state)


def innermost(kind: type[_T]) -> _T | None:
    """The innermost ambient state of type `kind`, or None."""
    return next((state for state in reversed(_stack) if isinstance(state, kind)), None)


def current_context() -> MicroBatchContext | None:
    """The innermost active context, or None (plain causal attention)."""
    return innermost(MicroBatchContext)


@contextlib.contextmanager
def micro_batch(
    cu_seqlens: torch.Tensor | list[int] | None = None,
    group: list[int] | tuple[int, ...] | None = None,
    layout: ZigzagLayout | None = None,
    micro_batch_id: int = 0,
    ctx: MicroBatchContext | None = None,
    ulysses: int = 1,
) -> Iterator[MicroBatchContext]:
    """Run forward or backward of one micro-batch.

        with micro_batch(cu_seqlens=[0, 5, 9]): ...                  # packed row on this rank
        with micro_batch(group=[0, 2], layout=zigzag_layout([9], 2)): ...  # shared over ranks 0 and 2

    Pass `ctx=` to re-enter the same context for the backward.
    """
    if ctx is None:
        if isinstance(cu_seqlens, list):
            cu_seqlens = torch.tensor(cu_seqlens, dtype=torch.int64)
        ctx = MicroBatchContext(
            cu_seqlens=cu_seqlens,
            group=None if group is None else tuple(group),
            layout=layout,
            micro_batch_id=micro_batch_id,
            ulysses=ulysses,
        )
    enter(ctx)
    try:
        yield ctx
    finally:
        leave(ctx)


def restarts(position_ids: torch.Tensor, batch: int, tokens: int) -> list[torch.Tensor] | None:
    """Per row, the cu_seqlens of the sequences packed in it: a sequence starts where a position is not its
    predecessor's plus one (Hugging Face's padding-free format). None when no row packs several sequences."""
    pos = position_ids.reshape(-1, tokens).expand(batch, tokens).cpu()
    starts = pos[:, 1:] != pos[:, :-1] + 1
    if not bool(starts.any()):
        return None
    edge = torch.tensor([tokens])
    return [torch.cat([torch.zeros(1, dtype=torch.long), row.nonzero().flatten() + 1, edge]) for row in starts]


@dataclass(frozen=True)
class RowPacking:
    """The packed sequences of each row of a call made outside any micro-batch context.

    An optimized model called on rows that pack sequences (`position_ids` restarting) reads them once and
    makes them ambient for the forward: the convolution and scan ops do not see `position_ids`. The ops return
    where the pieces start, so their backward needs nothing ambient.
    """

    cu_seqlens: tuple[torch.Tensor, ...]

    def row(self, index: int, tokens: int) -> torch.Tensor:
        cu = self.cu_seqlens[index]
        if int(cu[-1]) != tokens:
            raise ContextError(
                f"the packed row has {int(cu[-1])} tokens (from position_ids) but a mixer input has {tokens}"
            )
        return cu


@contextlib.contextmanager
def row_packing(position_ids: torch.Tensor | None, tokens: int) -> Iterator[RowPacking | None]:
    """Make the sequences packed in the rows of `position_ids` ambient (nothing when no row packs several)."""
    found = (
        None if position_ids is None else restarts(position_ids, int(position_ids.reshape(-1, tokens).shape[0]), tokens)
    )
    if found is None:
        yield None
        return
    packing = RowPacking(tuple(found))
    enter(packing)
    try:
        yield packing
    finally:
        leave(packing)
