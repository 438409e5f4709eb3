"""Attention pass: causal attention becomes `bytescale::attention`.

Matched on the Dynamo graph (pre-autograd), two shapes of the same computation:

    scaled_dot_product_attention(q, k, v, is_causal=True[, scale=s][, enable_gqa=True])
    softmax(masked_fill(q @ k.transpose(-2, -1) * s, triu(ones(T, T), 1), -inf), -1) @ v

both become `getitem(bytescale.attention(q, k, v, s, None), 0)`. A third shape, SDPA with the mask
Hugging Face builds from `position_ids` (causal within each packed sequence, see `masks.py`), becomes
`bytescale.attention(q, k, v, s, position_ids)`: the op finds the same segments from the restarts.
K/V expanded by the repeat-kv pattern are
unwrapped so only the `Hkv` heads reach the op (and travel in the ring). Whatever cannot be proved
equivalent — an attention mask tensor, dropout, non-causal, a KV cache — is left alone and reported.
"""

from __future__ import annotations

import logging
import math
import operator

import torch
import torch.nn.functional as F
from torch import fx

from .. import ops  # noqa: F401  (registers torch.ops.bytescale)
from .graph import NotEquivalent, arg, is_call, replace_with_op, same_size, source_module, value
from .manager import PassContext
from .masks import segment_causal_positions
from .report import PassResult, Rewrite, Skipped

__all__ = ["rewrite_attention"]

log = logging.getLogger(__name__)

NAME = "attention"
_SDPA = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)
_MATMUL = (operator.matmul, torch.matmul, torch.bmm)
_SOFTMAX = (F.softmax, torch.softmax)



