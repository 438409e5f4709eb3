"""Token-mixer analysis: every op whose output at token t reads the inputs of other tokens.

Packing sequences into one row and splitting a sequence over ranks are right only for ops that keep tokens
apart, and for the mixers we rewrite: softmax attention becomes `bytescale::attention`, which knows the
packed segments and the ring. Hybrid models mix tokens in other ways too: short convolutions (LFM2),
selective scans and SSD chunk loops (Mamba, Mamba2, Bamba, Jamba), gated delta rules and linear attention
(Qwen3-Next). Left as they are, each runs straight through packed sequence boundaries, and over a rank's
zigzag chunks only. This pass finds them by what they do to the token dimension, not by name:

    conv*(x, w)                    with a token dim among x's spatial dims and a kernel longer than 1
    cumsum / cumprod / ...(x, d)   along a token dim
    matmul / einsum / linear       contracting a token dim (k^T v of linear attention, a chunk recurrence)
    softmax(x, d)                  along a token dim (an attention the attention pass left alone)
    sum / mean / amax ...(x, d)    over a token dim, when the result flows back into a tensor with token dims
    roll / flip / x[:, 1:] / x[:, ::2] / pad in front / cat after a prefix   along a token dim (a shift)
    scan / associative_scan        over tensors with a token dim

A token dim is one whose size is an expression of the token count T (dim 1 of `input_ids`): T, T + k - 1,
ceil(T / 64) chunks and 2 T all count, so reshapes into chunks keep their tokens visible. With a static token
dimension (`CompileConfig(dynamic=False)`) dims equal to T count, which may over-report. Every op found is left
alone and reported; the runtime then neither packs nor shards the model.

The mixers of known Hugging Face modules were swapped for the segment-aware `bytescale::causal_conv1d` and
`bytescale::scan` before capture (`capture/mixers.py`); the pass lists each of those calls as rewritten.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import fx

from ..ops.mixers import boundary_bytes
from .graph import ATTENTION_SITE, source_module, value
from .manager import PassContext
from .regions import find_regions
from .report import TOKEN_MIXERS_PASS as NAME
from .report import PassResult, Rewrite, Skipped

__all__ = ["find_token_mixers", "mixers_in", "token_dims", "NAME"]

_CONVS = {"conv1d", "conv2d", "conv3d", "convolution", "conv_transpose1d", "conv_transpose2d"}
_CUMULATIVE = {"cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "cumsum_", "cumprod_"}
_NORMALISE = {"softmax", "log_softmax", "_softmax", "softmin"}
_REDUCE = {
    "sum",
    "mean",
    "amax",
    "amin",
    "max",
    "min",
    "prod",
    "logsumexp",
    "var",
    "std",
    "norm",
    "nansum",
    "nanmean",
    "all",
    "any",
    "count_nonzero",
    "argmax",
    "argmin",
    "median",
    "var_mean",
    "std_mean",
}
_CONTRACT = {
    "matmul",
    "bmm",
    "mm",
    "baddbmm",
    "addmm",
    "addbmm",
    "__matmul__",
    "__rmatmul__",
    "einsum",
    "linear",
    "tensordot",
    "mv",
    "dot",
    "bilinear",
}
_SHIFT = {"roll", "flip", "fliplr", "flipud"}
_SCANS = {"scan", "associative_scan", "while_loop"}
_CAT = {"cat", "concat", "concatenate", "hstack"}


@dataclass(frozen=True)
class _Found:
    pattern: str
    """What the op does to the tokens, as the report names it."""
    detail: str = ""


def find_token_mixers(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Report every token-mixing op of `gm` that is not a rewritten attention, with its module and pattern."""
    result = PassResult(NAME)
    graphs: list[tuple[fx.Graph, Callable[[str], list[str]]]] = [(gm.graph, lambda source: [source])]
    graphs += [(r.body.graph, r.sources) for r in find_regions(gm)]
    for graph, sources in graphs:
        for node in graph.nodes:
            rewritten = _segment_aware(node)
            if rewritten is not None:
                for source in sources(source_module(node)):
                    result.rewrites.append(Rewrite(node.name, str(node.target), source, *rewritten))
    tokens = _TokenDims.of(gm)
    if tokens is None:
        return result
    reported: set[tuple[str, str]] = set()
    for graph, sources in graphs:
        attention_sites = {source_module(n) for n in graph.nodes if n.meta.get(ATTENTION_SITE)}
        for node, what in mixers_in(graph, tokens):
            if source_module(node) in attention_sites:
                continue
            for source in sources(source_module(node)):
                if (source, what) not in reported:
                    reported.add((source, what))
                    result.skipped.append(Skipped(node.name, _op_name(node) or str(node.target), source, what))
    return result


