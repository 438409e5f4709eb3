"""P2P with an ordered group of global ranks: the ring (`ring_attention.py`), the Ulysses all-to-all
(`ulysses.py`) and the recurrent mixers' halos and states (`dist_mixers.py`) all move their tensors through
`Peers`, with one timeout, named faults (`P2PError`, `P2PTimeoutError`) and one set of counters (`P2PStats`).

All P2P goes over the default process group (`batch_isend_irecv`): the group changes every
micro-batch, and creating a process group per micro-batch would allocate communicator buffers each
time (the paper's NCCL-buffer point). Sender and receiver derive every transfer from what both know (a
layout), so a pair with nothing to exchange posts nothing on either side, and both post a pair's transfers
in the same order, as in-order P2P matching needs. `check_group_agrees` makes every member raise alike
when their inputs differ, before anything else moves.
"""

from __future__ import annotations

import datetime
import json
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "P2PError",
    "P2PStats",
    "P2PTimeoutError",
    "Peers",
    "Shapes",
    "check_group_agrees",
    "make_peers",
]

DEFAULT_TIMEOUT_S = 300.0
_CLOCK_SLACK_S = 1e-3
"""Backends count a wait's timeout in whole milliseconds: a wait that fails this close to it has timed out."""


class P2PError(RuntimeError):
    """P2P in a group cannot run: bad arguments, inputs that differ across the group, or a lost peer."""


class P2PTimeoutError(P2PError, TimeoutError):
    """A peer of the group did not send in time."""


@dataclass
class P2PStats:
    """This rank's P2P counters, which the runtime and the simulator report; they accumulate over calls.

    Bytes count all of this rank's P2P: the ring's K/V rows (forward and backward) and fp32 dK/dV rows
    (backward), and the Ulysses and mixer traffic, whose shares are also counted apart below. The blocks
    are the ring's. `sends_skipped` / `receives_skipped` count the ring steps at which the layout left this
    rank nothing to send to / receive from that step's peer (a window can empty a pair).
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
    named faults: the ring's (`runtime/ring_attention.py`), the recurrent mixers' halos and states
    (`runtime/dist_mixers.py`) and the Ulysses all-to-all (`runtime/ulysses.py`) all move through it."""

    group: tuple[int, ...]
    index: int
    timeout: datetime.timedelta
    stats: P2PStats
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
        """Post `ops`; a peer already lost (gloo refuses to post to a closed connection) raises `P2PError`."""
        if not ops:
            return []
        try:
            return dist.batch_isend_irecv(ops)
        except RuntimeError as e:
            raise self.fault(e, what, peers, timed_out=False, stream_ordered=False) from e

    def wait(self, works: list[Any], what: str, peers: tuple[int, ...]) -> None:
        """Wait for posted P2P; a timeout raises `P2PTimeoutError`, a lost peer `P2PError`.

        Off NCCL each wait is bounded by the group's timeout. A backend reports a wait that timed out and one
        whose peer is gone alike (gloo: a RuntimeError either way), so `Peers` tells them apart by its own
        deadline, never by the words of the message: a wait that failed once its timeout had passed timed out.
        On NCCL the wait is stream-ordered (the CPU goes on queueing compute): `wait(timeout=...)` there would
        block the CPU for the whole transfer, so the timeout is the process group's, enforced by NCCL's
        watchdog, and whatever NCCL reports (a timeout or a lost peer) is a `P2PError` quoting it.
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
    ) -> P2PError:
        """The `P2PError` of a backend error: `P2PTimeoutError` when the group's own timeout ran out."""
        where = f"{self.label} {list(self.group)}: rank {self.me}"
        if timed_out:
            return P2PTimeoutError(
                f"{where} waited {self.timeout.total_seconds():.0f}s for {what} (peers "
                f"{list(peers)}); a peer never joined this ring step or is stuck elsewhere"
            )
        reported = str(error).splitlines()[0] if str(error) else type(error).__name__
        if stream_ordered:
            return P2PError(
                f"{where}: NCCL failed exchanging {what} with peers {list(peers)} (a lost peer, or the "
                f"process group's timeout): {reported}"
            )
        return P2PError(f"{where} lost a peer while exchanging {what}: {reported}")


def make_peers(
    group: list[int] | tuple[int, ...], size: int, timeout_s: float, stats: P2PStats | None, label: str
) -> Peers:
    """This rank's `Peers` in `group` (global ranks), checked: distinct ranks in the world, this rank among them,
    as many as the layout's `size`."""
    group = tuple(int(r) for r in group)
    if len(set(group)) != len(group):
        raise P2PError(f"{label} {list(group)} lists a rank twice")
    if len(group) != size:
        raise P2PError(f"{label} {list(group)} has {len(group)} ranks but the layout was made for {size}")
    if len(group) > 1 and not dist.is_initialized():
        raise P2PError(f"{label} {list(group)} needs torch.distributed to be initialised")
    world = dist.get_world_size() if dist.is_initialized() else 1
    outside = [r for r in group if not 0 <= r < world]
    if len(group) > 1 and outside:
        raise P2PError(
            f"{label} {list(group)} names rank(s) {outside} outside the world of {world} ranks "
            f"(valid: 0 to {world - 1})"
        )
    me = dist.get_rank() if dist.is_initialized() else group[0]
    if me not in group:
        raise P2PError(f"rank {me} is not in {label} {list(group)}")
    return Peers(group, group.index(me), datetime.timedelta(seconds=timeout_s), stats or P2PStats(), label=label)


# --- agreement checks ------------------------------------------------------------------------------


def check_group_agrees(
    peers: Peers,
    mine: dict[str, Any],
    problem: str | None,
    device: torch.device,
    error: type[P2PError] = P2PError,
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


def _exchange_with_group(group: Peers, payload: bytes, device: torch.device) -> dict[int, bytes]:
    """Every group member's `payload` (this rank's included): sizes first, then the bytes.

    The buffers live on the inputs' device: NCCL takes no CPU tensors.
    """
    peers = tuple(r for r in group.group if r != group.me)
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = {r: torch.empty_like(size) for r in peers}
    group.wait(_all_to_peers(group, size, sizes), "the input descriptor", peers)
    data = {r: torch.empty(int(sizes[r]), dtype=torch.uint8, device=device) for r in peers}
    mine = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    group.wait(_all_to_peers(group, mine, data), "the input descriptor", peers)
    return {group.me: payload, **{r: bytes(data[r].cpu().tolist()) for r in peers}}


def _all_to_peers(group: Peers, mine: Tensor, theirs: dict[int, Tensor]) -> list[Any]:
    ops = [dist.P2POp(dist.isend, mine, r) for r in theirs] + [dist.P2POp(dist.irecv, t, r) for r, t in theirs.items()]
    return group.start(ops, "the input descriptor", tuple(theirs))
