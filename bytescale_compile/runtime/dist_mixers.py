"""Convolutions and linear recurrences over a packed row, or over a sequence shared by ranks.

A row is a list of pieces: contiguous runs of one sequence's tokens (`layout.Piece`). On one rank every
piece is a whole packed sequence; in a shared micro-batch the pieces are the rank's zigzag chunks, and the
tokens before a chunk live on other ranks. That is the recurrent counterpart of the ring:

- a causal convolution of kernel k reads the k - 1 tokens before each piece: the halo, sent by their
  owners (zero before a sequence's first token, never across a packed sequence's start);
- a linear recurrence h_t = A_t(h_{t-1}) + u_t (Mamba's scans, the gated delta rule) is affine in its
  initial state: a chunk maps h to apply(M, h) + b. Each rank computes (M, b) of its chunks from a zero
  state, sends each straight to the ranks whose later chunks need it, folds the summaries before each of
  its chunks into the chunk's initial state, and finishes the chunk from it (LASP-2). Every rank works in
  parallel; only the small summaries travel, never a serial relay.

The backward recomputes the forward under autograd with the received halos and summaries as leaves, sends
their gradients straight back to their owners, and adds what it receives to the gradients of the inputs it
sent from. All P2P goes over the default process group through `Ring` (timeouts, named faults), and each
pair of ranks derives what it exchanges from the layout alone, so both sides post the same transfers.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..kernels.recurrences import Recurrence
from .layout import Piece, ZigzagLayout
from .p2p import Shapes
from .ring_attention import Ring

__all__ = [
    "MixerRow",
    "packed_row",
    "ring_row",
    "causal_conv",
    "causal_conv_backward",
    "scan",
    "scan_backward",
    "summary_shapes",
]


@dataclass(frozen=True)
class MixerRow:
    """The pieces of one row in row order, where each starts in its sequence, and the ring sharing them (if any)."""

    pieces: tuple[Piece, ...]
    starts: tuple[int, ...]
    ring: Ring | None = None


def packed_row(bounds: Sequence[int]) -> MixerRow:
    """A row packing whole sequences between consecutive `bounds` (cu_seqlens)."""
    pieces = tuple(Piece(i, 0, lo, hi - lo) for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])) if hi > lo)
    return MixerRow(pieces, (0,) * len(pieces))


def ring_row(ring: Ring) -> MixerRow:
    """This rank's zigzag chunks of every sequence of a shared micro-batch."""
    layout = ring.layout
    pieces = layout.rank(ring.index).pieces
    return MixerRow(pieces, tuple(layout.chunk_bounds(p.seq)[p.chunk] for p in pieces), ring)


def _owner(layout: ZigzagLayout, chunk: int) -> int:
    return chunk if chunk < layout.group_size else layout.num_chunks - 1 - chunk


def _piece_of(layout: ZigzagLayout, rank: int, seq: int, chunk: int) -> Piece:
    return next(p for p in layout.rank(rank).pieces if p.seq == seq and p.chunk == chunk)


# --- exchange -------------------------------------------------------------------------------------


def _exchange(
    ring: Ring, sends: dict[int, Tensor], receives: Shapes, what: str, device: torch.device
) -> dict[int, Tensor]:
    """`Peers.exchange`, counting what it sends as mixer bytes too."""
    ring.stats.mixer_bytes_sent += sum(t.numel() * t.element_size() for t in sends.values())
    return ring.exchange(sends, receives, what, device)


_K = torch._C.DispatchKey
_AUTOGRAD_KEYS = [_K.AutogradFunctionality, _K.AutogradOther, _K.AutogradNestedTensor, _K.ADInplaceOrView]


