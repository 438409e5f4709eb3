"""Micro-batch building: a plan's micro-batch → this rank's model inputs and micro-batch context.

Packed (one rank): the sequences concatenated, positions restarting per sequence, `cu_seqlens` in the
context. Shared (a ring): this rank's zigzag chunks of every sequence, their original positions, and
the group and layout in the context. Either way `shift_labels` hold each token's true next token —
read one token past every chunk, so a label that lives on another rank's chunk is still right — and
-100 at every sequence's last token (`protocol.py` builds them). `num_items_in_batch` counts the targets
of the whole global batch, so every rank's summed loss is already token-level (paper §4.1, Eq. 2 = Eq. 1).

Also here, shared by the HDP `Runtime` and the pipeline executor: what a global batch must offer
(`BatchLike`, `ListBatch`), what one rank's micro-batches of a step did (`RankWork`, timed by a `Stopwatch`), and
the errors of the model protocol and of a bad batch. Every token a micro-batch reads is checked against the
vocabulary while it is still on the host (`ids_checked`): an id past the embedding names its dataset and sequence
instead of failing as an `IndexError` inside the compiled forward.

Nothing between a step's micro-batches waits for the device: every micro-batch's inputs are built on the host and
copied at the start of the step (`device_inputs`: pinned and non-blocking on CUDA, where a pageable copy
synchronizes), the loss is summed on the device, and busy time comes from CUDA events read once the step's work is
done.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ..data import GlobalBatch, MixedDataset
from ..kernels.transfer import to_device
from ..planner.plan import MicroBatch
from ..runtime.context import MicroBatchContext
from ..runtime.layout import UlyssesLayout, zigzag_layout
from .protocol import ModelProtocolError, ProtocolInputs, next_token_labels, num_targets, packed_row

__all__ = [
    "BatchError",
    "BatchLike",
    "ListBatch",
    "MicroBatchInputs",
    "ModelProtocolError",
    "RankWork",
    "Stopwatch",
    "TokenReader",
    "build_micro_batch",
    "device_inputs",
    "ids_checked",
    "num_targets",
]

TokenReader = Callable[[int, int, int], torch.Tensor]
"""read(seq, start, end) -> int64 tokens [start, end) of the global batch's sequence `seq`."""


class BatchError(ValueError):
    """A global batch the runtime cannot train on: not 1-D integer token ids inside the vocabulary."""


class BatchLike(Protocol):
    """What `Runtime.step` reads: every length, and tokens only of this rank's micro-batches."""

    @property
    def lengths(self) -> np.ndarray: ...

    def tokens(self, seq: int, start: int = 0, end: int | None = None) -> torch.Tensor: ...


class Stopwatch:
    """Seconds of a rank's device work between marks, and its busy spans: CUDA events on the current stream on CUDA,
    `perf_counter` elsewhere (where the host's time is the device's).

    Recording an event waits for nothing; its time is read only once the device has passed it (`wait`, or any
    later host read of the stream's work), so timing adds no host sync between micro-batches."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._marks: list[float | torch.cuda.Event] = []
        self._spans: list[tuple[int, int]] = []
        self._open: int | None = None

    def mark(self) -> int:
        """Note this point of the device's work; its index for `seconds`."""
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())
        return len(self._marks) - 1

    def start(self) -> None:
        """Open a busy span (`stop` closes it)."""
        if self._open is not None:
            raise RuntimeError("Stopwatch.start() called twice without stop(): busy spans do not nest")
        self._open = self.mark()

    def stop(self) -> None:
        if self._open is None:
            raise RuntimeError("Stopwatch.stop() called without start()")
        self._spans.append((self._open, self.mark()))
        self._open = None

    def wait(self) -> None:
        """Block the host until the device has done all the work queued so far (on CUDA; elsewhere it has)."""
        if self._cuda:
            self._marks[self.mark()].synchronize()  # type: ignore[union-attr]

    def seconds(self, start: int, end: int) -> float:
        """Seconds from mark `start` to mark `end`; on CUDA only once the device has passed `end`."""
        first, last = self._marks[start], self._marks[end]
        if isinstance(first, torch.cuda.Event) and isinstance(last, torch.cuda.Event):
            return first.elapsed_time(last) / 1000.0
        return float(last) - float(first)  # type: ignore[arg-type]

    @property
    def busy(self) -> float:
        """Seconds in the closed busy spans."""
        return sum(self.seconds(start, end) for start, end in self._spans)


