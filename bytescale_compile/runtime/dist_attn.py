"""Packed ring attention over any ordered subset of the global ranks (paper §6, "Dist-attn with Packing").

Each group rank holds its zigzag tokens of every sequence of the micro-batch (`layout.py`). At step s
(1..N-1) group rank i sends straight to rank i+s, and receives from rank i-s, only the K/V rows the
receiver's blocks read (`ZigzagLayout.transfer`): under a plain causal mask the sender's chunks that
precede one of the receiver's, under a sliding window at most the window-1 tokens before each of the
receiver's chunks, so a rank whose chunks lie more than a window behind another's gets nothing from it. Only the `Hkv` heads travel, K and V side by side in one row-major buffer (any head
dims). Each rank attends its queries to every block and merges the partial results through their
log-sum-exp in fp32. The next step's transfer is posted before the current step is computed, so on a
GPU communication hides behind compute.

The backward moves K/V the same way; each rank computes its contribution to the received rows' dK/dV
and sends exactly those rows (fp32) straight back to their owner, which accumulates them.

All P2P goes over the default process group (`batch_isend_irecv`): the group changes every
micro-batch, and creating a process group per micro-batch would allocate communicator buffers each
time (the paper's NCCL-buffer point). Sender and receiver derive every transfer from the layout, so
a pair with nothing to exchange posts nothing on either side, and both post a pair's transfers in the
same order (K/V of step s+1, then dK/dV of step s), as in-order P2P matching needs.
"""

from __future__ import annotations

import datetime
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..kernels.dispatch import block_attention_bwd, block_attention_fwd
from .layout import Block, LayoutError, Transfer, ZigzagLayout, validate_window

__all__ = [
    "packed_ring_attention",
    "ring_attention_fwd",
    "ring_attention_bwd",
    "RingStats",
    "RingError",
    "RingTimeoutError",
    "DEFAULT_TIMEOUT_S",
    "Peers",
    "Shapes",
    "Ring",
    "make_peers",
    "make_ring",
]

DEFAULT_TIMEOUT_S = 300.0
_CLOCK_SLACK_S = 1e-3
"""Backends count a wait's timeout in whole milliseconds: a wait that fails this close to it has timed out."""


class RingError(RuntimeError):
    """The ring cannot run: bad arguments, or inputs that differ across the group."""


class RingTimeoutError(RingError, TimeoutError):
    """A peer of the ring did not send in time."""


@dataclass
class RingStats:
    """Counters the runtime and the simulator report; accumulate over calls.

    Bytes count the K/V rows (forward and backward) and the fp32 dK/dV rows (backward) this rank
    sent and received. `sends_skipped` / `receives_skipped` count the steps at which the layout left
    this rank nothing to send to / receive from that step's peer (a window can empty a pair).
    """

    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    blocks_computed: int = 0
    blocks_skipped: int = 0
    sends_skipped: int = 0
    receives_skipped: int = 0
    mixer_bytes_sent: int = 0
    """Of `bytes_sent`: the convolution halos and scan state summaries of `dist_mixers`, and their gradients."""
    ulysses_bytes_sent: int = 0
    """Of `bytes_sent`: the Ulysses all-to-all's token and head shards (`runtime/ulysses.py`), both ways."""


Shapes = dict[int, tuple[tuple[int, ...], torch.dtype]]
"""Group index -> (shape, dtype) of the tensor to receive from that member."""


