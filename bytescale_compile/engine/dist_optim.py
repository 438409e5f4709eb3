"""The distributed optimizer: bf16 weights on every rank, fp32 main weights and AdamW moments sharded.

What one rank holds per parameter, with N ranks sharing the parameters (the HDP ranks, or a pipeline stage's):
2 bytes of bf16 weight, 4 of fp32 gradient (`GradBuffer`), and a 1/N shard of the 4-byte fp32 main weight and the
8 bytes of Adam moments: 6 + 12/N in all, against 16 (or 8 + 8/N with ZeRO-1) when fp32 weights are their own
master. Weights and gradients share one layout of buckets (`grad_buffer.bucket_layout`); rank i owns the i-th
slice of every bucket, and its main weights are the fragments of parameters that fall in its slices. Torch's
fused AdamW updates those fragments (weight decay by the group of the parameter a fragment comes from; step
counters on the device, as the kernel needs), the fragments are rounded into the rank's slice of the bf16 weights,
and each bucket of weights is all-gathered.

Nothing in a step waits for the host: the gradient norm is one fp32 norm over the rank's slices and one all-reduce,
and the clipping and the skip on a non-finite norm or loss reach the fused kernel as device tensors (`StepGuard`).

Checkpoints hold the fp32 main weights under the parameters' names and global shapes, and the moments under the
names torch's flattened optimizer state dict uses (`state.<param>.exp_avg`), as `ShardedTensor`s whose local
shards are the rectangular pieces of this rank's fragments (`_boxes`): the same keys and shapes as a replicated
fp32 run, read back by whatever fragments the loading ranks hold.

Under tensor parallelism a DTensor parameter stays a DTensor, its local tensor the bf16 view into the buffer: the
layout is of local shards, the group the HDP ranks of this rank's TP index (`mesh.replica_group`), and a piece's
box sits at its TP shard's offset in the global tensor (`TPSplit`; a strided shard's chunks, Hugging Face's fused
gate/up experts, in boxes that never cross a chunk). Every TP index needs the same layout (its pieces are named for
each TP rank at once), so TP shards must be even.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor import Shard as TPShard
from torch.distributed.tensor.placement_types import _StridedShard

from .adamw import IMPLEMENTATION_FLAGS, StepGuard, fused_supported, guarded_step, param_groups
from .collectives import BUCKET_BYTES, local
from .grad_buffer import Bucket, GradBuffer, all_gather_single, bucket_layout
from .mesh import replica_group

__all__ = ["DistributedOptimizer", "DistributedOptimizerError", "TPSplit", "restore_fp32_"]

_MOMENTS = ("exp_avg", "exp_avg_sq")

_NOT_LOADED = ("params", *IMPLEMENTATION_FLAGS)
"""Group keys a checkpoint does not set: the parameters, and the implementation (a checkpoint of the foreach
AdamW must not turn the fused one back)."""

warnings.filterwarnings(
    "ignore", message="Please use DTensor instead and we are deprecating ShardedTensor", category=FutureWarning
)
"""Our ShardedTensors are deliberate (a fragment's pieces are boxes no DTensor placement describes), and torch warns
on every torch function that touches one, in DCP's loading as in ours."""


class DistributedOptimizerError(ValueError):
    """The model or the settings cannot train with the distributed optimizer (the message says which)."""


@dataclass(frozen=True)
class _Fragment:
    """Elements [lo, hi) of parameter `param` (flat index), at [shard, shard + hi - lo) of this rank's shard."""

    param: int
    lo: int
    hi: int
    shard: int


class DistributedOptimizer:
    """`DistributedOptimizer(model, lr, weight_decay, betas, group=None)`: AdamW on sharded fp32 main weights.

    Construct it on every rank at once, from the model in fp32: the main weights start from those values, and the
    model's trainable parameters become `dtype` views of one contiguous buffer (a DTensor's local tensor). `group`
    defaults to the ranks holding the same parameters (`mesh.replica_group`: all, or the HDP ranks of this TP
    index); a pipeline stage without tensor parallelism passes its `stage_group`.
    Each step: `start(micro_batches)` before the backward passes, `finish()` after them (the gradients then
    summed over the group, each rank holding its slice), `grad_norm()`, then `step(guard)` with the `StepGuard`
    of that norm (clipping and the skip, on the device).
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        *,
        group: dist.ProcessGroup | None = None,
        dtype: torch.dtype = torch.bfloat16,
        grad_reduce_dtype: torch.dtype = torch.float32,
        bucket_bytes: int = BUCKET_BYTES,
    ) -> None:
        if dtype not in (torch.bfloat16, torch.float32):
            raise DistributedOptimizerError(
                f"the distributed optimizer keeps weights in bf16 (or fp32, where the main weights copy them), not "
                f"{dtype}: fp16 would need loss scaling"
            )
        if grad_reduce_dtype not in (torch.float32, torch.bfloat16):
            raise DistributedOptimizerError(f"grad_reduce_dtype must be float32 or bfloat16, got {grad_reduce_dtype}")
        groups = [g for g in param_groups(model, weight_decay) if g["params"]]
        self.params: list[nn.Parameter] = [p for g in groups for p in g["params"]]
        if not self.params:
            raise DistributedOptimizerError(f"{type(model).__name__} has no trainable parameter")
        if any(local(p).dtype != torch.float32 for p in self.params):
            found = sorted({str(local(p).dtype) for p in self.params})
            raise DistributedOptimizerError(
                f"build the distributed optimizer from the model in fp32 (its main weights start from those "
                f"values), found parameters in {found}"
            )
        names = {id(p): name for name, p in model.named_parameters()}
        self.names = [names[id(p)] for p in self.params]
        self._tp = _TPShards.of(self.params, self.names)
        group = replica_group(model, group)
        self.group, self.dtype = group, dtype
        self.size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self._group_ranks = dist.get_process_group_ranks(group or dist.group.WORLD) if dist.is_initialized() else [0]
        """Global rank of each group rank."""
        fp32_bytes = 4
        numels = [local(p).numel() for p in self.params]
        offsets, self.buckets = bucket_layout(numels, self.size, bucket_bytes // fp32_bytes)
        self.offsets = offsets
        device = self.params[0].device
        self.weights = torch.zeros(self.buckets[-1].end, dtype=dtype, device=device)
        originals = [local(p).detach() for p in self.params]  # what the main weights start from, kept from here
        with torch.no_grad():
            for p, offset, value in zip(self.params, offsets, originals):
                view = self.weights[offset : offset + value.numel()]
                view.copy_(value.reshape(-1))
                _rebind(p, view.view(value.shape))  # before the gradient hooks: a DTensor's rebinding swaps it
        self.grads = GradBuffer(
            self.params, offsets, self.buckets, _reduce_group(group), self.size, self.rank, grad_reduce_dtype
        )
        widths = [(b.end - b.start) // self.size for b in self.buckets]
        self._shard_starts = [sum(widths[:k]) for k in range(len(widths))]
        """Where a rank's slice of each bucket begins in its shard (the same on every rank)."""
        shard_size = sum(widths)
        self.main = torch.zeros(shard_size, dtype=torch.float32, device=device)
        self.moments = {m: torch.zeros(shard_size, dtype=torch.float32, device=device) for m in _MOMENTS}
        self.fragments = [f for i in range(len(self.params)) if (f := self._fragment(i, self.rank)) is not None]
        self._main_views = [self._view(self.main, f) for f in self.fragments]
        with torch.no_grad():
            for fragment, view in zip(self.fragments, self._main_views):
                view.copy_(originals[fragment.param].reshape(-1)[fragment.lo : fragment.hi])
        decayed = {id(p) for p in groups[0]["params"]} if groups[0]["weight_decay"] else set()
        self._decayed = [id(p) in decayed for p in self.params]
        groups_of_fragments: list[dict[str, Any]] = [
            {"params": [v for v, f in zip(self._main_views, self.fragments) if self._decayed[f.param]]},
            {
                "params": [v for v, f in zip(self._main_views, self.fragments) if not self._decayed[f.param]],
                "weight_decay": 0.0,
            },
        ]
        self.inner = torch.optim.AdamW(
            groups_of_fragments,
            lr=lr,
            betas=betas,
            weight_decay=weight_decay,
            fused=fused_supported([self.main]),
        )
        for view, fragment in zip(self._main_views, self.fragments):
            lo, hi = self._buffer_range(fragment)
            view.grad = self.grads.data[lo:hi]
            self.inner.state[view] = {
                "step": self._step_tensor(0.0),
                **{m: self._view(self.moments[m], fragment) for m in _MOMENTS},
            }
        self.param_groups = self.inner.param_groups
        """AdamW's groups of fragments: what a schedule sets `lr` on."""
        self._norm_runs = [
            self.grads.data[lo:hi]
            for lo, hi in _merged([self._buffer_range(f) for f in self.fragments if self._tp.counted(f.param)])
        ]
        """This rank's slices of the summed gradient whose squares enter the norm, contiguous runs merged."""
        self._weight_runs = _weight_runs(
            self.weights, self.main, self.buckets, self._shard_starts, self.rank, self.size
        )
        """(bf16 destination, fp32 source) of the weight refresh, one pair per contiguous run."""

    def _fragment(self, i: int, rank: int) -> _Fragment | None:
        """Group rank `rank`'s part of parameter `i`: where the param meets that rank's slice of its bucket."""
        bucket = self.buckets[self.grads.bucket_of[i]]
        lo, hi = bucket.shard(rank, self.size)
        start, end = self.offsets[i], self.offsets[i] + local(self.params[i]).numel()
        a, b = max(lo, start), min(hi, end)
        if a >= b:
            return None
        return _Fragment(i, a - start, b - start, self._shard_starts[bucket.index] + a - lo)

    def _view(self, shard: torch.Tensor, fragment: _Fragment) -> torch.Tensor:
        return shard[fragment.shard : fragment.shard + fragment.hi - fragment.lo]

    def _buffer_range(self, fragment: _Fragment) -> tuple[int, int]:
        start = self.offsets[fragment.param]
        return start + fragment.lo, start + fragment.hi

    # a step ---------------------------------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: `start` zeroes the buffer, and the parameters' own `.grad` is always None."""

    def start(self, micro_batches: int) -> None:
        """Zero the gradient sums before a step in which this rank runs `micro_batches` backward passes."""
        self.grads.start(micro_batches)

    def finish(self) -> int:
        """Reduce-scatter what the backward has not yet; the bytes this rank reduced."""
        return self.grads.finish()

    @property
    def launched_in_backward(self) -> float:
        """The share of this step's buckets reduce-scattered while the backward still ran."""
        return self.grads.launched_in_backward / len(self.buckets)

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """The 2-norm of the whole model's summed gradient, a 0-dim fp32 tensor on the device: every rank's slices,
        over every rank (with pipelines, each stage's ranks hold disjoint slices of disjoint parameters; with tensor
        parallelism each TP index its shards, and a replicated parameter is counted at TP index 0 only). One fp32
        norm over this rank's runs of slices (a bucket's padding is zero), one all-reduce of its square."""
        runs = self._norm_runs
        if not runs:
            squares = torch.zeros((), dtype=torch.float32, device=self.main.device)
        elif len(runs) == 1:
            squares = torch.linalg.vector_norm(runs[0]).square()
        else:
            squares = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(runs))).square()
        if dist.is_initialized():
            dist.all_reduce(squares)
        return squares.sqrt()

    @torch.no_grad()
    def step(self, guard: StepGuard | None = None) -> None:
        """AdamW on this rank's fp32 fragments, clipped and skipped as `guard` says (None: neither), then every
        rank's bf16 weights all-gathered (unchanged ones after a skip: every rank issues the same collectives)."""
        if guard is None:
            self.inner.step()
        else:
            guarded_step(self.inner, guard, cast(list[nn.Parameter], self._main_views))
        self._gather_weights()

    def _gather_weights(self) -> None:
        """Round the main weights into this rank's slices of the bf16 weights (one copy per contiguous run), then
        all-gather each bucket."""
        destinations, sources = self._weight_runs
        if len(destinations) == 1:
            destinations[0].copy_(sources[0])
        else:
            torch._foreach_copy_(destinations, sources)
        if self.size > 1:
            for bucket in self.buckets:
                lo, hi = bucket.shard(self.rank, self.size)
                all_gather_single(self.weights[bucket.start : bucket.end], self.weights[lo:hi], group=self.group)

    def remove_hooks(self) -> None:
        """Stop accumulating the model's gradients (another optimizer takes the model over)."""
        self.grads.remove_hooks()

    # checkpoints ----------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The main weights under the parameters' names, and the optimizer state under torch's flattened names
        (`state.<param>.<exp_avg|exp_avg_sq|step>`, `param_groups.<param>.<hyperparameter>`), tensors as
        ShardedTensors of this rank's pieces; the step count a 0-dim fp32 CPU tensor, as checkpoints have always
        held it."""
        model = {name: self._sharded(self.main, i) for i, name in enumerate(self.names)}
        step = self._step_count()
        optim: dict[str, Any] = {}
        for i, name in enumerate(self.names):
            for m in _MOMENTS:
                optim[f"state.{name}.{m}"] = self._sharded(self.moments[m], i)
            optim[f"state.{name}.step"] = step.clone()
            group = self._group_of(i)
            for key, value in group.items():
                if key != "params":
                    optim[f"param_groups.{name}.{key}"] = value
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """After DCP has read into `state_dict()`'s tensors (this rank's pieces, in place): the step counts (on the
        CPU or any device) taken over onto the main weights' device, the hyperparameters, and the bf16 weights
        rebuilt from the main weights."""
        optim = state["optim"]
        for i, name in enumerate(self.names):
            group = self._group_of(i)
            for key in group:
                if key not in _NOT_LOADED and f"param_groups.{name}.{key}" in optim:
                    group[key] = optim[f"param_groups.{name}.{key}"]
        step = max(float(optim[f"state.{name}.step"]) for name in self.names)
        for view in self._main_views:
            self.inner.state[view]["step"] = self._step_tensor(step)  # one per fragment: the kernel adds to each
        with torch.no_grad():
            self._gather_weights()

    def _step_tensor(self, value: float) -> torch.Tensor:
        """A fragment's step counter: fp32 beside the main weights, where the fused kernel reads it."""
        return torch.full((), value, dtype=torch.float32, device=self.main.device)

    def _step_count(self) -> torch.Tensor:
        """Adam's step count on the CPU (the same for every fragment; 0 before the first step): one device read."""
        counts = [self.inner.state[v]["step"] for v in self._main_views]
        if not counts:
            return torch.tensor(0.0)
        return torch.stack(counts).max().cpu()

    def _group_of(self, i: int) -> dict[str, Any]:
        """AdamW's group of parameter `i`'s fragments: decayed (matrices, embeddings) or not."""
        return self.inner.param_groups[0 if self._decayed[i] else 1]

    def _sharded(self, shard: torch.Tensor, i: int) -> ShardedTensor | torch.Tensor:
        """Parameter `i`'s pieces of the fp32 `shard` (main weights or a moment) as a ShardedTensor of its shape
        (one process without torch.distributed: the whole parameter, a plain tensor)."""
        shape = tuple(self.params[i].shape)
        if not dist.is_initialized():  # one rank: its fragment is the whole parameter
            return self._view(shard, cast(_Fragment, self._fragment(i, 0))).view(shape)
        every = []
        mine = []
        for rank in range(self.size):
            fragment = self._fragment(i, rank)
            if fragment is None:
                continue
            for holder, index in self._tp.holders(i, self._group_ranks[rank]):
                for at, sizes, start in self._tp.boxes(i, index, fragment.lo, fragment.hi):
                    meta = ShardMetadata(list(at), list(sizes), f"rank:{holder}/{shard.device}")
                    every.append(meta)
                    if holder == dist.get_rank():
                        first = fragment.shard + start - fragment.lo
                        mine.append(Shard(shard[first : first + math.prod(sizes)].view(sizes), meta))
        properties = TensorProperties(dtype=torch.float32, layout=torch.strided, requires_grad=False)
        metadata = ShardedTensorMetadata(every, torch.Size(shape), properties)
        return ShardedTensor._init_from_local_shards_and_global_metadata(mine, metadata)


