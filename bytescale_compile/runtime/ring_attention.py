"""Packed ring attention over any ordered subset of the global ranks (paper §6, "Dist-attn with Packing").

Each group rank holds its zigzag tokens of every sequence of the micro-batch (`layout.py`). At step s
(1..N-1) group rank i sends straight to rank i+s, and receives from rank i-s, only the K/V rows the
receiver's blocks read (`ZigzagLayout.transfer`): under a plain causal mask the sender's chunks that
precede one of the receiver's, under a sliding window at most the window-1 tokens before each of the
receiver's chunks, so a rank whose chunks lie more than a window behind another's gets nothing from it.
Only the `Hkv` heads travel, K and V side by side in one row-major buffer (any head dims). Each rank
attends its queries to every block and merges the partial results through their log-sum-exp in fp32. The next step's transfer is posted before the current step is computed, so on a
GPU communication hides behind compute.

The backward moves K/V the same way; each rank computes its contribution to the received rows' dK/dV
and sends exactly those rows (fp32) straight back to their owner, which accumulates them.

All P2P goes over the default process group through `Peers` (`p2p.py`): sender and receiver derive every
transfer from the layout, so a pair with nothing to exchange posts nothing on either side, and both post a
pair's transfers in the same order (K/V of step s+1, then dK/dV of step s), as in-order P2P matching needs.

`bytescale_compile.runtime.dist_attn`, the former module of this code and of `p2p.py`, resolves here for one
release; its names that moved to `p2p.py` resolve through this module with a `DeprecationWarning`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..kernels.dispatch import block_attention_bwd, block_attention_fwd
from ..lazy import lazy_getattr
from .layout import Block, LayoutError, Transfer, ZigzagLayout, validate_window
from .p2p import DEFAULT_TIMEOUT_S, P2PError, P2PStats, Peers, check_group_agrees, make_peers

__all__ = [
    "packed_ring_attention",
    "ring_attention_fwd",
    "ring_attention_bwd",
    "Ring",
    "make_ring",
    "descriptor",
    "local_problem",
]


@dataclass(frozen=True)
class Ring(Peers):
    """This rank's view of one ring group: its peers and the layout."""

    layout: ZigzagLayout
    window: int | None
    label: str = field(default="ring group", kw_only=True)

    def peer(self, step: int) -> int:
        """Global rank `step` places after this one in the group (before it for a negative step)."""
        return self.group[(self.index + step) % self.size]

    def incoming(self, step: int) -> Transfer:
        """The K/V rows this rank receives at `step`, from the rank `step` places before it."""
        return self.layout.transfer(self.index, (self.index - step) % self.size, self.window)

    def outgoing(self, step: int) -> Transfer:
        """The K/V rows this rank sends at `step`, to the rank `step` places after it."""
        return self.layout.transfer((self.index + step) % self.size, self.index, self.window)

    def count_blocks(self, step: int, blocks: tuple[Block, ...]) -> None:
        """Count this step's blocks and the (query piece, key piece) pairs the mask or the window empties."""
        owner = (self.index - step) % self.size
        pairs = len(self.layout.rank(self.index).pieces) * len(self.layout.rank(owner).pieces)
        self.stats.blocks_computed += len(blocks)
        self.stats.blocks_skipped += pairs - len(blocks)


def make_ring(
    layout: ZigzagLayout,
    group: list[int] | tuple[int, ...],
    timeout_s: float,
    stats: P2PStats | None,
    window: int | None,
) -> Ring:
    """This rank's `Ring` in `group`, checked as `make_peers` checks a group against the layout's size."""
    peers = make_peers(group, layout.group_size, timeout_s, stats, "ring group")
    return Ring(peers.group, peers.index, peers.timeout, peers.stats, layout, window)


# --- input checks ---------------------------------------------------------------------------------


