"""Choose the Triton kernels or the torch references per call.

The custom ops and the ring import their kernels from here, under the references' names and
signatures. CUDA tensors with Triton importable run the Triton kernels; everything else runs the
references. `BYTESCALE_KERNELS=reference|triton` (read at every call) overrides the choice;
`triton` with CPU tensors runs the kernels in Triton's interpreter, which needs `TRITON_INTERPRET=1`
set when the process starts (see `triton_mode`). The compile report records `choose`'s answer for the
device of each compiled graph's inputs (`capture/backend.py`). The vocabulary-parallel loss has no Triton
kernel: its torch reference runs on every device.

The fused loss has two implementations, token chunks and vocabulary slices (`cross_entropy_ref`);
`linear_cross_entropy_chunked` runs the one `use_vocab_slices` picks, and both are exported by name
(`linear_cross_entropy_token_chunks`, `linear_cross_entropy_vocab_slices`) for the benchmarks to time.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable, Sequence
from types import ModuleType

import torch
from torch import Tensor

from . import attention_ref, cross_entropy_ref

__all__ = [
    "ENV_VAR",
    "KernelUnavailableError",
    "choose",
    "causal_attention_fwd",
    "causal_attention_bwd",
    "segment_causal_attention_fwd",
    "segment_causal_attention_bwd",
    "block_attention_fwd",
    "block_attention_bwd",
    "linear_cross_entropy_chunked",
    "linear_cross_entropy_token_chunks",
    "linear_cross_entropy_vocab_slices",
    "use_vocab_slices",
    "vocab_parallel_linear_cross_entropy_chunked",
]

ENV_VAR = "BYTESCALE_KERNELS"
_CHOICES = ("auto", "reference", "triton")


class KernelUnavailableError(RuntimeError):
    """The Triton kernels were asked for but cannot run on these tensors in this process."""


def choose(device: torch.device) -> str:
    """ "triton" or "reference" for tensors on `device`, after the environment override."""
    wanted = os.environ.get(ENV_VAR, "").strip().lower() or "auto"
    if wanted not in _CHOICES:
        raise ValueError(f"{ENV_VAR} must be one of {_CHOICES} (or unset), got {os.environ[ENV_VAR]!r}")
    if wanted == "auto":
        return "triton" if device.type == "cuda" and _triton_importable() else "reference"
    if wanted == "triton" and device.type not in ("cuda", "cpu"):
        raise KernelUnavailableError(
            f"{ENV_VAR}=triton, but the Triton kernels run on CUDA (or CPU under "
            f"TRITON_INTERPRET=1) tensors, got {device.type} tensors"
        )
    return wanted


@functools.cache
def _triton_importable() -> bool:
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def _kernels(name: str, device: torch.device) -> ModuleType:
    """The Triton kernel module `name`, imported on first use and checked to be able to run on `device`."""
    try:
        module = importlib.import_module(f"{__package__}.{name}")
    except ImportError as e:
        raise KernelUnavailableError(
            f"the Triton kernels were chosen but cannot be imported ({e}); install Triton or set {ENV_VAR}=reference"
        ) from e
    if device.type == "cpu" and not module.INTERPRETED:
        raise KernelUnavailableError(
            f"{ENV_VAR}=triton with CPU tensors needs Triton's interpreter, but {module.__name__} was built for "
            f"the GPU: start the process with TRITON_INTERPRET=1 in its environment (triton reads it at import, "
            f"and torch imports triton early)"
        )
    return module


def _pick(device: torch.device, kernels: str) -> ModuleType | None:
    """The Triton kernel module `kernels` when Triton is chosen for `device`, else None (the reference)."""
    return _kernels(kernels, device) if choose(device) == "triton" else None


# --- attention ------------------------------------------------------------------------------------


def causal_attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """`attention_ref.causal_attention_fwd`, on the chosen implementation."""
    triton_ = _pick(q.device, "attention_triton")
    if triton_ is None:
        return attention_ref.causal_attention_fwd(q, k, v, scale, window=window, softcap=softcap)
    return triton_.attention_fwd(q, k, v, scale, causal=True, window=window, softcap=softcap)


def causal_attention_bwd(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """`attention_ref.causal_attention_bwd`, on the chosen implementation."""
    triton_ = _pick(q.device, "attention_triton")
    if triton_ is None:
        return attention_ref.causal_attention_bwd(grad_out, q, k, v, out, lse, scale, window=window, softcap=softcap)
    return triton_.attention_bwd(grad_out, q, k, v, out, lse, scale, causal=True, window=window, softcap=softcap)


def segment_causal_attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor | Sequence[int],
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """`attention_ref.segment_causal_attention_fwd`, on the chosen implementation."""
    triton_ = _pick(q.device, "attention_triton")
    if triton_ is None:
        return attention_ref.segment_causal_attention_fwd(q, k, v, cu_seqlens, scale, window=window, softcap=softcap)
    attention_ref._check_single_row(q)
    return triton_.attention_fwd(
        q, k, v, scale, causal=True, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, window=window, softcap=softcap
    )


def segment_causal_attention_bwd(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens: Tensor | Sequence[int],
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """`attention_ref.segment_causal_attention_bwd`, on the chosen implementation."""
    triton_ = _pick(q.device, "attention_triton")
    if triton_ is None:
        return attention_ref.segment_causal_attention_bwd(
            grad_out, q, k, v, out, lse, cu_seqlens, scale, window=window, softcap=softcap
        )
    attention_ref._check_single_row(q)
    return triton_.attention_bwd(
        grad_out,
        q,
        k,
        v,
        out,
        lse,
        scale,
        causal=True,
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_k=cu_seqlens,
        window=window,
        softcap=softcap,
    )


def block_attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    causal: bool,
    *,
    window: int | None = None,
    softcap: float | None = None,
    offset: int = 0,
) -> tuple[Tensor, Tensor]:
    """`attention_ref.block_attention_fwd`, on the chosen implementation."""
    triton_ = _pick(q.device, "attention_triton")
    if triton_ is None:
        return attention_ref.block_attention_fwd(q, k, v, scale, causal, window=window, softcap=softcap, offset=offset)
    return triton_.attention_fwd(q, k, v, scale, causal=causal, window=window, softcap=softcap, offset=offset)


def block_attention_bwd(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    causal: bool,
    *,
    window: int | None = None,
    softcap: float | None = None,
    offset: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    """`attention_ref.block_attention_bwd`, on the chosen implementation."""
    triton_ = _pick(q.device, "attention_triton")
    if triton_ is None:
        return attention_ref.block_attention_bwd(
            grad_out, q, k, v, out, lse, scale, causal, window=window, softcap=softcap, offset=offset
        )
    return triton_.attention_bwd(
        grad_out, q, k, v, out, lse, scale, causal=causal, window=window, softcap=softcap, offset=offset
    )


# --- loss -----------------------------------------------------------------------------------------

_LossKernel = Callable[..., tuple[Tensor, Tensor, Tensor, Tensor | None]]


def _loss_kernel(device: torch.device, reference: _LossKernel, triton_name: str) -> _LossKernel:
    """The torch `reference`, or its drop-in `triton_name` from `cross_entropy_triton` when Triton is chosen."""
    triton_ = _pick(device, "cross_entropy_triton")
    return reference if triton_ is None else getattr(triton_, triton_name)


VOCAB_SLICES_MAX_TOKENS = 1024
"""Up to this many tokens the vocabulary slices' extra matmul costs less than the token chunks' fp32 grad_weight
accumulator (measured on an H200 at V = 128K, H = 4096); above it they are slower (`benchmarks/gpu.py`)."""


def use_vocab_slices(n_tokens: int, vocab: int) -> bool:
    """Whether the fused loss of `n_tokens` tokens over `vocab` rows runs as vocabulary slices rather than token
    chunks. The slices hold grad_hidden [T, H] in fp32 instead of grad_weight [V, H] and cost one matmul more (four
    instead of three), so they pay only for short micro-batches: at most `VOCAB_SLICES_MAX_TOKENS` tokens, and
    fewer than the vocabulary."""
    return n_tokens <= VOCAB_SLICES_MAX_TOKENS and n_tokens < vocab


def linear_cross_entropy_token_chunks(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    ignore_index: int,
    reduction: str,
    upcast: bool,
    chunk_size: int,
    scale: float = 1.0,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """`cross_entropy_ref.linear_cross_entropy_chunked`, on the chosen implementation."""
    impl = _loss_kernel(
        hidden.device, cross_entropy_ref.linear_cross_entropy_chunked, "linear_cross_entropy_chunked_triton"
    )
    return impl(hidden, weight, bias, target, ignore_index, reduction, upcast, chunk_size, scale, softcap)


def linear_cross_entropy_vocab_slices(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    ignore_index: int,
    reduction: str,
    upcast: bool,
    chunk_size: int,
    scale: float = 1.0,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """`cross_entropy_ref.linear_cross_entropy_vocab_slices`, on the chosen implementation."""
    impl = _loss_kernel(
        hidden.device, cross_entropy_ref.linear_cross_entropy_vocab_slices, "linear_cross_entropy_vocab_slices_triton"
    )
    return impl(hidden, weight, bias, target, ignore_index, reduction, upcast, chunk_size, scale, softcap)


def linear_cross_entropy_chunked(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    ignore_index: int,
    reduction: str,
    upcast: bool,
    chunk_size: int,
    scale: float = 1.0,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The fused loss (`cross_entropy_ref.linear_cross_entropy_chunked`'s arguments and returns) as token chunks
    or vocabulary slices, as `use_vocab_slices` picks, on the chosen implementation."""
    impl = (
        linear_cross_entropy_vocab_slices
        if use_vocab_slices(hidden.shape[0], weight.shape[0])
        else linear_cross_entropy_token_chunks
    )
    return impl(hidden, weight, bias, target, ignore_index, reduction, upcast, chunk_size, scale, softcap)


vocab_parallel_linear_cross_entropy_chunked = cross_entropy_ref.vocab_parallel_linear_cross_entropy_chunked
"""The torch reference on every device, whatever `choose` says: no Triton kernel implements it."""