@dataclass(frozen=True)
class RankWork:
    """What one rank's micro-batches of a step did (`Runtime.forward_backward`), before any reduction; read on the
    host only when the step's figures are gathered."""

    loss: torch.Tensor
    """This rank's summed loss: a 0-dim tensor on the device, not yet read."""
    busy: Stopwatch
    """Its busy spans: seconds in its micro-batches (`Stopwatch.busy`), readable once the device has done them."""
    micro_batches: int
    p2p_bytes: int
    offloaded_bytes: int
    peak_saved_bytes: int
    stage_bytes: int = 0
    """Hidden states and their gradients sent to the neighbouring pipeline stages (0 without pipelines)."""
    mixer_bytes: int = 0
    """Of `p2p_bytes`: the halos and state summaries of convolutions and scans (hybrid models)."""


class ListBatch:
    """A list of 1-D integer token tensors as a batch, checked against the vocabulary."""

    def __init__(self, sequences: Sequence[torch.Tensor], vocab_size: int | None) -> None:
        self.sequences = [torch.as_tensor(s) for s in sequences]
        for i, seq in enumerate(self.sequences):
            if seq.dim() != 1 or seq.numel() == 0:
                raise BatchError(
                    f"sequence {i} has shape {tuple(seq.shape)}: each sequence must be a non-empty 1-D "
                    f"tensor of token ids"
                )
            if seq.dtype.is_floating_point or seq.dtype.is_complex or seq.dtype == torch.bool:
                raise BatchError(f"sequence {i} holds {seq.dtype} values: token ids must be integers")
            low, high = int(seq.min()), int(seq.max())
            if low < 0 or (vocab_size is not None and high >= vocab_size):
                raise BatchError(
                    f"sequence {i} holds token id {low if low < 0 else high}, outside the model's "
                    f"vocabulary of {vocab_size} (ids 0 to {(vocab_size or 1) - 1})"
                )
        self.lengths = np.array([s.numel() for s in self.sequences], dtype=np.int64)

    def tokens(self, seq: int, start: int = 0, end: int | None = None) -> torch.Tensor:
        return self.sequences[seq][start:end].long()


class VocabularyCheckedBatch:
    """`batch`, whose every read is checked against the vocabulary on the host (a tensor read onto a device is
    passed as it is: checking it there would wait for the device)."""

    def __init__(self, batch: BatchLike, vocab_size: int) -> None:
        self.batch, self.vocab_size = batch, vocab_size

    @property
    def lengths(self) -> np.ndarray:
        return self.batch.lengths

    def tokens(self, seq: int, start: int = 0, end: int | None = None) -> torch.Tensor:
        ids = self.batch.tokens(seq, start, end)
        if ids.device.type == "cpu" and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            at = int(torch.nonzero((ids < 0) | (ids >= self.vocab_size))[0, 0])
            where, spec = _sequence_of(self.batch, seq)
            raise BatchError(
                f"{where} holds token id {int(ids[at])} at position {start + at}, outside the model's vocabulary "
                f"of {self.vocab_size} (ids 0 to {self.vocab_size - 1}): the data was tokenized with a larger "
                f"vocabulary than it declares or the model has; `bytescale-compile data check --data {spec} "
                f"--vocab-size {self.vocab_size}` scans every id"
            )
        return ids


def ids_checked(batch: BatchLike, vocab_size: int | None) -> BatchLike:
    """`batch` with its reads checked against `vocab_size` (`VocabularyCheckedBatch`); as it is without one, or for
    a `ListBatch`, checked whole when it was made."""
    if vocab_size is None or isinstance(batch, ListBatch):
        return batch
    return VocabularyCheckedBatch(batch, vocab_size)


def _sequence_of(batch: BatchLike, seq: int) -> tuple[str, str]:
    """Where the global batch's sequence `seq` comes from, in words, and the `--data` spec that opens it."""
    if not isinstance(batch, GlobalBatch):
        return f"sequence {seq} of the global batch", "SPEC"
    index, data = int(batch.indices[seq]), batch.dataset
    if isinstance(data, MixedDataset):
        part = int(data.part_of([index])[0])
        index -= data.starts[part]
        data = data.parts[part]
    spec = getattr(data, "spec", str(data.prefix))
    return f"dataset {spec}: sequence {index} (sequence {seq} of the global batch)", spec


