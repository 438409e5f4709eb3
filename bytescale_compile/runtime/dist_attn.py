"""Packed ring attention over any ordered subset of the global ranks (paper §6, "Dist-attn with Packing").

Each group rank holds its zigzag tokens of every sequence of the micro-batch (`layout.py`). K/V blocks
travel around the ring — only the `Hkv` heads, as one buffer — and each rank attends its queries to
every block, skipping the (query piece, key piece) pairs the segment-causal mask empties. Partial
results merge through their log-sum-exp in fp32. The next transfer is posted before the current
block is computed, so on a GPU communication hides behind compute.

The backward runs the ring again: each rank adds its contribution to the dK/dV of the block it holds
and passes the fp32 accumulator on with the block, so after N steps every accumulator reaches its owner.

All P2P goes over the default process group (`batch_isend_irecv`): the group changes every
micro-batch, and creating a process group per micro-batch would allocate communicator buffers each
time (the paper's NCCL-buffer point).
"""

from __future__ import annotations

import datetime
import hashlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..kernels.dispatch import block_attention_bwd, block_attention_fwd
from .layout import ZigzagLayout

__all__ = ["packed_ring_attention", "ring_attention_fwd", "ring_attention_bwd", "RingStats", "RingError",
           "RingTimeoutError", "DEFAULT_TIMEOUT_S"]

DEFAULT_TIMEOUT_S = 300.0


class RingError(RuntimeError):
    """The ring cannot run: bad arguments, or inputs that differ across the group."""


class RingTimeoutError(RingError, TimeoutError):
    """A peer of the ring did not send in time."""


@dataclass
class RingStats:
    """Counters the runtime and the simulator report; accumulate over calls."""

    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    blocks_computed: int = 0
    blocks_skipped: int = 0


@dataclass(frozen=True)
class _Ring:
    group: tuple[int, ...]
    index: int
    layout: ZigzagLayout
    timeout: datetime.timedelta
    stats: RingStats

    @property
    def size(self) -> int:
        return len(self.group)

    @property
    def next(self) -> int:
        return self.group[(self.index + 1) % self.size]

    @property
    def prev(self) -> int:
        return self.group[(self.index - 1) % self.size]

    def owner(self, step: int) -> int:
        """Group index of the K/V block this rank holds at `step`."""
        return (self.index - step) % self.size

    def post(self, send: Tensor, recv: Tensor) -> list[Any]:
        """Send to the next rank and receive from the previous one, without waiting."""
        self.stats.bytes_sent += send.numel() * send.element_size()
        self.stats.bytes_received += recv.numel() * recv.element_size()
        ops = [dist.P2POp(dist.isend, send, self.next), dist.P2POp(dist.irecv, recv, self.prev)]
        return dist.batch_isend_irecv(ops)

    def wait(self, works: list[Any], what: str) -> None:
        for work in works:
            try:
                work.wait(timeout=self.timeout)
            except RuntimeError as e:
                where = f"ring group {list(self.group)}: rank {self.group[self.index]}"
                if "imed out" in str(e):
                    raise RingTimeoutError(
                        f"{where} waited {self.timeout.total_seconds():.0f}s for {what} (peers {self.prev} and "
                        f"{self.next}); a peer never joined this ring step or is stuck elsewhere"
                    ) from e
                raise RingError(f"{where} lost a peer while exchanging {what}: {str(e).splitlines()[0]}") from e


def _make_ring(layout: ZigzagLayout, group: list[int] | tuple[int, ...], timeout_s: float, stats: RingStats | None) -> _Ring:
    group = tuple(int(r) for r in group)
    if len(set(group)) != len(group):
        raise RingError(f"ring group {list(group)} lists a rank twice")
    if len(group) != layout.group_size:
        raise RingError(f"ring group {list(group)} has {len(group)} ranks but the layout was made for {layout.group_size}")
    if len(group) > 1 and not dist.is_initialized():
        raise RingError(f"ring group {list(group)} needs torch.distributed to be initialised")
    me = dist.get_rank() if dist.is_initialized() else group[0]
    if me not in group:
        raise RingError(f"rank {me} is not in ring group {list(group)}")
    return _Ring(group, group.index(me), layout, datetime.timedelta(seconds=timeout_s), stats or RingStats())


def _local_problem(ring: _Ring, q: Tensor, k: Tensor, v: Tensor) -> str | None:
    """Why this rank's q/k/v cannot enter the ring, or None."""
    tokens = ring.layout.rank(ring.index).num_tokens
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape:
        return f"ring attention expects q [T, Hq, D] and k, v [T, Hkv, D], got {shapes}"
    if q.shape[0] != tokens or k.shape[0] != tokens:
        return f"rank {ring.group[ring.index]} holds {tokens} tokens in this layout, got {shapes}"
    if q.shape[2] != k.shape[2] or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        return f"ring attention needs equal head dims and Hq a multiple of Hkv, got {shapes}"
    return None


