"""Selective activation offload (paper §4.2) on the partitioned forward and backward graphs.

A saved activation is a forward output the backward takes as an input. Saved tensors that share a
storage (a tensor and its views) form one group, since only the storage as a whole can be freed:

    forward:   ... x = f(...) ... last use of x's storage ...   output(..., x, x_view, ...)
           ->  ... x = f(...) ... last use ... h = bytescale::offload_saved(layer, dim, keep, [x, x_view])
                                                output(..., h[0], h[1], ...)
    backward:  x, x_view = placeholders ... first use of either ...
           ->  s = bytescale::reload_saved(layer, [x, x_view], device)
               uses of x, x_view read as_strided(s, x's layout), as_strided(s, x_view's layout)

Between the two the graph carries only data-less handles (`ops/offload.py`); the act_ctx
(`runtime/offload.py`) holds the data and reads the micro-batch's ratio r at run time, so r never
causes a recompilation. A group belongs
to the layer whose backward reads it (a layer's output to the next layer, the embedding to layer 0).
Groups of the last two layers go through the same ops with `keep=True` (resident, as D(s) in Eq. 2
assumes, and counted), as do those outside the layers (final norm, loss) and those read by several
layers (the rotary tables). Groups that cannot
be split by tokens — not floating point, growing with T², storage not token-major, or storage also
a graph input or output (copying would free nothing) — are left alone, and the report says why.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import cast

import sympy
import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.multiprocessing.reductions import StorageWeakRef

from ..ops.offload import offload_saved, reload_saved
from .graph import flat_outputs, layer_index
from .report import PassResult, Rewrite, SavedActivation, Skipped

__all__ = ["NAME", "KEPT_LAYERS", "OFFLOADED", "RESIDENT", "apply_offload"]

NAME = "offload"
KEPT_LAYERS = 2
"""Layers whose activations always stay on the device: D(s) in Eq. 2 counts 2 layers' worth."""

OFFLOADED, RESIDENT = "offloaded", "resident"
"""`PassResult.counts` keys: storages whose first ⌊r·T⌋ tokens go to host, and those routed through the ops with
`keep=True` (counted, never moved)."""

_OUTSIDE = -1
"""Layer id of groups outside the transformer layers (reloaded whenever their first use comes)."""


@dataclasses.dataclass
class _Group:
    nodes: list[fx.Node]
    rows: list[SavedActivation]
    layer: int | None
    token_dim: int | None = None
    keep: bool = False
    shared_by: list[int] | None = None
    """The layers reading the group when there are several."""
    reason: str | None = None
    """Why the group is left alone (not routed through the ops), or None."""

    @property
    def owner(self) -> SavedActivation:
        return self.rows[0]


def apply_offload(
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    num_fwd_outputs: int,
    table: list[SavedActivation],
    token_size: torch.SymInt,
    contiguous_only: bool = False,
) -> tuple[PassResult, list[SavedActivation]]:
    """Route every token-carrying saved storage through offload/reload; return the result and the table
    with each row's decision and the layer whose backward reads it back.

    `contiguous_only` (Inductor compiles the graphs) leaves non-contiguous storages resident: Inductor
    may lay such a tensor out its own way before the op, and the backward reads the traced layout."""
    outputs = list(flat_outputs(fw.graph))
    groups = _groups(fw, outputs, num_fwd_outputs, table)
    num_layers = 1 + max((r.layer for r in table if r.layer is not None), default=-1)
    bw_inputs = {n.name: n for n in bw.graph.find_nodes(op="placeholder")}
    last_reader = _last_readers(fw)  # both indexes are of the graphs as partitioned: new nodes read nothing
    bw_order = {n: i for i, n in enumerate(bw.graph.nodes)}  # of the groups' storages or placeholders
    result, decisions = PassResult(NAME, counts={OFFLOADED: 0, RESIDENT: 0}), {}
    for group in groups:
        _decide(group, num_layers, token_size, bw_inputs, contiguous_only)
        decision = _decision(group)
        for row in group.rows:
            text = decision if row is group.owner or group.reason else f"{decision}, with {group.owner.name}"
            decisions[row.name] = (text, group.layer)
        if group.reason:
            result.skipped.append(Skipped(group.owner.name, "offload_saved", group.owner.source, group.reason))
            continue
        _rewrite(fw, bw, outputs, num_fwd_outputs, group, bw_inputs, last_reader, bw_order)
        result.counts[RESIDENT if group.keep else OFFLOADED] += 1
        members = ", ".join(n.name for n in group.nodes)
        result.rewrites.append(
            Rewrite(
                group.owner.name,
                "offload_saved/reload_saved",
                group.owner.source,
                f"{decision}; backward layer {group.layer}: {members}",
            )
        )
    fw.graph.output_node().args = (tuple(outputs),)
    for gm in (fw, bw):
        gm.graph.lint()
        gm.recompile()
    table = [
        dataclasses.replace(r, decision=decisions[r.name][0], layer=decisions[r.name][1]) if r.name in decisions else r
        for r in table
    ]
    return result, table


