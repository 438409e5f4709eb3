"""Shared layer bodies: the `invoke_subgraph` regions Dynamo emits for `Config(compile_layers_once=True)`.

Each repeated decoder layer is marked with `torch.compiler.nested_compile_region`; Dynamo then traces
the first call once into a body (`subgraph_0`) and calls it for every layer with that layer's weights:

    invoke_subgraph(subgraph_0, 'subgraph_0', *operands)    # operand i feeds the body's placeholder i

A pass rewriting a body rewrites every layer at once. What the body reads from outside (the attention
mask built once by the model) is a placeholder here; `Region.outer_argument` follows it back to the
operand every call passes, and `Region.input_for` threads an outer value (position_ids) into the body.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from .graph import NotEquivalent, eliminate_dead_code, source_module

__all__ = ["Region", "find_regions", "has_regions"]

_FIRST_OPERAND = 2
"""invoke_subgraph's arguments: the body, its identifier, then the operands."""


def _is_invoke_subgraph(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.ops.higher_order.invoke_subgraph


def has_regions(gm: fx.GraphModule) -> bool:
    """Whether `gm` calls a shared subgraph body (a layer compiled once)."""
    return any(_is_invoke_subgraph(n) for n in gm.graph.nodes)


@dataclass
class Region:
    """One body and the calls that run it, in graph order (one per layer)."""

    body: fx.GraphModule
    calls: list[fx.Node]

    def placeholders(self) -> list[fx.Node]:
        return list(self.body.graph.find_nodes(op="placeholder"))

    def site_source(self, call: fx.Node, body_source: str) -> str:
        """`body_source`, a module path under the first call's layer (`model.layers.0.self_attn`), under `call`'s."""
        first, here = source_module(self.calls[0]), source_module(call)
        if first != "<root>" and (body_source + ".").startswith(first + "."):
            return here + body_source[len(first) :]
        return body_source

    def outer_argument(self, placeholder: fx.Node) -> fx.Node:
        """The outer node every call passes for `placeholder`; raise NotEquivalent when layers pass different ones."""
        index = self.placeholders().index(placeholder) + _FIRST_OPERAND
        passed = {call.args[index] for call in self.calls}
        if len(passed) != 1 or not isinstance(outer := passed.pop(), fx.Node):
            raise NotEquivalent(
                f"`{placeholder.name}` of the shared layer body is not one tensor passed to every layer "
                f"(got {list(dict.fromkeys(str(call.args[index]) for call in self.calls))})"
            )
        return outer

    def input_for(self, outer: fx.Node) -> fx.Node:
        """The body placeholder that every call feeds with `outer`, added (with the operand) if there is none."""
        for i, placeholder in enumerate(self.placeholders()):
            if all(call.args[i + _FIRST_OPERAND] is outer for call in self.calls):
                return placeholder
        last = self.placeholders()[-1]
        with self.body.graph.inserting_after(last):
            placeholder = self.body.graph.placeholder(f"{outer.name}_outer")
        placeholder.meta.update({k: outer.meta[k] for k in ("example_value", "val") if k in outer.meta})
        for call in self.calls:
            call.args = (*call.args, outer)
        return placeholder

    def drop_unused(self, placeholders: set[fx.Node]) -> None:
        """Remove those of `placeholders` the body no longer reads, with their operands (a mask nobody applies)."""
        eliminate_dead_code(self.body)
        for placeholder in [p for p in self.placeholders() if p in placeholders and not p.users]:
            index = self.placeholders().index(placeholder) + _FIRST_OPERAND
            for call in self.calls:
                call.args = call.args[:index] + call.args[index + 1 :]
            self.body.graph.erase_node(placeholder)
        self.body.recompile()


def find_regions(gm: fx.GraphModule) -> list[Region]:
    """Every body `gm` calls through invoke_subgraph, once, with its calls."""
    regions: dict[str, Region] = {}
    for node in gm.graph.nodes:
        if not _is_invoke_subgraph(node):
            continue
        target = node.args[0].target
        body = getattr(gm, target)
        regions.setdefault(target, Region(body, [])).calls.append(node)
    return list(regions.values())
