"""Loss pass: `lm_head` + cross-entropy becomes `bytescale::fused_linear_cross_entropy`.

Matched on the Dynamo graph (pre-autograd):

    logits = linear(h, W[, b]);  [logits = logits.float()];  logits = logits.view(-1, V)
    loss = cross_entropy(logits, target, ignore_index=i, reduction="sum" | "mean")

becomes `getitem(bytescale.fused_linear_cross_entropy(h, W, b, target, i, reduction, upcast, chunk), 0)`;
what follows the loss (HF's division by `num_items_in_batch`) is untouched. The fused op never holds
the full logits, so a graph output that returned them gets an empty tensor instead (training only:
in eval mode the pass leaves the model alone and logits come back as usual).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import fx

from .. import ops  # noqa: F401  (registers torch.ops.bytescale)
from .graph import NotEquivalent, arg, is_call, is_float_upcast, replace_with_op, source_module, value
from .manager import PassContext
from .report import PassResult, Rewrite, Skipped

__all__ = ["rewrite_loss"]

log = logging.getLogger(__name__)

NAME = "fused_loss"
_LINEAR = (F.linear, torch._C._nn.linear)
_CROSS_ENTROPY = (F.cross_entropy,)
_RESHAPES = ("view", "reshape", "flatten", "contiguous")



def rewrite_loss(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    result = PassResult(NAME)
    for node in list(gm.graph.nodes):
        if not is_call(node, *_CROSS_ENTROPY):
            continue
        source = source_module(node)
        try:
            if not ctx.training:
                raise NotEquivalent("model in eval mode: logits are returned, the loss is not fused")
            linear, upcast, reduction, ignore_index = _match(node)
        except NotEquivalent as why:
            result.skipped.append(Skipped(node.name, "cross_entropy", source, str(why)))
            continue
        except Exception as error:  # a shape the matcher did not foresee: leave it alone, say so
            log.warning("fused_loss pass: cannot analyse %s (%s): %r", node.name, source, error)
            result.skipped.append(Skipped(node.name, "cross_entropy", source, f"matcher could not analyse it: {error!r}"))
            continue
        hidden, weight = linear.args[:2]
        bias = arg(linear, 2, "bias")
        args = (hidden, weight, bias, arg(node, 1, "target"), ignore_index, reduction, upcast, ctx.config.loss_chunk_size)
        replace_with_op(gm.graph, node, torch.ops.bytescale.fused_linear_cross_entropy.default, args)
        returned = _drop_logits_output(gm.graph, linear)
        detail = f"reduction={reduction}, ignore_index={ignore_index}, upcast={upcast}"
        if returned:
            detail += "; returned logits replaced by an empty tensor"
        result.rewrites.append(Rewrite(node.name, "bytescale.fused_linear_cross_entropy", source, detail))
    return result


def _match(ce: fx.Node) -> tuple[fx.Node, bool, str, int]:
    """Check the cross-entropy call and walk back to the lm_head linear."""
    if arg(ce, 2, "weight") is not None:
        raise NotEquivalent("class weights given")
    if arg(ce, 7, "label_smoothing", 0.0) != 0.0:
        raise NotEquivalent("label_smoothing is not supported")
    if arg(ce, 3, "size_average") is not None or arg(ce, 5, "reduce") is not None:
        raise NotEquivalent("deprecated size_average/reduce arguments")
    reduction = arg(ce, 6, "reduction", "mean")
    if reduction not in ("sum", "mean"):
        raise NotEquivalent(f"reduction={reduction!r}: only 'sum' and 'mean' are fused")
    ignore_index = arg(ce, 4, "ignore_index", -100)
    if not isinstance(ignore_index, int):
        raise NotEquivalent("ignore_index is not a constant")
    logits = arg(ce, 0, "input")
    logits_val, target_val = value(logits), value(arg(ce, 1, "target"))
    if logits_val is None or logits_val.dim() != 2:
        raise NotEquivalent("cross_entropy input is not 2-D [tokens, vocab]")
    if target_val is None or target_val.dtype != torch.int64 or target_val.dim() != 1:
        raise NotEquivalent("targets are not int64 class indices [tokens] (soft targets are not fused)")
    node, upcast = logits, False
    while not is_call(node, *_LINEAR):
        if is_float_upcast(node):
            upcast = True
        elif not is_call(node, methods=_RESHAPES):
            raise NotEquivalent(f"logits come from `{getattr(node, 'name', node)}`, not a linear layer (through casts and views)")
        if len(node.users) != 1:
            raise NotEquivalent(f"`{node.name}` is used elsewhere too, so the logits must be materialised")
        node = node.args[0]
    _check_other_users(node, ce)
    return node, upcast, reduction, ignore_index


def _check_other_users(linear: fx.Node, ce: fx.Node) -> None:
    others = [u.name for u in linear.users if u.op != "output" and not _feeds(u, ce)]
    if others:
        raise NotEquivalent(f"the logits are also used by {others}")


def _feeds(node: fx.Node, target: fx.Node) -> bool:
    while node is not target:
        if len(node.users) != 1:
            return False
        node = next(iter(node.users))
    return True


def _drop_logits_output(graph: fx.Graph, linear: fx.Node) -> bool:
    """Replace the logits among the graph outputs by an empty tensor; True if they were returned."""
    output = graph.output_node()
    if linear not in output.all_input_nodes:
        return False
    val = value(linear)
    with graph.inserting_before(output):
        empty = graph.call_function(torch.empty, ((0,),), {"dtype": val.dtype, "device": val.device})
    empty.meta["example_value"] = torch.empty((0,), dtype=val.dtype, device="meta")
    output.replace_input_with(linear, empty)
    return True