@contextlib.contextmanager
def _autograd() -> Iterator[None]:
    """Autograd on, also inside a custom op's implementation, which runs below the autograd dispatch keys (the
    backward ops recompute the forward under autograd)."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        exclude = exclude - torch._C.DispatchKeySet(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield


class _Mixer:
    """One call of a mixer on one row: what this rank sends before it can finish its pieces, and how it finishes.

    `sends(inputs)` -> tensors for other group ranks; `receives(inputs)` -> what it gets from them;
    `finish(inputs, received)` -> the output. The forward and the backward are written once, below, for all.
    """

    what = ""

    def __init__(self, row: MixerRow) -> None:
        self.row = row

    def sends(self, inputs: list[Tensor]) -> dict[int, Tensor]:
        raise NotImplementedError

    def receives(self, inputs: list[Tensor]) -> Shapes:
        raise NotImplementedError

    def finish(self, inputs: list[Tensor], received: dict[int, Tensor]) -> Tensor:
        raise NotImplementedError

    def forward(self, inputs: list[Tensor]) -> Tensor:
        ring = self.row.ring
        if ring is None:
            return self.finish(inputs, {})
        received = _exchange(ring, self.sends(inputs), self.receives(inputs), self.what, inputs[0].device)
        return self.finish(inputs, received)

    def backward(self, inputs: list[Tensor], grad: Tensor) -> list[Tensor]:
        """Gradients of every input (zeros where it does not reach the output), from a recompute under autograd."""
        ring, device = self.row.ring, inputs[0].device
        with _autograd():
            leaves = [x.detach().requires_grad_() for x in inputs]
            sent = self.sends(leaves) if ring is not None else {}
            received = {}
            if ring is not None:
                plain = {dst: t.detach() for dst, t in sent.items()}
                received = _exchange(ring, plain, self.receives(leaves), self.what, device)
                received = {src: t.requires_grad_() for src, t in received.items()}
            out = self.finish(leaves, received)
            wrt = leaves + list(received.values())
            grads = list(torch.autograd.grad(out, wrt, grad, allow_unused=True, retain_graph=bool(sent)))
        result = [g if g is not None else torch.zeros_like(x) for x, g in zip(leaves, grads[: len(leaves)])]
        if ring is None:
            return result
        back = {
            src: g if g is not None else torch.zeros_like(t)
            for (src, t), g in zip(received.items(), grads[len(leaves) :])
        }
        shapes = {dst: (tuple(t.shape), t.dtype) for dst, t in sent.items()}
        sent_grads = _exchange(ring, back, shapes, self.what + " gradients", device)
        if sent_grads:
            with _autograd():
                more = torch.autograd.grad(
                    [sent[dst] for dst in sent_grads], leaves, list(sent_grads.values()), allow_unused=True
                )
            result = [r if g is None else r + g for r, g in zip(result, more)]
        return result


# --- causal convolution ---------------------------------------------------------------------------


class _Conv(_Mixer):
    """Depthwise causal convolution: y[t] = bias + sum_j weight[:, j] * x[t - (k - 1) + j], within a sequence.

    inputs: x [T, C], weight [C, k], bias [C]. Every tap is a gather from the row, the halo rows received
    from other ranks, or a zero row (before a sequence's first token).
    """

    what = "convolution halo"

    def __init__(self, row: MixerRow, kernel: int) -> None:
        super().__init__(row)
        self.kernel = kernel
        ring = row.ring
        self.halo = None if ring is None else _halo_plan(ring.layout, kernel)

    def sends(self, inputs: list[Tensor]) -> dict[int, Tensor]:
        assert self.halo is not None and self.row.ring is not None
        x, me = inputs[0], self.row.ring.index
        return {dst: x[torch.tensor(rows)] for dst, rows in self.halo.sends(me).items()}

    def receives(self, inputs: list[Tensor]) -> Shapes:
        assert self.halo is not None and self.row.ring is not None
        x = inputs[0]
        return {src: ((n, x.shape[1]), x.dtype) for src, n in self.halo.receives(self.row.ring.index).items()}

    def finish(self, inputs: list[Tensor], received: dict[int, Tensor]) -> Tensor:
        x, weight, bias = inputs
        halo = [received[src] for src in sorted(received)]
        ext = torch.cat([x, *halo, x.new_zeros(1, x.shape[1])])
        index = _conv_index(self.row, self.kernel, x.shape[0], self.halo).to(x.device)
        taps = ext[index]  # [T, k, C]
        dtype = torch.promote_types(x.dtype, torch.float32)
        return torch.einsum("tkc,ck->tc", taps.to(dtype), weight.to(dtype)).add(bias.to(dtype)).to(x.dtype)


@dataclass(frozen=True)
class _HaloPlan:
    """For every group rank, the halo tokens its pieces read, in (piece, position) order, as (owner, owner's row)."""

    needs: tuple[tuple[tuple[int, int, int, int], ...], ...]
    """needs[r]: (piece index, position in the sequence, owner group rank, row in the owner's local tokens)."""

    def sends(self, me: int) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for dst, needs in enumerate(self.needs):
            rows = [row for _, _, owner, row in needs if owner == me and dst != me]
            if rows:
                out[dst] = rows
        return out

    def receives(self, me: int) -> dict[int, int]:
        out: dict[int, int] = {}
        for _, _, owner, _ in self.needs[me]:
            if owner != me:
                out[owner] = out.get(owner, 0) + 1
        return out

    def rows(self, me: int, num_tokens: int) -> dict[tuple[int, int], int]:
        """(piece index, position) -> row of the extended input [own tokens, received halos by sender, zero row]."""
        base, offset = {}, num_tokens
        for src, n in sorted(self.receives(me).items()):
            base[src], offset = offset, offset + n
        out, seen = {}, {src: 0 for src in base}
        for piece, pos, owner, row in self.needs[me]:
            if owner == me:
                out[piece, pos] = row
            else:
                out[piece, pos] = base[owner] + seen[owner]
                seen[owner] += 1
        return out


@functools.lru_cache(maxsize=256)
def _halo_plan(layout: ZigzagLayout, kernel: int) -> _HaloPlan:
    needs = []
    for rank in range(layout.group_size):
        mine = []
        for i, p in enumerate(layout.rank(rank).pieces):
            bounds = layout.chunk_bounds(p.seq)
            start = bounds[p.chunk]
            if p.length == 0:
                continue
            for pos in range(max(0, start - (kernel - 1)), start):
                chunk = max(c for c in range(layout.num_chunks) if bounds[c] <= pos)
                owner = _owner(layout, chunk)
                row = _piece_of(layout, owner, p.seq, chunk).offset + pos - bounds[chunk]
                mine.append((i, pos, owner, row))
        needs.append(tuple(mine))
    return _HaloPlan(tuple(needs))


def _conv_index(row: MixerRow, kernel: int, num_tokens: int, halo: _HaloPlan | None) -> Tensor:
    """[T, k] rows of the extended input each tap reads (the last row of it is zeros)."""
    zero = num_tokens + (sum(halo.receives(row.ring.index).values()) if halo is not None and row.ring else 0)
    where = halo.rows(row.ring.index, num_tokens) if halo is not None and row.ring is not None else {}
    index = torch.full((num_tokens, kernel), zero, dtype=torch.long)
    for i, (p, start) in enumerate(zip(row.pieces, row.starts)):
        for j in range(kernel):
            back = kernel - 1 - j
            for t in range(min(back, p.length)):
                pos = start + t - back
                index[p.offset + t, j] = where.get((i, pos), zero) if pos >= 0 else zero
            if p.length > back:
                index[p.offset + back : p.offset + p.length, j] = torch.arange(p.offset, p.offset + p.length - back)
    return index


def causal_conv(x: Tensor, weight: Tensor, bias: Tensor, row: MixerRow) -> Tensor:
    """Depthwise causal convolution of x [T, C] with weight [C, k] and bias [C] over the row's pieces."""
    return _Conv(row, weight.shape[1]).forward([x, weight, bias])


def causal_conv_backward(x: Tensor, weight: Tensor, bias: Tensor, row: MixerRow, grad: Tensor) -> list[Tensor]:
    """(dx, dweight, dbias) of `causal_conv`."""
    return _Conv(row, weight.shape[1]).backward([x, weight, bias], grad)


# --- linear recurrences ---------------------------------------------------------------------------


class _Scan(_Mixer):
    """A linear recurrence over the row's pieces, each from the state its sequence's earlier chunks leave."""

    def __init__(self, row: MixerRow, recurrence: Recurrence) -> None:
        super().__init__(row)
        self.rec = recurrence
        self.what = f"{recurrence.name} states"
        self.plan = None if row.ring is None else _state_plan(row.ring.layout)
        self._summaries: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}

    def part(self, inputs: list[Tensor], piece: Piece) -> list[Tensor]:
        rows = slice(piece.offset, piece.offset + piece.length)
        return [x[rows] if i in self.rec.token_inputs else x for i, x in enumerate(inputs)]

    def summary(self, inputs: list[Tensor], piece: Piece) -> tuple[Tensor, Tensor]:
        """(M, b) of a piece: it maps an initial state h to apply(M, h) + b."""
        key = (piece.seq, piece.chunk)
        if key not in self._summaries:
            part = self.part(inputs, piece)
            self._summaries[key] = (self.rec.transition(part), self.rec.run(part, None)[1])
        return self._summaries[key]

    def _flat_size(self, inputs: list[Tensor]) -> int:
        m, h = summary_shapes(self.rec, inputs)
        return int(torch.Size(m).numel() + torch.Size(h).numel())

    def sends(self, inputs: list[Tensor]) -> dict[int, Tensor]:
        assert self.plan is not None and self.row.ring is not None
        me, out = self.row.ring.index, {}
        for dst, keys in self.plan.sends(me).items():
            flat = []
            for seq, chunk in keys:
                m, b = self.summary(inputs, _piece_of(self.row.ring.layout, me, seq, chunk))
                flat.append(torch.cat([m.flatten(), b.flatten()]))
            out[dst] = torch.stack(flat)
        return out

    def receives(self, inputs: list[Tensor]) -> Shapes:
        assert self.plan is not None and self.row.ring is not None
        wanted = self.plan.receives(self.row.ring.index)
        if not wanted:
            return {}
        size = self._flat_size(inputs)
        dtype = torch.promote_types(inputs[0].dtype, torch.float32)
        return {src: ((len(keys), size), dtype) for src, keys in wanted.items()}

    def finish(self, inputs: list[Tensor], received: dict[int, Tensor]) -> Tensor:
        theirs: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}
        if received and self.plan is not None and self.row.ring is not None:
            m_shape, h_shape = summary_shapes(self.rec, inputs)
            m_size = int(torch.Size(m_shape).numel())
            for src, keys in self.plan.receives(self.row.ring.index).items():
                rows = received[src]
                summaries = zip(rows[:, :m_size].unbind(0), rows[:, m_size:].unbind(0))
                theirs.update((key, (m.reshape(m_shape), b.reshape(h_shape))) for key, (m, b) in zip(keys, summaries))
        outs = []
        for piece in self.row.pieces:
            if piece.length == 0:
                continue
            h = None
            for chunk in range(piece.chunk):
                summary = self._before(inputs, piece.seq, chunk, theirs)
                if summary is not None:
                    m, b = summary
                    h = b if h is None else self.rec.apply(m, h) + b
            outs.append(self.rec.run(self.part(inputs, piece), h)[0])
        return torch.cat(outs)

    def _before(
        self, inputs: list[Tensor], seq: int, chunk: int, theirs: dict[tuple[int, int], tuple[Tensor, Tensor]]
    ) -> tuple[Tensor, Tensor] | None:
        """(M, b) of an earlier chunk of the sequence: this rank's own, or received; None for an empty chunk."""
        assert self.row.ring is not None
        layout = self.row.ring.layout
        owner = _owner(layout, chunk)
        if owner == self.row.ring.index:
            piece = _piece_of(layout, owner, seq, chunk)
            return self.summary(inputs, piece) if piece.length else None
        return theirs.get((seq, chunk))


