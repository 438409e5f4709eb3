"""Attention pass: causal attention becomes `bytescale::attention`.

Attention is found by what it computes — an SDPA call, or a softmax whose probabilities multiply the
values (`probs @ v`) — and every site found is either rewritten or reported with the reason, named after
what the model does (sliding window, soft-cap, sinks, ALiBi, a mask that is not causal...). Matched on the
Dynamo graph (pre-autograd):

    scaled_dot_product_attention(q, k, v, is_causal=True | attn_mask=M[, scale=s][, enable_gqa=True])
    softmax(mask(softcap(q @ k.transpose(-2, -1) * s)), -1) @ v

become `getitem(bytescale.attention(q, k, v, s[, position_ids, window, softcap]), 0)`. The mask is a
causal triangle built in the graph, or Hugging Face's mask proved node by node (`masks.py`): causal, within
the packed sequences where `position_ids` restart, optionally with a sliding window w; `softcap` is Gemma2's
`tanh(s / c) * c`. K/V expanded by the repeat-kv pattern are unwrapped so only the `Hkv` heads reach the op
(and travel in the ring); V's head dim may differ from Q/K's (DeepSeek-V3).
"""

from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass
from typing import TypeGuard, cast

import torch
import torch.nn.functional as F
from torch import fx
from torch.fx.node import Argument

from .. import ops  # noqa: F401  (registers torch.ops.bytescale)
from .graph import (
    ATTENTION_SITE,
    NotEquivalent,
    arg,
    input_node,
    is_call,
    replace_with_op,
    same_size,
    source_module,
    value,
)
from .manager import PassContext
from .masks import CausalMask, prove_causal_mask, strip_additive_mask
from .regions import Region, find_regions
from .report import PassResult, Rewrite, Skipped

__all__ = ["rewrite_attention", "is_attention"]

log = logging.getLogger(__name__)

NAME = "attention"
_SDPA = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)
_MATMUL = (operator.matmul, torch.matmul, torch.bmm)
_SOFTMAX = (F.softmax, torch.softmax)
_CASTS = ("to", "type_as", "float", "half", "bfloat16")
_RESHAPES = ("view", "reshape", "contiguous", "expand")


