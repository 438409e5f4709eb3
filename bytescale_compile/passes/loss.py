"""Loss pass: `lm_head` + cross-entropy becomes `bytescale::fused_linear_cross_entropy`.

Matched on the Dynamo graph (pre-autograd), walking back from the cross-entropy's input:

    z = linear(h, W[, b])
    logits = z through any chain of: views, casts to the same or a wider float (`.float()`),
             × or ÷ a constant (Granite, Cohere), tanh with constant factors around it (Gemma2's
             final soft-cap `tanh(z / c) * c`), a `tp_all_gather` of vocabulary shards on the last dim
    loss = cross_entropy(logits.view(-1, V), target, ignore_index=i, reduction="sum" | "mean")

becomes `getitem(bytescale.fused_linear_cross_entropy(h, W, b, target, i, reduction, upcast, chunk,
scale, softcap), 0)`, the constants folded into logits = softcap · tanh(scale · z / softcap) (scale · z
without a tanh); what follows the loss (HF's division by `num_items_in_batch`) is untouched. The fused
op never holds the full logits, so graph outputs that returned them (at any point of the chain) get an
empty tensor instead (training only: in eval mode the pass leaves the model alone and logits come back
as usual). A chain it cannot fold stays eager, with a reason that names what the model does there.

A tensor-parallel lm_head split over the vocabulary with its output gathered (`capture/tensor_parallel.py`
runs it as `tp_all_gather(linear(copy_to_tp(h), W_i), -1)`) has the gather in the chain; that becomes
`bytescale.vocab_parallel_linear_cross_entropy(copy_to_tp(h), W_i, ..., group, rank × V/tp)`, which
combines per-token statistics over the group instead of gathering the logits. Its grad of h is partial:
`copy_to_tp`'s backward sums it over the group, as it summed the linear's.
"""

from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass
from fractions import Fraction
from typing import SupportsFloat

import torch
import torch.nn.functional as F
from torch import fx
from torch.fx.node import Argument

from .. import ops  # noqa: F401  (registers torch.ops.bytescale)
from ..ops.tensor_parallel import tp_rank, tp_size
from .graph import NotEquivalent, arg, is_call, replace_with_op, same_size, source_module, value
from .manager import PassContext
from .regions import Region, find_regions
from .report import PassResult, Rewrite, Skipped

__all__ = ["EVAL_MODE", "PREVIOUS_GRAPH_BREAK", "rewrite_loss", "is_cross_entropy"]

log = logging.getLogger(__name__)

NAME = "fused_loss"
EVAL_MODE = "model in eval mode: logits are returned, the loss is not fused"
"""Why a loss is left alone in an eval-mode graph: `OptimizedModule` warns when a backward runs through one."""
PREVIOUS_GRAPH_BREAK = "bytescale_previous_graph_break"
"""`GraphModule.meta` key the backend sets to the latest graph break it saw before this graph, so a
loss whose logits are a graph input can say which break split them from the lm_head."""

_LINEAR = (F.linear, torch._C._nn.linear)
_CROSS_ENTROPY = (F.cross_entropy,)
_RESHAPES = ("view", "reshape", "flatten", "contiguous")
_CASTS = ("float", "to", "type", "type_as", "half", "bfloat16", "double")
_MUL, _MUL_METHODS = (operator.mul, torch.mul, torch.multiply), ("mul", "multiply", "__mul__", "__rmul__")
_DIV, _DIV_METHODS = (operator.truediv, torch.div, torch.true_divide), ("div", "divide", "true_divide", "__truediv__")
_NEG, _NEG_METHODS = (operator.neg, torch.neg, torch.negative), ("neg", "negative", "__neg__")
_TANH, _TANH_METHODS = (torch.tanh, F.tanh), ("tanh",)
_TP_ALL_GATHER = torch.ops.bytescale.tp_all_gather.default