def local_problem(
    me: int, tokens: int, window: int | None, q: Tensor, k: Tensor, v: Tensor, softcap: float | None
) -> str | None:
    """Why global rank `me`'s q/k/v (`tokens` rows expected) and attention arguments cannot enter the ring, or None."""
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    try:
        validate_window(window)
    except LayoutError as e:
        return str(e)
    if softcap is not None and (
        isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap) or softcap <= 0
    ):
        return f"softcap must be None or a finite number > 0, got {softcap!r}"
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or k.shape[:2] != v.shape[:2]:
        return f"ring attention expects q [T, Hq, D], k [T, Hkv, D] and v [T, Hkv, Dv], got {shapes}"
    if q.shape[0] != tokens or k.shape[0] != tokens:
        return f"rank {me} holds {tokens} tokens in this layout, got {shapes}"
    if q.shape[2] != k.shape[2] or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        return f"ring attention needs q and k of one head dim and Hq a multiple of Hkv, got {shapes}"
    if not q.dtype == k.dtype == v.dtype:
        return (
            f"ring attention needs q, k and v of one dtype, got {_dtype_name(q.dtype)}, "
            f"{_dtype_name(k.dtype)} and {_dtype_name(v.dtype)}"
        )
    return None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def descriptor(
    group: tuple[int, ...],
    seq_lens: tuple[int, ...],
    window: int | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    softcap: float | None,
) -> dict[str, Any]:
    """What every rank of the group must agree on, in words."""

    def dim(x: Tensor, i: int) -> int | None:
        return int(x.shape[i]) if x.dim() == 3 else None

    return {
        "group": list(group),
        "layout (sequence lengths)": list(seq_lens),
        "query heads": dim(q, 1),
        "kv heads": dim(k, 1),
        "head dim": dim(q, 2),
        "v head dim": dim(v, 2),
        "dtype": _dtype_name(q.dtype),
        "window": window,
        "softcap": softcap,
    }


def _check_inputs(ring: Ring, q: Tensor, k: Tensor, v: Tensor, softcap: float | None, exchange: bool) -> None:
    """Check this rank's inputs and, with `exchange`, that the whole group agrees; every rank raises alike."""
    problem = local_problem(ring.me, ring.layout.rank(ring.index).num_tokens, ring.window, q, k, v, softcap)
    if exchange and ring.size > 1:
        mine = descriptor(ring.group, ring.layout.seq_lens, ring.window, q, k, v, softcap)
        check_group_agrees(ring, mine, problem, q.device)
    if problem:
        raise P2PError(problem)


# --- K/V steps ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Rows:
    """K and V rows side by side in one [t, Hkv·D + Hkv·Dv] buffer: one transfer per step for any head dims."""

    kv_heads: int
    head_dim: int
    v_head_dim: int

    @property
    def width(self) -> int:
        return self.kv_heads * (self.head_dim + self.v_head_dim)

    def join(self, k: Tensor, v: Tensor) -> Tensor:
        return torch.cat([k.reshape(k.shape[0], -1), v.reshape(v.shape[0], -1)], dim=1)

    def keys(self, rows: Tensor) -> Tensor:
        return rows[:, : self.kv_heads * self.head_dim].unflatten(1, (self.kv_heads, self.head_dim))

    def values(self, rows: Tensor) -> Tensor:
        return rows[:, self.kv_heads * self.head_dim :].unflatten(1, (self.kv_heads, self.v_head_dim))


def _gather(rows: Tensor, ranges: tuple[tuple[int, int], ...]) -> Tensor | None:
    """The rows of `ranges` back to back (no copy for one range), None for no rows."""
    if not ranges:
        return None
    if len(ranges) == 1:
        return rows[ranges[0][0] : ranges[0][1]]
    return torch.cat([rows[start:end] for start, end in ranges])


def _scatter_add(acc: Tensor, packed: Tensor, ranges: tuple[tuple[int, int], ...]) -> None:
    """Add rows packed by `_gather` back onto their places in `acc`."""
    row = 0
    for start, end in ranges:
        acc[start:end] += packed[row : row + end - start]
        row += end - start


@dataclass(frozen=True)
class _Step:
    step: int
    keys: Tensor
    """[t, Hkv, D]: this rank's own keys at step 0, the packed rows received from `step` ranks back after."""
    values: Tensor
    blocks: tuple[Block, ...]


