"""Prove an attention-mask subgraph equal to (sliding-window) causal attention, optionally within packed segments.

Hugging Face models (transformers 5) build the mask in the graph as an AND of per-(query, key) conditions:

    seq  = cumsum(diff(P, prepend=P[:, :1] - 1, dim=-1) != 1, -1)      # segment id per token
    mask = ones & (seq[b, q] == seq[b, kv])                             # same packed sequence
                & (P[b, kv] <= P[b, q])                                 # causal
                & (P[b, kv] > P[b, q] - w)                              # sliding window of w (Mistral, Gemma...)

with `q = arange(T)[None, None, :, None]`, `kv = arange(T)[None, None, None, :]`. Without `position_ids` the
conditions compare the index aranges themselves (no segment term). Eager-attention models add the mask as
`where(mask, 0, min_dtype)`. Only these structures are accepted, node by node; a mask that merely evaluates
alike on some inputs is not, and the reason names the condition that could not be proved.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TypeGuard

import torch
from torch import fx

from .graph import NotEquivalent, arg, is_call

__all__ = ["CausalMask", "prove_causal_mask", "strip_additive_mask"]

_AND = (operator.and_, torch.logical_and, torch.bitwise_and)
_FULL = slice(None, None, None)


@dataclass(frozen=True)
class CausalMask:
    """What a proved mask computes: causal attention, within the segments of `positions` if given."""

    positions: fx.Node | None
    """The position_ids node whose restarts delimit packed sequences; None for one sequence per row."""
    window: int | None
    """Sliding window w (a query sees itself and the w - 1 keys before it); None for full causal."""


def prove_causal_mask(mask: object) -> CausalMask:
    """The causal structure `mask` (a boolean [B, 1, T, T] node) provably has; raise NotEquivalent why not."""
    name = getattr(mask, "name", mask)
    terms = [t for t in _and_terms(_strip(mask, "expand", "to")) if not _is_all_true(t)]
    segments = [p for p in map(_segment_equality, terms) if p is not None]
    if len(segments) > 1:
        raise NotEquivalent(f"attn_mask `{name}` compares two packed-sequence segmentations")
    positions = segments[0] if segments else None
    causal, windows, unknown = [], [], []
    for term in terms:
        if _segment_equality(term) is not None:
            continue
        if _is_causal(term, positions):
            causal.append(term)
        elif (w := _window(term, positions)) is not None:
            windows.append(w)
        else:
            unknown.append(term)
    if unknown:
        raise NotEquivalent(
            f"attn_mask `{name}`: condition {_describe(unknown[0], positions)} is not a packed-segment, "
            f"causal or sliding-window condition"
        )
    if not causal:
        raise NotEquivalent(f"attn_mask `{name}` has no causal condition (bidirectional attention)")
    if len(windows) > 1:
        raise NotEquivalent(f"attn_mask `{name}` has several sliding windows {windows}")
    return CausalMask(positions, windows[0] if windows else None)


def strip_additive_mask(mask: object) -> object:
    """The boolean mask behind an additive `where(mask, 0, min)` (HF eager attention), else raise why not."""
    if not is_call(mask, torch.where):
        raise NotEquivalent(
            f"additive mask `{getattr(mask, 'name', mask)}` is not where(bool_mask, 0, -inf or dtype min)"
        )
    cond, keep, drop = mask.args[:3]
    if not (is_call(keep, torch.zeros) or keep == 0) or not isinstance(drop, float) or drop > -1e30:
        raise NotEquivalent(
            f"additive mask `{mask.name}` adds {keep}/{drop}, not 0 where visible and -inf (or dtype min) elsewhere"
        )
    return cond


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
    """`ones(dtype=bool)`, or a padding term `ones(B, T).to(bool)[b, kv]` built in the graph (BioGPT without a mask)."""
    if is_call(node, torch.ones, methods=("new_ones",)) and node.kwargs.get("dtype") == torch.bool:
        return True
    if not _gather(node, "kv"):
        return False
    source = node.args[0]
    cast = is_call(source, methods=("bool",)) or (
        is_call(source, methods=("to",)) and torch.bool in (*source.args[1:], *source.kwargs.values())
    )
    base = source.args[0] if cast else source
    return is_call(base, torch.ones, methods=("new_ones",)) and (cast or base.kwargs.get("dtype") == torch.bool)


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
    if not (
        isinstance(positions, fx.Node)
        and is_call(first, operator.getitem)
        and first.args[0] is positions
        and first.args[1] == (_FULL, slice(None, 1, None))
    ):
        return None
    return positions


def _comparison(node: object, *, strict: bool) -> tuple[object, object] | None:
    """(smaller, larger) operands of `a <= b` / `b >= a` (or `<` / `>` when strict), else None."""
    le, ge = (
        ((operator.lt, torch.lt, "lt"), (operator.gt, torch.gt, "gt"))
        if strict
        else ((operator.le, torch.le, "le"), (operator.ge, torch.ge, "ge"))
    )
    if is_call(node, *le[:2], methods=(le[2],)):
        lhs, rhs = node.args[:2]
    elif is_call(node, *ge[:2], methods=(ge[2],)):
        rhs, lhs = node.args[:2]
    else:
        return None
    return _strip(lhs, "to"), _strip(rhs, "to")


def _positions(key: object, query: object, positions: fx.Node | None) -> bool:
    """A key and a query position: both bare indices, or both `P[b, kv]`, `P[b, q]` of the segmented P.

    Within a segment positions are consecutive, so comparing indices there is comparing positions.
    """
    if _index(key, "kv") and _index(query, "q"):
        return True
    return (
        positions is not None
        and _gather(key, "kv")
        and _gather(query, "q")
        and all(_strip(x.args[0], "expand") is positions for x in (key, query))
    )


def _is_causal(node: object, positions: fx.Node | None) -> bool:
    """`P[b, kv] <= P[b, q]` (or `kv <= q` on indices): no key after its query."""
    pair = _comparison(node, strict=False)
    return pair is not None and _positions(*pair, positions)


def _window(node: object, positions: fx.Node | None) -> int | None:
    """w of `P[b, kv] > P[b, q] - w` (HF's sliding window: `kv_idx > q_idx - sliding_window`), else None."""
    pair = _comparison(node, strict=True)
    if pair is None:
        return None
    lower, key = pair
    if not is_call(lower, operator.sub, torch.sub):
        return None
    query, w = lower.args[:2]
    if not (_positions(key, _strip(query, "to"), positions) and isinstance(w, int) and w >= 1):
        return None
    return w


def _describe(term: object, positions: fx.Node | None) -> str:
    """Name a condition the proof does not accept, as specifically as its shape allows."""
    name = f"`{getattr(term, 'name', term)}`"
    if _gather(term, "kv"):
        return f"{name} (a padding mask: keys switched off per row by `{getattr(term.args[0], 'name', term.args[0])}`)"
    pair = _comparison(term, strict=False) or _comparison(term, strict=True)
    if is_call(term, operator.eq, torch.eq, methods=("eq",)):
        lhs, rhs = term.args[:2]  # two operands: `_segment_equality` unpacked this term already
        pair = _strip(lhs, "to"), _strip(rhs, "to")
    if pair is not None and any(
        is_call(x, operator.floordiv, torch.floor_divide, methods=("__floordiv__",)) for x in pair
    ):
        return f"{name} (chunked attention: positions compared after integer division)"
    if is_call(term, operator.eq, torch.eq, methods=("eq",)):
        return f"{name} (an equality that is not HF's packed-sequence segment test)"
    if (
        (loose := _comparison(term, strict=False)) is not None
        and positions is None
        and any(_gather(x, w) for x, w in zip(loose, ("kv", "q")))
    ):
        return f"{name} (causal on positions without packed-sequence segments)"
    return name


def _gather(node: object, which: str) -> TypeGuard[fx.Node]:
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