@dataclass(frozen=True)
class _Step:
    """One node between the lm_head and the cross-entropy, as the fold sees it."""

    node: fx.Node
    source: Argument
    """Its logits operand: the next node toward the lm_head (`_step` refuses one that is a constant)."""
    factor: Fraction = Fraction(1)
    """Constant the logits are multiplied by here (× c, ÷ c as 1/c, negation as -1), exact: Gemma2's
    ÷ c then × c folds to a scale of exactly 1."""
    tanh: bool = False
    scaled_by: fx.Node | None = None
    """A non-constant operand the logits are multiplied or divided by here."""
    gathered_over: str | None = None
    """The TP group (name) whose vocabulary shards of the logits are gathered here."""


@dataclass(frozen=True)
class _VocabShard:
    """This rank's rows of an lm_head split over the vocabulary across a TP group."""

    group_name: str
    tp: int
    vocab_start: int


@dataclass(frozen=True)
class _LossMatch:
    """A cross-entropy the pass can fuse, with everything the op needs besides the graph inputs."""

    linear: fx.Node
    chain: tuple[fx.Node, ...]
    """The nodes from the lm_head linear (first) to the cross-entropy's input (last)."""
    upcast: bool
    reduction: str
    ignore_index: int
    scale: float
    softcap: float | None
    shard: _VocabShard | None = None
    """Where the lm_head is split over the vocabulary across a TP group; None for a whole lm_head."""

    @property
    def op(self) -> torch._ops.OpOverload:
        """The op the cross-entropy becomes."""
        if self.shard is None:
            return torch.ops.bytescale.fused_linear_cross_entropy.default
        return torch.ops.bytescale.vocab_parallel_linear_cross_entropy.default


def is_cross_entropy(node: fx.Node) -> bool:
    return is_call(node, *_CROSS_ENTROPY)


