"""Selective activation offload (paper §4.2) on the partitioned forward and backward graphs.

A saved activation is a forward output the backward takes as an input. Saved tensors that share a
storage (a tensor and its views) form one group, since only the storage as a whole can be freed:

    forward:   ... x = f(...) ... last use of x's storage ...   output(..., x, x_view, ...)
           ->  ... x = f(...) ... last use ... h = offload_saved(layer, dim, keep, x, x_view)
                                                output(..., h[0], h[1], ...)
    backward:  x, x_view = placeholders ... first use of either ...
           ->  r = reload_saved(layer, x, x_view); uses of x, x_view read r[0], r[1]

Between the two the graph carries only handles; the act_ctx (`runtime/offload.py`) holds the data
and reads the micro-batch's ratio r at run time, so r never causes a recompilation. A group belongs
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

import sympy
import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.multiprocessing.reductions import StorageWeakRef

from ..runtime.offload import offload_saved, reload_saved
from .graph import layer_index
from .report import PassResult, Rewrite, SavedActivation, Skipped

__all__ = ["NAME", "KEPT_LAYERS", "apply_offload"]

NAME = "offload"
KEPT_LAYERS = 2
"""Layers whose activations always stay on the device: D(s) in Eq. 2 counts 2 layers' worth."""

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


def apply_offload(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int,
                  table: list[SavedActivation], token_size: torch.SymInt) -> tuple[PassResult, list[SavedActivation]]:
    """Route every token-carrying saved storage through offload/reload; return the result and the table
    with each row's decision and the layer whose backward reads it back."""
    outputs = list(fw.graph.output_node().args[0])
    groups = _groups(fw, outputs, num_fwd_outputs, table)
    num_layers = 1 + max((r.layer for r in table if r.layer is not None), default=-1)
    bw_inputs = {n.name: n for n in bw.graph.find_nodes(op="placeholder")}
    last_reader = _last_readers(fw)  # both indexes are of the graphs as partitioned: new nodes read nothing
    bw_order = {n: i for i, n in enumerate(bw.graph.nodes)}  # of the groups' storages or placeholders
    result, decisions = PassResult(NAME), {}
    for group in groups:
        _decide(group, num_layers, token_size, bw_inputs)
        decision = _decision(group)
        for row in group.rows:
            text = decision if row is group.owner or group.reason else f"{decision}, with {group.owner.name}"
            decisions[row.name] = (text, group.layer)
        if group.reason:
            result.skipped.append(Skipped(group.owner.name, "offload_saved", group.owner.source, group.reason))
            continue
        _rewrite(fw, bw, outputs, num_fwd_outputs, group, bw_inputs, last_reader, bw_order)
        members = ", ".join(n.name for n in group.nodes)
        result.rewrites.append(Rewrite(group.owner.name, "offload_saved/reload_saved", group.owner.source,
                                       f"{decision}; backward layer {group.layer}: {members}"))
    fw.graph.output_node().args = (tuple(outputs),)
    for gm in (fw, bw):
        gm.graph.lint()
        gm.recompile()
    table = [dataclasses.replace(r, decision=decisions[r.name][0], layer=decisions[r.name][1]) if r.name in decisions
             else r for r in table]
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


def _decide(group: _Group, num_layers: int, token_size: torch.SymInt, bw_inputs: dict[str, fx.Node]) -> None:
    if group.reason:
        return
    val = next(n for n in group.nodes if n.name == group.owner.name).meta["val"]
    if any(r.bytes_per_token is None for r in group.rows):
        group.reason = "resident (grows with T²)"
    elif not val.is_floating_point():
        group.reason = "resident (not floating point)"
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


def _rewrite(fw: fx.GraphModule, bw: fx.GraphModule, outputs: list, num_fwd_outputs: int, group: _Group,
             bw_inputs: dict[str, fx.Node], last_reader: dict[StorageWeakRef, fx.Node], bw_order: dict[fx.Node, int]) -> None:
    layer = _OUTSIDE if group.layer is None else group.layer
    args = (layer, group.token_dim, group.keep, *group.nodes)
    storage = StorageWeakRef(group.nodes[0].meta["val"].untyped_storage())
    with fw.graph.inserting_after(last_reader[storage]):
        offload = fw.graph.call_function(offload_saved, args)
    handles, previous = [], offload
    for i in range(len(group.nodes)):  # inserting_after each new node keeps them in order
        with fw.graph.inserting_after(previous):
            previous = fw.graph.call_function(operator.getitem, (offload, i))
        handles.append(previous)
    fake_mode = detect_fake_mode(_vals(group.nodes))
    for handle in handles:
        with fake_mode:
            handle.meta["val"] = torch.empty(4, dtype=torch.int64)
    slot_of = {node: handle for node, handle in zip(group.nodes, handles)}
    for i in range(num_fwd_outputs, len(outputs)):
        if outputs[i] in slot_of:
            outputs[i] = slot_of[outputs[i]]

    inputs = [bw_inputs[n.name] for n in group.nodes]
    users = [u for p in inputs for u in p.users]
    with bw.graph.inserting_before(min(users, key=bw_order.__getitem__)):
        reload = bw.graph.call_function(reload_saved, (layer, *inputs))
        tensors = [bw.graph.call_function(operator.getitem, (reload, i)) for i in range(len(inputs))]
    for placeholder, tensor in zip(inputs, tensors):
        tensor.meta["val"] = placeholder.meta.get("val")
        placeholder.replace_all_uses_with(tensor, delete_user_cb=lambda user: user is not reload)


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
