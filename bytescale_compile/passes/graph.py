"""Small FX helpers shared by the passes: argument lookup, provenance, and the one rewrite they all do."""

from __future__ import annotations

import operator
import re
from collections.abc import Sequence
from typing import Any, TypeGuard, cast

from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.node import Argument

__all__ = [
    "ATTENTION_SITE",
    "NotEquivalent",
    "arg",
    "input_node",
    "flat_outputs",
    "value",
    "source_module",
    "layer_index",
    "same_size",
    "is_call",
    "replace_with_op",
    "has_side_effects",
    "eliminate_dead_code",
]

ATTENTION_SITE = "bytescale_attention_site"
"""`node.meta` key the attention pass sets on a site it left alone, so later analyses report it there once."""


class NotEquivalent(Exception):
    """Raised by a matcher with the reason a pattern is left alone."""


_META_TO_KEEP = ("nn_module_stack", "stack_trace", "source_fn_stack")
_LAYER = re.compile(r"\.(\d+)(?:\.|$)")
_ROOT = re.compile(r"^L\['args'\]\[0\]|^L\['[A-Za-z_]\w*'\]")
"""The root of a Dynamo module path: `L['args'][0]`, or the local the forward's first argument names."""


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """An argument of a call node, positional or keyword."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def input_node(node: fx.Node, index: int = 0) -> fx.Node:
    """`node.args[index]` where the call takes a tensor: a graph passes tensors as nodes, never as literals."""
    return cast(fx.Node, node.args[index])


def flat_outputs(graph: fx.Graph) -> Sequence[Argument]:
    """What a graph returning a flat tuple or list returns (AOTAutograd's partitioned forward and backward)."""
    return cast("Sequence[Argument]", graph.output_node().args[0])


def value(node: Any) -> Any:
    """The fake value recorded at trace time (Dynamo: example_value, AOT graphs: val)."""
    if not isinstance(node, fx.Node):
        return node
    return node.meta.get("example_value", node.meta.get("val"))


def source_module(node: fx.Node) -> str:
    """Dotted path of the innermost module that produced the node, '<root>' at top level.

    Dynamo names the root after the forward's first argument, `L['self']` or whatever the model calls it (`L['s']`),
    or `L['args'][0]` when the model's forward is wrapped by a decorator taking `*args` (transformers 5.24's
    `deprecate_kwarg`)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return "<root>"
    path = list(stack.values())[-1][0]
    path = _ROOT.sub("", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path).replace("._modules['", ".").replace("']", "")
    return path.lstrip(".") or "<root>"


def layer_index(node: fx.Node) -> int | None:
    """Index of the transformer layer (first numbered module on the path), None outside layers."""
    m = _LAYER.search("." + source_module(node))
    return int(m.group(1)) if m else None


def same_size(a: Any, b: Any) -> bool:
    """Sizes provably equal for every value of their symbols (ints or SymInts)."""
    return bool(statically_known_true(a == b))


def is_call(node: object, *targets: Any, methods: tuple[str, ...] = ()) -> TypeGuard[fx.Node]:
    """A call_function to one of `targets`, or a call_method named in `methods` or the dunder method of an
    `operator` target: Dynamo of torch 2.11 records `a == b` on tensors as `call_method __eq__`, where 2.13
    records `call_function operator.eq`."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_function":
        return node.target in targets
    return node.op == "call_method" and (node.target in methods or node.target in tuple(map(_dunder, targets)))


def _dunder(target: Any) -> str | None:
    """`__eq__` for `operator.eq`, `__and__` for `operator.and_`; None for a target outside `operator`."""
    if getattr(target, "__module__", None) != "_operator":
        return None
    return f"__{target.__name__.rstrip('_')}__"


def replace_with_op(graph: fx.Graph, old: fx.Node, op: Any, args: tuple, output_index: int | None = 0) -> fx.Node:
    """Replace `old` by `op(*args)` (or its `output_index`-th output), keeping provenance metadata.

    Returns the node that now stands for `old`; `old` is erased.
    """
    with graph.inserting_before(old):
        call = graph.call_function(op, args)
        new = call if output_index is None else graph.call_function(operator.getitem, (call, output_index))
    for n in {call, new}:
        n.meta.update({k: old.meta[k] for k in _META_TO_KEEP if k in old.meta})
    if "example_value" in old.meta:
        new.meta["example_value"] = old.meta["example_value"]
    old.replace_all_uses_with(new)
    graph.erase_node(old)
    return new


_INPLACE_OPERATORS = frozenset(
    {
        operator.iadd,
        operator.isub,
        operator.imul,
        operator.itruediv,
        operator.ifloordiv,
        operator.imod,
        operator.ipow,
        operator.imatmul,
        operator.iand,
        operator.ior,
        operator.ixor,
        operator.ilshift,
        operator.irshift,
        operator.setitem,
        operator.delitem,
    }
)
_FUNCTORCH_LEVELS = "torch._functorch.predispatch"
_INPLACE_DUNDERS = frozenset(f"__{op.__name__}__" for op in _INPLACE_OPERATORS)


def has_side_effects(node: fx.Node) -> bool:
    """Whether dead-code elimination must keep `node` although nothing uses its result.

    FX's own rule misses in-place tensor methods in Dynamo graphs (`y.mul_(2)` is a call_method
    whose result is often unused, as is `scatter_add_` in a custom autograd.Function's backward),
    so names ending in a single underscore, in-place operators (`x += y`, `x[i] = y`) and `out=`
    count as mutations; a higher-order op or submodule call is kept when a graph it runs is. So are
    functorch's level changes, which FX's rule misses too: Dynamo inlines a `torch.vmap` (Jamba's
    associative scan) as `_vmap_increment_nesting` ... `_vmap_decrement_nesting`, both unused.
    """
    if node.op not in ("call_function", "call_method", "call_module"):
        return node.op in ("placeholder", "output")
    if node.is_impure() or node.target in _INPLACE_OPERATORS or "out" in node.kwargs:
        return True
    if getattr(node.target, "__module__", None) == _FUNCTORCH_LEVELS:
        return True
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if node.op != "call_module" and (name in _INPLACE_DUNDERS or (name.endswith("_") and not name.endswith("__"))):
        return True
    return any(_graph_has_side_effects(sub) for sub in _called_graphs(node))


def eliminate_dead_code(gm: fx.GraphModule) -> bool:
    """Remove unused nodes without side effects from `gm` and every graph it calls; True if any went.

    Does not call `fx.Graph.eliminate_dead_code`: after its own graph that one cleans every subgraph
    read by a get_attr (higher-order-op bodies, autograd.Function forward/backward) with FX's default
    rule, which drops unused in-place results such as `scatter_add_`, and takes no rule for them.
    """
    changed = False
    for sub in _subgraph_modules(gm):
        changed |= eliminate_dead_code(sub)
    removed = False
    for node in reversed(gm.graph.nodes):
        if not node.users and not has_side_effects(node):
            gm.graph.erase_node(node)
            removed = True
    if removed:
        gm.graph.lint()
        gm.recompile()
    return changed or removed


def _graph_has_side_effects(gm: fx.GraphModule) -> bool:
    return any(has_side_effects(n) for n in gm.graph.nodes if n.op not in ("placeholder", "output"))


def _resolve_graph_module(owner: fx.GraphModule | None, target: Any) -> fx.GraphModule | None:
    """The GraphModule a get_attr or call_module target names in `owner`, None for anything else."""
    if owner is None or not isinstance(target, str):
        return None
    obj: Any = owner
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, fx.GraphModule) else None


def _called_graphs(node: fx.Node) -> list[fx.GraphModule]:
    """Graphs `node` runs: the submodule it calls, or the bodies a higher-order op gets as get_attr inputs."""
    owner = node.graph.owning_module
    refs = [node] if node.op == "call_module" else [a for a in node.all_input_nodes if a.op == "get_attr"]
    return [sub for sub in (_resolve_graph_module(owner, r.target) for r in refs) if sub is not None]


def _subgraph_modules(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """Each GraphModule that `gm`'s graph reads (get_attr) or calls (call_module), once."""
    found: dict[int, fx.GraphModule] = {}
    for node in gm.graph.nodes:
        if node.op in ("get_attr", "call_module"):
            sub = _resolve_graph_module(gm, node.target)
            if sub is not None:
                found.setdefault(id(sub), sub)
    return list(found.values())
