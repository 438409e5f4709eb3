"""Choose the kernels per call: attention from a table of backends, the fused loss from Triton or the reference.

Attention runs on the first row of `ATTENTION_BACKENDS` whose predicate accepts the call: torch's
FlashAttention-2 (`attention_flash`: CUDA, bf16/fp16, D == Dv <= 256, no soft-cap, a mask it can place), our
Triton kernel (`attention_triton`: CUDA; also fp32, soft-caps and Dv != D), the torch reference
(`attention_ref`: anything). Every row keeps one contract: q `[Tq, Hq, D]`, k/v `[Tk, Hkv, D | Dv]` (GQA
without repeating k/v) in, out `[Tq, Hq, Dv]` and fp32 lse `[Hq, Tq]` (-inf for a query that sees no key)
out, and a backward that takes out and lse; so local segments and ring blocks, whose out and lse are merged
across blocks, share the table. The FlashAttention-2/3 packages are not in it: the varlen entry points that
take a merged lse (`_flash_attn_varlen_forward/backward`) are private and change between releases. The
entry points below keep the references' `[B, H, T, D]` names and signatures and hand the rows over as views.

`BYTESCALE_KERNELS` (read at every call) overrides the choice: `auto` (or unset), `reference` and `triton`
for attention and the loss, `torch-flash` for attention (the loss then chooses as in `auto`).
`CompileConfig.attention_backend` (the op scopes it with `attention_backend`) wins over it for attention. A backend
asked for by name that cannot serve a call raises `KernelUnavailableError` naming the unmet condition; `auto`
passes over it. `triton` with CPU tensors runs the kernels in Triton's interpreter, which needs
`TRITON_INTERPRET=1` set when the process starts (see `triton_mode`). The compile report records, for each
compiled graph, what each of our ops chooses on its inputs (`capture/backend.py`). The vocabulary-parallel
loss has no Triton kernel: its torch reference runs on every device.

The fused loss has two implementations, token chunks and vocabulary slices (`cross_entropy_ref`);
`linear_cross_entropy` runs the one `use_vocab_slices` picks (token chunks unless a short micro-batch
does not fit one chunk), and both are exported by name (`linear_cross_entropy_token_chunks`,
`linear_cross_entropy_vocab_slices`) for the benchmarks to time. All take `max_workspace_bytes`, the cap on the
chunk's [chunk, V] buffers (the config's `loss_workspace_bytes`), and `grad_dtype=torch.float32` for an fp32
grad_weight of a low-precision weight.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..config import ATTENTION_BACKEND_CHOICES as KERNEL_CHOICES
from ..lazy import lazy_getattr
from . import attention_flash, attention_ref, cross_entropy_ref
from .attention_ref import AttentionMask, check_attention_options, check_attention_shapes, layout_like

__all__ = [
    "ENV_VAR",
    "KERNEL_CHOICES",
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttentionCall",
    "AttentionChoice",
    "KernelUnavailableError",
    "attention_backend",
    "choose",
    "choose_attention",
    "explain_attention",
    "requested_attention_backend",
    "causal_attention_fwd",
    "causal_attention_bwd",
    "segment_causal_attention_fwd",
    "segment_causal_attention_bwd",
    "block_attention_fwd",
    "block_attention_bwd",
    "linear_cross_entropy",
    "linear_cross_entropy_token_chunks",
    "linear_cross_entropy_vocab_slices",
    "use_vocab_slices",
    "vocab_parallel_linear_cross_entropy_chunked",
]

ENV_VAR = "BYTESCALE_KERNELS"


class KernelUnavailableError(RuntimeError):
    """Kernels were asked for by name (environment, config) but cannot run this call in this process."""


def _requested() -> str:
    """`BYTESCALE_KERNELS`, checked: "auto" when unset."""
    wanted = os.environ.get(ENV_VAR, "").strip().lower() or "auto"
    if wanted not in KERNEL_CHOICES:
        raise ValueError(f"{ENV_VAR} must be one of {KERNEL_CHOICES} (or unset), got {os.environ[ENV_VAR]!r}")
    return wanted


def choose(device: torch.device) -> str:
    """ "triton" or "reference" for the fused loss's tensors on `device`, after the environment override
    (`torch-flash` names an attention backend: the loss then chooses as in auto)."""
    wanted = _requested()
    if wanted not in ("reference", "triton"):
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


def _interpreter_message(module_name: str) -> str:
    return (
        f"CPU tensors need Triton's interpreter, but {module_name} was built for the GPU: start the process with "
        f"TRITON_INTERPRET=1 in its environment (triton reads it at import, and torch imports triton early)"
    )


def _kernels(name: str, device: torch.device) -> ModuleType:
    """The Triton kernel module `name`, imported on first use and checked to be able to run on `device`."""
    try:
        module = importlib.import_module(f"{__package__}.{name}")
    except ImportError as e:
        raise KernelUnavailableError(
            f"the Triton kernels were chosen but cannot be imported ({e}); install Triton or set {ENV_VAR}=reference"
        ) from e
    if device.type == "cpu" and not module.INTERPRETED:
        raise KernelUnavailableError(f"{ENV_VAR}=triton: {_interpreter_message(module.__name__)}")
    return module


def _pick(device: torch.device, kernels: str) -> ModuleType | None:
    """The Triton kernel module `kernels` when Triton is chosen for `device`, else None (the reference)."""
    return _kernels(kernels, device) if choose(device) == "triton" else None


# --- attention ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionCall:
    """One attention call as the backends' predicates see it: the tensors' device, dtypes and head dims, the
    scores' soft-cap and the mask, and the segments.

    Several segments are always self-attention ones (the same boundaries for queries and keys, causal at
    offset 0: what the entry points build); one segment is a block, any mask (a ring block).
    """

    device: torch.device
    dtypes: tuple[torch.dtype, torch.dtype, torch.dtype]
    """Of q, k and v."""
    head_dim: int
    v_dim: int
    softcap: float | None
    mask: AttentionMask
    bounds_q: tuple[int, ...] | None = None
    bounds_k: tuple[int, ...] | None = None
    """Segment boundaries of the queries and the keys, host ints from 0; None at compile time: self-attention
    segments of a packing not known yet."""

    def __post_init__(self) -> None:
        check_attention_options(self.mask.window, self.softcap)
        if (self.bounds_q is None) != (self.bounds_k is None):
            raise ValueError("an attention call gives the boundaries of both its queries and its keys, or neither")
        several = self.bounds_q is not None and len(self.bounds_q) > 2
        if several and not (self.bounds_q == self.bounds_k and self._self_attention_mask):
            raise ValueError(
                "several segments in one attention call must be self-attention ones (the same boundaries for "
                f"queries and keys, causal at offset 0), got {self.bounds_q}, {self.bounds_k} and {self.mask}"
            )

    @classmethod
    def of(
        cls,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: AttentionMask,
        softcap: float | None,
        bounds_q: tuple[int, ...] | None = None,
        bounds_k: tuple[int, ...] | None = None,
    ) -> AttentionCall:
        """The call of q `[..., D]`, k and v `[..., Dv]` (real or fake tensors)."""
        return cls(
            q.device,
            (q.dtype, k.dtype, v.dtype),
            int(q.shape[-1]),
            int(v.shape[-1]),
            softcap,
            mask,
            bounds_q,
            bounds_k,
        )

    @property
    def _self_attention_mask(self) -> bool:
        return self.mask.causal and self.mask.offset == 0

    @property
    def lengths(self) -> list[tuple[int, int]] | None:
        """(queries, keys) of each segment, or None for self-attention segments: then every query sees itself,
        whatever the packing."""
        if self.bounds_q is None or self.bounds_k is None:
            return None
        if self.bounds_q == self.bounds_k and self._self_attention_mask:
            return None
        return [(self.bounds_q[-1] - self.bounds_q[0], self.bounds_k[-1] - self.bounds_k[0])]


_Fwd = Callable[[Tensor, Tensor, Tensor, float, AttentionCall], tuple[Tensor, Tensor]]
_Bwd = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, float, AttentionCall], tuple[Tensor, Tensor, Tensor]]


@dataclass(frozen=True)
class AttentionBackend:
    """A row of the table: when it can serve a call, and its kernels under the contract (tokens-first views)."""

    name: str
    unmet: Callable[[AttentionCall, bool], str | None]
    """Why it cannot serve the call (None: it can); the flag says whether it was asked for by name."""
    fwd: _Fwd
    """(q `[Tq, Hq, D]`, k `[Tk, Hkv, D]`, v `[Tk, Hkv, Dv]`, scale, call) -> (out `[Tq, Hq, Dv]`, lse `[Hq, Tq]`)."""
    bwd: _Bwd
    """(grad_out, q, k, v, out, lse, scale, call) -> (dq, dk, dv) shaped like q, k, v."""


def _heads_first(x: Tensor) -> Tensor:
    """[T, H, D] -> the [1, H, T, D] view the Triton kernels and the references take. Its batch stride (which
    addresses nothing: one row) is the row's size, as `empty_like` gives a dense row, so outputs made like it
    have exactly the strides of the references' outputs."""
    row = x.transpose(0, 1).unsqueeze(0)
    return row.as_strided(row.shape, (max(1, x.numel()), *row.stride()[1:]), row.storage_offset())