@dataclass(frozen=True)
class TPSplit:
    """How a tensor-parallel parameter's local tensor sits in its global one: sharded on `dim` over `size` TP ranks,
    in `chunks` strided chunks (`_StridedShard`'s split factor: Hugging Face's fused gate/up experts hold a slice of
    each half; 1: one contiguous shard)."""

    dim: int
    chunks: int
    size: int

    @classmethod
    def of(cls, p: torch.Tensor, name: str) -> TPSplit | None:
        """Read from a DTensor on a 1-D TP mesh (None: replicated or a plain tensor); `DistributedOptimizerError`
        for a placement, or an uneven shard, whose pieces this cannot place."""
        if not isinstance(p, DTensor) or all(isinstance(pl, Replicate) for pl in p.placements):
            return None
        placement, size = p.placements[0], p.device_mesh.size()
        if len(p.placements) == 1 and isinstance(placement, _StridedShard):  # first: in some torch versions a Shard
            split = cls(placement.dim % p.ndim, int(placement.split_factor), size)
        elif len(p.placements) == 1 and isinstance(placement, TPShard):
            split = cls(placement.dim % p.ndim, 1, size)
        else:
            raise DistributedOptimizerError(
                f"parameter `{name}` has placements {p.placements}; the distributed optimizer and checkpoints take "
                f"Shard, _StridedShard or Replicate on a 1-D TP mesh"
            )
        if p.shape[split.dim] % (size * split.chunks):
            raise DistributedOptimizerError(
                f"parameter `{name}` {tuple(p.shape)} is sharded on dim {split.dim} unevenly over tp {size}"
                f"{f' in {split.chunks} strided chunks' if split.chunks > 1 else ''}: every TP rank must hold the "
                f"same shard shape; pick a tp that divides {p.shape[split.dim] // split.chunks}"
            )
        return split

    def boxes(
        self, shape: tuple[int, ...], index: int, lo: int, hi: int
    ) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], int]]:
        """The flat range [lo, hi) of TP index `index`'s local tensor of `shape` as rectangular boxes of the global
        tensor, each contiguous in the local one: (global offsets, sizes, local flat start). A strided shard's
        chunks are apart in the global tensor, so a box never crosses from one chunk to the next."""
        dim, width = self.dim, shape[self.dim] // self.chunks
        if self.chunks == 1:
            for offsets, sizes, start in _boxes(shape, lo, hi):
                yield tuple(o + index * width if d == dim else o for d, o in enumerate(offsets)), sizes, start
            return
        split = (*shape[:dim], self.chunks, width, *shape[dim + 1 :])  # the same row-major order, chunks apart
        for offsets, sizes, start in _one_chunk_each(split, dim, _boxes(split, lo, hi)):
            at = offsets[dim] * width * self.size + index * width + offsets[dim + 1]
            yield (*offsets[:dim], at, *offsets[dim + 2 :]), (*sizes[:dim], sizes[dim + 1], *sizes[dim + 2 :]), start


