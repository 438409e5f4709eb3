"""The saved-activation table: forward tensors the backward needs, sized per token and per layer."""

from __future__ import annotations

import math

import sympy
import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from ..passes.graph import flat_outputs, input_node, layer_index, source_module
from ..passes.report import SavedActivation

__all__ = ["saved_activations"]


def saved_activations(fw: fx.GraphModule, num_fwd_outputs: int, token_size: torch.SymInt) -> list[SavedActivation]:
    """Describe the token-carrying tensors the partitioned forward hands to the backward.

    `token_size` is the (symbolic) token dimension of the inputs; a tensor has the token dimension
    when one of its sizes is that symbol, and its bytes per token are then the product of the other
    sizes times the element size. Saved weights (and their transposes) carry no tokens,
    cannot be offloaded per token and are not listed.
    """
    outputs = flat_outputs(fw.graph)
    table = []
    owners: dict[StorageWeakRef, str] = {}
    for node in outputs[num_fwd_outputs:]:
        if not isinstance(node, fx.Node) or not isinstance(val := node.meta.get("val"), torch.Tensor):
            continue
        if not _has_token_dim(val, token_size):
            continue
        per_token = _bytes_per_token(val, token_size)
        producer = _producer(node)
        owner = owners.setdefault(StorageWeakRef(val.untyped_storage()), node.name)
        table.append(
            SavedActivation(
                name=node.name,
                shape=str(tuple(val.shape)).replace("'", ""),
                dtype=str(val.dtype).removeprefix("torch."),
                bytes_per_token=per_token,
                layer=layer_index(producer),
                source=source_module(producer),
                decision="resident (no offload pass ran)" if per_token is not None else "resident (grows with T²)",
                alias_of=None if owner == node.name else owner,
            )
        )
    return table


_ALIASES = {
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.t.default,
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.transpose.int,
}


def _producer(node: fx.Node) -> fx.Node:
    """Aliases made by AOTAutograd carry no module; look through them to the op that made the tensor."""
    while "nn_module_stack" not in node.meta and node.target in _ALIASES:
        node = input_node(node)
    return node


def _has_token_dim(val: torch.Tensor, token_size: torch.SymInt) -> bool:
    return _expr(token_size) in [_expr(s) for s in val.shape]


def _bytes_per_token(val: torch.Tensor, token_size: torch.SymInt) -> int | None:
    """Bytes per token, or None when the size is not linear in the tokens ([.., T, T] scores)."""
    token = _expr(token_size)
    sizes = [_expr(s) for s in val.shape]
    others = list(sizes)
    others.remove(token)
    per_token = sympy.simplify(math.prod(others, start=sympy.Integer(1)))
    return int(per_token) * val.element_size() if per_token.is_number else None


def _expr(size: int | torch.SymInt) -> sympy.Expr:
    return size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(size)