def _groups(fw: fx.GraphModule, outputs: list, num_fwd_outputs: int, table: list[SavedActivation]) -> list[_Group]:
    """Saved tensors grouped by storage, in the order the forward returns them; only groups with a
    token-carrying member (a row of the table)."""
    rows = {r.name: r for r in table}
    by_storage: dict[StorageWeakRef, _Group] = {}
    for node in outputs[num_fwd_outputs:]:
        val = node.meta.get("val") if isinstance(node, fx.Node) else None
        if not isinstance(val, torch.Tensor):
            continue
        group = by_storage.setdefault(StorageWeakRef(val.untyped_storage()), _Group([], [], None))
        if node not in group.nodes:
            group.nodes.append(node)
        if node.name in rows:
            group.rows.append(rows[node.name])
    protected = {StorageWeakRef(v.untyped_storage()) for v in _vals(fw.graph.find_nodes(op="placeholder"))}
    protected |= {StorageWeakRef(v.untyped_storage()) for v in _vals(outputs[:num_fwd_outputs])}
    groups = []
    for storage, group in by_storage.items():
        if not group.rows:
            continue
        group.layer = _backward_layer(group)
        if storage in protected:
            group.reason = "resident (its storage is also a graph input or output: a copy would free nothing)"
        groups.append(group)
    return groups


def _backward_layer(group: _Group) -> int | None:
    """The layer whose backward reads the group: that of its forward readers (a layer's output feeds the
    next layer's norm, so the backward needs it back there), else the producer's; None (outside, kept)
    when several layers read it, like the rotary tables."""
    readers = [u for n in group.nodes for u in n.users if u.op != "output"]
    layers = {layer for layer in map(layer_index, readers) if layer is not None}
    if len(layers) > 1:
        group.shared_by = sorted(layers)
        return None
    return layers.pop() if layers else group.owner.layer


def _vals(nodes: list) -> list[torch.Tensor]:
    return [n.meta["val"] for n in nodes if isinstance(n, fx.Node) and isinstance(n.meta.get("val"), torch.Tensor)]


def _decide(
    group: _Group, num_layers: int, token_size: torch.SymInt, bw_inputs: dict[str, fx.Node], contiguous_only: bool
) -> None:
    if group.reason:
        return
    val = next(n for n in group.nodes if n.name == group.owner.name).meta["val"]
    if any(r.bytes_per_token is None for r in group.rows):
        group.reason = "resident (grows with T²)"
    elif not val.is_floating_point():
        group.reason = "resident (not floating point)"
    elif contiguous_only and not all(n.meta["val"].is_contiguous() for n in group.nodes):
        group.reason = "resident (not contiguous: Inductor may lay it out otherwise than traced)"
    elif (dim := _token_major_dim(val, token_size)) is None:
        group.reason = "resident (its storage is not token-major: no token prefix is contiguous)"
    elif missing := [n.name for n in group.nodes if n.name not in bw_inputs]:
        group.reason = f"resident (the backward has no input named {missing[0]})"
    elif not any(bw_inputs[n.name].users for n in group.nodes):
        group.reason = "resident (the backward never reads it)"
    else:
        group.token_dim = dim
        group.keep = group.layer is None or group.layer >= num_layers - KEPT_LAYERS


def _decision(group: _Group) -> str:
    if group.reason:
        return group.reason
    if group.shared_by:
        return f"resident (read by layers {group.shared_by[0]}-{group.shared_by[-1]})"
    if group.layer is None:
        return "resident (outside the transformer layers)"
    if group.keep:
        return f"resident (last {KEPT_LAYERS} layers stay, as D(s) assumes)"
    return "offload first ⌊r·T⌋ tokens"


def _token_major_dim(val: torch.Tensor, token_size: torch.SymInt) -> int | None:
    """The token dimension when the storage is T tokens laid out one after another, else None."""
    token = _expr(token_size)
    dims = [d for d, s in enumerate(val.shape) if _expr(s) == token]
    if len(dims) != 1:
        return None
    dim = dims[0]
    per_token = _expr(val.stride(dim))
    storage = _expr(val.untyped_storage().nbytes()) / val.element_size()
    if sympy.simplify(storage - token * per_token) != 0:
        return None
    for d in range(val.dim()):
        if d != dim and _expr(val.shape[d]) != 1:
            inside = sympy.simplify(per_token - _expr(val.stride(d)) * _expr(val.shape[d]))
            if not inside.is_nonnegative:
                return None
    return dim