def _tokens_first(x: Tensor) -> Tensor:
    """[1, H, T, D] -> [T, H, D] view."""
    return x[0].transpose(0, 1)


def _segment_kwargs(call: AttentionCall) -> dict[str, tuple[int, ...]]:
    """cu_seqlens for the Triton kernel: none for one segment (it then spans the row)."""
    assert call.bounds_q is not None and call.bounds_k is not None  # run-time calls carry their packing
    if len(call.bounds_q) == 2:
        return {}
    return {"cu_seqlens_q": call.bounds_q, "cu_seqlens_k": call.bounds_k}


def _same_dtype_in(call: AttentionCall, dtypes: tuple[torch.dtype, ...]) -> str | None:
    if len(set(call.dtypes)) != 1 or call.dtypes[0] not in dtypes:
        names = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        got = ", ".join(str(d).removeprefix("torch.") for d in call.dtypes)
        return f"needs q/k/v of one dtype among {names}, got {got}"
    return None


# torch's FlashAttention-2


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _torch_flash_unmet(call: AttentionCall, forced: bool) -> str | None:
    del forced  # the same conditions either way
    if call.device.type != "cuda":
        return f"needs CUDA tensors, got {call.device.type} ones"
    if not torch.backends.cuda.is_flash_attention_available():
        return "this torch build has no flash attention"
    index = call.device.index if call.device.index is not None else torch.cuda.current_device()
    major, minor = _capability(torch.device("cuda", index))
    if major < 8:
        return f"needs an sm80 or newer GPU, got sm{major}{minor}"
    wrong_dtype = _same_dtype_in(call, attention_flash.FLASH_DTYPES)
    if wrong_dtype is not None:
        return wrong_dtype
    if call.head_dim != call.v_dim:
        return f"needs one head dim for q, k and v, got D={call.head_dim} and Dv={call.v_dim}"
    if call.head_dim > attention_flash.MAX_HEAD_DIM or call.head_dim % 8:
        return f"needs a head dim that is a multiple of 8, at most {attention_flash.MAX_HEAD_DIM}, got {call.head_dim}"
    if call.softcap is not None:
        return "has no soft-cap"
    window = attention_flash.flash_window(call.mask, call.lengths)
    return window if isinstance(window, str) else None