def _kv_steps(ring: Ring, k: Tensor, v: Tensor) -> Iterator[_Step]:
    """Every step's K/V and blocks; step s+1's transfer is posted before step s is handed out."""
    rows = _Rows(k.shape[1], k.shape[2], v.shape[2])
    local = ring.layout.blocks(ring.index, ring.index, ring.window)
    ring.count_blocks(0, local)
    if ring.size == 1:
        yield _Step(0, k, v, local)
        return
    mine = rows.join(k, v)

    def post(step: int) -> tuple[list[Any], Tensor, tuple[Block, ...]]:
        incoming = ring.incoming(step)
        buffer = mine.new_empty((incoming.num_rows, rows.width))
        works = ring.post(
            _gather(mine, ring.outgoing(step).ranges),
            ring.peer(step),
            buffer if incoming.num_rows else None,
            ring.peer(-step),
            "K/V rows",
        )
        return works, buffer, incoming.blocks

    pending = post(1)
    yield _Step(0, k, v, local)
    for step in range(1, ring.size):
        works, buffer, blocks = pending
        if step + 1 < ring.size:
            pending = post(step + 1)
        ring.wait(works, "K/V rows", (ring.peer(step), ring.peer(-step)))
        ring.count_blocks(step, blocks)
        yield _Step(step, rows.keys(buffer), rows.values(buffer), blocks)


# --- attention ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Attention:
    """The score arguments every block kernel call shares."""

    scale: float
    softcap: float | None

    def kwargs(self, block: Block) -> dict[str, Any]:
        return {"window": block.window, "softcap": self.softcap, "offset": block.offset}


def _heads_first(x: Tensor) -> Tensor:
    """[t, H, D] → [1, H, t, D] view, the layout of the block kernels."""
    return x.transpose(0, 1).unsqueeze(0)


def _tokens_first(x: Tensor) -> Tensor:
    """[1, H, t, D] → [t, H, D] view."""
    return x.squeeze(0).transpose(0, 1)


def ring_attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: ZigzagLayout,
    group: list[int] | tuple[int, ...],
    scale: float | None = None,
    *,
    stats: P2PStats | None = None,
    check: bool = True,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    window: int | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """(out [T, Hq, Dv] in q's dtype, lse [Hq, T] fp32) of this rank's queries over the whole group.

    `window` is Hugging Face's sliding window (a query sees itself and the window-1 keys before it),
    `softcap` Gemma2's logit soft-capping. `check` trades a descriptor with the group first, so inputs
    that differ across ranks raise `P2PError` on all of them before any K/V moves.
    """
    ring = make_ring(layout, group, timeout_s, stats, window)
    _check_inputs(ring, q, k, v, softcap, exchange=check)
    attn = _Attention(q.shape[-1] ** -0.5 if scale is None else scale, softcap)
    ring.stats.calls += 1
    out = torch.zeros((*q.shape[:2], v.shape[2]), dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[1::-1], float("-inf"), dtype=torch.float32, device=q.device)
    for step in _kv_steps(ring, k, v):
        for block in step.blocks:
            keys = slice(block.k_start, block.k_end)
            _merge(
                out,
                lse,
                block,
                *block_attention_fwd(
                    _heads_first(q[block.q_start : block.q_end]),
                    _heads_first(step.keys[keys]),
                    _heads_first(step.values[keys]),
                    attn.scale,
                    block.causal,
                    **attn.kwargs(block),
                ),
            )
    return out.to(q.dtype), lse


