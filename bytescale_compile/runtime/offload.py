"""The act_ctx of the paper's Listing 1: where offloaded activations wait between forward and backward.

    act_ctx = get_act_ctx(num_micro_batch, offload_ratios)
    act_ctx.update_micro_batch_id(i)
    with act_ctx: loss = model(...)        # saved activations: first ⌊r·T⌋ tokens go to host memory
    with act_ctx: loss.backward()          # ... and come back, one layer ahead of their use

The offload pass (`passes/offload.py`) routes every token-carrying saved activation of the compiled
forward through the `bytescale::offload_saved` op (`ops/offload.py`), which hands the backward only
data-less handles keyed by a `SavedKey` {act_ctx, micro-batch, call}, so the graph carries no activation
and never changes when r does: r is read here, at run time, from the micro-batch's entry in
`offload_ratios`. A saved storage is token-major (the token
dimension is outermost in memory), so its first ⌊r·T⌋ tokens are one contiguous prefix: that prefix
goes to a pooled host buffer, the rest stays on the device as its own (smaller) tensor, and the
original storage is released. On CUDA the copies run on a device-to-host and a host-to-device stream
ordered by events (host buffers pinned); on CPU the same code runs with plain copies and no streams.

Without an active act_ctx the ops keep the storage as it is (the eager model's behaviour).
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .context import ContextError, enter, innermost, leave

__all__ = [
    "ActivationContext",
    "OffloadStats",
    "current_act_ctx",
    "SavedKey",
    "get_act_ctx",
    "token_major_storage",
]


@dataclass
class OffloadStats:
    """Counters of one micro-batch."""

    micro_batch_id: int
    offload_ratio: float
    offloaded_bytes: int = 0
    """Bytes copied to host memory in the forward."""
    reloaded_bytes: int = 0
    """Bytes copied back in the backward (equal to offloaded_bytes once the backward has run)."""
    resident_bytes: int = 0
    """Saved-activation bytes on the device now, offloadable and kept alike (a layer's storages count
    until the backward moves below that layer)."""
    peak_resident_bytes: int = 0
    """The most saved-activation bytes on the device at any point of the micro-batch."""

    def add_resident(self, nbytes: int) -> None:
        self.resident_bytes += nbytes
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)


@dataclass(frozen=True)
class SavedKey:
    """Where the act_ctx keeps one saved storage: what the forward's handles carry to the backward."""

    owner: weakref.ref[ActivationContext] = field(repr=False)
    """The act_ctx that holds the storage; weak, so that a key left behind keeps no step's activations alive."""
    micro_batch_id: int
    call: int


@dataclass
class _Saved:
    """One saved storage of one forward call: its members, split into a host prefix and a device rest."""

    layer: int
    numel: int
    dtype: torch.dtype
    device: torch.device
    offloaded: int
    """Elements of the host prefix."""
    rest: Tensor | None
    """The device part: the whole storage when nothing is offloaded, else the elements after the prefix."""
    host: Tensor | None = None
    copied: torch.cuda.Event | None = None
    """CUDA: recorded once the prefix is on the host and the rest cloned."""
    full: Tensor | None = None
    """The reassembled storage once fetched back."""
    ready: torch.cuda.Event | None = None
    """CUDA: recorded once `full` is complete."""

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def offloaded_bytes(self) -> int:
        return self.offloaded * self.dtype.itemsize

    @property
    def rest_bytes(self) -> int:
        return self.nbytes - self.offloaded_bytes


class _HostPool:
    """Reusable host buffers (pinned with CUDA): pinning is slow, so buffers outlive micro-batches.

    Sizes are rounded up to a power of two, so micro-batches of other lengths reuse the same buffers
    and the pool stays bounded by the most that one step ever has offloaded at once.
    """

    def __init__(self) -> None:
        self._free: dict[tuple[torch.dtype, int], list[tuple[Tensor, torch.cuda.Event | None]]] = defaultdict(list)

    def get(self, dtype: torch.dtype, numel: int, pin: bool) -> Tensor:
        """A buffer of at least `numel` elements."""
        size = 1 << max(numel - 1, 0).bit_length()
        free = self._free[(dtype, size)]
        for i, (buf, done) in enumerate(free):
            if done is None or done.query():
                del free[i]
                return buf
        return torch.empty(size, dtype=dtype, pin_memory=pin)

    def put(self, buf: Tensor, done: torch.cuda.Event | None) -> None:
        """Return `buf`; it is reused once `done` (its last copy) has completed."""
        self._free[(buf.dtype, buf.numel())].append((buf, done))