def rewrite_attention(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    result = PassResult(NAME)
    for node in list(gm.graph.nodes):
        if is_call(node, *_SDPA):
            match = _match_sdpa
        elif _looks_like_explicit_attention(node):
            match = _match_explicit
        else:
            continue
        source = source_module(node)
        try:
            q, k, v, scale, positions, detail = match(node)
        except NotEquivalent as why:
            result.skipped.append(Skipped(node.name, _target_name(node), source, str(why)))
            continue
        except Exception as error:  # a shape the matcher did not foresee: leave it alone, say so
            log.warning("attention pass: cannot analyse %s (%s): %r", node.name, source, error)
            result.skipped.append(Skipped(node.name, _target_name(node), source, f"matcher could not analyse it: {error!r}"))
            continue
        new = replace_with_op(gm.graph, node, torch.ops.bytescale.attention.default, (q, k, v, scale, positions))
        result.rewrites.append(Rewrite(node.name, "bytescale.attention", source, detail or new.name))
    return result


_Match = tuple[fx.Node, fx.Node, fx.Node, float, "fx.Node | None", str]


def _match_sdpa(node: fx.Node) -> _Match:
    q, k, v = arg(node, 0, "query"), arg(node, 1, "key"), arg(node, 2, "value")
    dropout = arg(node, 4, "dropout_p", 0.0)
    if not isinstance(dropout, (int, float)) or dropout != 0.0:
        raise NotEquivalent(f"dropout_p={dropout}: dropout is not supported")
    positions = _segment_positions(arg(node, 3, "attn_mask"), q)
    if positions is None and arg(node, 5, "is_causal", False) is not True:
        raise NotEquivalent("is_causal=False: only causal attention is rewritten")
    scale = _resolve_scale(arg(node, 6, "scale"), q)
    k, v, detail = _check_heads(q, k, v, gqa=bool(arg(node, 7, "enable_gqa", False)))
    if positions is not None:
        detail = ", ".join(filter(None, ["segments from position_ids restarts", detail]))
    return q, k, v, scale, positions, detail


def _segment_positions(mask: object, q: fx.Node) -> fx.Node | None:
    """None without a mask; the position_ids node for a provably segment-causal mask; else raise."""
    if mask is None:
        return None
    mask_val, q_val = value(mask), value(q)
    if mask_val is None or mask_val.dtype != torch.bool:
        raise NotEquivalent(f"attn_mask `{getattr(mask, 'name', mask)}` is not a boolean mask")
    positions = segment_causal_positions(mask)
    if positions is None or mask_val.dim() != 4 or not all(
        same_size(m, q_val.shape[2]) for m in mask_val.shape[-2:]
    ):
        raise NotEquivalent(f"attn_mask `{getattr(mask, 'name', mask)}` is not provably causal")
    return positions


def _looks_like_explicit_attention(node: fx.Node) -> bool:
    """`probs @ v` where probs come (through casts) from a softmax: the tail of explicit attention."""
    if not is_call(node, *_MATMUL, methods=("matmul",)):
        return False
    return _strip_casts_and_dropout(node.args[0], check=False) is not None


def _match_explicit(node: fx.Node) -> _Match:
    probs, v = node.args[:2]
    softmax = _strip_casts_and_dropout(probs, check=True)
    _single_use(softmax, "softmax output")
    if arg(softmax, 1, "dim") not in (-1, 3):
        raise NotEquivalent(f"softmax over dim {arg(softmax, 1, 'dim')}, not the key dimension")
    masked = softmax.args[0]
    _single_use(masked, "masked scores")
    scores = _unmask_causal(masked)
    _single_use(scores, "scores")
    q, k, scale = _unscale_scores(scores)
    k, v, detail = _check_heads(q, k, v, gqa=False)
    return q, k, v, scale, None, detail


def _strip_casts_and_dropout(node: fx.Node, check: bool) -> fx.Node | None:
    """Walk back from the probabilities to the softmax through dtype casts and no-op dropout."""
    while isinstance(node, fx.Node):
        if is_call(node, *_SOFTMAX, methods=("softmax",)):
            return node
        if is_call(node, methods=("to", "type_as", "float", "half", "bfloat16")):
            node = node.args[0]
        elif is_call(node, F.dropout, methods=()):
            p, training = arg(node, 1, "p", 0.5), arg(node, 2, "training", True)
            if check and training and p != 0.0:
                raise NotEquivalent(f"dropout p={p} on the attention probabilities while training")
            node = node.args[0]
        else:
            return None
    return None


def _single_use(node: fx.Node, what: str) -> None:
    if len(node.users) != 1:
        raise NotEquivalent(f"the {what} `{node.name}` is used elsewhere too, so it must stay materialised")


def _unmask_causal(masked: fx.Node) -> fx.Node:
    """Return the unmasked scores if `masked` applies a provably causal mask, else raise why not."""
    if is_call(masked, torch.masked_fill, methods=("masked_fill",)):
        scores, mask, fill = masked.args[0], arg(masked, 1, "mask"), arg(masked, 2, "value")
        if fill != -math.inf:
            raise NotEquivalent(f"masked_fill with {fill}, not -inf")
        if not _is_strict_upper_triangle(mask, value(scores)):
            raise NotEquivalent(f"mask `{getattr(mask, 'name', mask)}` is not built in the graph as triu(ones(T, T), 1)")
        return scores
    if is_call(masked, operator.add, torch.add):
        scores, mask = masked.args[:2]
        if not _is_additive_causal(mask, value(scores)):
            raise NotEquivalent(f"additive mask `{getattr(mask, 'name', mask)}` is not triu(full((T, T), -inf), 1)")
        return scores
    raise NotEquivalent("softmax input is not masked causally (no masked_fill/add of a triangular mask)")


def _is_strict_upper_triangle(mask: object, scores_val: torch.Tensor) -> bool:
    """`triu(ones(T, T[, dtype=bool]), diagonal=1)`, optionally cast to bool."""
    while is_call(mask, methods=("bool", "to")):
        mask = mask.args[0]
    return _is_triu_of(mask, scores_val, is_call_to=(torch.ones,), fill=None)


def _is_additive_causal(mask: object, scores_val: torch.Tensor) -> bool:
    return _is_triu_of(mask, scores_val, is_call_to=(torch.full,), fill=-math.inf)


def _is_triu_of(mask: object, scores_val: torch.Tensor, is_call_to: tuple, fill: float | None) -> bool:
    if not is_call(mask, torch.triu, methods=("triu",)) or arg(mask, 1, "diagonal", 0) != 1:
        return False
    base = mask.args[0]
    if not is_call(base, *is_call_to):
        return False
    if fill is not None and arg(base, 1, "fill_value") != fill:
        return False
    base_val = value(base)
    return base_val is not None and base_val.dim() == 2 and all(
        same_size(a, b) for a, b in zip(base_val.shape, scores_val.shape[-2:])
    )


def _unscale_scores(scores: fx.Node) -> tuple[fx.Node, fx.Node, float]:
    """`q @ k.transpose(-2, -1)` times or divided by a constant: return q, k and the scale."""
    scale = 1.0
    if is_call(scores, operator.mul, operator.truediv, torch.mul, torch.div):
        a, b = scores.args[:2]
        if isinstance(b, (int, float)) and isinstance(a, fx.Node):
            scale = float(b) if scores.target in (operator.mul, torch.mul) else 1.0 / float(b)
            scores = a
        else:
            raise NotEquivalent("scores are scaled by a tensor, not a constant")
    if not is_call(scores, *_MATMUL, methods=("matmul",)):
        raise NotEquivalent("scores are not q @ k^T")
    q, kt = scores.args[:2]
    if not is_call(kt, torch.transpose, methods=("transpose",)) or {d % 4 for d in kt.args[1:3]} != {2, 3}:
        raise NotEquivalent("scores are not q @ k.transpose(-2, -1)")
    return q, kt.args[0], scale


def _resolve_scale(scale: object, q: fx.Node) -> float:
    if scale is None:
        return 1.0 / math.sqrt(value(q).shape[-1])
    if not isinstance(scale, (int, float)):
        raise NotEquivalent("scale is not a constant")
    return float(scale)


def _check_heads(q: fx.Node, k: fx.Node, v: fx.Node, gqa: bool) -> tuple[fx.Node, fx.Node, str]:
    """Check self-attention shapes; unwrap repeat-kv so the op sees the `Hkv` heads."""
    qv, kv, vv = value(q), value(k), value(v)
    if qv is None or kv is None or vv is None or qv.dim() != 4 or kv.dim() != 4:
        raise NotEquivalent("query/key are not 4-D [B, H, T, D] tensors")
    if vv.shape != kv.shape or not same_size(qv.shape[3], kv.shape[3]):
        raise NotEquivalent(f"value shape {tuple(vv.shape)} differs from key shape {tuple(kv.shape)} (or query head dim)")
    if not same_size(qv.shape[2], kv.shape[2]):
        raise NotEquivalent("query and key lengths differ (KV cache or cross-attention): not causal self-attention")
    k_inner, v_inner = _unrepeat_kv(k), _unrepeat_kv(v)
    if k_inner is not None and v_inner is not None:
        return k_inner, v_inner, f"repeat-kv unwrapped: {value(k_inner).shape[1]} kv heads"
    heads_q, heads_kv = qv.shape[1], kv.shape[1]
    if heads_q != heads_kv and not gqa:
        raise NotEquivalent(f"{heads_q} query heads vs {heads_kv} key heads without enable_gqa")
    return k, v, f"GQA {heads_q}/{heads_kv} heads" if heads_q != heads_kv else ""


def _unrepeat_kv(node: fx.Node) -> fx.Node | None:
    """The un-expanded K/V if `node` is `repeat_interleave(x, n, dim=1)` or HF's expand+reshape repeat_kv."""
    if is_call(node, torch.repeat_interleave, methods=("repeat_interleave",)) and arg(node, 2, "dim") == 1:
        return node.args[0]
    if is_call(node, methods=("reshape",)) and is_call(node.args[0], methods=("expand",)):
        indexed = node.args[0].args[0]
        if is_call(indexed, operator.getitem) and _inserts_dim_2(indexed.args[1]):
            return indexed.args[0]
    return None


def _inserts_dim_2(index: object) -> bool:
    """`x[:, :, None, :, :]`: the new axis repeat_kv expands over."""
    full = slice(None, None, None)
    return isinstance(index, tuple) and len(index) >= 3 and index[:3] == (full, full, None) and all(
        i == full for i in index[3:]
    )


def _target_name(node: fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
