"""`CompileConfig`: every knob of `optimize()`, validated when it is built."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

__all__ = [
    "ATTENTION_BACKEND_CHOICES",
    "CompileConfig",
    "DEFAULT_LOSS_WORKSPACE_BYTES",
    "LOSS_MIN_CHUNK",
    "loss_chunk_tokens",
]

DEFAULT_LOSS_WORKSPACE_BYTES = 2**30
"""Bytes the fused loss's [chunk, V] buffers may take (the default `CompileConfig.loss_workspace_bytes`): 1 GiB holds the
bf16 logits of 4096 tokens at V = 128K, the chunk the loss wants for 128K tokens of H = 4096 (about T·H/V).
Defined here, at the bottom of the layers, so that `CompileConfig` and the loss op share it."""

LOSS_MIN_CHUNK = 1024
"""The fewest tokens a chunk of the fused loss takes when its workspace cap allows: shorter chunks give the
grad_weight matmul a short inner dimension and read and write grad_weight once more each."""


def loss_chunk_tokens(*, n_tokens: int, vocab: int, hidden: int, bytes_per_logit: int, budget_bytes: int) -> int:
    """Tokens per chunk of the fused loss: about n_tokens · hidden / vocab (the [chunk, V] logits as large as the
    hidden states), rounded up to a power of two and at least `LOSS_MIN_CHUNK`; then no more than the tokens, nor
    than `budget_bytes` holds at `bytes_per_logit` bytes per logit. A chunk shorter than the tokens is a multiple
    of 64 when it can be, so the matmuls keep full tiles. Here, at the bottom of the layers, so that the kernels
    and the memory model that predicts them share it."""
    wanted = max(LOSS_MIN_CHUNK, 1 << max(0, math.ceil(n_tokens * hidden / max(1, vocab)) - 1).bit_length())
    fits = budget_bytes // max(1, vocab * bytes_per_logit)
    rows = max(1, min(wanted, n_tokens, fits))
    return rows // 64 * 64 if 64 <= rows < n_tokens else rows


_PARTITIONERS = ("auto", "default", "min_cut")
_OFFLOAD_MODES = ("auto", "off")
_CODEGEN = ("auto", "inductor", "none")
ATTENTION_BACKEND_CHOICES = ("auto", "torch-flash", "triton", "reference")
"""What `CompileConfig.attention_backend` and `BYTESCALE_KERNELS` may name: "auto" or a row of `kernels.dispatch`'s table."""