def _one_chunk_each(
    shape: tuple[int, ...], axis: int, boxes: Iterator[tuple[tuple[int, ...], tuple[int, ...], int]]
) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """`_boxes`' boxes of `shape` cut so that each spans one index of dimension `axis`. A `_boxes` box is one index
    on its leading dimensions, a range on one, and whole on the rest: one spanning several indices of `axis` is
    whole past it, and falls apart into whole blocks, one per index of the dimensions up to `axis`."""
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    for offsets, sizes, start in boxes:
        if sizes[axis] == 1:
            yield offsets, sizes, start
            continue
        for lead in itertools.product(*(range(o, o + n) for o, n in zip(offsets[: axis + 1], sizes[: axis + 1]))):
            flat = sum(i * stride for i, stride in zip(lead, strides))
            yield (*lead, *offsets[axis + 1 :]), (*[1] * (axis + 1), *sizes[axis + 1 :]), flat


@dataclass(frozen=True)
class _TPShards:
    """Where the parameters' local tensors sit in their global ones under tensor parallelism (tp 1: in place)."""

    size: int
    rank: int
    shapes: list[tuple[int, ...]]
    """Each parameter's local shape: the same at every TP index (even shards)."""
    splits: list[TPSplit | None]
    """How each parameter is sharded over its TP group; None: replicated (or a plain tensor)."""

    @classmethod
    def of(cls, params: list[nn.Parameter], names: list[str]) -> _TPShards:
        """Read from the DTensor parameters; `DistributedOptimizerError` for a layout the buffer cannot share."""
        mesh = next((p.device_mesh for p in params if isinstance(p, DTensor)), None)
        size = mesh.size() if mesh is not None else 1
        splits = [TPSplit.of(p, name) for p, name in zip(params, names)]
        return cls(
            size, mesh.get_local_rank() if mesh is not None else 0, [tuple(local(p).shape) for p in params], splits
        )

    def counted(self, i: int) -> bool:
        """Whether this rank's squares of parameter `i` enter the norm: each TP shard's, a replicated one's once."""
        return self.splits[i] is not None or self.rank == 0

    def holders(self, i: int, global_rank: int) -> list[tuple[int, int]]:
        """The global ranks holding the fragments that `global_rank` holds of parameter `i` at their own TP index,
        each with that TP index: itself for a replicated parameter, every rank of its TP group (adjacent ranks: tp
        is the innermost mesh dimension) for a sharded one."""
        if self.splits[i] is None:
            return [(global_rank, self.rank)]
        first = global_rank - self.rank
        return [(first + t, t) for t in range(self.size)]

    def boxes(self, i: int, index: int, lo: int, hi: int) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], int]]:
        """The flat range [lo, hi) of parameter `i`'s local tensor at TP index `index` as boxes of the global tensor:
        (global offsets, sizes, local flat start)."""
        split = self.splits[i]
        return _boxes(self.shapes[i], lo, hi) if split is None else split.boxes(self.shapes[i], index, lo, hi)


