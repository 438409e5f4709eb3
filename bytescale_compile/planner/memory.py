"""What one rank holds in device memory, and the token capacity C that fits a budget (paper §4.2, Eq. 2).

A rank's peak is its static bytes (weights, gradients, main weights and optimizer moments, gradient buckets:
fixed once the model and the parallel layout are) plus the activations of the micro-batches it holds at once
plus a workspace (buffers no micro-batch length changes: the fused loss's, the allocator's slack). Activations
are linear in the tokens: one layer's saved tensors cost `layer_bytes_per_token` per token, the tensors
outside the layers (embedding output, final norm, loss) `other_bytes_per_token`. Offloading at ratio r keeps
the last 2 of the rank's l layers whole and a share 1 - r of the others, the numerator of Eq. 2's D(s). Under
gradient checkpointing a layer saves only its inputs, and the backward rebuilds one layer's activations at a
time: `recomputed_bytes_per_token` more per token, once (one backward runs at a time), never offloaded.

Pure arithmetic on numbers: the figures come from a compile report (`train/memory.py`) or from hand, so the
planner can solve C without torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "ALLOCATOR_SLACK",
    "BUCKET_BYTES",
    "DTYPES",
    "MemoryBudgetError",
    "MemoryModel",
    "StaticBytes",
    "format_bytes",
]

BUCKET_BYTES = 25 * 2**20
"""Gradient bucket size: a bucket closes once it holds this many bytes of fp32 gradients (so it can exceed it
by its last parameter). Large enough for the reduction to run near the network's bandwidth, small enough that
the first bucket is reduced early in the backward and that its flat copy is no burden."""

ALLOCATOR_SLACK = 0.05
"""Share of a device's memory the workspace sets aside for what the model above does not count: the caching
allocator's rounding and fragmentation, the CUDA context and the communication library's buffers, short-lived
temporaries of the backward."""

DTYPES = ("fp32", "bf16")
"""fp32: fp32 weights, gradients and Adam moments on every rank (moments sharded with `zero`). bf16: the
distributed optimizer, bf16 weights, an fp32 gradient buffer, fp32 main weights and moments sharded over HDP."""

_REDUCE_DTYPES = ("fp32", "bf16")
_ADAM_STATES = 2
"""Adam keeps two fp32 moments per parameter."""
_FP32 = 4
_BF16 = 2


def format_bytes(n: float) -> str:
    """'12.34 GiB', '3.00 MiB', '512 B': the unit that keeps a small model's figures readable too."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


class MemoryBudgetError(ValueError):
    """The budget cannot hold the rank's static bytes and workspace, or not one token besides."""


@dataclass(frozen=True)
class StaticBytes:
    """What a rank holds whatever its micro-batches, by part. `master` is 0 in fp32 (the weights are the master
    copy); `buckets` is the flat copy the gradient reduction makes of one bucket at a time."""

    weights: int
    gradients: int
    master: int
    optimizer: int
    buckets: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.master + self.optimizer + self.buckets

    def parts(self) -> dict[str, int]:
        return {
            "weights": self.weights,
            "gradients": self.gradients,
            "master": self.master,
            "optimizer": self.optimizer,
            "buckets": self.buckets,
        }

    def summary(self) -> str:
        """'weights 14.96 GiB + gradients ... = total': one line for error messages."""
        parts = " + ".join(f"{name} {format_bytes(value)}" for name, value in self.parts().items() if value)
        return f"{parts or 'nothing'} = {format_bytes(self.total)}"