@dataclass(frozen=True)
class CompileConfig:
    """What `optimize()` rewrites and how it captures.

    attention: rewrite causal attention into the `bytescale::attention` op (packed, later ring).
    token_mixers: swap the short convolutions and scans of known Hugging Face hybrid mixers (Mamba, Mamba2,
        gated delta rule, LFM2's convolution) for the segment-aware `bytescale::causal_conv1d` and
        `bytescale::scan` (packed, and sharded with halos and states). Off, they are left alone, and a model
        with any is neither packed nor sharded.
    fused_loss: rewrite `lm_head` + cross-entropy into `bytescale::fused_linear_cross_entropy`
        (training mode only: in eval mode the logits are returned as usual).
    loss_workspace_bytes: the most bytes the fused loss's workspace may take: the [chunk, V/tp] buffers of one chunk
        (its logits, plus in the torch reference their fp32 copy and a soft-cap's derivative). The chunk itself
        follows the data, about T·H/V tokens rounded up to a power of two and at least 1024, and this caps it
        (below 1024 tokens too); on the CPU it is also capped at 256 MiB.
    dynamic: mark the token dimension (dim 1 of every `[B, T, ...]` input) dynamic so varying
        micro-batch lengths do not recompile.
    partitioner: how AOTAutograd splits forward from backward: "default" saves what eager saves,
        "min_cut" recomputes cheap ops to save memory, "auto" picks per device (`resolve_partitioner`).
    keep_graph_text: keep the graphs before and after the passes as text in the report.
    offload: selective activation offload (paper §4.2): "auto" takes each micro-batch's ratio r from
        the plan, a number in [0, 1] uses that r for every micro-batch, "off" leaves the graphs alone.
        The ratio is read at run time under the act_ctx (`runtime.offload.get_act_ctx`); without one,
        nothing is offloaded.
    codegen: what runs the graphs our passes produce: "inductor" compiles them with Inductor (the
        elementwise work around our ops fused into generated kernels, our `bytescale::` ops opaque
        calls), "none" runs them as FX code over aten ops, "auto" picks per device (`resolve_codegen`).
    compile_layers_once: trace and compile one decoder layer and reuse it for the identical others
        (`torch.compiler.nested_compile_region` on the ModuleList of same-class layers with the most
        parameters, `capture/layers.py`). The offload pass is off for such graphs (reported).
    attention_backend: the kernels `bytescale::attention` runs on: "auto" takes the first backend of
        `kernels.dispatch.ATTENTION_BACKENDS` that can serve each call ("torch-flash", "triton", "reference");
        a name forces that backend (a call it cannot serve raises `KernelUnavailableError`). It wins over
        `BYTESCALE_KERNELS`, which "auto" leaves in charge.
    """

    attention: bool = True
    token_mixers: bool = True
    fused_loss: bool = True
    loss_workspace_bytes: int = DEFAULT_LOSS_WORKSPACE_BYTES
    dynamic: bool = True
    partitioner: str = "auto"
    keep_graph_text: bool = True
    offload: str | float = "auto"
    codegen: str = "auto"
    compile_layers_once: bool = False
    attention_backend: str = "auto"

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "bool" and not isinstance(value, bool):
                raise ValueError(f"CompileConfig.{f.name} must be True or False, got {value!r}")
        if (
            isinstance(self.loss_workspace_bytes, bool)
            or not isinstance(self.loss_workspace_bytes, int)
            or self.loss_workspace_bytes < 1
        ):
            raise ValueError(
                f"CompileConfig.loss_workspace_bytes must be an int >= 1, got {self.loss_workspace_bytes!r}"
            )
        if not (
            self.offload in _OFFLOAD_MODES
            or (
                isinstance(self.offload, (int, float))
                and not isinstance(self.offload, bool)
                and 0.0 <= self.offload <= 1.0
            )
        ):
            raise ValueError(
                f"CompileConfig.offload must be one of {_OFFLOAD_MODES} or a ratio in [0, 1], got {self.offload!r}"
            )
        if self.codegen not in _CODEGEN:
            raise ValueError(f"CompileConfig.codegen must be one of {_CODEGEN}, got {self.codegen!r}")
        if self.attention_backend not in ATTENTION_BACKEND_CHOICES:
            raise ValueError(
                f"CompileConfig.attention_backend must be one of {ATTENTION_BACKEND_CHOICES}, got {self.attention_backend!r}"
            )
        if self.partitioner not in _PARTITIONERS:
            raise ValueError(f"CompileConfig.partitioner must be one of {_PARTITIONERS}, got {self.partitioner!r}")

    def resolve_codegen(self, device_type: str) -> str:
        """The codegen for graphs on `device_type`: "auto" is Inductor on CUDA, where fusion saves memory
        traffic, and FX code on CPU, where Inductor's compile time outweighs its gain (README, CompileConfig)."""
        if self.codegen != "auto":
            return self.codegen
        return "inductor" if device_type == "cuda" else "none"

    def resolve_partitioner(self, device_type: str) -> str:
        """The partitioner for graphs on `device_type`: "auto" is min-cut on CUDA, where it halved peak memory
        at equal step time on an H100 (benchmarks/history/gpu.md), and the default split on CPU, where recomputation costs
        time that the memory, plentiful there, does not buy back."""
        if self.partitioner != "auto":
            return self.partitioner
        return "min_cut" if device_type == "cuda" else "default"

    def with_overrides(self, **overrides: Any) -> CompileConfig:
        """A copy with some fields changed; unknown names raise ValueError listing the known ones."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown CompileConfig field(s) {unknown}; allowed: {sorted(known)}")
        return replace(self, **overrides)


if not TYPE_CHECKING:  # mypy sees only the current names

    def __getattr__(name: str) -> Any:
        """`Config`, the former name of `CompileConfig`, for one release."""
        if name == "Config":
            import warnings

            warnings.warn(
                "bytescale_compile.config.Config moved to bytescale_compile.config.CompileConfig; the old name goes in "
                "the next release",
                DeprecationWarning,
                stacklevel=2,
            )
            return CompileConfig
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
