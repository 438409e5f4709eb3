"""Zigzag layout of a shared micro-batch (paper §6, "Dist-attn with Packing").

Every sequence is cut into 2N contiguous chunks as equal as possible (no padding); group rank i holds
chunks i and 2N-1-i of every sequence. Under a causal mask the work of chunk c grows with c, so
pairing c with 2N-1-c gives every rank the same attention area and the same ring traffic.

The masks need only chunk order and positions: a query chunk attends to earlier chunks of its own
sequence, causally to itself, and not at all to later chunks or other sequences; a sliding window `w`
(Hugging Face's: a query sees itself and the w-1 keys before it) cuts that down further.
`ZigzagLayout.blocks(i, j, window)` lists the non-empty (query range, key range) pairs of rank i's
queries against rank j's keys, both trimmed to the tokens the window lets meet, and
`ZigzagLayout.transfer(i, j, window)` the rows of rank j's K/V that those blocks read: exactly what
the ring moves from j to i. Both are pure functions of the layout, so every rank derives the same.

`UlyssesLayout` adds a head-parallel (DeepSpeed-Ulysses) degree u beside the ring: the zigzag layout
over r "virtual ranks", each virtual rank's tokens cut into u contiguous parts, one per member of its
Ulysses group (global index g = ring index × u + Ulysses index). An all-to-all inside the Ulysses group
reassembles the virtual rank's tokens in order, so the ring sees exactly its zigzag layout over r ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

__all__ = [
    "Piece",
    "Block",
    "Transfer",
    "RankLayout",
    "ZigzagLayout",
    "zigzag_layout",
    "UlyssesLayout",
    "ulysses_layout",
    "validate_window",
    "LayoutError",
]


class LayoutError(ValueError):
    """A layout that cannot be built or does not fit its tensors."""


@dataclass(frozen=True)
class Piece:
    """One chunk of one sequence as a rank holds it (under a Ulysses split, the part of the chunk in the rank's
    part): `length` tokens at local offset `offset`."""

    seq: int
    chunk: int
    offset: int
    length: int


@dataclass(frozen=True)
class Block:
    """Query rows × key rows that the mask does not empty; `causal` on the diagonal chunk.

    `offset` is the position of the first query minus that of the first key (the block kernels'
    `offset`): with it a kernel places the causal diagonal and the window's edge inside the block.
    `window` is the window the kernel must apply: None where it hides no key of the block from any of
    its queries, so the kernel can take its unmasked path.
    """

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    causal: bool
    offset: int
    window: int | None = None


@dataclass(frozen=True)
class Transfer:
    """The K/V rows of one rank that another rank's blocks read: what travels between the two.

    `ranges` are merged, ascending [start, end) row ranges of the sender's local tokens; they are
    packed back to back into one buffer, and `blocks` are the receiver's blocks with key rows in that
    buffer. No ranges: the pair exchanges nothing.
    """

    ranges: tuple[tuple[int, int], ...]
    blocks: tuple[Block, ...]

    @property
    def num_rows(self) -> int:
        return sum(end - start for start, end in self.ranges)


@dataclass(frozen=True)
class RankLayout:
    token_index: torch.Tensor
    """Indices of this rank's tokens into the concatenated sequences, ascending."""
    position_ids: torch.Tensor
    """Each token's position in its own sequence."""
    pieces: tuple[Piece, ...]

    @property
    def num_tokens(self) -> int:
        return int(self.token_index.numel())