_DESCRIPTOR_FIELDS = ("group", "sequences", "tokens in the micro-batch", "layout (sequence lengths)",
                      "query heads", "kv heads", "head dim", "dtype", "q/k/v fit the layout")


def _descriptor(ring: _Ring, q: Tensor, k: Tensor, fits: bool) -> Tensor:
    def digest(values: tuple[int, ...]) -> int:
        return int.from_bytes(hashlib.blake2b(repr(values).encode(), digest_size=7).digest(), "little")

    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
    heads = (q.shape[-2], k.shape[-2], q.shape[-1]) if q.dim() and k.dim() else (0, 0, 0)
    fields = (digest(ring.group), len(ring.layout.seq_lens), ring.layout.total_tokens, digest(ring.layout.seq_lens),
              *heads, dtypes.index(q.dtype) if q.dtype in dtypes else -1, int(fits))
    return torch.tensor(fields, dtype=torch.int64)


def _check_inputs(ring: _Ring, q: Tensor, k: Tensor, v: Tensor, exchange: bool) -> None:
    """Check this rank's inputs and, with `exchange`, that the whole group agrees; every rank raises alike."""
    problem = _local_problem(ring, q, k, v)
    if exchange and ring.size > 1:
        _check_group_agrees(ring, q, k, problem is None)
    if problem:
        raise RingError(problem)


def _check_group_agrees(ring: _Ring, q: Tensor, k: Tensor, fits: bool) -> None:
    """Exchange a small descriptor with every group member; raise the same error on all of them."""
    mine = _descriptor(ring, q, k, fits)
    peers = [r for r in ring.group if r != ring.group[ring.index]]
    theirs = {r: torch.empty_like(mine) for r in peers}
    ops = [dist.P2POp(dist.isend, mine, r) for r in peers] + [dist.P2POp(dist.irecv, theirs[r], r) for r in peers]
    ring.wait(dist.batch_isend_irecv(ops), "the input descriptor")
    theirs[ring.group[ring.index]] = mine
    # every rank compares rank-ordered descriptors, so all of them raise the same message
    ordered = [(r, theirs[r]) for r in sorted(ring.group)]
    problems = []
    for i, name in enumerate(_DESCRIPTOR_FIELDS):
        values = {r: int(d[i]) for r, d in ordered}
        if len(set(values.values())) > 1:
            shown = ", ".join(f"rank {r}: {'#%x' % val if name in ('group', 'layout (sequence lengths)') else val}"
                              for r, val in values.items())
            problems.append(f"{name} differs ({shown})")
    if problems:
        raise RingError(f"ring group {sorted(ring.group)}: inputs differ across ranks, nothing was sent: "
                        + "; ".join(problems))


def _heads_first(x: Tensor) -> Tensor:
    """[t, H, D] → [1, H, t, D] view, the layout of the block kernels."""
    return x.transpose(0, 1).unsqueeze(0)


def _tokens_first(x: Tensor) -> Tensor:
    """[1, H, t, D] → [t, H, D] view."""
    return x.squeeze(0).transpose(0, 1)


def ring_attention_fwd(q: Tensor, k: Tensor, v: Tensor, layout: ZigzagLayout, group: list[int] | tuple[int, ...],
                       scale: float | None = None, *, stats: RingStats | None = None, check: bool = True,
                       timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[Tensor, Tensor]:
    """(out [T, Hq, D] in q's dtype, lse [Hq, T] fp32) of this rank's queries over the whole group."""
    ring = _make_ring(layout, group, timeout_s, stats)
    _check_inputs(ring, q, k, v, exchange=check)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    ring.stats.calls += 1
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[1::-1], float("-inf"), dtype=torch.float32, device=q.device)
    kv = torch.stack([k, v])
    tokens = layout.rank_tokens()
    for step in range(ring.size):
        works = []
        if step < ring.size - 1:
            incoming = kv.new_empty((2, tokens[ring.owner(step + 1)], *kv.shape[2:]))
            works = ring.post(kv, incoming)
        for block in _blocks(ring, step):
            _merge(out, lse, block, *block_attention_fwd(
                _heads_first(q[block.q_start:block.q_end]), _heads_first(kv[0, block.k_start:block.k_end]),
                _heads_first(kv[1, block.k_start:block.k_end]), scale, block.causal))
        if works:
            ring.wait(works, "a K/V block")
            kv = incoming
    return out.to(q.dtype), lse