def token_dims(gm: fx.GraphModule) -> _TokenDims | None:
    """Which dims of the values traced in `gm` (and the graphs it calls) hold tokens; None without input_ids."""
    return _TokenDims.of(gm)


def mixers_in(graph: fx.Graph, tokens: _TokenDims) -> Iterator[tuple[fx.Node, str]]:
    """Each token-mixing node of `graph` with what it does, as the report names it."""
    for node, found in _mixers(graph, tokens):
        yield node, f"{found.pattern} ({found.detail})" if found.detail else found.pattern


_SCAN_PATTERNS = {"ssd": "Mamba2 SSD scan", "selective": "selective scan (Mamba)", "gated_delta": "gated delta rule"}


def _segment_aware(node: fx.Node) -> tuple[str, int] | None:
    """What a call of our segment-aware mixer ops computes, as the report names it, and the bytes a chunk
    boundary moves for it (`ops.mixers.boundary_bytes`); None for any other node."""
    if node.op != "call_function":
        return None
    if node.target in (torch.ops.bytescale.causal_conv1d, torch.ops.bytescale.causal_conv1d.default):
        x, w = value(node.args[0]), value(node.args[1])
        return f"causal convolution (kernel {w.shape[1]})", boundary_bytes("conv", [x, w])
    if node.target in (torch.ops.bytescale.scan, torch.ops.bytescale.scan.default):
        kind, inputs = str(node.args[0]), [value(a) for a in cast(list, node.args[1])]
        return _SCAN_PATTERNS.get(kind, kind), boundary_bytes(kind, inputs)
    return None


class _TokenDims:
    """Which dims of a traced value hold tokens, from their sizes."""

    def __init__(self, symbols: frozenset, static: int | None) -> None:
        self.symbols, self.static = symbols, static

    @classmethod
    def of(cls, gm: fx.GraphModule) -> _TokenDims | None:
        """From dim 1 of the `[B, T]` integer input (input_ids); None for a graph without one."""
        for node in gm.graph.find_nodes(op="placeholder"):
            t = value(node)
            if isinstance(t, torch.Tensor) and t.dim() == 2 and not t.is_floating_point() and t.dtype != torch.bool:
                size = t.shape[1]
                if isinstance(size, torch.SymInt):
                    return cls(frozenset(size.node.expr.free_symbols), None)
                return cls(frozenset(), int(size))
        return None

    def is_token(self, size: Any) -> bool:
        if isinstance(size, torch.SymInt):
            return bool(self.symbols & size.node.expr.free_symbols)
        return self.static is not None and size == self.static

    def dims(self, t: Any) -> set[int]:
        if not isinstance(t, torch.Tensor):
            return set()
        return {d for d, size in enumerate(t.shape) if self.is_token(size)}

    def has(self, t: Any) -> bool:
        return bool(self.dims(t))


