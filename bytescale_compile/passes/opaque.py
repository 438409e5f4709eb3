"""Opaque regions: higher-order ops with a body the passes do not look inside.

Dynamo captures some constructs as a higher-order op calling a subgraph of its own: a custom
`autograd.Function` (`autograd_function_apply`), `torch.cond` branches, `wrap`, `map`... The attention,
fused-loss and token-mixer passes look inside shared layer bodies and checkpointed regions (`regions.py`),
one level deep, and nowhere else. An attention, a cross-entropy or a token mixer in any other body runs as the model wrote
it: straight through packed sequences, and over a rank's own chunks of a shared one. Training would be
silently wrong, so this pass runs last and reports each such op, per module, as left alone;
`CompileReport.shard_blockers()` names them and the runtime neither packs nor shards the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import fx

from .attention import is_attention
from .graph import source_module
from .loss import is_cross_entropy
from .manager import PassContext
from .regions import find_regions, is_region_call
from .report import OPAQUE_PASS as NAME
from .report import PassResult, Skipped
from .token_mixers import mixers_in, token_dims

if TYPE_CHECKING:
    from .token_mixers import _TokenDims

__all__ = ["find_opaque_regions", "NAME"]

_FORWARD_BODIES = {"autograd_function_apply": 1}
"""Higher-order ops whose later bodies run only in the backward (a custom Function's `backward` contracts the
tokens to get weight gradients): the number of bodies that run forward."""


def find_opaque_regions(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Report every attention, cross-entropy and token mixer inside a body the other passes did not look into."""
    result = PassResult(NAME)
    tokens = token_dims(gm)
    graphs: list[tuple[fx.GraphModule, Callable[[str], list[str]]]] = [(gm, lambda source: [source])]
    graphs += [(r.body, r.sources) for r in find_regions(gm)]
    reported: set[tuple[str, str]] = set()
    for owner, sources in graphs:
        for call in owner.graph.nodes:
            if call.op != "call_function" or not isinstance(call.target, torch._ops.HigherOrderOperator):
                continue
            if owner is gm and is_region_call(call):  # the passes look one level into regions, not into nested ones
                continue
            hop = call.target.name()
            for body_name, body in _forward_bodies(owner, call):
                for inner, what in _hidden(body, tokens):
                    source = source_module(inner)
                    reason = (
                        f"{what} inside `{hop}` (body `{body_name}`), a region the passes do not look into: it would "
                        f"read across packed sequences, and only a rank's own chunks of a shared one"
                    )
                    for site in sources(source if source != "<root>" else source_module(call)):
                        if (site, reason) not in reported:
                            reported.add((site, reason))
                            result.skipped.append(Skipped(call.name, hop, site, reason))
    return result


def _forward_bodies(owner: fx.GraphModule, call: fx.Node) -> list[tuple[str, fx.GraphModule]]:
    """The bodies `call` runs in the forward, by attribute name."""
    bodies = [
        (a.target, body)
        for a in call.all_input_nodes
        if a.op == "get_attr"
        and isinstance(a.target, str)
        and isinstance(body := getattr(owner, a.target, None), fx.GraphModule)
    ]
    return bodies[: _FORWARD_BODIES.get(call.target.name(), len(bodies))]


def _hidden(body: fx.GraphModule, tokens: _TokenDims | None) -> Iterator[tuple[fx.Node, str]]:
    """What in `body` (and the bodies it calls) a pass would have rewritten or reported, with what it is."""
    attention_sources = set()
    for node in body.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        if is_attention(node):
            attention_sources.add(source_module(node))
            yield node, f"attention (`{_name(node)}`)"
        elif is_cross_entropy(node):
            yield node, "a loss (`cross_entropy`)"
        elif isinstance(node.target, torch._ops.HigherOrderOperator):
            for _, inner in _forward_bodies(body, node):
                yield from _hidden(inner, tokens)
    if tokens is not None:
        for node, what in mixers_in(body.graph, tokens):
            if source_module(node) not in attention_sources:  # the attention's own softmax and `@ v`
                yield node, f"a token mixer: {what}"


def _name(node: fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