def ring_attention_bwd(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       layout: ZigzagLayout, group: list[int] | tuple[int, ...], scale: float | None = None, *,
                       stats: RingStats | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of this rank's tokens; dK/dV accumulate in fp32 as they travel back to their owners."""
    ring = _make_ring(layout, group, timeout_s, stats)
    _check_inputs(ring, q, k, v, exchange=False)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = torch.stack([k, v])
    tokens = layout.rank_tokens()
    grad_out, out = _heads_first(grad_out), _heads_first(out)
    pending: tuple[list[Any], Tensor] | None = None
    for step in range(ring.size):
        kv_works = []
        if step < ring.size - 1:
            incoming = kv.new_empty((2, tokens[ring.owner(step + 1)], *kv.shape[2:]))
            kv_works = ring.post(kv, incoming)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        for block in _blocks(ring, step):
            rows, keys = slice(block.q_start, block.q_end), slice(block.k_start, block.k_end)
            dq_b, dk_b, dv_b = block_attention_bwd(
                grad_out[:, :, rows], _heads_first(q[rows]), _heads_first(kv[0, keys]), _heads_first(kv[1, keys]),
                out[:, :, rows], lse[None, :, rows], scale, block.causal)
            dq[rows] += _tokens_first(dq_b)
            dkv[0, keys] += _tokens_first(dk_b)
            dkv[1, keys] += _tokens_first(dv_b)
        if pending is not None:
            ring.wait(pending[0], "a dK/dV accumulator")
            dkv += pending[1]
        if ring.size > 1:
            arriving = torch.empty((2, tokens[ring.owner(step + 1)], *kv.shape[2:]), dtype=torch.float32, device=kv.device)
            pending = (ring.post(dkv, arriving), arriving)
        else:
            pending = ([], dkv)
        if kv_works:
            ring.wait(kv_works, "a K/V block")
            kv = incoming
    ring.wait(pending[0], "this rank's dK/dV")
    dkv = pending[1]
    return dq.to(q.dtype), dkv[0].to(k.dtype, copy=True), dkv[1].to(v.dtype, copy=True)


def _blocks(ring: _Ring, step: int):
    """The mask blocks of this step; counts the ones the mask empties."""
    blocks = ring.layout.blocks(ring.index, ring.owner(step))
    pieces = len(ring.layout.rank(ring.index).pieces) * len(ring.layout.rank(ring.owner(step)).pieces)
    ring.stats.blocks_computed += len(blocks)
    ring.stats.blocks_skipped += pieces - len(blocks)
    return blocks


def _merge(out: Tensor, lse: Tensor, block: Any, block_out: Tensor, block_lse: Tensor) -> None:
    """Fold one block's (out, lse) into the running fp32 result of its query rows."""
    rows = slice(block.q_start, block.q_end)
    new = torch.logaddexp(lse[:, rows], block_lse[0])
    keep = torch.exp(lse[:, rows] - new).T.unsqueeze(-1)
    add = torch.exp(block_lse[0] - new).T.unsqueeze(-1)
    out[rows] = out[rows] * keep + _tokens_first(block_out).float() * add
    lse[:, rows] = new


class _PackedRingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, layout: ZigzagLayout, group: tuple[int, ...],
                scale: float | None, stats: RingStats | None, timeout_s: float) -> Tensor:
        out, lse = ring_attention_fwd(q, k, v, layout, group, scale, stats=stats, timeout_s=timeout_s)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (layout, group, scale, stats, timeout_s)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        layout, group, scale, stats, timeout_s = ctx.args
        dq, dk, dv = ring_attention_bwd(grad_out, q, k, v, out, lse, layout, group, scale, stats=stats, timeout_s=timeout_s)
        return dq, dk, dv, None, None, None, None, None


def packed_ring_attention(q: Tensor, k: Tensor, v: Tensor, layout: ZigzagLayout, group: list[int] | tuple[int, ...],
                          scale: float | None = None, *, stats: RingStats | None = None,
                          timeout_s: float = DEFAULT_TIMEOUT_S) -> Tensor:
    """Segment-causal attention of this rank's zigzag tokens against the whole group's, differentiable.

    q [T_local, Hq, D], k/v [T_local, Hkv, D] in `layout.rank(i).token_index` order, where i is this
    rank's index in `group` (an ordered list of global ranks). Returns out [T_local, Hq, D].
    """
    return _PackedRingAttention.apply(q, k, v, layout, tuple(group), scale, stats, timeout_s)