def _flash_plan(call: AttentionCall) -> tuple[tuple[int, ...], tuple[int, ...], attention_flash.FlashWindow]:
    """The boundaries and FlashAttention's mask arguments of a call the predicate accepted."""
    window = attention_flash.flash_window(call.mask, call.lengths)
    if isinstance(window, str) or call.bounds_q is None or call.bounds_k is None:
        raise KernelUnavailableError(f"torch-flash cannot run this call: {window}")
    return call.bounds_q, call.bounds_k, window


def _torch_flash_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, call: AttentionCall) -> tuple[Tensor, Tensor]:
    bounds_q, bounds_k, window = _flash_plan(call)
    return attention_flash.attention_fwd(
        q,
        k,
        v,
        scale,
        bounds_q=bounds_q,
        bounds_k=bounds_k,
        window=window,
        rows_may_see_nothing=call.lengths is not None,
    )


def _torch_flash_bwd(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, call: AttentionCall
) -> tuple[Tensor, Tensor, Tensor]:
    bounds_q, bounds_k, window = _flash_plan(call)
    return attention_flash.attention_bwd(
        grad_out,
        q,
        k,
        v,
        out,
        lse,
        scale,
        bounds_q=bounds_q,
        bounds_k=bounds_k,
        window=window,
        rows_may_see_nothing=call.lengths is not None,
    )