@dataclass(frozen=True)
class ZigzagLayout:
    seq_lens: tuple[int, ...]
    group_size: int
    _ranks: dict[int, RankLayout] = field(default_factory=dict, init=False, repr=False, compare=False)
    _blocks: dict[tuple[int, int, int | None], tuple[Block, ...]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _transfers: dict[tuple[int, int, int | None], Transfer] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise LayoutError(f"group_size must be >= 1, got {self.group_size}")
        bad = [n for n in self.seq_lens if not isinstance(n, int) or n < 1]
        if not self.seq_lens or bad:
            raise LayoutError(f"seq_lens must be a non-empty list of positive ints, got {list(self.seq_lens)}")

    @property
    def num_chunks(self) -> int:
        return 2 * self.group_size

    @property
    def total_tokens(self) -> int:
        return sum(self.seq_lens)

    def chunk_bounds(self, seq: int) -> list[int]:
        """Start offsets (within the sequence) of its 2N chunks, plus its length; earlier chunks get the remainder."""
        n, c = self.seq_lens[seq], self.num_chunks
        base, extra = divmod(n, c)
        bounds = [0]
        for i in range(c):
            bounds.append(bounds[-1] + base + (1 if i < extra else 0))
        return bounds

    def chunks_of(self, rank: int) -> tuple[int, int]:
        return rank, self.num_chunks - 1 - rank

    def rank(self, rank: int) -> RankLayout:
        if not 0 <= rank < self.group_size:
            raise LayoutError(f"rank {rank} is outside the group of {self.group_size}")
        if rank not in self._ranks:
            self._ranks[rank] = self._build_rank(rank)
        return self._ranks[rank]

    def _build_rank(self, rank: int) -> RankLayout:
        starts = [0]
        for n in self.seq_lens[:-1]:
            starts.append(starts[-1] + n)
        index, positions, pieces, offset = [], [], [], 0
        for seq, start in enumerate(starts):
            bounds = self.chunk_bounds(seq)
            for chunk in self.chunks_of(rank):
                lo, hi = bounds[chunk], bounds[chunk + 1]
                index.append(torch.arange(start + lo, start + hi))
                positions.append(torch.arange(lo, hi))
                pieces.append(Piece(seq, chunk, offset, hi - lo))
                offset += hi - lo
        return RankLayout(torch.cat(index), torch.cat(positions), tuple(pieces))

    def blocks(self, q_rank: int, kv_rank: int, window: int | None = None) -> tuple[Block, ...]:
        """Non-empty mask blocks of `q_rank`'s queries against `kv_rank`'s keys, in local rows.

        With a `window`, each block keeps only the keys some of its queries see and the queries that
        see some of its keys; a block with none left is dropped.
        """
        key = (q_rank, kv_rank, validate_window(window))
        if key not in self._blocks:
            self._blocks[key] = self._build_blocks(q_rank, kv_rank, window)
        return self._blocks[key]

    def _build_blocks(self, q_rank: int, kv_rank: int, window: int | None) -> tuple[Block, ...]:
        blocks = []
        for qp in self.rank(q_rank).pieces:
            for kp in self.rank(kv_rank).pieces:
                if qp.seq == kp.seq and kp.chunk <= qp.chunk:
                    block = self._trimmed_block(qp, kp, window)
                    if block is not None:
                        blocks.append(block)
        return tuple(blocks)

    def _trimmed_block(self, qp: Piece, kp: Piece, window: int | None) -> Block | None:
        """Query piece `qp` against an earlier (or the same) chunk `kp` of its sequence, cut to what the window lets meet.

        Under the causal mask key j is seen by query p when j <= p and p - j < window: the keys reach
        back to q_lo - window + 1, and the queries that see any key end at k_hi + window - 2.
        """
        bounds = self.chunk_bounds(qp.seq)
        q_lo, q_hi = bounds[qp.chunk], bounds[qp.chunk + 1]
        k_lo, k_hi = bounds[kp.chunk], bounds[kp.chunk + 1]
        if window is not None:
            k_lo = max(k_lo, q_lo - window + 1)
            q_hi = min(q_hi, k_hi + window - 1)
        q_lo = max(q_lo, k_lo)
        if q_lo >= q_hi or k_lo >= k_hi:
            return None
        q_base = qp.offset - bounds[qp.chunk]
        k_base = kp.offset - bounds[kp.chunk]
        cuts = window is not None and (q_hi - 1) - k_lo >= window  # the farthest pair lies outside the window
        return Block(
            q_base + q_lo,
            q_base + q_hi,
            k_base + k_lo,
            k_base + k_hi,
            causal=kp.chunk == qp.chunk,
            offset=q_lo - k_lo,
            window=window if cuts else None,
        )

    def transfer(self, q_rank: int, kv_rank: int, window: int | None = None) -> Transfer:
        """The rows of `kv_rank`'s K/V that `q_rank`'s blocks read, and those blocks on the packed rows."""
        key = (q_rank, kv_rank, validate_window(window))
        if key not in self._transfers:
            self._transfers[key] = _pack(self.blocks(q_rank, kv_rank, window))
        return self._transfers[key]

    def rank_tokens(self) -> list[int]:
        """Local token count of every group rank (they differ by at most 2 per sequence)."""
        return [self.rank(i).num_tokens for i in range(self.group_size)]


@dataclass(frozen=True)
class UlyssesLayout:
    """The zigzag layout over `ring.group_size` virtual ranks, each virtual rank's tokens cut into `ulysses`
    contiguous parts; with `ulysses == 1` its ranks are exactly `ring`'s."""

    ring: ZigzagLayout
    ulysses: int

    def __post_init__(self) -> None:
        if isinstance(self.ulysses, bool) or not isinstance(self.ulysses, int) or self.ulysses < 1:
            raise LayoutError(f"the Ulysses degree must be an int >= 1, got {self.ulysses!r}")

    @property
    def group_size(self) -> int:
        return self.ring.group_size * self.ulysses

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return self.ring.seq_lens

    def part_bounds(self, ring_index: int) -> list[int]:
        """Offsets into virtual rank `ring_index`'s tokens where each Ulysses member's part starts, plus its
        token count; earlier parts get the remainder."""
        base, extra = divmod(self.ring.rank(ring_index).num_tokens, self.ulysses)
        bounds = [0]
        for i in range(self.ulysses):
            bounds.append(bounds[-1] + base + (1 if i < extra else 0))
        return bounds

    def rank(self, rank: int) -> RankLayout:
        """Global index `rank`'s tokens: part `rank % u` of virtual rank `rank // u`'s, pieces cut to the part."""
        if not 0 <= rank < self.group_size:
            raise LayoutError(f"rank {rank} is outside the group of {self.group_size}")
        virtual = self.ring.rank(rank // self.ulysses)
        if self.ulysses == 1:
            return virtual
        bounds = self.part_bounds(rank // self.ulysses)
        lo, hi = bounds[rank % self.ulysses], bounds[rank % self.ulysses + 1]
        pieces = tuple(
            Piece(p.seq, p.chunk, max(p.offset, lo) - lo, min(p.offset + p.length, hi) - max(p.offset, lo))
            for p in virtual.pieces
            if max(p.offset, lo) < min(p.offset + p.length, hi)
        )
        return RankLayout(virtual.token_index[lo:hi], virtual.position_ids[lo:hi], pieces)

    def rank_tokens(self) -> list[int]:
        """Local token count of every group rank."""
        return [self.rank(i).num_tokens for i in range(self.group_size)]


def ulysses_layout(seq_lens: list[int] | tuple[int, ...], ulysses: int, ring: int) -> UlyssesLayout:
    """The u × r layout of one shared micro-batch (u = `ulysses`, r = `ring`); see the module docstring."""
    return UlyssesLayout(zigzag_layout(seq_lens, ring), ulysses)


def validate_window(window: int | None) -> int | None:
    """`window` itself, or LayoutError unless it is None or a whole number of keys >= 1."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise LayoutError(
            f"window must be None or an int >= 1 (a query sees itself and window-1 keys before it), got {window!r}"
        )
    return window


def _pack(blocks: tuple[Block, ...]) -> Transfer:
    """Merge the blocks' key ranges and move each block's keys onto the rows of the packed buffer."""
    ranges: list[list[int]] = []
    for start, end in sorted((b.k_start, b.k_end) for b in blocks):
        if ranges and start <= ranges[-1][1]:
            ranges[-1][1] = max(ranges[-1][1], end)
        else:
            ranges.append([start, end])
    packed_start, row = [], 0
    for start, end in ranges:
        packed_start.append(row - start)
        row += end - start
    moved = []
    for b in blocks:
        shift = next(shift for (start, end), shift in zip(ranges, packed_start) if start <= b.k_start < end)
        moved.append(replace(b, k_start=b.k_start + shift, k_end=b.k_end + shift))
    return Transfer(tuple((start, end) for start, end in ranges), tuple(moved))


def zigzag_layout(seq_lens: list[int] | tuple[int, ...], group_size: int) -> ZigzagLayout:
    """The zigzag layout of one shared micro-batch; see the module docstring."""
    return ZigzagLayout(tuple(int(n) for n in seq_lens), int(group_size))
