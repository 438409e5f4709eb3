"""What one rank holds in device memory, and the token capacity C that fits a budget (paper §4.2, Eq. 2).

The peak predicted is what the caching allocator *reserves*, since that is what runs out: a rank's static
bytes (weights, gradients, main weights and optimizer moments, gradient buckets: fixed once the model and the
parallel layout are), plus the activations of the micro-batches it holds at once, plus the transients of the
step (the fused loss's buffers, one layer's backward, an offloaded layer's copy in flight), all of these but
the static bytes scaled by the allocator's fragmentation, plus a fixed workspace (headroom for what the device
gives away outside the allocator). Activations are linear in the tokens: one layer's saved tensors cost
`layer_bytes_per_token` per token, the tensors outside the layers (embedding output, final norm, loss)
`other_bytes_per_token`. Offloading at ratio r keeps the last 2 of the rank's l layers whole and a share 1 - r
of the others, the numerator of Eq. 2's D(s). Under gradient checkpointing a layer saves only its inputs, and
the backward rebuilds one layer's activations at a time: `recomputed_bytes_per_token` more per token, once (one
backward runs at a time), never offloaded.

Pure arithmetic on numbers: the figures come from a compile report (`train/memory.py`) or from hand, so the
planner can solve C without torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import CompileConfig, loss_chunk_tokens
from ..strategies import ExpertLayout
from .model_shape import ModelShape

__all__ = [
    "BUCKET_BYTES",
    "DEVICE_HEADROOM",
    "DTYPES",
    "FRAGMENTATION",
    "SEGMENT_GRANULES_BYTES",
    "LossWorkspace",
    "MemoryBudgetError",
    "MemoryModel",
    "ParallelLayout",
    "StaticBytes",
    "format_bytes",
    "shape_memory_model",
]

BUCKET_BYTES = 25 * 2**20
"""Gradient bucket size: a bucket closes once it holds this many bytes of fp32 gradients (so it can exceed it
by its last parameter). Large enough for the reduction to run near the network's bandwidth, small enough that
the first bucket is reduced early in the backward and that its flat copy is no burden."""

DEVICE_HEADROOM = 0.01
"""Share of the budget the workspace sets aside for device memory taken outside torch's allocator after the
budget is read (the budget is the free memory, so the CUDA context and the first communicator are already out of
it): the kernel images of graphs compiled later, communicators created on first use (the gradient buckets'
process group), host-pinned staging the driver maps. An allowance, not a measurement: 1.4 GiB of an H200."""

FRAGMENTATION = {True: 0.05, False: 0.20}
"""Reserved over allocated bytes, as a share of what changes with the micro-batches (activations and transients),
by whether the allocator runs with expandable segments. With them, a segment grows and shrinks by mapping pages
at its end, and an allocation that finds no free block maps new pages after unmapping every free page: the waste
is the partial pages around free blocks and the 2 MiB rounding of each large tensor, under 1% for tensors of
hundreds of MiB (a [T, H] activation of 64K tokens is 512 MiB). The 5% also covers what the terms above miss: on
an H200 one 64K-token micro-batch of the LLaMA-3-8B shape (8 layers) peaked 2.9 GiB above them, 3.8% of its
activations and transients. Without expandable segments a freed block serves only requests that fit it, and a
segment returns to the device only when wholly free: a micro-batch longer than the one before strands that one's
blocks wherever a longer-lived tensor shares their segment. The same H200 ran out of memory on two such
micro-batches with 12.3 GiB, 16% of their activations and transients, free above the allocated peak of one:
20% covers that case (the trainer sets expandable segments by default)."""

SEGMENT_GRANULES_BYTES = (20 + 2) * 2**20
"""The allocator maps memory per stream in 20 MiB granules for large tensors and 2 MiB for small ones, and can
leave one of each partly used. The step allocates on the compute stream alone (offloading's copy streams only
read and write tensors allocated there)."""

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


@dataclass(frozen=True, kw_only=True)
class LossWorkspace:
    """What the fused linear cross-entropy holds beside the saved activations while it runs on `tokens` tokens.

    The loss computes its gradients in the forward, a chunk of tokens at a time: the chunk's [chunk, V] logits
    (in the hidden states' dtype, plus an fp32 copy when they are upcast), d(loss)/d(hidden) [T, H] for all
    tokens, kept until the backward takes it, and lm_head's gradient unless the loss writes it straight into the
    rank's gradient buffer. The chunk follows the data: about T·H/V tokens (the chunk's logits then take about as
    much as the hidden states), rounded up to a power of two, at least `config.LOSS_MIN_CHUNK`, and no more than
    `max_buffer_bytes` holds (`config.loss_chunk_tokens`, the kernels' rule).
    """

    vocab: int
    hidden: int
    hidden_bytes: int
    """Bytes of an element of the hidden states, of their gradient and of the logits (the compute dtype)."""
    logit_bytes: int
    """Bytes per entry of a chunk's buffers together: the logits, plus 4 for an fp32 upcast copy."""
    head_grad_bytes: int = 0
    """lm_head's gradient while the loss holds it, beside the gradient buffer: the one the op returns and its
    scaled copy in the compiled backward (2·V·H in the weight's dtype)."""
    max_buffer_bytes: int | None = None
    """The most bytes a chunk's [chunk, V/tp] buffers may take (`CompileConfig.loss_workspace_bytes`); None: no cap."""
    tp: int = 1
    """A vocabulary-parallel loss: each rank holds V/tp columns of every chunk."""

    def __post_init__(self) -> None:
        for name in ("vocab", "hidden", "hidden_bytes", "logit_bytes", "tp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LossWorkspace.{name} must be an int >= 1, got {value!r}")
        if self.head_grad_bytes < 0 or (self.max_buffer_bytes is not None and self.max_buffer_bytes < 1):
            raise ValueError(
                f"LossWorkspace: head_grad_bytes must be >= 0 and max_buffer_bytes None or >= 1, got "
                f"{self.head_grad_bytes!r} and {self.max_buffer_bytes!r}"
            )

    def chunk(self, tokens: float) -> int:
        """Tokens per chunk for a micro-batch of `tokens`: the kernels' rule (`config.loss_chunk_tokens`) over this
        rank's V/tp columns, within `max_buffer_bytes` (without a cap, as many as the rule wants)."""
        t = math.ceil(tokens)
        if t <= 0:
            return 0
        budget = self.max_buffer_bytes if self.max_buffer_bytes is not None else t * self._columns * self.logit_bytes
        return loss_chunk_tokens(
            n_tokens=t, vocab=self._columns, hidden=self.hidden, bytes_per_logit=self.logit_bytes, budget_bytes=budget
        )

    @property
    def _columns(self) -> int:
        """Vocabulary columns of a chunk on one rank."""
        return math.ceil(self.vocab / self.tp)

    def bytes(self, tokens: float) -> float:
        """The chunk's buffers, d(loss)/d(hidden) and lm_head's gradient outside the buffer, for `tokens`."""
        chunk_buffers = self.chunk(tokens) * self._columns * self.logit_bytes
        return chunk_buffers + tokens * self.hidden * self.hidden_bytes + self.head_grad_bytes / self.tp


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
    """Bytes no micro-batch changes beyond the static ones: headroom for memory taken outside the allocator."""
    in_flight: int = 1
    """Micro-batches whose activations the rank holds at its peak: 1 without pipeline stages; pp under 1F1B,
    whose first stage runs pp forwards before its first backward."""
    backward_bytes_per_token: float = 0.0
    """The largest transient of one layer's backward per token, held once (one backward runs at a time): the MLP's
    intermediate gradients beside the gradient coming in and going out of the layer."""
    loss: LossWorkspace | None = None
    """The fused loss's transients (None: no fused loss, whose logits are then saved activations)."""
    fragmentation: float = 0.0
    """Reserved over allocated bytes as a share of the activations and transients (`FRAGMENTATION`)."""

    def __post_init__(self) -> None:
        for name in ("params", "hdp_size", "layers", "bucket_bytes", "in_flight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MemoryModel.{name} must be an int >= 1, got {value!r}")
        for name in ("largest_param", "workspace_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"MemoryModel.{name} must be an int >= 0, got {value!r}")
        for name in (
            "layer_bytes_per_token",
            "other_bytes_per_token",
            "recomputed_bytes_per_token",
            "backward_bytes_per_token",
            "fragmentation",
        ):
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

    def transient_bytes(self, tokens: float, offload_ratio: float = 0.0) -> float:
        """What a micro-batch of `tokens` allocates beside its saved activations, at its largest: the fused
        loss's buffers (at the end of the forward) or one layer's backward, whichever is larger (they never run
        at once), plus, when offloading (l > 2, r > 0), the offloaded share of one layer on the device while its
        copy is in flight: in the forward the source storage until the copy to the host ends, in the backward
        the prefetched layer's reloaded storage beside its device part and the layer being differentiated."""
        loss = self.loss.bytes(tokens) if self.loss is not None else 0.0
        in_flight_copy = offload_ratio * self.layer_bytes_per_token * tokens if self.layers > 2 else 0.0
        return max(loss, self.backward_bytes_per_token * tokens) + in_flight_copy

    def peak(self, tokens: float, offload_ratio: float = 0.0) -> float:
        """Predicted reserved peak bytes: static + (activations + transients) x (1 + fragmentation) + workspace."""
        varying = self.activation_bytes(tokens, offload_ratio) + self.transient_bytes(tokens, offload_ratio)
        return self.static.total + varying * (1.0 + self.fragmentation) + self.workspace_bytes

    def available(self, budget: int) -> int:
        """Bytes of `budget` left for activations and transients; MemoryBudgetError when nothing is."""
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
        """Bytes C costs per token without transients: l layers plus the outside tensors of up to max(1, l/2) x C
        tokens. With offloading the planner puts a rank's share of up to l x C / 2 tokens on it (D(s) at r = 1
        counts only layer activations, in units of l x Act(C)), and what lies outside the layers stays."""
        l = self.layers
        outside = max(1.0, l / 2) if offload and l > 2 else 1.0
        per_token = self.in_flight * (l * self.layer_bytes_per_token + outside * self.other_bytes_per_token)
        return per_token + outside * self.recomputed_bytes_per_token

    def capacity(self, budget: int, offload: bool) -> int:
        """The largest C whose every plan fits `budget`: without offload a micro-batch puts at most C tokens on
        a rank, with offload up to l x C / 2 at r = 1 (and, at any r, no more than l layers' worth of C tokens).
        The peak grows with C but not linearly (the loss's chunk doubles in steps), so C is found by bisection
        below the linear bound that leaves the transients out."""
        avail = self.available(budget)
        if self._per_token(offload) <= 0:
            raise ValueError("MemoryModel without activation figures (both per-token figures are 0) has no capacity")
        hi = math.floor(avail / self._per_token(offload)) + 1
        while self.worst_peak(hi, offload) <= budget:  # guard the float division: hi must not fit
            hi *= 2
        lo = 0  # peak(lo) <= budget < peak(hi), lo = 0 taken as fitting
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.worst_peak(mid, offload) <= budget else (lo, mid)
        if lo < 1:
            one = self.worst_peak(1, offload) - self.static.total - self.workspace_bytes
            raise MemoryBudgetError(
                f"the budget of {format_bytes(budget)} ({budget} bytes) leaves {format_bytes(avail)} for activations "
                f"after static bytes {format_bytes(self.static.total)} ({self.static.summary()}) and workspace "
                f"{format_bytes(self.workspace_bytes)}: less than one token ({format_bytes(one)} with its "
                f"transients); {self._remedies()}"
            )
        return lo

    def worst_peak(self, capacity: int, offload: bool) -> float:
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
            f"transients: {self.backward_bytes_per_token:,.0f} bytes/token of one layer's backward"
            + (
                f", the fused loss's {format_bytes(self.loss.bytes(8192))} at 8K tokens "
                f"(chunk of {self.loss.chunk(8192):,} tokens)"
                if self.loss is not None
                else ""
            ),
            f"fragmentation: {self.fragmentation:.0%} of activations and transients (reserved over allocated)",
            f"workspace: {format_bytes(self.workspace_bytes)}",
        ]
        if budget is not None:
            lines.append(f"budget: {format_bytes(budget)}")
            for offload in (False, True):
                c = self.capacity(budget, offload)
                lines.append(
                    f"  C {'with' if offload else 'without'} offload: {c:,} tokens "
                    f"(predicted reserved peak {format_bytes(self.worst_peak(c, offload))})"
                )
            lines.append(f"  longest per rank (offload r = 1): {self.longest_per_rank(budget):,} tokens")
        return "\n".join(lines)


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """Where one device sits: a TP group of `tp`, a pipeline of `pp` stages, `hdp` HDP ranks, and how the TP
    group holds an MoE's experts."""

    tp: int = 1
    pp: int = 1
    hdp: int = 1
    expert_layout: ExpertLayout = "auto"


def shape_memory_model(
    shape: ModelShape,
    layout: ParallelLayout,
    *,
    dtype: str,
    zero: bool = False,
    grad_reduce_dtype: str = "fp32",
    budget: int | None = None,
    expandable: bool = True,
) -> MemoryModel:
    """The `MemoryModel` of one device of the largest pipeline stage training `shape`, from its counts alone (no
    model, no compilation), planned for CUDA: parameters `ModelShape.params_per_device` (experts split over tp in
    either layout, the router whole), activations `ModelShape.layer_act_bytes_per_token` in the dtype's element
    size, two hidden-wide tensors per token outside the layers (the final norm's input and the lm_head's), pp
    micro-batches in flight (1F1B's first stage), one layer's backward, the Triton fused loss (its chunk's logits
    alone), `DEVICE_HEADROOM` of `budget` and the allocator's granules, and `FRAGMENTATION` by `expandable`.
    ValueError, naming the fix, for a tp the heads or experts cannot be split over and a pp over the layers."""
    if layout.pp > shape.layers:
        raise ValueError(
            f"pp {layout.pp} is larger than {shape.name}'s {shape.layers} decoder layers: every pipeline stage "
            f"needs at least one layer"
        )
    experts = shape.resolve_expert_layout(layout.tp, layout.expert_layout)
    element = _FP32 if dtype == "fp32" else _BF16
    tp = layout.tp
    loss = LossWorkspace(
        vocab=shape.vocab,
        hidden=shape.hidden,
        hidden_bytes=element,
        logit_bytes=element,
        head_grad_bytes=2 * shape.vocab * shape.hidden * element,
        tp=tp,
        max_buffer_bytes=CompileConfig().loss_workspace_bytes,
    )
    return MemoryModel(
        params=shape.params_per_device(tp=tp, pp=layout.pp),
        hdp_size=layout.hdp,
        dtype=dtype,
        zero=zero,
        grad_reduce_dtype=grad_reduce_dtype,
        largest_param=shape.largest_param_per_device(tp),
        layers=math.ceil(shape.layers / layout.pp),
        layer_bytes_per_token=shape.layer_act_bytes_per_token(tp, experts, element),
        other_bytes_per_token=float(2 * shape.hidden * element),
        workspace_bytes=(round(DEVICE_HEADROOM * budget) if budget else 0) + SEGMENT_GRANULES_BYTES,
        in_flight=layout.pp,
        backward_bytes_per_token=shape.backward_bytes_per_token(tp, element),
        loss=loss,
        fragmentation=FRAGMENTATION[expandable],
    )