def rewrite_attention(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Rewrite the graph's attention, then that of each shared layer body (once; reported for every layer)."""
    result = PassResult(NAME)
    _rewrite_graph(gm.graph, result, None)
    for region in find_regions(gm):
        _rewrite_graph(region.body.graph, result, region)
    return result


def is_attention(node: fx.Node) -> bool:
    """Whether `node` is an attention site the pass matches: an SDPA call, or `softmax(...) @ v`."""
    return is_call(node, *_SDPA) or _softmax_behind(node) is not None


def _rewrite_graph(graph: fx.Graph, result: PassResult, region: Region | None) -> None:
    scope = _Scope(region)
    for node in list(graph.nodes):
        if not is_attention(node):
            continue
        match = _match_sdpa if is_call(node, *_SDPA) else _match_explicit
        source = source_module(node)
        try:
            found = match(node, scope)
        except NotEquivalent as why:
            node.meta[ATTENTION_SITE] = True
            result.skipped += [Skipped(node.name, _target_name(node), s, str(why)) for s in scope.sources(source)]
            continue
        except Exception as error:  # a shape the matcher did not foresee: leave it alone, say so
            log.warning("attention pass: cannot analyse %s (%s): %r", node.name, source, error)
            node.meta[ATTENTION_SITE] = True
            result.skipped += [
                Skipped(node.name, _target_name(node), s, f"matcher could not analyse it: {error!r}")
                for s in scope.sources(source)
            ]
            continue
        new = replace_with_op(graph, node, torch.ops.bytescale.attention.default, scope.inside(found.op_args()))
        result.rewrites += [
            Rewrite(node.name, "bytescale.attention", s, found.describe() or new.name) for s in scope.sources(source)
        ]
    scope.drop_resolved()


class _Scope:
    """Where a match happens: the outer graph, or a layer body whose mask comes from outside."""

    def __init__(self, region: Region | None) -> None:
        self.region = region
        self.resolved: set[fx.Node] = set()

    def outer(self, node: object) -> object:
        """A body placeholder as the outer node every layer passes for it (the mask); anything else unchanged."""
        if self.region is None or not isinstance(node, fx.Node) or node.op != "placeholder":
            return node
        self.resolved.add(node)
        return self.region.outer_argument(node)

    def inside(self, args: tuple) -> tuple:
        """The op's arguments with outer nodes (position_ids of a proved mask) threaded into the body."""
        if self.region is None:
            return args
        graph = self.region.body.graph
        return tuple(self.region.input_for(a) if isinstance(a, fx.Node) and a.graph is not graph else a for a in args)

    def sources(self, source: str) -> list[str]:
        """The module path of a site, once per layer that runs it."""
        if self.region is None:
            return [source]
        return self.region.sources(source)

    def drop_resolved(self) -> None:
        if self.region is not None:
            self.region.drop_unused(self.resolved)


@dataclass(frozen=True)
class _Match:
    """A proved attention: the op's arguments and what the report says about it."""

    q: fx.Node
    k: fx.Node
    v: fx.Node
    scale: float
    mask: CausalMask
    softcap: float | None
    heads: str

    def op_args(self) -> tuple:
        """`attention(q, k, v, scale, position_ids, window, softcap)` without trailing defaults."""
        args = [self.q, self.k, self.v, self.scale, self.mask.positions, self.mask.window, self.softcap]
        while args[-1] is None:
            args.pop()
        return tuple(args)

    def describe(self) -> str:
        return ", ".join(
            filter(
                None,
                [
                    "segments from position_ids restarts" if self.mask.positions is not None else "",
                    f"sliding window {self.mask.window}" if self.mask.window is not None else "",
                    f"soft-cap {self.softcap:g}" if self.softcap is not None else "",
                    self.heads,
                ],
            )
        )


def _match_sdpa(node: fx.Node, scope: _Scope) -> _Match:
    q, k, v = arg(node, 0, "query"), arg(node, 1, "key"), arg(node, 2, "value")
    dropout = arg(node, 4, "dropout_p", 0.0)
    if not isinstance(dropout, (int, float)) or dropout != 0.0:
        raise NotEquivalent(f"dropout_p={dropout}: dropout is not supported")
    mask = _sdpa_mask(scope.outer(arg(node, 3, "attn_mask")), q)
    if mask is None:
        if arg(node, 5, "is_causal", False) is not True:
            raise NotEquivalent("is_causal=False and no attn_mask: bidirectional attention is not causal")
        mask = CausalMask(None, None)
    scale = _resolve_scale(arg(node, 6, "scale"), q)
    k, v, heads = _check_heads(q, k, v, gqa=bool(arg(node, 7, "enable_gqa", False)))
    return _Match(q, k, v, scale, mask, None, heads)


def _sdpa_mask(mask: object, q: fx.Node) -> CausalMask | None:
    """None without a mask; what a provably causal mask computes; else raise why not."""
    if mask is None:
        return None
    mask_val, q_val = value(mask), value(q)
    name = getattr(mask, "name", mask)
    if mask_val is None:
        raise NotEquivalent(f"attn_mask `{name}` is not a tensor built in the graph")
    if mask_val.dim() != 4 or not all(same_size(m, q_val.shape[2]) for m in mask_val.shape[-2:]):
        raise NotEquivalent(f"attn_mask `{name}` has shape {tuple(mask_val.shape)}, not [B, 1, T, T]")
    if mask_val.dtype != torch.bool:
        mask = strip_additive_mask(mask)
    return prove_causal_mask(mask)


def _softmax_behind(node: fx.Node) -> fx.Node | None:
    """The softmax whose probabilities `node` multiplies with values (`probs @ v`), if it is one."""
    if not is_call(node, *_MATMUL, methods=("matmul", "bmm")):
        return None
    probs = arg(node, 0, "input")  # keyword-only calls (`torch.matmul(input=p, other=v)`) too
    while isinstance(probs, fx.Node):
        if is_call(probs, *_SOFTMAX, methods=("softmax",)):
            return probs
        if not (is_call(probs, F.dropout, operator.getitem, methods=_CASTS + _RESHAPES)):
            return None
        probs = arg(probs, 0, "input")
    return None


def _match_explicit(node: fx.Node, scope: _Scope) -> _Match:
    probs, v = cast("tuple[fx.Node, fx.Node]", node.args[:2])  # `probs @ v`: both tensors
    softmax = _softmax_behind(node)
    assert softmax is not None  # _rewrite_graph sends here only a matmul with a softmax behind it
    _name_known_variants(softmax)
    _check_probabilities(probs, softmax)
    _single_use(softmax, "softmax output")
    if arg(softmax, 1, "dim") not in (-1, 3):
        raise NotEquivalent(f"softmax over dim {arg(softmax, 1, 'dim')}, not the key dimension")
    if arg(softmax, 2, "dtype") not in (None, torch.float32):
        raise NotEquivalent(f"softmax in {arg(softmax, 2, 'dtype')}, not float32")
    masked = _strip_casts(input_node(softmax))
    masked, outer_scale = _unscale(masked)
    _single_use(masked, "masked scores")
    capped, mask = _unmask_causal(_strip_casts(masked), scope)
    _single_use(capped, "scores")
    scores, softcap = _unsoftcap(capped)
    q, k, scale = _unscale_scores(scores)
    k, v, heads = _check_heads(q, k, v, gqa=False)
    return _Match(q, k, v, scale * outer_scale, mask, softcap, heads)


def _strip_casts(node: fx.Node) -> fx.Node:
    while is_call(node, methods=_CASTS):
        _single_use(node, "masked scores")
        node = input_node(node)
    return node


def _unscale(node: fx.Node) -> tuple[fx.Node, float]:
    """`x * c` or `x / c` with a positive constant c (CodeGen scales after masking): x and the factor.

    A masked score (-inf, or the dtype's minimum) stays far below every visible one after the
    scaling, so its probability is still exactly 0.
    """
    if (
        is_call(node, operator.mul, torch.mul, operator.truediv, torch.div)
        and isinstance(node.args[1], (int, float))
        and node.args[1] > 0
        and _applies_mask(node.args[0])
    ):
        c = float(node.args[1])
        return node.args[0], c if is_call(node, operator.mul, torch.mul) else 1.0 / c
    return node, 1.0


def _applies_mask(node: object) -> TypeGuard[fx.Node]:
    """Whether `node` applies a mask (so a scale above it is the outer one, not the scores' own)."""
    return is_call(node, operator.add, torch.add, torch.masked_fill, torch.where, methods=("masked_fill",))


def _name_known_variants(softmax: fx.Node) -> None:
    """Raise with the variant's name when the scores are those of an attention the op does not compute."""
    node = softmax.args[0]
    while isinstance(node, fx.Node):
        if is_call(node, torch.cat):
            raise NotEquivalent(
                f"attention sinks: the softmax runs over the scores concatenated with extra logits "
                f"(`{node.name}`), which the op does not take"
            )
        if is_call(node, torch.baddbmm, methods=("baddbmm",)) and arg(node, 3, "beta", 1) != 0:
            raise NotEquivalent(
                f"ALiBi slopes: a position bias `{getattr(node.args[0], 'name', node.args[0])}` is "
                f"added to the scores (`{node.name}`, baddbmm), which the op does not take"
            )
        if is_call(node, operator.add, torch.add) and any(_is_head_bias(x) for x in node.args[:2]):
            bias = next(x for x in node.args[:2] if _is_head_bias(x))
            raise NotEquivalent(
                f"ALiBi slopes: a per-head position bias `{bias.name}` {tuple(value(bias).shape)} is "
                f"added to the scores (`{node.name}`), which the op does not take"
            )
        if not is_call(
            node,
            operator.add,
            torch.add,
            operator.sub,
            torch.sub,
            operator.mul,
            operator.truediv,
            torch.masked_fill,
            methods=_CASTS + _RESHAPES + ("masked_fill",),
        ):
            return
        node = node.args[0]


def _is_head_bias(node: object) -> bool:
    """A float tensor added to the scores that differs per head ([.., H > 1, 1 or T, T]): a position bias, not a mask."""
    val = value(node)
    return (
        isinstance(node, fx.Node)
        and isinstance(val, torch.Tensor)
        and val.is_floating_point()
        and val.dim() >= 3
        and val.shape[-3] != 1
        and val.shape[-2] == 1
    )


def _check_probabilities(probs: fx.Node, softmax: fx.Node) -> None:
    """Between softmax and `@ v` only dtype casts and no-op dropout may stand."""
    node = probs
    while node is not softmax:
        if is_call(node, F.dropout):
            p, training = arg(node, 1, "p", 0.5), arg(node, 2, "training", True)
            if training and p != 0.0:
                raise NotEquivalent(f"dropout p={p} on the attention probabilities while training")
        elif not is_call(node, methods=_CASTS):
            raise NotEquivalent(
                f"the probabilities pass through `{node.name}` ({_target_name(node)}) before the "
                f"value matmul: a layout the op does not take (e.g. 3-D bmm over B·H heads)"
            )
        _single_use(node, "attention probabilities")
        node = input_node(node)


def _single_use(node: fx.Node, what: str) -> None:
    if len(node.users) != 1:
        raise NotEquivalent(f"the {what} `{node.name}` is used elsewhere too, so it must stay materialised")


def _unmask_causal(masked: fx.Node, scope: _Scope) -> tuple[fx.Node, CausalMask]:
    """The unmasked scores and what the mask computes, if `masked` applies a provably causal mask; else raise."""
    if is_call(masked, torch.masked_fill, methods=("masked_fill",)):
        scores, mask, fill = input_node(masked), arg(masked, 1, "mask"), arg(masked, 2, "value")
        if not isinstance(fill, float) or fill > -1e30:
            raise NotEquivalent(f"masked_fill with {fill}, not -inf (or the dtype's minimum)")
        if not _is_strict_upper_triangle(mask, value(scores)):
            raise NotEquivalent(
                f"mask `{getattr(mask, 'name', mask)}` is not built in the graph as triu(ones(T, T), 1)"
            )
        return scores, CausalMask(None, None)
    if is_call(masked, operator.add, torch.add):
        scores, mask = input_node(masked), scope.outer(masked.args[1])
        _refuse_buffer_mask(scores)
        if _is_additive_causal(mask, value(scores)):
            return scores, CausalMask(None, None)
        return scores, prove_causal_mask(strip_additive_mask(mask))
    _refuse_buffer_mask(masked)
    raise NotEquivalent(
        "softmax input is not masked causally (no masked_fill/add of a causal mask): bidirectional attention"
    )


def _refuse_buffer_mask(scores: object) -> None:
    """`where(buffer[..., :T, :T], s, min)` (GPT-Neo, GPT-2-style `bias` buffers): a mask the pass cannot read."""
    if not is_call(scores, torch.where):
        return
    source = scores.args[0]
    while is_call(source, operator.getitem, methods=_CASTS + ("bool",)):
        source = source.args[0]
    name = getattr(source, "name", str(source))
    what = f"the model buffer `{name}`" if "buffers" in name else f"`{name}`"
    raise NotEquivalent(
        f"mask read from {what}: its values are not known when compiling (e.g. GPT-Neo's causal "
        f"or local sliding-window `bias`)"
    )


def _unsoftcap(scores: fx.Node) -> tuple[fx.Node, float | None]:
    """`tanh(s / c) * c` (Gemma2's attn_logit_softcapping): return s and c; other scores pass unchanged."""
    if not is_call(scores, operator.mul, torch.mul) or not is_call(scores.args[0], torch.tanh, methods=("tanh",)):
        return scores, None
    cap, inner = scores.args[1], scores.args[0].args[0]
    if not (isinstance(cap, (int, float)) and is_call(inner, operator.truediv, torch.div) and inner.args[1] == cap):
        raise NotEquivalent(
            f"scores pass through tanh (`{scores.name}`) but not as a soft-cap tanh(s / c) * c with one constant c"
        )
    _single_use(inner, "soft-capped scores")
    _single_use(scores.args[0], "soft-capped scores")
    return input_node(inner), float(cap)


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
    return (
        base_val is not None
        and base_val.dim() == 2
        and all(same_size(a, b) for a, b in zip(base_val.shape, scores_val.shape[-2:]))
    )


def _unscale_scores(scores: fx.Node) -> tuple[fx.Node, fx.Node, float]:
    """`q @ k.transpose(-2, -1)` times or divided by a constant: return q, k and the scale."""
    scale = 1.0
    if is_call(scores, operator.mul, operator.truediv, torch.mul, torch.div):
        a, b = scores.args[:2]
        if isinstance(b, (int, float)) and isinstance(a, fx.Node):
            scale = float(b) if is_call(scores, operator.mul, torch.mul) else 1.0 / float(b)
            scores = a
        else:
            raise NotEquivalent("scores are scaled by a tensor, not a constant")
    if not is_call(scores, *_MATMUL, methods=("matmul",)):
        raise NotEquivalent("scores are not q @ k^T")
    q, kt = cast("tuple[fx.Node, Argument]", scores.args[:2])  # q is a tensor
    if not is_call(kt, torch.transpose, methods=("transpose",)) or {cast(int, d) % 4 for d in kt.args[1:3]} != {2, 3}:
        raise NotEquivalent("scores are not q @ k.transpose(-2, -1)")
    return q, input_node(kt), scale


def _resolve_scale(scale: object, q: fx.Node) -> float:
    if scale is None:
        return 1.0 / math.sqrt(value(q).shape[-1])
    if not isinstance(scale, (int, float)):
        raise NotEquivalent("scale is not a constant")
    return float(scale)


def _check_heads(q: fx.Node, k: fx.Node, v: fx.Node, gqa: bool) -> tuple[fx.Node, fx.Node, str]:
    """Check self-attention shapes; unwrap repeat-kv so the op sees the `Hkv` heads. V's head dim may differ."""
    qv, kv, vv = value(q), value(k), value(v)
    if any(x is None or x.dim() != 4 for x in (qv, kv, vv)):
        raise NotEquivalent("query/key/value are not 4-D [B, H, T, D] tensors")
    if not same_size(qv.shape[3], kv.shape[3]):
        raise NotEquivalent(f"differing head dims: query head dim {qv.shape[3]}, key head dim {kv.shape[3]}")
    if vv.shape[:3] != kv.shape[:3]:
        raise NotEquivalent(f"value shape {tuple(vv.shape)} does not match key shape {tuple(kv.shape)} in [B, H, T]")
    if not same_size(qv.shape[2], kv.shape[2]):
        raise NotEquivalent("query and key lengths differ (KV cache or cross-attention): not causal self-attention")
    v_dim = "" if same_size(vv.shape[3], kv.shape[3]) else f"V head dim {vv.shape[3]} (Q/K {kv.shape[3]})"
    k_inner, v_inner = _unrepeat_kv(k), _unrepeat_kv(v)
    if k_inner is not None and v_inner is not None:
        heads = f"repeat-kv unwrapped: {value(k_inner).shape[1]} kv heads"
    else:
        k_inner, v_inner = k, v
        heads_q, heads_kv = qv.shape[1], kv.shape[1]
        if heads_q != heads_kv and not gqa and heads_kv != 1:
            raise NotEquivalent(f"{heads_q} query heads vs {heads_kv} key heads without enable_gqa")
        heads = (
            ("multi-query: 1 kv head" if heads_kv == 1 else f"GQA {heads_q}/{heads_kv} heads")
            if heads_q != heads_kv
            else ""
        )
    return k_inner, v_inner, ", ".join(filter(None, [heads, v_dim]))


def _unrepeat_kv(node: fx.Node) -> fx.Node | None:
    """The un-expanded K/V if `node` is `repeat_interleave(x, n, dim=1)` or HF's expand+reshape repeat_kv."""
    if is_call(node, torch.repeat_interleave, methods=("repeat_interleave",)) and arg(node, 2, "dim") == 1:
        return input_node(node)
    if is_call(node, methods=("reshape",)) and is_call(node.args[0], methods=("expand",)):
        indexed = node.args[0].args[0]
        if is_call(indexed, operator.getitem) and _inserts_dim_2(indexed.args[1]):
            return input_node(indexed)
    return None


def _inserts_dim_2(index: object) -> bool:
    """`x[:, :, None, :, :]`: the new axis repeat_kv expands over."""
    full = slice(None, None, None)
    return (
        isinstance(index, tuple)
        and len(index) >= 3
        and index[:3] == (full, full, None)
        and all(i == full for i in index[3:])
    )


def _target_name(node: fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