def rewrite_loss(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Fuse the graph's losses, then those inside regions (a checkpointed lm_head and loss)."""
    result = PassResult(NAME)
    _rewrite_graph(gm.graph, result, ctx, gm.meta.get(PREVIOUS_GRAPH_BREAK), region=None)
    for region in find_regions(gm):
        _rewrite_graph(region.body.graph, result, ctx, None, region=region)
    return result


def _rewrite_graph(
    graph: fx.Graph, result: PassResult, ctx: PassContext, previous_break: str | None, *, region: Region | None
) -> None:
    for node in list(graph.nodes):
        if not is_cross_entropy(node):
            continue
        source = source_module(node)
        try:
            if not ctx.training:
                raise NotEquivalent(EVAL_MODE)
            match = _match(node, previous_break)
            if region is not None:
                _check_stays_inside(match.chain, region)
        except NotEquivalent as why:
            result.skipped.append(Skipped(node.name, "cross_entropy", source, str(why)))
            continue
        except Exception as error:  # a shape the matcher did not foresee: leave it alone, say so
            log.warning("fused_loss pass: cannot analyse %s (%s): %r", node.name, source, error)
            result.skipped.append(
                Skipped(node.name, "cross_entropy", source, f"matcher could not analyse it: {error!r}")
            )
            continue
        result.rewrites.append(
            Rewrite(
                node.name,
                str(match.op.overloadpacket),
                source,
                _fuse(graph, node, match, ctx.config.loss_workspace_bytes),
            )
        )


def _check_stays_inside(chain: tuple[fx.Node, ...], region: Region) -> None:
    """Logits a region returns cannot be emptied there: its callers' outputs are typed by the body's."""
    returned = [n.name for n in chain if n in region.body.graph.output_node().all_input_nodes]
    if returned:
        raise NotEquivalent(
            f"the logits {returned} leave the region `{region.calls[0].name}` they are computed in: "
            f"compute them and the loss in the same region (or outside it)"
        )


def _fuse(graph: fx.Graph, ce: fx.Node, match: _LossMatch, workspace_bytes: int) -> str:
    """Replace the cross-entropy by the fused op and the returned logits by empty tensors; the detail."""
    hidden, weight = match.linear.args[:2]
    args: tuple[Argument, ...] = (
        hidden,
        weight,
        arg(match.linear, 2, "bias"),
        arg(ce, 1, "target"),
        match.ignore_index,
        match.reduction,
        match.upcast,
        workspace_bytes,
        match.scale,
        match.softcap,
    )
    detail = f"reduction={match.reduction}, ignore_index={match.ignore_index}, upcast={match.upcast}"
    if match.shard is not None:
        args += (match.shard.group_name, match.shard.vocab_start)
        detail = f"vocabulary-parallel over TP {match.shard.tp}, {detail}"
    replace_with_op(graph, ce, match.op, args)
    if match.scale != 1.0:
        detail += f", logit scale={match.scale:g}"
    if match.softcap is not None:
        detail += f", final soft-cap={match.softcap:g}"
    returned = _drop_logits_outputs(graph, match.chain)
    if returned:
        detail += f"; returned logits ({', '.join(f'`{n}`' for n in returned)}) replaced by an empty tensor"
    return detail


def _match(ce: fx.Node, previous_break: str | None) -> _LossMatch:
    """Check the cross-entropy call, walk back to the lm_head linear and fold what lies between."""
    reduction, ignore_index = _check_cross_entropy(ce)
    logits = arg(ce, 0, "input")
    linear, steps = _walk_to_linear(logits, previous_break)
    chain = (linear, *reversed([s.node for s in steps]))
    _check_users(chain, ce)
    shard = _vocab_shard(linear, steps)
    if not same_size(value(logits).shape[-1], value(linear).shape[-1] * (1 if shard is None else shard.tp)):
        raise NotEquivalent(f"views between the lm_head `{linear.name}` and the loss change the vocabulary dimension")
    scale, softcap = _fold(steps)
    upcast = value(logits).dtype == torch.float32
    return _LossMatch(linear, chain, upcast, reduction, ignore_index, scale, softcap, shard)


def _vocab_shard(linear: fx.Node, steps: list[_Step]) -> _VocabShard | None:
    """The vocabulary shard of an lm_head whose logits are gathered over a TP group on the way to the loss."""
    gathers = [s for s in steps if s.gathered_over is not None]
    if not gathers:
        return None
    if len(gathers) > 1:
        raise NotEquivalent(f"logits gathered {len(gathers)} times ({', '.join(f'`{s.node.name}`' for s in gathers)})")
    gather, shard_rows = gathers[0], value(linear).shape[-1]
    if not same_size(value(gather.source).shape[-1], shard_rows):
        raise NotEquivalent(
            f"views between the lm_head `{linear.name}` and `{gather.node.name}` change the vocabulary dimension"
        )
    if not isinstance(shard_rows, int):
        raise NotEquivalent(f"the vocabulary shard of the lm_head `{linear.name}` has no fixed size ({shard_rows})")
    group_name = str(gather.gathered_over)
    return _VocabShard(group_name, tp_size(group_name), tp_rank(group_name) * shard_rows)


def _check_cross_entropy(ce: fx.Node) -> tuple[str, int]:
    """(reduction, ignore_index) of a cross-entropy call the op can compute; NotEquivalent otherwise."""
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
    logits_val, target_val = value(arg(ce, 0, "input")), value(arg(ce, 1, "target"))
    if logits_val is None or logits_val.dim() != 2:
        raise NotEquivalent("cross_entropy input is not 2-D [tokens, vocab]")
    if target_val is None or target_val.dtype != torch.int64 or target_val.dim() != 1:
        raise NotEquivalent("targets are not int64 class indices [tokens] (soft targets are not fused)")
    return reduction, ignore_index


def _walk_to_linear(logits: Argument, previous_break: str | None) -> tuple[fx.Node, list[_Step]]:
    """The lm_head linear and the steps from the cross-entropy's input back to it (input first)."""
    node, steps = logits, []
    while not is_call(node, *_LINEAR):
        step = _step(node, previous_break)
        steps.append(step)
        node = step.source
    return node, steps


def _step(node: Argument, previous_break: str | None) -> _Step:
    """What `node` does to the logits; NotEquivalent naming it when it is none of the foldable steps."""
    if not isinstance(node, fx.Node):
        raise NotEquivalent(f"the cross-entropy's input derives from the constant {node!r}, not from an lm_head")
    if node.op == "placeholder":
        raise NotEquivalent(_graph_input_reason(node, previous_break))
    if is_call(node, methods=_RESHAPES):
        return _Step(node, node.args[0])
    if is_call(node, methods=_CASTS):
        _check_cast(node)
        return _Step(node, node.args[0])
    if is_call(node, *_TANH, methods=_TANH_METHODS):
        return _Step(node, node.args[0], tanh=True)
    if is_call(node, *_NEG, methods=_NEG_METHODS):
        return _Step(node, node.args[0], factor=Fraction(-1))
    if is_call(node, *_MUL, methods=_MUL_METHODS):
        return _product(node)
    if is_call(node, *_DIV, methods=_DIV_METHODS):
        return _quotient(node)
    if is_call(node, _TP_ALL_GATHER):
        return _gather(node)
    raise NotEquivalent(
        f"logits come from `{node.name}` ({_describe(node)}); the fused loss takes the lm_head linear through "
        f"views, float casts, × or ÷ a constant, a tanh soft-cap and a gather over the TP group only"
    )


def _check_cast(node: fx.Node) -> None:
    """A cast the op reproduces: same dtype and device, or a widening to float32 (`upcast`)."""
    source, cast = value(node.args[0]), value(node)
    if not isinstance(source, torch.Tensor) or not isinstance(cast, torch.Tensor):
        raise NotEquivalent(f"cannot tell what `{node.name}` casts the logits to")
    if cast.device != source.device:
        raise NotEquivalent(f"`{node.name}` moves the logits from {source.device} to {cast.device}")
    if cast.dtype not in (source.dtype, torch.float32):
        raise NotEquivalent(
            f"`{node.name}` casts the logits from {source.dtype} to {cast.dtype}; only casts to float32 are fused"
        )


def _product(node: fx.Node) -> _Step:
    logits, other = node.args[0], arg(node, 1, "other")
    if _is_number(logits):
        logits, other = other, logits
    if _is_number(other):
        return _Step(node, logits, factor=_constant(node, other))
    if _rank(other) > _rank(logits):  # the logits are the [.., V] operand, the scale the smaller one
        logits, other = other, logits
    return _Step(node, logits, scaled_by=other)


def _quotient(node: fx.Node) -> _Step:
    logits, divisor = node.args[0], arg(node, 1, "other")
    if arg(node, 2, "rounding_mode") is not None:
        raise NotEquivalent(f"`{node.name}` divides the logits with rounding_mode={arg(node, 2, 'rounding_mode')!r}")
    if not isinstance(logits, fx.Node):
        raise NotEquivalent(f"`{node.name}` divides a constant by the logits")
    if _is_number(divisor):
        if divisor == 0:
            raise NotEquivalent(f"`{node.name}` divides the logits by 0")
        return _Step(node, logits, factor=1 / _constant(node, divisor))
    return _Step(node, logits, scaled_by=divisor)


def _gather(node: fx.Node) -> _Step:
    """A gather of the vocabulary shards of column-parallel logits: on their last dim, or not fusable."""
    logits, dim = node.args[0], arg(node, 1, "dim")
    ndim = value(node).dim()
    if dim % ndim != ndim - 1:
        raise NotEquivalent(f"`{node.name}` gathers the logits on dim {dim}, not on the vocabulary (last) dim")
    return _Step(node, logits, gathered_over=arg(node, 2, "group_name"))


def _constant(node: fx.Node, c: float) -> Fraction:
    if not math.isfinite(c):
        raise NotEquivalent(f"`{node.name}` scales the logits by {c}; only finite factors are fused")
    return Fraction(c)


def _fold(steps: list[_Step]) -> tuple[float, float | None]:
    """(scale, softcap) with logits = softcap · tanh(scale · z / softcap), from steps listed input first.

    A tanh with factors f_after after it and f_before before it gives f_after · tanh(f_before · z),
    which is the form above with softcap = |f_after| and scale = f_before · f_after.
    """
    scaled = [s for s in steps if s.scaled_by is not None]
    tanhs = [i for i, s in enumerate(steps) if s.tanh]
    if scaled:
        step = scaled[0]
        what = "a tensor" if isinstance(value(step.scaled_by), torch.Tensor) else "a non-constant"
        operand = f"{what} `{getattr(step.scaled_by, 'name', step.scaled_by)}` at `{step.node.name}`"
        if tanhs:
            raise NotEquivalent(f"logits soft-capped with a non-constant cap ({operand}); only constant caps are fused")
        raise NotEquivalent(f"logits scaled by {operand}; only constant factors are fused")
    if len(tanhs) > 1:
        names = ", ".join(f"`{steps[i].node.name}`" for i in tanhs)
        raise NotEquivalent(f"logits go through tanh {len(tanhs)} times ({names}); one final soft-cap is fused")
    if not tanhs:
        return _finite(math.prod(s.factor for s in steps)), None
    after, before = math.prod(s.factor for s in steps[: tanhs[0]]), math.prod(s.factor for s in steps[tanhs[0] :])
    if after == 0:
        raise NotEquivalent(f"logits soft-capped at 0 (tanh `{steps[tanhs[0]].node.name}` multiplied by 0)")
    return _finite(before * after), _finite(abs(after))


def _finite(factor: SupportsFloat) -> float:
    """The float nearest `factor`; NotEquivalent when it overflows (the fraction of two finite floats can)."""
    try:
        return float(factor)
    except OverflowError:
        raise NotEquivalent("logits scaled by a factor beyond float range") from None


def _check_users(chain: tuple[fx.Node, ...], ce: fx.Node) -> None:
    """Each node of the chain feeds only the next one (or the graph output, which the fusion empties)."""
    for node, consumer in zip(chain, (*chain[1:], ce)):
        others = [u.name for u in node.users if u is not consumer and u.op != "output"]
        if others:
            raise NotEquivalent(f"the logits `{node.name}` are also used by {others}, so they must be materialised")


def _graph_input_reason(node: fx.Node, previous_break: str | None) -> str:
    """Why logits that are an input of this graph cannot be fused, naming the graph break if one is known."""
    reason = f"the logits `{node.name}` are an input of this graph: the lm_head ran in an earlier graph"
    if previous_break:
        return f"{reason}, split from the loss by a graph break ({previous_break})"
    return f"{reason} (a graph break or a separately compiled loss function; TORCH_LOGS=graph_breaks shows breaks)"


def _drop_logits_outputs(graph: fx.Graph, chain: tuple[fx.Node, ...]) -> list[str]:
    """Replace the chain's nodes among the graph outputs by empty tensors; the names replaced."""
    output = graph.output_node()
    returned = [n for n in chain if n in output.all_input_nodes]
    for node in returned:
        val = value(node)
        with graph.inserting_before(output):
            empty = graph.call_function(torch.empty, ((0,),), {"dtype": val.dtype, "device": val.device})
        empty.meta["example_value"] = torch.empty((0,), dtype=val.dtype, device="meta")
        output.replace_input_with(node, empty)
    return [n.name for n in returned]


def _describe(node: fx.Node) -> str:
    if node.op == "call_method":
        return f"`.{node.target}()`"
    if node.op == "call_function":
        return f"`{getattr(node.target, '__name__', node.target)}`"
    return f"a {node.op} `{node.target}`"


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _rank(x: object) -> int:
    val = value(x)
    return val.dim() if isinstance(val, torch.Tensor) else 0