def _mixers(graph: fx.Graph, tokens: _TokenDims) -> Iterator[tuple[fx.Node, _Found]]:
    """Each mixing node with what it does; reductions over tokens when their result returns to token dims."""
    reduced: dict[fx.Node, set[fx.Node]] = {}
    """node -> the reductions over tokens whose result it carries"""
    returned: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        carried = set().union(*(reduced.get(a, ()) for a in node.all_input_nodes))
        out = value(node)
        found = _classify(node, tokens)
        if found is not None and found.pattern == _REDUCTION:
            carried.add(node)
        elif found is not None:
            yield node, found
        if carried and any(tokens.has(t) for t in _tensors(out)):
            for r in sorted(carried - returned, key=lambda n: n.name):
                returned.add(r)
                yield r, _Found(_REDUCTION, f"`{_op_name(r)}` comes back to the token dimension")
            carried = set()
        if carried:
            reduced[node] = carried


_REDUCTION = "reduction over tokens"


def _classify(node: fx.Node, tokens: _TokenDims) -> _Found | None:
    """What `node` does to the tokens, or None when it keeps them apart.

    Only floating-point values count: integer and boolean work over tokens (a mask from position_ids
    restarts, routing indices) computes where tokens go, not what they carry; the attention pass proves masks.
    """
    name = _op_name(node)
    if name is None or not any(t.is_floating_point() for t in _tensors(value(node))) or _segment_aware(node):
        return None
    args = list(node.args)
    x = value(args[0]) if args else None
    dims = tokens.dims(x)
    if name in _SCANS:
        if any(tokens.has(t) for a in node.all_input_nodes for t in _tensors(value(a))):
            return _Found("scan over tokens", name)
        return None
    if name in _CONTRACT:
        return _contraction(name, node, args, tokens)
    if name in _CAT:
        return _cat(node, args, tokens)
    if not dims or not isinstance(x, torch.Tensor):  # `dims` finds token dims on a tensor only
        return None
    if name in _CONVS:
        w = value(_arg(node, args, 1, "weight"))
        kernel = tuple(w.shape[2:]) if isinstance(w, torch.Tensor) else ()
        spatial = [d for d in dims if d >= 2]
        if spatial and any(k != 1 for k in kernel):
            return _Found("convolution over tokens", f"kernel {'x'.join(map(str, kernel))}")
        return None
    if name in _CUMULATIVE:
        return _Found("cumulative op over tokens", name) if _dim_arg(node, args, x) & dims else None
    if name in _NORMALISE:
        return _Found("softmax over tokens", name) if _dim_arg(node, args, x) & dims else None
    if name in _REDUCE:
        if name in ("max", "min") and isinstance(value(_arg(node, args, 1, "other")), torch.Tensor):
            return None  # elementwise max(a, b)
        return _Found(_REDUCTION) if _dim_arg(node, args, x, all_by_default=True) & dims else None
    if name in _SHIFT:
        return _Found("shift along tokens", name) if _dim_arg(node, args, x, key="dims") & dims else None
    if name == "pad":
        return _pad(node, args, x, dims)
    if name in ("getitem", "__getitem__"):
        return _slice(node, args, x, dims)
    if name in ("select", "unbind"):
        return _Found(_REDUCTION) if _dim_arg(node, args, x, default=0) & dims else None
    return None


def _contraction(name: str, node: fx.Node, args: list, tokens: _TokenDims) -> _Found | None:
    if name == "einsum":
        return _einsum(node, args, tokens)
    if name in ("baddbmm", "addmm", "addbmm"):
        args = args[1:]
    a = value(args[0]) if args else None
    if isinstance(a, torch.Tensor) and a.dim() >= 1 and tokens.is_token(a.shape[-1]):
        return _Found("contraction over tokens", name)
    return None


def _einsum(node: fx.Node, args: list, tokens: _TokenDims) -> _Found | None:
    equation = args[0] if args and isinstance(args[0], str) else None
    operands = list(args[1:])
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    if equation is None or "->" not in equation:
        return None
    inputs, output = equation.replace(" ", "").split("->")
    kept = set(output)
    for spec, operand in zip(inputs.split(","), operands):
        t = value(operand)
        if not isinstance(t, torch.Tensor):
            continue
        letters = _einsum_letters(spec, t.dim())
        if any(
            letter not in kept and letter != "." and tokens.is_token(size) for letter, size in zip(letters, t.shape)
        ):
            return _Found("contraction over tokens", f"einsum {equation}")
    return None