@dataclass(frozen=True)
class Peers:
    """This rank's P2P with an ordered group of global ranks over the default process group, with timeouts and
    named faults: the ring's, the recurrent mixers' halos and states (`runtime/dist_mixers.py`) and the Ulysses
    all-to-all (`runtime/ulysses.py`) all move through it."""

    group: tuple[int, ...]
    index: int
    timeout: datetime.timedelta
    stats: RingStats
    label: str = field(default="group", kw_only=True)
    """What the group is called in error messages."""

    @property
    def size(self) -> int:
        return len(self.group)

    @property
    def me(self) -> int:
        return self.group[self.index]

    def post(self, send: Tensor | None, dst: int, recv: Tensor | None, src: int, what: str) -> list[Any]:
        """Send `what` to `dst` and receive it from `src` without waiting; None on a side that has nothing to move."""
        ops = []
        if send is None:
            self.stats.sends_skipped += 1
        else:
            self.stats.bytes_sent += send.numel() * send.element_size()
            ops.append(dist.P2POp(dist.isend, send, dst))
        if recv is None:
            self.stats.receives_skipped += 1
        else:
            self.stats.bytes_received += recv.numel() * recv.element_size()
            ops.append(dist.P2POp(dist.irecv, recv, src))
        return self.start(ops, what, (dst, src))

    def exchange(
        self, sends: dict[int, Tensor], receives: Shapes, what: str, device: torch.device
    ) -> dict[int, Tensor]:
        """Send `sends[i]` to group member i and receive a tensor of the given shape and dtype from each member in
        `receives`; one batch of P2P on `device`, waited on with the group's timeout."""
        got = {src: torch.empty(shape, dtype=dtype, device=device) for src, (shape, dtype) in receives.items()}
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.group[dst]) for dst, t in sends.items()]
        ops += [dist.P2POp(dist.irecv, t, self.group[src]) for src, t in got.items()]
        self.stats.bytes_sent += sum(t.numel() * t.element_size() for t in sends.values())
        self.stats.bytes_received += sum(t.numel() * t.element_size() for t in got.values())
        peers = tuple(self.group[i] for i in {*sends, *receives})
        self.wait(self.start(ops, what, peers), what, peers)
        return got

    def start(self, ops: list[Any], what: str, peers: tuple[int, ...]) -> list[Any]:
        """Post `ops`; a peer already lost (gloo refuses to post to a closed connection) raises `RingError`."""
        if not ops:
            return []
        try:
            return dist.batch_isend_irecv(ops)
        except RuntimeError as e:
            raise self.fault(e, what, peers, timed_out=False, stream_ordered=False) from e

    def wait(self, works: list[Any], what: str, peers: tuple[int, ...]) -> None:
        """Wait for posted P2P; a timeout raises `RingTimeoutError`, a lost peer `RingError`.

        Off NCCL each wait is bounded by the ring's timeout. A backend reports a wait that timed out and one
        whose peer is gone alike (gloo: a RuntimeError either way), so the ring tells them apart by its own
        deadline, never by the words of the message: a wait that failed once its timeout had passed timed out.
        On NCCL the wait is stream-ordered (the CPU goes on queueing compute): `wait(timeout=...)` there would
        block the CPU for the whole transfer, so the timeout is the process group's, enforced by NCCL's
        watchdog, and whatever NCCL reports (a timeout or a lost peer) is a `RingError` quoting it.
        """
        stream_ordered = dist.is_initialized() and dist.get_backend() == "nccl"
        for work in works:
            began = time.monotonic()
            try:
                work.wait() if stream_ordered else work.wait(timeout=self.timeout)
            except RuntimeError as e:
                waited = time.monotonic() - began
                timed_out = not stream_ordered and waited >= self.timeout.total_seconds() - _CLOCK_SLACK_S
                raise self.fault(e, what, peers, timed_out, stream_ordered) from e

    def fault(
        self, error: RuntimeError, what: str, peers: tuple[int, ...], timed_out: bool, stream_ordered: bool
    ) -> RingError:
        """The ring error of a backend error: `RingTimeoutError` when the ring's own timeout ran out."""
        where = f"{self.label} {list(self.group)}: rank {self.me}"
        if timed_out:
            return RingTimeoutError(
                f"{where} waited {self.timeout.total_seconds():.0f}s for {what} (peers "
                f"{list(peers)}); a peer never joined this ring step or is stuck elsewhere"
            )
        reported = str(error).splitlines()[0] if str(error) else type(error).__name__
        if stream_ordered:
            return RingError(
                f"{where}: NCCL failed exchanging {what} with peers {list(peers)} (a lost peer, or the "
                f"process group's timeout): {reported}"
            )
        return RingError(f"{where} lost a peer while exchanging {what}: {reported}")


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


