"""Regions the passes look inside: shared layer bodies and checkpointed layers.

Dynamo emits two higher-order ops whose body holds a whole decoder layer:

    invoke_subgraph(subgraph_0, 'subgraph_0', *operands)    # CompileConfig(compile_layers_once=True): one body, one
                                                             # call per layer with that layer's weights
    tag_activation_checkpoint(wrap_body_0, *operands)        # torch.utils.checkpoint (Hugging Face's
                                                             # gradient_checkpointing_enable): one body per call

Operand i feeds the body's placeholder i. A pass rewriting a body rewrites every layer that calls it. What
the body reads from outside (the attention mask built once by the model) is a placeholder here;
`Region.outer_argument` follows it back to the operand every call passes, and `Region.input_for` threads
an outer value (position_ids) into the body. AOTAutograd inlines a checkpointed body into the joint graph,
its nodes tagged for recomputation, so the backward recomputes the rewritten ops. Every other higher-order
op with a body stays opaque to the passes (`opaque.py` reports what it hides).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from .graph import NotEquivalent, eliminate_dead_code, source_module

__all__ = ["Region", "find_regions", "has_regions", "is_region_call"]

_FIRST_OPERAND = {
    torch.ops.higher_order.invoke_subgraph: 2,  # the body, its identifier, then the operands
    torch.ops.higher_order.tag_activation_checkpoint: 1,  # the body, then the operands (checkpoint's own kwargs apart)
}
"""The higher-order ops whose bodies the passes look inside, and where their operands start."""


def is_region_call(node: fx.Node) -> bool:
    """A call of a body the passes look inside (a shared layer, a checkpointed region)."""
    return node.op == "call_function" and node.target in _FIRST_OPERAND


def has_regions(gm: fx.GraphModule) -> bool:
    """Whether `gm` calls a shared subgraph body (a layer compiled once). Checkpointed bodies do not count:
    AOTAutograd inlines them, so the partitioned graphs look like those of any other model."""
    return bool(gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph))


@dataclass
class Region:
    """One body and the calls that run it, in graph order (one per layer)."""

    body: fx.GraphModule
    calls: list[fx.Node]

    @property
    def first_operand(self) -> int:
        return _FIRST_OPERAND[self.calls[0].target]

    def placeholders(self) -> list[fx.Node]:
        return list(self.body.graph.find_nodes(op="placeholder"))

    def site_source(self, call: fx.Node, body_source: str) -> str:
        """`body_source`, a module path under the first call's layer (`model.layers.0.self_attn`), under `call`'s."""
        first, here = source_module(self.calls[0]), source_module(call)
        if first != "<root>" and (body_source + ".").startswith(first + "."):
            return here + body_source[len(first) :]
        return body_source

    def sources(self, body_source: str) -> list[str]:
        """The module path of a site in the body, once per layer that runs it."""
        return [self.site_source(call, body_source) for call in self.calls]

    def outer_argument(self, placeholder: fx.Node) -> fx.Node:
        """The outer node every call passes for `placeholder`; raise NotEquivalent when layers pass different ones."""
        index = self.placeholders().index(placeholder) + self.first_operand
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
            if all(call.args[i + self.first_operand] is outer for call in self.calls):
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
            index = self.placeholders().index(placeholder) + self.first_operand
            for call in self.calls:
                call.args = call.args[:index] + call.args[index + 1 :]
            self.body.graph.erase_node(placeholder)
        self.body.recompile()


def find_regions(gm: fx.GraphModule) -> list[Region]:
    """Every body `gm` calls through invoke_subgraph or tag_activation_checkpoint, once, with its calls."""
    regions: dict[int, Region] = {}
    for node in gm.graph.nodes:
        if not is_region_call(node):
            continue
        body = getattr(gm, node.args[0].target)
        regions.setdefault(id(body), Region(body, [])).calls.append(node)
    return list(regions.values())