# our Triton kernel

_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TRITON_MAX_HEAD_DIM = 256
"""The widest heads `attention_triton.tile_config` sizes tiles for (and its tests cover)."""


def _triton_runs_on(device: torch.device, forced: bool) -> str | None:
    """Why the Triton kernel cannot run on `device` here (None: it can). CPU tensors run in Triton's
    interpreter, a test vehicle: only when the kernel is asked for by name."""
    if device.type == "cuda":
        return None if _triton_importable() else "Triton is not importable"
    if device.type != "cpu":
        return f"runs on CUDA tensors (or CPU ones in Triton's interpreter), got {device.type} ones"
    if not forced:
        return "runs CPU tensors only when asked for by name, in Triton's interpreter"
    try:
        module = importlib.import_module(f"{__package__}.attention_triton")
    except ImportError as e:
        return f"cannot be imported ({e})"
    return None if module.INTERPRETED else _interpreter_message(module.__name__)


def _triton_unmet(call: AttentionCall, forced: bool) -> str | None:
    where = _triton_runs_on(call.device, forced)
    if where is not None:
        return where
    wrong_dtype = _same_dtype_in(call, _TRITON_DTYPES)
    if wrong_dtype is not None:
        return wrong_dtype
    if max(call.head_dim, call.v_dim) > _TRITON_MAX_HEAD_DIM:
        return f"takes head dims up to {_TRITON_MAX_HEAD_DIM}, got D={call.head_dim} and Dv={call.v_dim}"
    return None


def _triton_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, call: AttentionCall) -> tuple[Tensor, Tensor]:
    kernels = _kernels("attention_triton", q.device)
    out, lse = kernels.attention_fwd(
        *(_heads_first(x) for x in (q, k, v)),
        scale,
        causal=call.mask.causal,
        window=call.mask.window,
        softcap=call.softcap,
        offset=call.mask.offset,
        **_segment_kwargs(call),
    )
    return _tokens_first(out), lse[0]


def _triton_bwd(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, call: AttentionCall
) -> tuple[Tensor, Tensor, Tensor]:
    kernels = _kernels("attention_triton", q.device)
    dq, dk, dv = kernels.attention_bwd(
        *(_heads_first(x) for x in (grad_out, q, k, v, out)),
        lse.unsqueeze(0),
        scale,
        causal=call.mask.causal,
        window=call.mask.window,
        softcap=call.softcap,
        offset=call.mask.offset,
        **_segment_kwargs(call),
    )
    return _tokens_first(dq), _tokens_first(dk), _tokens_first(dv)


# the torch reference


def _reference_unmet(call: AttentionCall, forced: bool) -> None:
    del call, forced  # any device, dtype, head dims and mask
    return None


def _reference_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, call: AttentionCall) -> tuple[Tensor, Tensor]:
    q, k, v = _heads_first(q), _heads_first(k), _heads_first(v)
    mask, softcap = call.mask, call.softcap
    segments = _segment_kwargs(call)
    if segments:
        cu = segments["cu_seqlens_q"]
        out, lse = attention_ref.segment_causal_attention_fwd(q, k, v, cu, scale, window=mask.window, softcap=softcap)
    else:
        out, lse = attention_ref.block_attention_fwd(
            q, k, v, scale, mask.causal, window=mask.window, softcap=softcap, offset=mask.offset
        )
    return _tokens_first(out), lse[0]


def _reference_bwd(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, call: AttentionCall
) -> tuple[Tensor, Tensor, Tensor]:
    grad_out, q, k, v, out = (_heads_first(x) for x in (grad_out, q, k, v, out))
    lse, mask, softcap = lse.unsqueeze(0), call.mask, call.softcap
    segments = _segment_kwargs(call)
    if segments:
        cu = segments["cu_seqlens_q"]
        dq, dk, dv = attention_ref.segment_causal_attention_bwd(
            grad_out, q, k, v, out, lse, cu, scale, window=mask.window, softcap=softcap
        )
    else:
        dq, dk, dv = attention_ref.block_attention_bwd(
            grad_out, q, k, v, out, lse, scale, mask.causal, window=mask.window, softcap=softcap, offset=mask.offset
        )
    return _tokens_first(dq), _tokens_first(dk), _tokens_first(dv)


