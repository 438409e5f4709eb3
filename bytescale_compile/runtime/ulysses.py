"""Ulysses (head-parallel) attention beside the ring: the u × r split of a shared micro-batch (USP).

The group's global index g = ring index × u + Ulysses index: u consecutive ranks form a Ulysses group, the r
ranks of one Ulysses index a ring. Each rank holds its part of its virtual rank's zigzag tokens
(`layout.UlyssesLayout`). An all-to-all inside the Ulysses group turns those token shards of every head
into the virtual rank's tokens (in order) of H/u heads; the packed ring (`ring_attention.py`) runs among the r
ranks of one Ulysses index on those heads; a second all-to-all brings out and lse back to token shards.
The backward moves q, k, v, out, grad_out and lse to heads the same way, runs the ring's backward and
sends dq, dk, dv back.

Ulysses member m attends query heads [m·H/u, (m+1)·H/u) and gets the K/V heads they read (GQA's
h // (H/Hkv)), as few as keep the grouping uniform: Hkv/u each when u divides Hkv, else some heads go to
several members and their gradients are summed at the owner.

The all-to-all is P2P on the default process group (`Peers.exchange`), like the ring: no process group
per micro-batch, and a peer that times out or is lost raises `P2PTimeoutError` / `P2PError`. With
u = 1 every call is the ring's own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .layout import UlyssesLayout
from .p2p import DEFAULT_TIMEOUT_S, P2PError, P2PStats, Peers, Shapes, check_group_agrees, make_peers
from .ring_attention import descriptor, local_problem, ring_attention_bwd, ring_attention_fwd

__all__ = ["UlyssesError", "HeadSplit", "head_problem", "ulysses_attention_fwd", "ulysses_attention_bwd"]


class UlyssesError(P2PError):
    """The u × r split cannot run: a Ulysses degree that does not fit the heads or the group."""


def head_problem(ulysses: int, heads: int, kv_heads: int) -> str | None:
    """Why `heads` query heads (and `kv_heads` K/V heads) cannot be split over `ulysses` ranks, or None."""
    if heads % ulysses:
        return (
            f"the Ulysses degree u={ulysses} must divide the query heads (H={heads}, H_kv={kv_heads}): "
            f"choose u among the divisors of {heads}, or a smaller u and a larger ring degree"
        )
    return None


@dataclass(frozen=True)
class HeadSplit:
    """Which query and K/V heads each Ulysses member attends."""

    heads: int
    kv_heads: int
    ulysses: int

    def __post_init__(self) -> None:
        problem = head_problem(self.ulysses, self.heads, self.kv_heads)
        if problem:
            raise UlyssesError(problem)

    @property
    def q_per_member(self) -> int:
        return self.heads // self.ulysses

    @property
    def _group(self) -> int:
        """Consecutive local query heads that share one K/V head: uniform for every member."""
        return math.gcd(self.q_per_member, self.heads // self.kv_heads)

    @property
    def kv_per_member(self) -> int:
        return self.q_per_member // self._group

    def queries(self, member: int) -> slice:
        return slice(member * self.q_per_member, (member + 1) * self.q_per_member)

    def kv(self, member: int) -> list[int]:
        """The K/V heads of `member`'s query heads, in order: local query head i reads local K/V head i // group."""
        first, rep = member * self.q_per_member, self.heads // self.kv_heads
        return [(first + self._group * j) // rep for j in range(self.kv_per_member)]


@dataclass(frozen=True)
class _Split:
    """This rank's place in the u × r split: its Ulysses group (the all-to-all) and its ring."""

    layout: UlyssesLayout
    whole: Peers
    members: Peers
    ring_group: tuple[int, ...]

    @classmethod
    def make(
        cls, layout: UlyssesLayout, group: list[int] | tuple[int, ...], timeout_s: float, stats: P2PStats | None
    ) -> _Split:
        whole = make_peers(group, layout.group_size, timeout_s, stats, "ulysses × ring group")
        u, ring_index = layout.ulysses, whole.index // layout.ulysses
        members = Peers(
            whole.group[ring_index * u : (ring_index + 1) * u],
            whole.index % u,
            whole.timeout,
            whole.stats,
            label="ulysses group",
        )
        return cls(layout, whole, members, whole.group[whole.index % u :: u])

    @property
    def bounds(self) -> list[int]:
        """Where each member's part starts in the virtual rank's tokens, plus their count."""
        return self.layout.part_bounds(self.whole.index // self.layout.ulysses)

    def _all_to_all(self, sends: list[Tensor], rows: list[int], width: int, what: str) -> list[Tensor]:
        """Send `sends[j]` (byte rows) to member j and receive `rows[j]` rows of `width` bytes from it; this
        member's own part does not move. Pairs with nothing to move post nothing (both sides know the sizes)."""
        me, device = self.members.index, sends[0].device
        outgoing = {j: t for j, t in enumerate(sends) if j != me and t.numel()}
        incoming: Shapes = {j: ((n, width), torch.uint8) for j, n in enumerate(rows) if j != me and n * width}
        self.members.stats.ulysses_bytes_sent += sum(t.numel() for t in outgoing.values())
        got = self.members.exchange(outgoing, incoming, what, device)
        empty = torch.empty((0, width), dtype=torch.uint8, device=device)
        return [sends[me] if j == me else got.get(j, empty) for j in range(len(rows))]

    def to_heads(self, heads: HeadSplit, tensors: Sequence[tuple[Tensor, bool]], what: str) -> list[Tensor]:
        """Token shards `[t, H, ...]` of every head → the virtual rank's tokens of this member's heads;
        True marks a tensor of K/V heads."""
        parts = [
            _pack([x[:, heads.kv(m) if kv else heads.queries(m)] for x, kv in tensors]) for m in range(heads.ulysses)
        ]
        bounds = self.bounds
        rows = [bounds[j + 1] - bounds[j] for j in range(heads.ulysses)]
        received = self._all_to_all(parts, rows, parts[0].shape[1], what)
        specs = [((heads.kv_per_member if kv else heads.q_per_member, *x.shape[2:]), x.dtype) for x, kv in tensors]
        return _unpack(torch.cat(received), specs)

    def to_tokens(self, tensors: Sequence[Tensor], what: str) -> list[list[Tensor]]:
        """This member's heads `[T_virtual, h, ...]` of the virtual rank's tokens → for every member m, m's heads
        of this rank's tokens."""
        packed, bounds = _pack(tensors), self.bounds
        parts = [packed[bounds[j] : bounds[j + 1]] for j in range(self.members.size)]
        mine = bounds[self.members.index + 1] - bounds[self.members.index]
        received = self._all_to_all(parts, [mine] * self.members.size, packed.shape[1], what)
        specs = [(tuple(x.shape[1:]), x.dtype) for x in tensors]
        return [_unpack(part, specs) for part in received]


def _pack(tensors: Sequence[Tensor]) -> Tensor:
    """`[t, ...]` tensors of any dtypes side by side as bytes, `[t, bytes per row]` uint8: one message per peer."""
    return torch.cat([_row_major(x).view(torch.uint8).flatten(1) for x in tensors], dim=1)


def _row_major(x: Tensor) -> Tensor:
    """`x` with unit stride in its last dim (`contiguous` leaves a size-1 dim's stride as it is)."""
    x = x.contiguous()
    return x if x.stride(-1) == 1 else x.new_empty(x.shape).copy_(x)


def _unpack(rows: Tensor, specs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> list[Tensor]:
    """The tensors `_pack` joined, from their per-row shapes and dtypes."""
    out, column = [], 0
    for shape, dtype in specs:
        width = math.prod(shape) * dtype.itemsize
        part = rows[:, column : column + width].contiguous().view(dtype)
        out.append(part.reshape(rows.shape[0], *shape))
        column += width
    return out


def _check_inputs(
    split: _Split, q: Tensor, k: Tensor, v: Tensor, window: int | None, softcap: float | None, exchange: bool
) -> None:
    """The ring's checks on this rank's token shard plus the head split, agreed by the whole u × r group when
    `exchange`; every rank raises alike."""
    whole, layout = split.whole, split.layout
    problem = local_problem(whole.me, layout.rank(whole.index).num_tokens, window, q, k, v, softcap)
    if problem is None:
        problem = head_problem(layout.ulysses, q.shape[1], k.shape[1])
    if exchange and whole.size > 1:
        mine = {**descriptor(whole.group, layout.seq_lens, window, q, k, v, softcap), "ulysses degree": layout.ulysses}
        check_group_agrees(whole, mine, problem, q.device, UlyssesError)
    if problem:
        raise UlyssesError(problem)


def ulysses_attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: UlyssesLayout,
    group: list[int] | tuple[int, ...],
    scale: float | None = None,
    *,
    stats: P2PStats | None = None,
    check: bool = True,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    window: int | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """(out [t, Hq, Dv] in q's dtype, lse [Hq, t] fp32) of this rank's token shard, as `ring_attention_fwd`
    gives them; q, k, v in `layout.rank(g).token_index` order, g this rank's index in `group`."""
    if layout.ulysses == 1:
        return ring_attention_fwd(
            q,
            k,
            v,
            layout.ring,
            group,
            scale,
            stats=stats,
            check=check,
            timeout_s=timeout_s,
            window=window,
            softcap=softcap,
        )
    split = _Split.make(layout, group, timeout_s, stats)
    _check_inputs(split, q, k, v, window, softcap, exchange=check)
    heads = HeadSplit(q.shape[1], k.shape[1], layout.ulysses)
    qh, kh, vh = split.to_heads(heads, [(q, False), (k, True), (v, True)], "q/k/v head shards")
    out, lse = ring_attention_fwd(
        qh,
        kh,
        vh,
        layout.ring,
        split.ring_group,
        scale,
        stats=split.whole.stats,
        check=False,
        timeout_s=timeout_s,
        window=window,
        softcap=softcap,
    )
    parts = split.to_tokens([out, lse.T], "out/lse token shards")
    return torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts], dim=1).T.contiguous()


def ulysses_attention_bwd(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    layout: UlyssesLayout,
    group: list[int] | tuple[int, ...],
    scale: float | None = None,
    *,
    stats: P2PStats | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    window: int | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of this rank's token shard; the K/V heads that went to several members sum their gradients."""
    if layout.ulysses == 1:
        return ring_attention_bwd(
            grad_out,
            q,
            k,
            v,
            out,
            lse,
            layout.ring,
            group,
            scale,
            stats=stats,
            timeout_s=timeout_s,
            window=window,
            softcap=softcap,
        )
    split = _Split.make(layout, group, timeout_s, stats)
    _check_inputs(split, q, k, v, window, softcap, exchange=False)
    heads = HeadSplit(q.shape[1], k.shape[1], layout.ulysses)
    shards = [(q, False), (k, True), (v, True), (out, False), (grad_out.to(out.dtype), False), (lse.T, False)]
    qh, kh, vh, oh, gh, lh = split.to_heads(heads, shards, "backward head shards")
    grads = ring_attention_bwd(
        gh,
        qh,
        kh,
        vh,
        oh,
        lh.T.contiguous(),
        layout.ring,
        split.ring_group,
        scale,
        stats=split.whole.stats,
        timeout_s=timeout_s,
        window=window,
        softcap=softcap,
    )
    parts = split.to_tokens(grads, "dq/dk/dv token shards")
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for m, (_, dk_m, dv_m) in enumerate(parts):
        index = torch.tensor(heads.kv(m), device=k.device)
        dk.index_add_(1, index, dk_m.float())
        dv.index_add_(1, index, dv_m.float())
    return torch.cat([p[0] for p in parts], dim=1), dk.to(k.dtype), dv.to(v.dtype)
