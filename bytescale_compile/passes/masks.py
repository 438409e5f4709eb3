"""Prove an attention-mask subgraph equal to "causal within the segments where position_ids restart".

Hugging Face models (transformers 5) build exactly that boolean mask in the graph whenever
`position_ids` are passed without a padding mask — their packed-sequence support:

    seq  = cumsum(diff(P, prepend=P[:, :1] - 1, dim=-1) != 1, -1)        # segment id per token
    mask = ones & (seq[b, q] == seq[b, kv]) & (P[b, kv] <= P[b, q])      # [B, 1, T, T]

with `q = arange(T)[None, None, :, None]`, `kv = arange(T)[None, None, None, :]`. Only this structure
is accepted, node by node; a mask that merely evaluates alike on some inputs is not.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from .graph import arg, is_call

__all__ = ["segment_causal_positions"]

_AND = (operator.and_, torch.logical_and, torch.bitwise_and)
_FULL = slice(None, None, None)


def segment_causal_positions(mask: object) -> fx.Node | None:
    """The position_ids node P if `mask` is segment-causal over P's restarts, else None."""
    terms = _and_terms(_strip(mask, "expand", "to"))
    terms = [t for t in terms if not _is_all_true(t)]
    segment = [p for p in map(_segment_equality, terms) if p is not None]
    causal = [t for t in terms if _is_causal(t, segment[0] if segment else None)]
    if len(segment) != 1 or not causal or len(terms) != 1 + len(causal):
        return None
    return segment[0]


def _strip(node: object, *methods: str) -> object:
    """Look through the given methods; `.to` only while it keeps a boolean tensor (a device move)."""
    while is_call(node, methods=methods):
        val = node.meta.get("example_value")
        if node.target == "to" and (val is None or val.dtype != torch.bool):
            break
        node = node.args[0]
    return node


def _and_terms(node: object) -> list[object]:
    node = _strip(node, "to")
    if is_call(node, *_AND, methods=("__and__", "logical_and")):
        return [t for a in node.args[:2] for t in _and_terms(a)]
    return [node]


def _is_all_true(node: object) -> bool:
    return is_call(node, torch.ones, methods=("new_ones",)) and node.kwargs.get("dtype") == torch.bool


def _segment_equality(node: object) -> fx.Node | None:
    """`seq[b, q] == seq[b, kv]` with seq the segment ids of P: return P."""
    if not is_call(node, operator.eq, torch.eq, methods=("eq",)):
        return None
    lhs, rhs = node.args[:2]
    if not (_gather(lhs, "q") and _gather(rhs, "kv")) or lhs.args[0] is not rhs.args[0]:
        return None
    return _segment_ids_source(lhs.args[0])


def _segment_ids_source(seq: object) -> fx.Node | None:
    """`cumsum(diff(P, prepend=P[:, :1] - 1, dim=-1) != 1, -1)`: return P."""
    if not is_call(seq, torch.cumsum, methods=("cumsum",)) or arg(seq, 1, "dim") not in (-1, 1):
        return None
    ne = seq.args[0]
    if not is_call(ne, operator.ne, torch.ne, methods=("ne",)) or ne.args[1] != 1:
        return None
    diff = ne.args[0]
    if not is_call(diff, torch.diff, methods=("diff",)) or arg(diff, 2, "dim", -1) not in (-1, 1):
        return None
    positions, prepend = diff.args[0], arg(diff, 3, "prepend")
    first = prepend.args[0] if is_call(prepend, operator.sub, torch.sub) and prepend.args[1] == 1 else None
    if not (is_call(first, operator.getitem) and first.args[0] is positions and first.args[1] == (_FULL, slice(None, 1, None))):
        return None
    return positions


def _is_causal(node: object, positions: fx.Node | None) -> bool:
    """`P[b, kv] <= P[b, q]` (or `kv <= q` on indices): no key after its query."""
    if is_call(node, operator.ge, torch.ge, methods=("ge",)):
        rhs, lhs = node.args[:2]
    elif is_call(node, operator.le, torch.le, methods=("le",)):
        lhs, rhs = node.args[:2]
    else:
        return False
    lhs, rhs = _strip(lhs, "to"), _strip(rhs, "to")
    if _index(lhs, "kv") and _index(rhs, "q"):
        return True
    if not (_gather(lhs, "kv") and _gather(rhs, "q")) or lhs.args[0] is not rhs.args[0]:
        return False
    source = _strip(lhs.args[0], "expand")
    return positions is not None and source is positions


def _gather(node: object, which: str) -> bool:
    """`x[batch_index, q_index]` or `x[batch_index, kv_index]`."""
    if not is_call(node, operator.getitem) or not isinstance(node.args[1], tuple) or len(node.args[1]) != 2:
        return False
    batch, index = node.args[1]
    return _broadcast_arange(batch, axis=0) and _index(index, which)


def _index(node: object, which: str) -> bool:
    return _broadcast_arange(node, axis=2 if which == "q" else 3)


def _broadcast_arange(node: object, axis: int) -> bool:
    """`arange(n)[...]` (plus 0) placed on `axis` of a 4-D broadcast: (:, None, None, None) and the like."""
    if not is_call(node, operator.getitem):
        return False
    index = node.args[1]
    expected = tuple(_FULL if i == axis else None for i in range(4))
    if index != expected:
        return False
    base = node.args[0]
    if is_call(base, operator.add, torch.add) and base.args[1] == 0:
        base = base.args[0]
    return is_call(base, torch.arange) and len(base.args) == 1 and "start" not in base.kwargs
