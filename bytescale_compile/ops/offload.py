"""`bytescale::offload_saved` and `bytescale::reload_saved`: the offload pass's graph ops, opaque to Inductor.

    forward:   h0, h1 = offload_saved(layer, token_dim, keep, [x, x_view])      # after the last use of x
    backward:  s = reload_saved(layer, [h0, h1], device)                          # before the first use
               x, x_view = as_strided(s, h0's layout), as_strided(s, h1's layout)

The handles are meta tensors: each has its member's size, stride and storage offset (so the graph
keeps every symbolic shape) and no data. What the backward needs is filed under the first handle's
(meta) storage, which the autograd graph keeps alive from the forward to the backward: under an
act_ctx the `SavedKey` of the storage (`runtime/offload.py` holds the data, on the host or the device
by r), without one the storage itself. Entries whose handle died unused (a forward without its
backward) are dropped at the next offload. `reload_saved` returns the storage, flat, as far as the
members reach, and the members become views of it in the graph, where Inductor sees the aliasing;
an op's outputs may not alias one another.

Declared: neither op mutates an input and no output aliases one. Both are opaque (fallback) kernels
for Inductor; `offload_saved` asks for the members' exact strides (`needs_exact_strides`), though
Inductor may still re-lay out a non-contiguous one, so under Inductor the pass offloads contiguous
storages only, and members that no longer view one storage raise `OffloadError`. As the handles are
meta tensors, the dispatcher runs `reload_saved` under its Meta kernel, the fake kernel, which does the
real reload unless its handles are fake tensors.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch.multiprocessing.reductions import StorageWeakRef

from bytescale_compile.runtime.context import ContextError
from bytescale_compile.runtime.offload import SavedKey, current_act_ctx, token_major_storage

__all__ = ["OffloadError", "offload_saved", "reload_saved"]


class OffloadError(RuntimeError):
    """A compiled graph handed `offload_saved` members that do not view one storage."""


_held: dict[StorageWeakRef, SavedKey | Tensor] = {}
"""Per first handle's storage: the `SavedKey` (under an act_ctx) or the storage itself (without one)."""


def _span(t: Tensor) -> int | torch.SymInt:
    """Elements of the storage `t` reaches into: offset + last element + 1 (the storage may be longer)."""
    return t.storage_offset() + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1


def _meta_like(t: Tensor) -> Tensor:
    """A meta tensor with `t`'s dtype and layout, over its own storage of the span `t` reaches."""
    return torch.empty(_span(t), dtype=t.dtype, device="meta").as_strided(t.shape, t.stride(), t.storage_offset())


def _storage_span(handles: list[Tensor]) -> int | torch.SymInt:
    """The prefix of the saved storage every member reaches into: what `reload_saved` returns."""
    return functools.reduce(torch.sym_max, [_span(h) for h in handles])


@torch.library.custom_op("bytescale::offload_saved", mutates_args=(), tags=(torch.Tag.needs_exact_strides,))
def offload_saved(layer: int, token_dim: int, keep: bool, members: list[Tensor]) -> list[Tensor]:
    """Hand one saved storage (viewed by `members`) to the act_ctx; one data-less handle per member.

    `layer` orders the reloads (-1: outside the transformer layers), `token_dim` is the token dimension
    of the first member, `keep` leaves the storage resident whatever the ratio (counted all the same).
    """
    storage = members[0].untyped_storage().data_ptr()
    if any(m.untyped_storage().data_ptr() != storage for m in members):
        raise OffloadError(
            f"bytescale::offload_saved (layer {layer}): its {len(members)} members must view one "
            "storage, but the compiled graph passed copies; use CompileConfig(offload='off') for this model"
        )
    ctx = current_act_ctx()
    held = ctx.offload(layer, token_dim, keep, members[0]) if ctx else token_major_storage(members[0], token_dim)[0]
    handles = [_meta_like(m) for m in members]
    for dead in [ref for ref in _held if ref.expired()]:
        del _held[dead]
    _held[StorageWeakRef(handles[0].untyped_storage())] = held
    return handles


@offload_saved.register_fake
def _offload_saved_fake(layer: int, token_dim: int, keep: bool, members: list[Tensor]) -> list[Tensor]:
    return [_meta_like(m) for m in members]


def _reload_saved(layer: int, handles: list[Tensor], device: torch.device) -> Tensor:
    """The storage behind `handles` again, flat: from the act_ctx of the forward, or as the forward left it."""
    ref = StorageWeakRef(handles[0].untyped_storage())
    held = _held.get(ref)
    if held is None:
        raise ContextError(
            f"the saved activations of layer {layer} are gone: they were reloaded already (a backward "
            "through the same forward can run only once with offloading: retain_graph is not supported)"
        )
    if isinstance(held, Tensor):
        return held[: _storage_span(handles)]
    ctx = current_act_ctx()
    if ctx is None:
        raise ContextError(
            f"the backward needs the saved activations of layer {layer}, which the forward left in an act_ctx "
            f"(micro-batch {held.micro_batch_id}); run the backward inside `with act_ctx:` after "
            f"act_ctx.update_micro_batch_id({held.micro_batch_id})"
        )
    full = ctx.reload(layer, held)
    del _held[ref]
    return full[: _storage_span(handles)]


reload_saved = torch.library.custom_op("bytescale::reload_saved", _reload_saved, mutates_args=())


@reload_saved.register_fake
def _reload_saved_meta(layer: int, handles: list[Tensor], device: torch.device) -> Tensor:
    """Fake tensors get an empty result; real meta handles (the dispatcher sends them here, to the Meta
    kernel, which torch before 2.13 does not let a second registration override) the real reload."""
    if is_fake(handles[0]):
        return torch.empty(_storage_span(handles), dtype=handles[0].dtype, device=device)
    return _reload_saved(layer, handles, device)