ATTENTION_BACKENDS = (
    AttentionBackend("torch-flash", _torch_flash_unmet, _torch_flash_fwd, _torch_flash_bwd),
    AttentionBackend("triton", _triton_unmet, _triton_fwd, _triton_bwd),
    AttentionBackend("reference", _reference_unmet, _reference_fwd, _reference_bwd),
)
"""The attention backends in order of preference: `auto` runs the first that can serve a call."""
_BY_NAME = {b.name: b for b in ATTENTION_BACKENDS}


# --- choosing -------------------------------------------------------------------------------------

_ASKED: ContextVar[tuple[str, str] | None] = ContextVar("bytescale_attention_backend", default=None)


def _check_choice(name: str, what: str) -> None:
    if name not in KERNEL_CHOICES:
        raise ValueError(f"{what} must be one of {KERNEL_CHOICES}, got {name!r}")


@contextlib.contextmanager
def attention_backend(name: str | None, *, source: str = "dispatch.attention_backend") -> Iterator[None]:
    """Run attention in this scope on the backend `name` (None or "auto": as `BYTESCALE_KERNELS` says), which
    wins over the environment. `source` is who asked, for the error a backend that cannot serve raises. The
    op scopes its calls with `CompileConfig.attention_backend` this way: the ring's blocks inherit it."""
    if name is None or name == "auto":
        yield
        return
    _check_choice(name, source)
    token = _ASKED.set((name, source))
    try:
        yield
    finally:
        _ASKED.reset(token)


def requested_attention_backend() -> tuple[str, str]:
    """(the attention backend asked for, or "auto"; who asked): the innermost `attention_backend` scope, else
    `BYTESCALE_KERNELS`."""
    asked = _ASKED.get()
    if asked is not None:
        return asked
    wanted = _requested()
    return wanted, f"{ENV_VAR}={wanted}"


@dataclass(frozen=True)
class AttentionChoice:
    """The backend chosen for a call and why each one before it in the table was passed over."""

    backend: str
    passed_over: tuple[tuple[str, str], ...] = ()
    """(backend, unmet condition)."""

    def describe(self) -> str:
        """e.g. "triton (torch-flash: has no soft-cap)"."""
        if not self.passed_over:
            return self.backend
        return f"{self.backend} ({'; '.join(f'{name}: {why}' for name, why in self.passed_over)})"


def explain_attention(call: AttentionCall) -> AttentionChoice:
    """What `choose_attention` picks for `call`, with the reasons; raises `KernelUnavailableError` when the
    backend asked for by name cannot serve it."""
    name, source = requested_attention_backend()
    if name != "auto":
        reason = _BY_NAME[name].unmet(call, True)
        if reason is not None:
            raise KernelUnavailableError(
                f"attention backend {name!r} was asked for ({source}) but cannot run this call: {reason}"
            )
        return AttentionChoice(name)
    passed_over: list[tuple[str, str]] = []
    for backend in ATTENTION_BACKENDS:
        reason = backend.unmet(call, False)
        if reason is None:
            return AttentionChoice(backend.name, tuple(passed_over))
        passed_over.append((backend.name, reason))
    raise AssertionError("the reference serves every call")


def choose_attention(call: AttentionCall) -> AttentionBackend:
    """The backend that runs `call`: the one asked for by name, else the first in the table that can."""
    return _BY_NAME[explain_attention(call).backend]


# --- entry points ---------------------------------------------------------------------------------


def _fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, call: AttentionCall) -> tuple[Tensor, Tensor]:
    """Each batch row of `[B, H, T, D]` q/k/v through the chosen backend; one row passes straight through."""
    backend = choose_attention(call)

    def row(b: int) -> tuple[Tensor, Tensor]:
        rows = slice(b, b + 1)
        out, lse = backend.fwd(_tokens_first(q[rows]), _tokens_first(k[rows]), _tokens_first(v[rows]), scale, call)
        return _heads_first(out), lse.unsqueeze(0)

    if q.shape[0] == 1:
        out, lse = row(0)
        return layout_like(out, q), lse
    out, lse = attention_ref.empty_attention_out(q, v), q.new_empty(q.shape[:3], dtype=torch.float32)
    for b in range(q.shape[0]):
        out[b : b + 1], lse[b : b + 1] = row(b)
    return out, lse