@dataclass(frozen=True, kw_only=True)
class MemoryModel:
    """One rank's memory: its parameters and optimizer state by the training dtype, its activations per token.

    l (`layers`) and C follow Eq. 2: l is the decoder layers this rank holds, C the tokens a micro-batch may
    put on it without offloading.
    """

    params: int
    """Parameters this rank holds: its pipeline stage, its tensor-parallel shard."""
    hdp_size: int
    """N: the HDP ranks the gradients are reduced over and the distributed optimizer shards over."""
    dtype: str
    zero: bool = False
    """fp32 only: ZeRO-1, the Adam moments sharded over the N ranks (bf16 always shards them)."""
    grad_reduce_dtype: str = "fp32"
    """bf16 only: "bf16" reduce-scatters a bf16 copy of each bucket, "fp32" the buffer itself in place."""
    bucket_bytes: int = BUCKET_BYTES
    largest_param: int = 0
    """Elements of the largest parameter this rank holds: a bucket can exceed `bucket_bytes` by it, and ZeRO's
    per-parameter partition can put it on one rank beside an even share. 0: ignore both."""
    layers: int
    """l: decoder layers this rank holds."""
    layer_bytes_per_token: float = 0.0
    """One layer's saved activations per token."""
    other_bytes_per_token: float = 0.0
    """Saved activations per token outside the layers (embedding output, final norm, loss): never offloaded.
    Both 0: a model of the static part alone, which can check a budget but has no capacity."""
    recomputed_bytes_per_token: float = 0.0
    """Gradient checkpointing: one layer's activations per token that its backward recomputes and holds at
    once (0 without checkpointing, where `layer_bytes_per_token` holds them all along)."""
    workspace_bytes: int = 0
    in_flight: int = 1
    """Micro-batches whose activations the rank holds at its peak: 1 without pipeline stages; pp under 1F1B,
    whose first stage runs pp forwards before its first backward."""

    def __post_init__(self) -> None:
        for name in ("params", "hdp_size", "layers", "bucket_bytes", "in_flight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MemoryModel.{name} must be an int >= 1, got {value!r}")
        for name in ("largest_param", "workspace_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"MemoryModel.{name} must be an int >= 0, got {value!r}")
        for name in ("layer_bytes_per_token", "other_bytes_per_token", "recomputed_bytes_per_token"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"MemoryModel.{name} must be a finite number >= 0, got {value!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"MemoryModel.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.grad_reduce_dtype not in _REDUCE_DTYPES:
            raise ValueError(
                f"MemoryModel.grad_reduce_dtype must be one of {_REDUCE_DTYPES}, got {self.grad_reduce_dtype!r}"
            )
        if self.dtype == "fp32" and self.grad_reduce_dtype != "fp32":
            raise ValueError("MemoryModel: grad_reduce_dtype 'bf16' applies to bf16 training (fp32 all-reduces fp32)")

    # --- static bytes ---------------------------------------------------------------------------------

    @property
    def num_buckets(self) -> int:
        """At most this many buckets: each but the last holds at least `bucket_bytes` of fp32 gradients."""
        return math.ceil(_FP32 * self.params / self.bucket_bytes)

    @property
    def padded_params(self) -> int:
        """P_pad: every bucket is padded to a multiple of N elements, so that rank i owns the i-th equal slice."""
        return self.params + self.hdp_size * self.num_buckets

    @property
    def _largest_bucket(self) -> int:
        """Elements of the largest bucket: it closes on the parameter that takes it past `bucket_bytes`."""
        return min(self.padded_params, self.bucket_bytes // _FP32 + self.largest_param + self.hdp_size)

    @property
    def static(self) -> StaticBytes:
        p, n = self.params, self.hdp_size
        if self.dtype == "bf16":
            shard = math.ceil(self.padded_params / n)
            copy = _BF16 * self._largest_bucket if self.grad_reduce_dtype == "bf16" else 0
            return StaticBytes(
                weights=_BF16 * p,
                gradients=_FP32 * self.padded_params,
                master=_FP32 * shard,
                optimizer=_ADAM_STATES * _FP32 * shard,
                buckets=copy,
            )
        moments = min(p, math.ceil(p / n) + self.largest_param) if self.zero and n > 1 else p
        flat = _FP32 * min(p, self.bucket_bytes // _FP32 + self.largest_param) if n > 1 else 0
        return StaticBytes(
            weights=_FP32 * p, gradients=_FP32 * p, master=0, optimizer=_ADAM_STATES * _FP32 * moments, buckets=flat
        )

    @property
    def bytes_per_param(self) -> float:
        return self.static.total / self.params

    # --- activations and the peak ----------------------------------------------------------------------

    def activation_bytes(self, tokens: float, offload_ratio: float = 0.0) -> float:
        """Activations resident for `in_flight` micro-batches of `tokens` tokens on this rank at ratio r:
        (2 + (1 - r)(l - 2)) layers' worth plus those outside the layers (Eq. 2's numerator), plus the one
        layer a checkpointed backward recomputes. With l <= 2 the last 2 layers are all there are, and
        offloading frees nothing."""
        if not 0.0 <= offload_ratio <= 1.0:
            raise ValueError(f"offload_ratio must be in [0, 1], got {offload_ratio}")
        l = self.layers
        resident_layers = 2 + (1 - offload_ratio) * (l - 2) if l > 2 else l
        per_token = resident_layers * self.layer_bytes_per_token + self.other_bytes_per_token
        return (self.in_flight * per_token + self.recomputed_bytes_per_token) * tokens

    def peak(self, tokens: float, offload_ratio: float = 0.0) -> float:
        """Predicted peak bytes: static + activations + workspace."""
        return self.static.total + self.activation_bytes(tokens, offload_ratio) + self.workspace_bytes

    def available(self, budget: int) -> int:
        """Bytes of `budget` left for activations; MemoryBudgetError when nothing is."""
        left = budget - self.static.total - self.workspace_bytes
        if left <= 0:
            raise MemoryBudgetError(
                f"the budget of {format_bytes(budget)} ({budget} bytes) does not hold this rank's static bytes "
                f"{format_bytes(self.static.total)} ({self.static.summary()}, {self.bytes_per_param:.2f} bytes per "
                f"parameter for {self.params:,} parameters) and workspace {format_bytes(self.workspace_bytes)}: "
                f"{self._remedies()}"
            )
        return left

    def _per_token(self, offload: bool) -> float:
        """Bytes C costs per token: l layers plus the outside tensors of up to max(1, l/2) x C tokens. With
        offloading the planner puts a rank's share of up to l x C / 2 tokens on it (D(s) at r = 1 counts only
        layer activations, in units of l x Act(C)), and what lies outside the layers stays."""
        l = self.layers
        outside = max(1.0, l / 2) if offload and l > 2 else 1.0
        per_token = self.in_flight * (l * self.layer_bytes_per_token + outside * self.other_bytes_per_token)
        return per_token + outside * self.recomputed_bytes_per_token

    def capacity(self, budget: int, offload: bool) -> int:
        """The largest C whose every plan fits `budget`: without offload a micro-batch puts at most C tokens on
        a rank, with offload up to l x C / 2 at r = 1 (and, at any r, no more than l layers' worth of C tokens)."""
        avail = self.available(budget)
        if self._per_token(offload) <= 0:
            raise ValueError("MemoryModel without activation figures (both per-token figures are 0) has no capacity")
        c = math.floor(avail / self._per_token(offload))
        # Guard the float division both ways, so peak(C) <= budget < peak(C + 1) holds exactly.
        while self._worst(c + 1, offload) <= budget:
            c += 1
        while c > 0 and self._worst(c, offload) > budget:
            c -= 1
        if c < 1:
            raise MemoryBudgetError(
                f"the budget of {format_bytes(budget)} ({budget} bytes) leaves {format_bytes(avail)} for activations "
                f"after static bytes {format_bytes(self.static.total)} ({self.static.summary()}) and workspace "
                f"{format_bytes(self.workspace_bytes)}: less than one token ({format_bytes(self._per_token(offload))}"
                f"); {self._remedies()}"
            )
        return c

    def _worst(self, capacity: int, offload: bool) -> float:
        """The peak of the largest micro-batch share a plan of C = `capacity` may give this rank."""
        if offload and self.layers > 2:
            return self.peak(self.layers * capacity / 2, 1.0)
        return self.peak(capacity, 0.0)

    def longest_per_rank(self, budget: int) -> int:
        """Tokens one rank can hold of a sequence with everything offloadable offloaded (r = 1): l x C / 2 for
        the C `capacity(budget, offload=True)` picks (C itself for l <= 2)."""
        c = self.capacity(budget, offload=True)
        return self.layers * c // 2 if self.layers > 2 else c

    def _remedies(self) -> str:
        shards = "more HDP ranks (the distributed optimizer shards main weights and moments over them)"
        if self.dtype == "fp32":
            shards = (
                "more HDP ranks with --zero (it shards the moments over them)"
                if not self.zero
                else "more HDP ranks (ZeRO shards the moments over them)"
            )
        steps = [shards, "--tp or --pp (fewer parameters and layers per rank)"]
        if self.dtype == "fp32":
            steps.append("--dtype bf16 (about 6 + 12/N bytes per parameter instead of 16)")
        steps.append("a larger budget")
        return "use " + ", ".join(steps[:-1]) + " or " + steps[-1]

    def describe(self, budget: int | None = None) -> str:
        """The static breakdown, the activation figures and the workspace as a small table; with a budget, the
        C it gives with and without offload."""
        n = self.hdp_size
        head = f"{self.dtype}, {self.params:,} parameters on this rank, N = {n} HDP ranks"
        if self.dtype == "fp32":
            head += ", ZeRO-1" if self.zero else ""
        else:
            head += f", {self.grad_reduce_dtype} gradient reduction"
        lines = [f"static bytes per rank ({head}):"]
        for name, value in self.static.parts().items():
            lines.append(f"  {name:<10} {format_bytes(value):>12}  {value / self.params:6.2f} bytes/param")
        total = self.static.total
        lines.append(f"  {'total':<10} {format_bytes(total):>12}  {self.bytes_per_param:6.2f} bytes/param")
        lines += [
            f"activations: {self.layer_bytes_per_token:,.0f} bytes/token per layer x {self.layers} layers, "
            f"{self.other_bytes_per_token:,.0f} bytes/token outside the layers"
            + (f", {self.in_flight} micro-batches in flight" if self.in_flight > 1 else "")
            + (
                f", {self.recomputed_bytes_per_token:,.0f} bytes/token of one recomputed layer"
                if self.recomputed_bytes_per_token
                else ""
            ),
            f"workspace: {format_bytes(self.workspace_bytes)}",
        ]
        if budget is not None:
            lines.append(f"budget: {format_bytes(budget)}")
            for offload in (False, True):
                lines.append(
                    f"  C {'with' if offload else 'without'} offload: {self.capacity(budget, offload):,} tokens"
                )
            lines.append(f"  longest per rank (offload r = 1): {self.longest_per_rank(budget):,} tokens")
        return "\n".join(lines)