def _expr(size: int | torch.SymInt) -> sympy.Expr:
    return size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(size)


def _rewrite(
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    outputs: list,
    num_fwd_outputs: int,
    group: _Group,
    bw_inputs: dict[str, fx.Node],
    last_reader: dict[StorageWeakRef, fx.Node],
    bw_order: dict[fx.Node, int],
) -> None:
    layer = _OUTSIDE if group.layer is None else group.layer
    members = [n.meta["val"] for n in group.nodes]
    args = (layer, group.token_dim, group.keep, list(group.nodes))
    storage = StorageWeakRef(members[0].untyped_storage())
    with detect_fake_mode(members):
        handle_vals = offload_saved(layer, group.token_dim, group.keep, members)
    with fw.graph.inserting_after(last_reader[storage]):
        offload = fw.graph.call_function(torch.ops.bytescale.offload_saved.default, args)
    offload.meta["val"] = handle_vals
    handles, previous = [], offload
    for i, val in enumerate(handle_vals):  # inserting_after each new node keeps them in order
        with fw.graph.inserting_after(previous):
            previous = fw.graph.call_function(operator.getitem, (offload, i))
        previous.meta["val"] = val
        handles.append(previous)
    slot_of = {node: handle for node, handle in zip(group.nodes, handles)}
    for i in range(num_fwd_outputs, len(outputs)):
        if outputs[i] in slot_of:
            outputs[i] = slot_of[outputs[i]]

    inputs = [bw_inputs[n.name] for n in group.nodes]
    users = [u for p in inputs for u in p.users]
    with bw.graph.inserting_before(min(users, key=bw_order.__getitem__)):
        with detect_fake_mode(handle_vals):
            full_val = reload_saved(layer, handle_vals, members[0].device)
        reload = bw.graph.call_function(torch.ops.bytescale.reload_saved.default, (layer, inputs, members[0].device))
        reload.meta["val"] = full_val
        views = [_view_like(bw.graph, reload, placeholder) for placeholder in inputs]
    for placeholder, view, handle_val in zip(inputs, views, handle_vals):
        reads_handle = {reload, *_layout_nodes(view)}
        placeholder.replace_all_uses_with(view, delete_user_cb=_not_in(reads_handle))
        placeholder.meta["val"] = handle_val


def _not_in(nodes: set[fx.Node]) -> Callable[[fx.Node], bool]:
    """A `delete_user_cb` that leaves the uses by `nodes` alone."""
    return lambda user: user not in nodes


def _view_like(graph: fx.Graph, storage: fx.Node, handle: fx.Node) -> fx.Node:
    """`storage` viewed with the layout of the member `handle` stands for: symbolic sizes read off the handle."""
    val = handle.meta["val"]
    sizes = [_sym(graph, torch.ops.aten.sym_size.int, handle, d, s) for d, s in enumerate(val.shape)]
    strides = [_sym(graph, torch.ops.aten.sym_stride.int, handle, d, s) for d, s in enumerate(val.stride())]
    offset = _sym(graph, torch.ops.aten.sym_storage_offset.default, handle, None, val.storage_offset())
    view = graph.call_function(torch.ops.aten.as_strided.default, (storage, sizes, strides, offset))
    view.meta["val"] = val
    return view


def _sym(
    graph: fx.Graph, op: torch._ops.OpOverload, handle: fx.Node, dim: int | None, value: int | torch.SymInt
) -> int | fx.Node:
    """A size, stride or offset as a graph argument: the int itself when static, else read off the handle."""
    if not isinstance(value, torch.SymInt):
        return value
    node = graph.call_function(op, (handle,) if dim is None else (handle, dim))
    node.meta["val"] = value
    return node


def _layout_nodes(view: fx.Node) -> set[fx.Node]:
    """The sym_size/sym_stride nodes `_view_like` made for `view`: they read the handle, not the member."""
    sizes, strides, offset = cast("tuple[list[int | fx.Node], list[int | fx.Node], int | fx.Node]", view.args[1:])
    return {n for n in (*sizes, *strides, offset) if isinstance(n, fx.Node)}


def _last_readers(fw: fx.GraphModule) -> dict[StorageWeakRef, fx.Node]:
    """Per storage, the last forward node that reads it through any view (the output aside)."""
    order = {n: i for i, n in enumerate(fw.graph.nodes)}
    last: dict[StorageWeakRef, fx.Node] = {}
    for node in order:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        storage = StorageWeakRef(val.untyped_storage())
        readers = [node, *(u for u in node.users if u.op != "output")]
        if storage in last:
            readers.append(last[storage])
        last[storage] = max(readers, key=order.__getitem__)
    return last
