"""The fp32 gradient buffer of the distributed optimizer: one contiguous tensor cut into buckets, each
reduce-scattered over the HDP ranks as soon as this rank's last micro-batch has produced it.

Parameters are laid out in reverse order (the order a backward produces their gradients) and grouped into
buckets of about `bucket_bytes`, each padded to a multiple of the group size so that rank i owns the i-th
equal slice of every bucket. A hook after each parameter's gradient accumulation adds the (bf16) gradient
into its fp32 slot and drops it; when a parameter has received as many gradients as the rank has
micro-batches it is done, and a bucket whose parameters are all done is reduce-scattered asynchronously on
a process group of its own (so it runs beside the ring's P2P on the default group, and on a GPU beside the
compute). Buckets are always launched in bucket order, waiting for earlier ones, so every rank issues the same
collectives in the same order whatever its micro-batch count or the order its backward ran in; `finish`
launches what is left (all of it on a rank with no micro-batch, or a parameter no micro-batch used) and waits.
A tensor-parallel (DTensor) parameter takes the place of its local shard: the group is then the HDP ranks of
this rank's TP index, which hold the same shard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from .collectives import local

__all__ = ["Bucket", "GradBuffer", "GradientOrderError", "all_gather_single", "bucket_layout", "reduce_scatter_single"]

# torch renamed the flat-tensor collectives (`*_into_tensor`, `*_tensor` deprecated); older releases have only those
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


class GradientOrderError(RuntimeError):
    """A gradient arrived for a bucket already reduced: the step ran more backward passes over a parameter than
    this rank has micro-batches, and summing it now would leave it out of the other ranks' sums."""


@dataclass(frozen=True)
class Bucket:
    """Elements [start, end) of the flat buffers; (end - start) is a multiple of the group size, and the
    tail past the last parameter is padding that belongs to no parameter."""

    index: int
    start: int
    end: int
    params: tuple[int, ...]
    """Indices into the parameter list."""

    def shard(self, rank: int, size: int) -> tuple[int, int]:
        """The elements [lo, hi) of this bucket that group rank `rank` of `size` owns."""
        width = (self.end - self.start) // size
        return self.start + rank * width, self.start + (rank + 1) * width


def bucket_layout(numels: list[int], group_size: int, bucket_elements: int) -> tuple[list[int], list[Bucket]]:
    """Offsets of each parameter (by index into `numels`) and the buckets, filled from the last parameter
    backward; a bucket closes once it holds `bucket_elements` elements, and is padded to a multiple of
    `group_size`."""
    offsets = [0] * len(numels)
    buckets: list[Bucket] = []
    start, cursor, members = 0, 0, []
    for i in reversed(range(len(numels))):
        offsets[i] = cursor
        cursor += numels[i]
        members.append(i)
        if cursor - start >= bucket_elements or i == 0:
            end = start + math.ceil((cursor - start) / group_size) * group_size
            buckets.append(Bucket(len(buckets), start, end, tuple(members)))
            start = cursor = end
            members = []
    return offsets, buckets


class GradBuffer:
    """Gradients of `params` summed into fp32 over the rank's micro-batches, then reduce-scattered per bucket
    over `group` (`group_size` ranks, this one at `group_rank`). `reduce_dtype` bf16 sends a bf16 copy of each
    bucket (one in flight at a time) and keeps the fp32 sum of the received shard."""

    def __init__(
        self,
        params: list[nn.Parameter],
        offsets: list[int],
        buckets: list[Bucket],
        group: dist.ProcessGroup | None,
        group_size: int,
        group_rank: int,
        reduce_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.params, self.buckets = params, buckets
        self.group, self.group_size, self.group_rank = group, group_size, group_rank
        self.reduce_dtype = reduce_dtype
        device = params[0].device
        self.data = torch.zeros(buckets[-1].end, dtype=torch.float32, device=device)
        self.views = [self.data[o : o + local(p).numel()].view(local(p).shape) for o, p in zip(offsets, params)]
        self.bucket_of = {i: b.index for b in buckets for i in b.params}
        """Parameter index -> the one bucket it lies in."""
        self._index = {id(p): i for i, p in enumerate(params)}
        self._handles: list[RemovableHandle] = [p.register_post_accumulate_grad_hook(self._accumulate) for p in params]
        self.expected = 0
        self._received = [0] * len(params)
        self._pending = [len(b.params) for b in buckets]
        self._launched = 0
        self._in_flight: list[tuple[Bucket, dist.Work | None, torch.Tensor | None]] = []
        self.launched_in_backward = 0
        """Buckets of this step launched from a gradient hook, before the backward ended."""

    def start(self, micro_batches: int) -> None:
        """A new step in which this rank runs `micro_batches` backward passes: zero the sums."""
        self.finish_pending()
        self.data.zero_()
        self.expected = micro_batches
        self._received = [0] * len(self.params)
        self._pending = [len(b.params) for b in self.buckets]
        self._launched = 0
        self.launched_in_backward = 0

    def _accumulate(self, param: torch.Tensor) -> None:
        i = self._index[id(param)]
        bucket = self.bucket_of[i]
        if bucket < self._launched:
            raise GradientOrderError(
                f"a gradient of parameter {i} {tuple(param.shape)} arrived after its bucket {bucket} was "
                f"reduce-scattered: the step ran more than {self.expected} backward pass(es) over it, the "
                f"rank's micro-batch count"
            )
        grad = param.grad
        assert grad is not None  # the hook runs after accumulation
        self.views[i].add_(local(grad))
        param.grad = None
        self._received[i] += 1
        if self._received[i] == self.expected:
            self._pending[bucket] -= 1
            launched = self._launched
            while self._launched < len(self.buckets) and self._pending[self._launched] == 0:
                self._launch(self.buckets[self._launched])
            self.launched_in_backward += self._launched - launched

    def _launch(self, bucket: Bucket) -> None:
        """Reduce-scatter `bucket` asynchronously (in place: this rank's slice receives the sum)."""
        self._launched += 1
        if self.group_size == 1:
            return
        lo, hi = bucket.shard(self.group_rank, self.group_size)
        full = self.data[bucket.start : bucket.end]
        if self.reduce_dtype == torch.float32:
            work = reduce_scatter_single(self.data[lo:hi], full, group=self.group, async_op=True)
            self._in_flight.append((bucket, work, None))
            return
        self.finish_pending()  # one low-precision copy at a time
        copy = full.to(self.reduce_dtype)
        width = hi - lo
        shard = copy[lo - bucket.start : lo - bucket.start + width]
        work = reduce_scatter_single(shard, copy, group=self.group, async_op=True)
        self._in_flight.append((bucket, work, copy))

    def finish_pending(self) -> None:
        """Wait for the buckets in flight; a low-precision one's received shard is added back in fp32."""
        for bucket, work, copy in self._in_flight:
            if work is not None:
                work.wait()
            if copy is not None:
                lo, hi = bucket.shard(self.group_rank, self.group_size)
                self.data[lo:hi].copy_(copy[lo - bucket.start : hi - bucket.start])
        self._in_flight = []

    def finish(self) -> int:
        """Launch every bucket not launched yet, in order, and wait for all: this rank's slice of each bucket
        then holds the sum over the group. The bytes this rank put into reductions."""
        while self._launched < len(self.buckets):
            self._launch(self.buckets[self._launched])
        self.finish_pending()
        if self.group_size == 1:
            return 0
        element = torch.finfo(self.reduce_dtype).bits // 8
        return sum(b.end - b.start for b in self.buckets) * element

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