class _Streams:
    """Copy streams on CUDA; on CPU every copy is synchronous and there is nothing to order."""

    def __init__(self) -> None:
        self._cuda: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None

    def for_device(self, device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream] | None:
        if device.type != "cuda":
            return None
        if self._cuda is None:
            self._cuda = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._cuda


_pool = _HostPool()
"""Process-wide: pinned host buffers outlive the per-step act_ctx, as pinning anew every step is slow."""
_streams = _Streams()
"""Process-wide: the copy streams every act_ctx of the process orders its copies on."""


class ActivationContext:
    """One training step's offload state: ratios per micro-batch, the waiting activations, counters."""

    def __init__(self, num_micro_batch: int, offload_ratios: Sequence[float]) -> None:
        ratios = [float(r) for r in offload_ratios]
        if len(ratios) != num_micro_batch:
            raise ValueError(f"get_act_ctx: {num_micro_batch} micro-batches but {len(ratios)} offload ratios")
        bad = [r for r in ratios if not 0.0 <= r <= 1.0]
        if bad:
            raise ValueError(f"offload ratios must lie in [0, 1], got {bad}")
        self.offload_ratios = ratios
        self.micro_batch_id = 0
        self.stats = [OffloadStats(i, r) for i, r in enumerate(ratios)]
        self._waiting: list[dict[int, _Saved]] = [{} for _ in ratios]
        self._in_use: list[list[_Saved]] = [[] for _ in ratios]
        self._layer: list[int | None] = [None for _ in ratios]
        """Per micro-batch: the layer the backward is in."""
        self._calls = itertools.count()

    def update_micro_batch_id(self, micro_batch_id: int) -> None:
        if not 0 <= micro_batch_id < len(self.offload_ratios):
            raise ValueError(
                f"micro-batch id {micro_batch_id} out of range: this act_ctx has "
                f"{len(self.offload_ratios)} micro-batches"
            )
        self.micro_batch_id = micro_batch_id

    def __enter__(self) -> ActivationContext:
        enter(self)
        return self

    def __exit__(self, *exc: object) -> None:
        leave(self)

    def waiting(self, micro_batch_id: int) -> int:
        """Saved storages of a micro-batch that its backward has not taken back yet."""
        return len(self._waiting[micro_batch_id])

    # --- forward --------------------------------------------------------------------------------
    def offload(self, layer: int, token_dim: int, keep: bool, member: Tensor) -> SavedKey:
        """Take the storage `member` views; return the key its backward reloads it by."""
        mb = self.micro_batch_id
        flat, per_token = token_major_storage(member, token_dim)
        tokens = flat.numel() // per_token if per_token else 0
        offloaded = 0 if keep or not per_token else math.floor(self.offload_ratios[mb] * tokens) * per_token
        saved = _Saved(
            layer=layer, numel=flat.numel(), dtype=flat.dtype, device=flat.device, offloaded=offloaded, rest=flat
        )
        if offloaded:
            self._to_host(saved, flat)
        stats = self.stats[mb]
        stats.offloaded_bytes += saved.offloaded_bytes
        stats.add_resident(saved.rest_bytes)
        call = next(self._calls)
        self._waiting[mb][call] = saved
        return SavedKey(weakref.ref(self), mb, call)

    def _to_host(self, saved: _Saved, flat: Tensor) -> None:
        streams = _streams.for_device(flat.device)
        host = _pool.get(flat.dtype, saved.offloaded, pin=streams is not None)
        saved.rest = flat[saved.offloaded :].clone()
        if streams is None:
            host[: saved.offloaded].copy_(flat[: saved.offloaded])
        else:
            d2h = streams[0]
            d2h.wait_stream(torch.cuda.current_stream(flat.device))  # after the producer and the clone above
            with torch.cuda.stream(d2h):
                host[: saved.offloaded].copy_(flat[: saved.offloaded], non_blocking=True)
                saved.copied = torch.cuda.Event()
                saved.copied.record(d2h)
            flat.record_stream(d2h)  # the allocator keeps the source until the copy is done
        saved.host = host

    # --- backward -------------------------------------------------------------------------------
    def reload(self, layer: int, key: SavedKey) -> Tensor:
        """The whole storage again, flat, from the key the forward returned; prefetches the next layer down."""
        mb, call = key.micro_batch_id, key.call
        owner = key.owner()
        if owner is not self or mb != self.micro_batch_id:
            whose = "this act_ctx" if owner is self else "another act_ctx"
            raise ContextError(
                f"saved activations of layer {layer} belong to micro-batch {mb} of {whose}, but the backward "
                f"runs under micro-batch {self.micro_batch_id} of this one: call update_micro_batch_id({mb}) on the "
                f"act_ctx of the forward before the backward, inside `with` that act_ctx"
            )
        saved = self._waiting[mb].pop(call, None)
        if saved is None:
            raise ContextError(
                f"saved activations of layer {layer}, micro-batch {mb}, were already reloaded: "
                "a backward through the same forward can run only once (retain_graph is not supported "
                "with offloading)"
            )
        # the backward entering a layer frees the layers above and prefetches the next one down; storages
        # outside the layers (rotary tables, say) are read throughout and move nothing
        entering = layer >= 0 and layer != self._layer[mb]
        if entering:
            self._layer[mb] = layer
            self._release_above(mb, layer)
        full = self._fetch(saved, mb)
        if entering:
            self._prefetch_below(mb, layer)
        if saved.ready is not None:
            torch.cuda.current_stream(full.device).wait_event(saved.ready)
        self._in_use[mb].append(saved)
        return full

    def _release_above(self, mb: int, layer: int) -> None:
        """The backward moved down to `layer`: storages of the layers above it are done with (freed)."""
        done = [s for s in self._in_use[mb] if s.layer > layer]
        self._in_use[mb] = [s for s in self._in_use[mb] if s.layer <= layer]
        self.stats[mb].resident_bytes -= sum(s.nbytes for s in done)

    def _fetch(self, saved: _Saved, mb: int) -> Tensor:
        """Reassemble `saved`'s storage: the host prefix copied back, the device rest moved in (once); return it."""
        if saved.full is not None:
            return saved.full
        rest, host = saved.rest, saved.host
        assert rest is not None  # the device part stays until the storage is reassembled
        if not saved.offloaded:
            saved.full, saved.rest = rest, None
            return rest
        assert host is not None  # an offloaded prefix went to the host
        streams = _streams.for_device(saved.device)
        full = torch.empty(saved.numel, dtype=saved.dtype, device=saved.device)
        if streams is None:
            full[: saved.offloaded].copy_(host[: saved.offloaded])
            full[saved.offloaded :].copy_(rest)
            _pool.put(host, None)
        else:
            assert saved.copied is not None  # `_to_host` recorded it on the same CUDA device
            h2d = streams[1]
            h2d.wait_stream(torch.cuda.current_stream(saved.device))  # `full` may reuse memory compute just freed
            h2d.wait_event(saved.copied)
            with torch.cuda.stream(h2d):
                full[: saved.offloaded].copy_(host[: saved.offloaded], non_blocking=True)
                full[saved.offloaded :].copy_(rest, non_blocking=True)
                saved.ready = torch.cuda.Event()
                saved.ready.record(h2d)
            rest.record_stream(h2d)
            _pool.put(host, saved.ready)
        stats = self.stats[mb]
        stats.reloaded_bytes += saved.offloaded_bytes
        stats.add_resident(saved.nbytes)
        stats.resident_bytes -= saved.rest_bytes
        saved.host, saved.rest, saved.full = None, None, full
        return full

    def _prefetch_below(self, mb: int, layer: int) -> None:
        """Fetch the storages of the next layer down, so their copy overlaps this layer's backward."""
        below = [s for s in self._waiting[mb].values() if 0 <= s.layer < layer]
        if below:
            nxt = max(s.layer for s in below)
            for saved in below:
                if saved.layer == nxt:
                    self._fetch(saved, mb)


def token_major_storage(t: Tensor, token_dim: int) -> tuple[Tensor, int]:
    """The whole storage `t` views, flat, and its elements per token; 0 per token when the storage is not
    token-major (tokens outermost, exactly T of them), so no token prefix of it is contiguous."""
    numel = t.untyped_storage().nbytes() // t.element_size()
    flat = t.new_empty(0).set_(t.untyped_storage(), 0, (numel,), (1,))
    per_token = t.stride(token_dim)
    token_major = t.shape[token_dim] * per_token == numel and all(
        t.stride(d) * t.shape[d] <= per_token for d in range(t.dim()) if d != token_dim and t.shape[d] > 1
    )
    return flat, per_token if token_major else 0


def current_act_ctx() -> ActivationContext | None:
    """The innermost act_ctx entered with `with act_ctx:`, or None (nothing is offloaded)."""
    return innermost(ActivationContext)


def get_act_ctx(num_micro_batch: int, offload_ratios: Sequence[float]) -> ActivationContext:
    """The paper's `get_act_ctx`: one per step, `offload_ratios[i]` the r of micro-batch i."""
    return ActivationContext(num_micro_batch, offload_ratios)