def _einsum_letters(spec: str, ndim: int) -> str:
    """One character per dim, with '.' for each dim an ellipsis stands for."""
    if "..." not in spec:
        return spec
    before, after = spec.split("...")
    return before + "." * (ndim - len(before) - len(after)) + after


def _cat(node: fx.Node, args: list, tokens: _TokenDims) -> _Found | None:
    """Concatenation along a token dim after a part of fixed size: the tokens shift by that part (a conv state)."""
    parts = [value(p) for p in (args[0] if args and isinstance(args[0], (list, tuple)) else [])]
    parts = [p for p in parts if isinstance(p, torch.Tensor)]
    if not parts:
        return None
    dim = _arg(node, args, 1, "dim", 0)
    if not isinstance(dim, int):
        return None
    dim %= parts[0].dim()
    along = [tokens.is_token(p.shape[dim]) for p in parts]
    if any(along) and not along[0]:
        return _Found("shift along tokens", "cat after a prefix")
    return None


def _pad(node: fx.Node, args: list, x: torch.Tensor, dims: set[int]) -> _Found | None:
    """`F.pad` pads the last dims first, (left, right) each: padding in front of the tokens shifts them."""
    pad = _arg(node, args, 1, "pad", ())
    for i in range(0, len(pad), 2):
        dim = x.dim() - 1 - i // 2
        if dim in dims and not (isinstance(pad[i], int) and pad[i] == 0):
            return _Found("shift along tokens", "pad in front")
    return None


def _slice(node: fx.Node, args: list, x: torch.Tensor, dims: set[int]) -> _Found | None:
    """`x[..., 1:]` or `x[:, ::2]` along a token dim reads other tokens than the position it writes."""
    index = args[1] if len(args) > 1 else None
    items = index if isinstance(index, tuple) else (index,)
    if Ellipsis in items:
        at = items.index(Ellipsis)
        consumed = sum(1 for i in items if i is not None and i is not Ellipsis)
        items = items[:at] + (slice(None),) * (x.dim() - consumed) + items[at + 1 :]
    dim = 0
    for item in items:
        if item is None:
            continue
        if dim in dims:
            if isinstance(item, slice) and (_nonzero(item.start) or item.step not in (None, 1)):
                return _Found("shift along tokens", "slice not from the first token")
            if isinstance(item, int) or (isinstance(item, fx.Node) and not isinstance(value(item), torch.Tensor)):
                return _Found(_REDUCTION)
        dim += 1
    return None


def _nonzero(start: Any) -> bool:
    return start is not None and not (isinstance(start, int) and start == 0)


def _dim_arg(
    node: fx.Node, args: list, x: torch.Tensor, *, key: str = "dim", default: Any = None, all_by_default: bool = False
) -> set[int]:
    dim = _arg(node, args, 1, key, default)
    if dim is None:
        return set(range(x.dim())) if all_by_default else set()
    dims = dim if isinstance(dim, (list, tuple)) else (dim,)
    return {d % x.dim() for d in dims if isinstance(d, int)} if x.dim() else set()


def _op_name(node: fx.Node) -> str | None:
    if node.op == "call_method":
        return cast(str, node.target)  # a method's name
    target = node.target
    if isinstance(target, torch._ops.HigherOrderOperator):
        return target.name()
    if target is operator.getitem:
        return "getitem"
    name = getattr(target, "__name__", None)
    return re.sub(r"^_?torch_", "", name) if isinstance(name, str) else None


def _arg(node: fx.Node, args: list, index: int, key: str, default: Any = None) -> Any:
    if len(args) > index:
        return args[index]
    return node.kwargs.get(key, default)


def _tensors(v: Any) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for item in v for t in _tensors(item)]
    return []
