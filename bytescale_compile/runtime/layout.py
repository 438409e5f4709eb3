"""Zigzag layout of a shared micro-batch (paper §6, "Dist-attn with Packing").

Every sequence is cut into 2N contiguous chunks as equal as possible (no padding); group rank i holds
chunks i and 2N-1-i of every sequence. Under a causal mask the work of chunk c grows with c, so
pairing c with 2N-1-c gives every rank the same attention area and the same ring traffic.

The masks need only chunk order: a query chunk attends fully to earlier chunks of its own sequence,
causally to itself, and not at all to later chunks or other sequences. `ZigzagLayout.blocks(i, j)`
lists the non-empty (query piece, key piece) pairs of rank i's queries against rank j's keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["Piece", "Block", "RankLayout", "ZigzagLayout", "zigzag_layout", "LayoutError"]


class LayoutError(ValueError):
    """A layout that cannot be built or does not fit its tensors."""


@dataclass(frozen=True)
class Piece:
    """One chunk of one sequence as a rank holds it: `length` tokens at local offset `offset`."""

    seq: int
    chunk: int
    offset: int
    length: int


@dataclass(frozen=True)
class Block:
    """Query piece × key piece that the mask does not empty; `causal` on the diagonal chunk."""

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    causal: bool


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
    _blocks: dict[tuple[int, int], tuple[Block, ...]] = field(default_factory=dict, init=False, repr=False, compare=False)

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

    def blocks(self, q_rank: int, kv_rank: int) -> tuple[Block, ...]:
        """Non-empty mask blocks of `q_rank`'s queries against `kv_rank`'s keys, in local offsets."""
        key = (q_rank, kv_rank)
        if key not in self._blocks:
            self._blocks[key] = self._build_blocks(q_rank, kv_rank)
        return self._blocks[key]

    def _build_blocks(self, q_rank: int, kv_rank: int) -> tuple[Block, ...]:
        blocks = []
        for qp in self.rank(q_rank).pieces:
            for kp in self.rank(kv_rank).pieces:
                if qp.seq != kp.seq or kp.chunk > qp.chunk or qp.length == 0 or kp.length == 0:
                    continue
                blocks.append(Block(qp.offset, qp.offset + qp.length, kp.offset, kp.offset + kp.length,
                                    causal=kp.chunk == qp.chunk))
        return tuple(blocks)

    def rank_tokens(self) -> list[int]:
        """Local token count of every group rank (they differ by at most 2 per sequence)."""
        return [self.rank(i).num_tokens for i in range(self.group_size)]


def zigzag_layout(seq_lens: list[int] | tuple[int, ...], group_size: int) -> ZigzagLayout:
    """The zigzag layout of one shared micro-batch; see the module docstring."""
    return ZigzagLayout(tuple(int(n) for n in seq_lens), int(group_size))