def _rebind(p: nn.Parameter, data: torch.Tensor) -> None:
    """Make `data` (of `p`'s local shape) the storage of `p`, which stays the same object: a plain parameter takes
    it as `.data`; a DTensor one is swapped in place (`swap_tensors`) with a DTensor of the same placements around
    it, keeping its attributes (`.data` would retype the DTensor but leave its local tensor)."""
    if not isinstance(p, DTensor):
        p.data = data
    else:
        wrapped = DTensor.from_local(
            data, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )
        new = nn.Parameter(wrapped, requires_grad=p.requires_grad)
        new.__dict__.update(p.__dict__)
        torch.utils.swap_tensors(p, new)
    p.grad = None  # an fp32 gradient left beside bf16 data would break the compiled graphs


def restore_fp32_(model: nn.Module) -> None:
    """Give every parameter of `model` its own fp32 storage again, as the same objects (the distributed optimizer
    left them views of its bf16 buffer): what a model needs before another optimizer is built on it."""
    with torch.no_grad():
        for p in model.parameters():
            _rebind(p, local(p).detach().float().clone())


def _boxes(shape: tuple[int, ...], lo: int, hi: int) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """The flat range [lo, hi) of a row-major tensor of `shape` as rectangular boxes: (offsets, sizes, flat start)
    each, in order. A range that starts or ends mid-row splits into the partial rows and the whole rows between."""
    if not shape:
        if lo < hi:
            yield (), (), lo
        return
    inner = math.prod(shape[1:])
    first, last = lo // inner, (hi - 1) // inner
    if lo % inner == 0 and hi % inner == 0 or hi - lo == 0:
        if lo < hi:
            yield (first, *[0] * (len(shape) - 1)), (last - first + 1, *shape[1:]), lo
        return
    if first == last:
        for offsets, sizes, start in _boxes(shape[1:], lo - first * inner, hi - first * inner):
            yield (first, *offsets), (1, *sizes), start + first * inner
        return
    head_end = (first + 1) * inner
    yield from _boxes(shape, lo, head_end)
    tail_start = last * inner
    if head_end < tail_start:
        yield from _boxes(shape, head_end, tail_start)
    yield from _boxes(shape, tail_start, hi)


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """`ranges` [lo, hi) sorted, those that touch joined."""
    runs: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if runs and runs[-1][1] == lo:
            runs[-1] = (runs[-1][0], hi)
        else:
            runs.append((lo, hi))
    return runs


def _weight_runs(
    weights: torch.Tensor, main: torch.Tensor, buckets: list[Bucket], shard_starts: list[int], rank: int, size: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """This rank's slice of each bucket of `weights` beside its place in the `main` shard, joined where both run
    on (one rank: the whole buffer is one run)."""
    runs: list[tuple[int, int, int]] = []  # weights [lo, hi) from main[start]
    for bucket, start in zip(buckets, shard_starts):
        lo, hi = bucket.shard(rank, size)
        if runs and runs[-1][1] == lo and runs[-1][2] + runs[-1][1] - runs[-1][0] == start:
            runs[-1] = (runs[-1][0], hi, runs[-1][2])
        else:
            runs.append((lo, hi, start))
    return [weights[lo:hi] for lo, hi, _ in runs], [main[start : start + hi - lo] for lo, hi, start in runs]


def _reduce_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """A process group of `group`'s ranks for the gradient reductions alone, so that they run beside the ring's
    P2P on the default group (one communicator would serialise or even deadlock them). A pipeline stage's group
    is already its own; the default group gets a twin (created on every rank at once)."""
    if not dist.is_initialized() or group is not None:
        return group
    return dist.new_group(list(range(dist.get_world_size())))