def make_peers(
    group: list[int] | tuple[int, ...], size: int, timeout_s: float, stats: RingStats | None, label: str
) -> Peers:
    """This rank's `Peers` in `group` (global ranks), checked: distinct ranks in the world, this rank among them,
    as many as the layout's `size`."""
    group = tuple(int(r) for r in group)
    if len(set(group)) != len(group):
        raise RingError(f"{label} {list(group)} lists a rank twice")
    if len(group) != size:
        raise RingError(f"{label} {list(group)} has {len(group)} ranks but the layout was made for {size}")
    if len(group) > 1 and not dist.is_initialized():
        raise RingError(f"{label} {list(group)} needs torch.distributed to be initialised")
    world = dist.get_world_size() if dist.is_initialized() else 1
    outside = [r for r in group if not 0 <= r < world]
    if len(group) > 1 and outside:
        raise RingError(
            f"{label} {list(group)} names rank(s) {outside} outside the world of {world} ranks "
            f"(valid: 0 to {world - 1})"
        )
    me = dist.get_rank() if dist.is_initialized() else group[0]
    if me not in group:
        raise RingError(f"rank {me} is not in {label} {list(group)}")
    return Peers(group, group.index(me), datetime.timedelta(seconds=timeout_s), stats or RingStats(), label=label)


def make_ring(
    layout: ZigzagLayout,
    group: list[int] | tuple[int, ...],
    timeout_s: float,
    stats: RingStats | None,
    window: int | None,
) -> Ring:
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
        raise RingError(problem)


def check_group_agrees(
    peers: Peers,
    mine: dict[str, Any],
    problem: str | None,
    device: torch.device,
    error: type[RingError] = RingError,
) -> None:
    """Exchange descriptors and local problems with every group member; raise the same `error` on all of them."""
    theirs = _exchange_with_group(peers, json.dumps({"descriptor": mine, "problem": problem}).encode(), device)
    received = {r: json.loads(payload) for r, payload in sorted(theirs.items())}
    differences = []
    for name in mine:
        values = {r: got["descriptor"].get(name) for r, got in received.items()}
        if len({json.dumps(x) for x in values.values()}) > 1:
            shown = ", ".join(f"rank {r}: {_shown(x)}" for r, x in values.items())
            differences.append(f"{name} differs ({shown})")
    problems = [f"rank {r}: {got['problem']}" for r, got in received.items() if got["problem"]]
    if differences or problems:
        raise error(
            f"{peers.label} {sorted(peers.group)}: {'inputs differ across ranks, ' if differences else ''}"
            f"nothing was sent: " + "; ".join(differences + problems)
        )


def _shown(value: Any, limit: int = 8) -> str:
    """A descriptor value for a message; long lists keep their head and say how long they are."""
    if isinstance(value, list) and len(value) > limit:
        return "[" + ", ".join(map(str, value[:limit])) + f", ... ({len(value)} values)]"
    return "none" if value is None else str(value)


def _exchange_with_group(ring: Peers, payload: bytes, device: torch.device) -> dict[int, bytes]:
    """Every group member's `payload` (this rank's included): sizes first, then the bytes.

    The buffers live on the inputs' device: NCCL takes no CPU tensors.
    """
    peers = tuple(r for r in ring.group if r != ring.me)
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = {r: torch.empty_like(size) for r in peers}
    ring.wait(_all_to_peers(ring, size, sizes), "the input descriptor", peers)
    data = {r: torch.empty(int(sizes[r]), dtype=torch.uint8, device=device) for r in peers}
    mine = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    ring.wait(_all_to_peers(ring, mine, data), "the input descriptor", peers)
    return {ring.me: payload, **{r: bytes(data[r].cpu().tolist()) for r in peers}}


def _all_to_peers(ring: Peers, mine: Tensor, theirs: dict[int, Tensor]) -> list[Any]:
    ops = [dist.P2POp(dist.isend, mine, r) for r in theirs] + [dist.P2POp(dist.irecv, t, r) for r, t in theirs.items()]
    return ring.start(ops, "the input descriptor", tuple(theirs))


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
    stats: RingStats | None = None,
    check: bool = True,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    window: int | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """(out [T, Hq, Dv] in q's dtype, lse [Hq, T] fp32) of this rank's queries over the whole group.

    `window` is Hugging Face's sliding window (a query sees itself and the window-1 keys before it),
    `softcap` Gemma2's logit soft-capping. `check` trades a descriptor with the group first, so inputs
    that differ across ranks raise `RingError` on all of them before any K/V moves.
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
    stats: RingStats | None = None,
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
        stats: RingStats | None,
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
    stats: RingStats | None = None,
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