def ring_attention_bwd(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    layout: ZigzagLayout,
    group: list[int] | tuple[int, ...],
    scale: float | None = None,
    *,
    stats: P2PStats | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    window: int | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of this rank's tokens; each rank's dK/dV rows of another's keys go straight back to it in fp32."""
    ring = make_ring(layout, group, timeout_s, stats, window)
    _check_inputs(ring, q, k, v, softcap, exchange=False)
    attn = _Attention(q.shape[-1] ** -0.5 if scale is None else scale, softcap)
    rows = _Rows(k.shape[1], k.shape[2], v.shape[2])
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    grads = torch.zeros((k.shape[0], rows.width), dtype=torch.float32, device=k.device)
    grad_out, out = _heads_first(grad_out), _heads_first(out)
    returning: _Returning | None = None
    for step in _kv_steps(ring, k, v):
        part = grads if step.step == 0 else grads.new_zeros((step.keys.shape[0], rows.width))
        dk, dv = rows.keys(part), rows.values(part)
        for block in step.blocks:
            q_rows, keys = slice(block.q_start, block.q_end), slice(block.k_start, block.k_end)
            dq_b, dk_b, dv_b = block_attention_bwd(
                grad_out[:, :, q_rows],
                _heads_first(q[q_rows]),
                _heads_first(step.keys[keys]),
                _heads_first(step.values[keys]),
                out[:, :, q_rows],
                lse[None, :, q_rows],
                attn.scale,
                block.causal,
                **attn.kwargs(block),
            )
            dq[q_rows] += _tokens_first(dq_b)
            dk[keys] += _tokens_first(dk_b)
            dv[keys] += _tokens_first(dv_b)
        if step.step:
            arriving = _Returning.post(ring, step.step, part)
            if returning is not None:
                returning.add_to(grads)
            returning = arriving
    if returning is not None:
        returning.add_to(grads)
    return dq.to(q.dtype), rows.keys(grads).to(k.dtype, copy=True), rows.values(grads).to(v.dtype, copy=True)


@dataclass(frozen=True)
class _Returning:
    """The dK/dV rows of this rank's keys that the peer `step` places after it computed, on their way back."""

    ring: Ring
    step: int
    works: list[Any]
    buffer: Tensor | None
    ranges: tuple[tuple[int, int], ...]

    @classmethod
    def post(cls, ring: Ring, step: int, part: Tensor) -> _Returning:
        """Send this step's dK/dV rows `part` back to their owner; receive ours from where this step's K/V went."""
        ours = ring.outgoing(step)
        buffer = part.new_empty((ours.num_rows, part.shape[1])) if ours.num_rows else None
        works = ring.post(part if part.shape[0] else None, ring.peer(-step), buffer, ring.peer(step), "dK/dV rows")
        return cls(ring, step, works, buffer, ours.ranges)

    def add_to(self, grads: Tensor) -> None:
        """Wait for the rows and add them to this rank's own dK/dV."""
        self.ring.wait(self.works, "dK/dV rows", (self.ring.peer(self.step), self.ring.peer(-self.step)))
        if self.buffer is not None:
            _scatter_add(grads, self.buffer, self.ranges)


def _merge(out: Tensor, lse: Tensor, block: Block, block_out: Tensor, block_lse: Tensor) -> None:
    """Fold one block's (out, lse) into the running fp32 result of its query rows.

    A row that has seen no key yet on either side (lse = -inf) stays at out = 0, lse = -inf: the
    weights are taken against a finite stand-in for the merged lse, so they come out 0, not NaN.
    """
    rows = slice(block.q_start, block.q_end)
    new = torch.logaddexp(lse[:, rows], block_lse[0])
    finite = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    keep = torch.exp(lse[:, rows] - finite).T.unsqueeze(-1)
    add = torch.exp(block_lse[0] - finite).T.unsqueeze(-1)
    out[rows] = out[rows] * keep + _tokens_first(block_out).float() * add
    lse[:, rows] = new


class _PackedRingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        layout: ZigzagLayout,
        group: tuple[int, ...],
        scale: float | None,
        stats: P2PStats | None,
        timeout_s: float,
        window: int | None,
        softcap: float | None,
    ) -> Tensor:
        out, lse = ring_attention_fwd(
            q, k, v, layout, group, scale, stats=stats, timeout_s=timeout_s, window=window, softcap=softcap
        )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (layout, group, scale)
        ctx.kwargs = {"stats": stats, "timeout_s": timeout_s, "window": window, "softcap": softcap}
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_attention_bwd(grad_out, q, k, v, out, lse, *ctx.args, **ctx.kwargs)
        return dq, dk, dv, None, None, None, None, None, None, None


def packed_ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: ZigzagLayout,
    group: list[int] | tuple[int, ...],
    scale: float | None = None,
    *,
    stats: P2PStats | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    window: int | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Segment-causal attention of this rank's zigzag tokens against the whole group's, differentiable.

    q [T_local, Hq, D], k [T_local, Hkv, D], v [T_local, Hkv, Dv] in `layout.rank(i).token_index`
    order, where i is this rank's index in `group` (an ordered list of global ranks). Returns out
    [T_local, Hq, Dv]. `window` and `softcap` as in `ring_attention_fwd`.
    """
    return _PackedRingAttention.apply(q, k, v, layout, tuple(group), scale, stats, timeout_s, window, softcap)


if not TYPE_CHECKING:  # mypy sees only the current names
    __getattr__ = lazy_getattr(
        __name__,
        {},
        globals(),
        renamed={
            "RingStats": "bytescale_compile.runtime.p2p:P2PStats",
            "RingError": "bytescale_compile.runtime.p2p:P2PError",
            "RingTimeoutError": "bytescale_compile.runtime.p2p:P2PTimeoutError",
            "Shapes": "bytescale_compile.runtime.p2p:Shapes",
        },
    )