@dataclass(frozen=True)
class MicroBatchInputs:
    micro_batch: MicroBatch
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    shift_labels: torch.Tensor
    num_items_in_batch: torch.Tensor
    context: MicroBatchContext

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def to(self, device: torch.device) -> MicroBatchInputs:
        """These inputs on `device` (`to_device`); the context's tables stay on the host, where the ops read them."""
        return dataclasses.replace(
            self,
            input_ids=to_device(self.input_ids, device),
            position_ids=to_device(self.position_ids, device),
            shift_labels=to_device(self.shift_labels, device),
            num_items_in_batch=to_device(self.num_items_in_batch, device),
        )

    def model_kwargs(self, labels: bool = False) -> dict[str, torch.Tensor]:
        """The model protocol's kwargs; `labels` adds `labels` = `shift_labels` (what a Hugging Face forward reads
        its targets from)."""
        row = ProtocolInputs(self.input_ids, self.position_ids, self.shift_labels, self.num_items_in_batch)
        return row.kwargs(labels=labels)


def device_inputs(inputs: list[MicroBatchInputs], device: torch.device) -> list[MicroBatchInputs]:
    """Every micro-batch's host-built `inputs` on `device`, their copies issued together at the start of a step so
    that none waits for the device between micro-batches."""
    return [i.to(device) for i in inputs]


def _chunk(read: TokenReader, seq: int, seq_len: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [start, end) of a sequence and their next-token labels (one token read past the end)."""
    tokens = read(seq, start, min(end + 1, seq_len))
    return tokens[: end - start], next_token_labels(tokens, ends_sequence=end == seq_len)


def build_micro_batch(
    mb: MicroBatch, rank: int, lengths: np.ndarray, read: TokenReader, num_items: int
) -> MicroBatchInputs:
    """This rank's inputs for micro-batch `mb` of a plan over the global batch `lengths`."""
    if rank not in mb.ranks:
        raise ValueError(f"rank {rank} is not among micro-batch {mb.id}'s ranks {list(mb.ranks)}")
    lens = [int(lengths[s]) for s in mb.sequences]
    return _shared(mb, rank, lens, read, num_items) if mb.shared else _packed(mb, lens, read, num_items)


def _packed(mb: MicroBatch, lens: list[int], read: TokenReader, num_items: int) -> MicroBatchInputs:
    """The whole sequences of `mb` in one row, positions restarting per sequence, `cu_seqlens` in the context."""
    row = packed_row(torch.cat([read(seq, 0, n) for seq, n in zip(mb.sequences, lens)]), lens, num_items=num_items)
    cu_seqlens = torch.tensor(np.concatenate([[0], np.cumsum(lens)]))
    context = MicroBatchContext(cu_seqlens=cu_seqlens, micro_batch_id=mb.id)
    return MicroBatchInputs(mb, row.input_ids, row.position_ids, row.shift_labels, row.num_items_in_batch, context)


def _shared(mb: MicroBatch, rank: int, lens: list[int], read: TokenReader, num_items: int) -> MicroBatchInputs:
    """This rank's pieces of `mb`'s sequences: the zigzag over the r rings, each ring position's tokens cut into u
    parts (u = 1: the ring), at their positions in their sequences."""
    layout = zigzag_layout(lens, len(mb.ranks) // mb.ulysses)
    mine = UlyssesLayout(layout, mb.ulysses).rank(mb.ranks.index(rank))
    ids, positions, labels = [], [], []
    for piece in mine.pieces:
        if piece.length == 0:  # sequences shorter than 2N leave some chunks empty
            continue
        lo = int(mine.position_ids[piece.offset])  # where the piece starts in its sequence
        tokens, next_tokens = _chunk(read, mb.sequences[piece.seq], lens[piece.seq], lo, lo + piece.length)
        ids.append(tokens)
        labels.append(next_tokens)
        positions.append(torch.arange(lo, lo + piece.length))
    context = MicroBatchContext(group=mb.ranks, layout=layout, micro_batch_id=mb.id, ulysses=mb.ulysses)
    return MicroBatchInputs(
        mb, torch.cat(ids)[None], torch.cat(positions)[None], torch.cat(labels)[None], torch.tensor(num_items), context
    )