def _bwd(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, call: AttentionCall
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of `_fwd`, like `empty_like` of q, k and v."""
    backend = choose_attention(call)

    def row(b: int) -> tuple[Tensor, Tensor, Tensor]:
        g, q_, k_, v_, o = (_tokens_first(x[b : b + 1]) for x in (grad_out, q, k, v, out))
        dq, dk, dv = backend.bwd(g, q_, k_, v_, o, lse[b], scale, call)
        return _heads_first(dq), _heads_first(dk), _heads_first(dv)

    if q.shape[0] == 1:
        dq, dk, dv = row(0)
        return layout_like(dq, q), layout_like(dk, k), layout_like(dv, v)
    grads = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for b in range(q.shape[0]):
        for grad, part in zip(grads, row(b)):
            grad[b : b + 1] = part
    return grads


def _self_bounds(cu_seqlens: Tensor | Sequence[int], tokens: int) -> tuple[int, ...]:
    """A packing's boundaries as host ints (one read of a tensor), checked, without its empty segments."""
    bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else cu_seqlens
    ends = [end for start, end in attention_ref._segments(bounds, tokens) if end > start]
    return (0, *ends) if ends else (0, tokens)


def _block_call(
    q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, softcap: float | None, same_length: bool
) -> AttentionCall:
    check_attention_shapes(q, k, v, same_length=same_length)
    return AttentionCall.of(q, k, v, mask=mask, softcap=softcap, bounds_q=(0, q.shape[2]), bounds_k=(0, k.shape[2]))


def causal_attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """`attention_ref.causal_attention_fwd`, on the chosen backend."""
    return _fwd(q, k, v, scale, _block_call(q, k, v, AttentionMask(True, window), softcap, same_length=True))


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
    """`attention_ref.causal_attention_bwd`, on the chosen backend."""
    call = _block_call(q, k, v, AttentionMask(True, window), softcap, same_length=True)
    return _bwd(grad_out, q, k, v, out, lse, scale, call)


def _segment_call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor | Sequence[int],
    window: int | None,
    softcap: float | None,
) -> AttentionCall:
    attention_ref._check_single_row(q)
    check_attention_shapes(q, k, v)
    bounds = _self_bounds(cu_seqlens, q.shape[2])
    return AttentionCall.of(
        q, k, v, mask=AttentionMask(True, window), softcap=softcap, bounds_q=bounds, bounds_k=bounds
    )


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
    """`attention_ref.segment_causal_attention_fwd`, on the chosen backend."""
    return _fwd(q, k, v, scale, _segment_call(q, k, v, cu_seqlens, window, softcap))


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
    """`attention_ref.segment_causal_attention_bwd`, on the chosen backend."""
    return _bwd(grad_out, q, k, v, out, lse, scale, _segment_call(q, k, v, cu_seqlens, window, softcap))


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
    """`attention_ref.block_attention_fwd`, on the chosen backend."""
    call = _block_call(q, k, v, AttentionMask(causal, window, offset), softcap, same_length=False)
    return _fwd(q, k, v, scale, call)


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
    """`attention_ref.block_attention_bwd`, on the chosen backend."""
    call = _block_call(q, k, v, AttentionMask(causal, window, offset), softcap, same_length=False)
    return _bwd(grad_out, q, k, v, out, lse, scale, call)


# --- loss -----------------------------------------------------------------------------------------

_LossKernel = Callable[..., tuple[Tensor, Tensor, Tensor, Tensor | None]]


def _loss_kernel(device: torch.device, reference: _LossKernel, triton_name: str) -> _LossKernel:
    """The torch `reference`, or its drop-in `triton_name` from `cross_entropy_triton` when Triton is chosen."""
    triton_ = _pick(device, "cross_entropy_triton")
    return reference if triton_ is None else getattr(triton_, triton_name)


VOCAB_SLICES_MAX_TOKENS = 1024
"""Up to this many tokens the vocabulary slices can pay (measured on an H200 at V = 128K, H = 4096, against token
chunks that still accumulated grad_weight in fp32); above it they are slower (`benchmarks/gpu.py`)."""