def summary_shapes(recurrence: Recurrence, inputs: Sequence[Tensor]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of a chunk's (M, b) from one row's inputs of any length, without computing them (meta tensors)."""
    meta = [
        torch.empty((1, *x.shape[1:]) if i in recurrence.token_inputs else tuple(x.shape), device="meta", dtype=x.dtype)
        for i, x in enumerate(inputs)
    ]
    return tuple(recurrence.transition(meta).shape), tuple(recurrence.state_shape(meta))


@dataclass(frozen=True)
class _StatePlan:
    """For every group rank, the earlier chunks (seq, chunk) whose summaries it needs, by owner."""

    needs: tuple[tuple[tuple[int, int, int], ...], ...]
    """needs[r]: (seq, chunk, owner) in (seq, chunk) order."""

    def sends(self, me: int) -> dict[int, list[tuple[int, int]]]:
        out: dict[int, list[tuple[int, int]]] = {}
        for dst, needs in enumerate(self.needs):
            if dst != me:
                keys = [(seq, chunk) for seq, chunk, owner in needs if owner == me]
                if keys:
                    out[dst] = keys
        return out

    def receives(self, me: int) -> dict[int, list[tuple[int, int]]]:
        out: dict[int, list[tuple[int, int]]] = {}
        for seq, chunk, owner in self.needs[me]:
            if owner != me:
                out.setdefault(owner, []).append((seq, chunk))
        return out


@functools.lru_cache(maxsize=256)
def _state_plan(layout: ZigzagLayout) -> _StatePlan:
    needs = []
    for rank in range(layout.group_size):
        keys: set[tuple[int, int, int]] = set()
        for p in layout.rank(rank).pieces:
            if p.length == 0:
                continue
            bounds = layout.chunk_bounds(p.seq)
            for chunk in range(p.chunk):
                if bounds[chunk + 1] > bounds[chunk]:
                    keys.add((p.seq, chunk, _owner(layout, chunk)))
        needs.append(tuple(sorted(keys)))
    return _StatePlan(tuple(needs))


def scan(recurrence: Recurrence, inputs: list[Tensor], row: MixerRow) -> Tensor:
    """The recurrence's output over the row's pieces (token inputs [T, ...], the others as they are)."""
    return _Scan(row, recurrence).forward(inputs)


def scan_backward(recurrence: Recurrence, inputs: list[Tensor], row: MixerRow, grad: Tensor) -> list[Tensor]:
    """Gradients of every input of `scan`."""
    return _Scan(row, recurrence).backward(inputs, grad)