def use_vocab_slices(n_tokens: int, vocab: int, chunk: int) -> bool:
    """Whether the fused loss of `n_tokens` tokens over `vocab` rows runs as vocabulary slices rather than token
    chunks of `chunk` tokens. One chunk of all the tokens writes grad_weight once with three matmuls, which nothing
    beats; when the workspace cap splits them, every further chunk reads and writes grad_weight [V, H] again,
    while the slices write each row of it once for one matmul more (four instead of three). So: slices for a
    short micro-batch (at most `VOCAB_SLICES_MAX_TOKENS` tokens, fewer than the vocabulary) that does not fit one
    chunk."""
    return chunk < n_tokens <= VOCAB_SLICES_MAX_TOKENS and n_tokens < vocab


def _token_chunk(
    hidden: Tensor, vocab: int, upcast: bool, softcap: float | None, max_workspace_bytes: int, triton: bool
) -> int:
    """Tokens per chunk of the token-chunk implementation, Triton or not: the Triton kernel holds only the logits,
    the reference its upcast copy and tanh's derivative too."""
    per_logit = hidden.dtype.itemsize if triton else cross_entropy_ref.logit_bytes(hidden.dtype, upcast, softcap)
    return cross_entropy_ref.chunk_rows(
        n_tokens=hidden.shape[0],
        vocab=vocab,
        hidden=hidden.shape[1],
        bytes_per_logit=per_logit,
        max_workspace_bytes=max_workspace_bytes,
        device=hidden.device,
    )


def linear_cross_entropy_token_chunks(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    ignore_index: int,
    reduction: str,
    upcast: bool,
    max_workspace_bytes: int,
    scale: float = 1.0,
    softcap: float | None = None,
    *,
    grad_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """`cross_entropy_ref.linear_cross_entropy_token_chunks`, on the chosen implementation."""
    impl = _loss_kernel(
        hidden.device, cross_entropy_ref.linear_cross_entropy_token_chunks, "linear_cross_entropy_token_chunks_triton"
    )
    options = (ignore_index, reduction, upcast, max_workspace_bytes, scale, softcap)
    return impl(hidden, weight, bias, target, *options, grad_dtype=grad_dtype)


def linear_cross_entropy_vocab_slices(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    ignore_index: int,
    reduction: str,
    upcast: bool,
    max_workspace_bytes: int,
    scale: float = 1.0,
    softcap: float | None = None,
    *,
    grad_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """`cross_entropy_ref.linear_cross_entropy_vocab_slices`, on the chosen implementation."""
    impl = _loss_kernel(
        hidden.device, cross_entropy_ref.linear_cross_entropy_vocab_slices, "linear_cross_entropy_vocab_slices_triton"
    )
    options = (ignore_index, reduction, upcast, max_workspace_bytes, scale, softcap)
    return impl(hidden, weight, bias, target, *options, grad_dtype=grad_dtype)


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    ignore_index: int,
    reduction: str,
    upcast: bool,
    max_workspace_bytes: int,
    scale: float = 1.0,
    softcap: float | None = None,
    *,
    grad_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The fused loss (`cross_entropy_ref.linear_cross_entropy_token_chunks`'s arguments and returns) as token
    chunks or vocabulary slices, as `use_vocab_slices` picks, on the chosen implementation."""
    vocab = weight.shape[0]
    triton_ = _pick(hidden.device, "cross_entropy_triton")
    chunk = _token_chunk(hidden, vocab, upcast, softcap, max_workspace_bytes, triton=triton_ is not None)
    slices = use_vocab_slices(hidden.shape[0], vocab, chunk)
    name = "linear_cross_entropy_vocab_slices" if slices else "linear_cross_entropy_token_chunks"
    impl: _LossKernel = getattr(cross_entropy_ref, name) if triton_ is None else getattr(triton_, f"{name}_triton")
    options = (ignore_index, reduction, upcast, max_workspace_bytes, scale, softcap)
    return impl(hidden, weight, bias, target, *options, grad_dtype=grad_dtype)


vocab_parallel_linear_cross_entropy_chunked = cross_entropy_ref.vocab_parallel_linear_cross_entropy_chunked
"""The torch reference on every device, whatever `choose` says: no Triton kernel implements it."""

if not TYPE_CHECKING:  # mypy sees only the current names
    __getattr__ = lazy_getattr(
        __name__, {}, globals(), renamed={"linear_cross_entropy_chunked": f"{__name__}:linear_cross_entropy"}
    )
