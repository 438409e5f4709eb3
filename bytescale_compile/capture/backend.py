"""The `torch.compile` backend: passes on the Dynamo graph, AOTAutograd, passes on the partitioned graphs.

    Dynamo graph ──PassManager (attention, fused_loss)──▶ aot_module_simplified
        └─ joint graph ──partition hook (default or min-cut)──▶ forward graph + backward graph
                                 └─ saved-activation table ──offload pass──▶ offload/reload ops
                                       └─ CompileConfig.codegen: FX code over aten ops, or Inductor (`codegen.py`)

With codegen "none" the partitioned graphs run as FX code over aten ops: no code generation stands
between a user and their eager model's numerics. With "inductor" the same passes and partition hook
run inside Inductor's pipeline and the elementwise work around our ops is fused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from functorch.compile import make_boxed_func
from torch import fx
from torch._functorch.aot_autograd import aot_module_simplified
from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

from ..config import CompileConfig
from ..kernels.attention_ref import AttentionMask
from ..kernels.dispatch import AttentionCall, AttentionChoice, attention_backend, choose, explain_attention
from ..ops import KERNEL_OPS, REFERENCE_OPS
from ..passes.attention import NAME as ATTENTION
from ..passes.attention import rewrite_attention
from ..passes.graph import value as fake_value
from ..passes.loss import NAME as FUSED_LOSS
from ..passes.loss import PREVIOUS_GRAPH_BREAK, rewrite_loss
from ..passes.manager import Pass, PassContext, PassManager
from ..passes.offload import NAME as OFFLOAD
from ..passes.offload import apply_offload
from ..passes.opaque import NAME as OPAQUE
from ..passes.opaque import find_opaque_regions
from ..passes.regions import has_regions
from ..passes.report import CompileReport, GraphReport, PassResult
from ..passes.token_mixers import NAME as TOKEN_MIXERS
from ..passes.token_mixers import find_token_mixers
from ..runtime.context import current_context
from .codegen import compile_with_inductor
from .saved import saved_activations

__all__ = ["Backend", "default_passes", "ShardingError"]


class ShardingError(RuntimeError):
    """A model is asked to run a packed row or a shared sequence that one of its token mixers (an attention
    the pass left alone, a convolution, a scan) would read across."""


log = logging.getLogger(__name__)
ATTENTION_OP = "bytescale::attention"
REGIONS_HIDE_SAVED = (
    "layers compiled once (CompileConfig.compile_layers_once): the tensors each layer saves for its "
    "backward are made inside one body shared by every layer, which the offload pass cannot tell apart"
)


def default_passes() -> list[Pass]:
    """The pre-autograd passes in the order they run; then the analyses of what they left: token mixers, and what
    hides inside regions no pass looked into."""
    return [
        Pass(ATTENTION, rewrite_attention, enabled_by="attention"),
        Pass(FUSED_LOSS, rewrite_loss, enabled_by="fused_loss"),
        Pass(TOKEN_MIXERS, find_token_mixers),
        Pass(OPAQUE, find_opaque_regions),
    ]


class Backend:
    """One per optimized module and mode (train/eval), so reports and caches never mix. `graph_ids` numbers the
    graphs in the reports: the module's two backends share one, so its graphs never share a number."""

    def __init__(
        self, config: CompileConfig, training: bool, on_graph: Callable[[GraphReport], None], graph_ids: Iterator[int]
    ) -> None:
        self.config = config
        self.training = training
        self.on_graph = on_graph
        self.graph_ids = graph_ids
        self.pass_manager = PassManager(default_passes())
        self.compilations = 0
        self.last_graph_break: str | None = None  # the latest break that ended one of our graphs, for later ones
        self._breaks_seen = 0

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        self.compilations += 1
        report = GraphReport(graph_id=next(self.graph_ids))
        keep_text = self.config.keep_graph_text
        if keep_text:
            report.graph_before = gm.print_readable(print_output=False)
        if self.last_graph_break:
            gm.meta[PREVIOUS_GRAPH_BREAK] = self.last_graph_break
        report.passes = self.pass_manager.run(gm, PassContext(self.config, self.training))
        _set_attention_backend(gm, self.config.attention_backend)
        self._note_graph_break(gm)
        if keep_text:
            report.graph_after = gm.print_readable(print_output=False)
        log.info(
            "graph %d: %s", report.graph_id, ", ".join(f"{p.name}: {len(p.rewrites)} rewritten" for p in report.passes)
        )
        device_type = _device_type(example_inputs)
        report.kernels, report.kernel_notes = _kernel_choices(gm, device_type)
        self.on_graph(report)
        _refuse_unshardable(report)
        partitioner = self.config.resolve_partitioner(device_type)
        regions = has_regions(gm)
        if self.config.resolve_codegen(device_type) == "inductor":
            partition = self._partition_fn(report, partitioner, regions, inductor=True)
            return compile_with_inductor(gm, example_inputs, self.config, report, partition)
        return aot_module_simplified(
            gm,
            example_inputs,
            fw_compiler=self._graph_compiler(report, "forward_graph"),
            bw_compiler=self._graph_compiler(report, "backward_graph"),
            partition_fn=self._partition_fn(report, partitioner, regions),
            keep_inference_input_mutations=True,
        )

    def _note_graph_break(self, gm: fx.GraphModule) -> None:
        """Remember the break that ends `gm`, if one does, as its first cause Dynamo recorded and its line.

        A break inside a nested call ends the graph with a generic reason at the outer call's line;
        the cause (e.g. a `logger.warning_once` in a property) is the earliest of the reasons Dynamo
        recorded since this backend's previous graph.
        """
        recorded = torch._dynamo.utils.graph_break_reasons
        if self._breaks_seen > len(recorded):  # torch._dynamo.reset() cleared them
            self._breaks_seen = 0
        new, self._breaks_seen = recorded[self._breaks_seen :], len(recorded)
        reason = getattr(gm, "compile_subgraph_reason", None)
        if reason is None or not reason.graph_break:
            return
        cause = new[0] if new else reason
        message = cause.reason.strip().splitlines()[0]
        where = cause.user_stack[-1] if cause.user_stack else None
        self.last_graph_break = f"{message}, at {where.filename}:{where.lineno} in {where.name}" if where else message

    def _partition_fn(self, report: GraphReport, partitioner: str, regions: bool, inductor: bool = False) -> Callable:
        """Our hook around `partitioner`. With `regions` (layers compiled once) it is also called for each layer
        body, whose saved tensors are those of every layer at once: bodies are split as they are, untouched."""
        base = min_cut_rematerialization_partition if partitioner == "min_cut" else default_partition

        def partition(joint: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **kwargs: Any):
            if base is default_partition:  # Inductor names itself as `compiler`, for min-cut's recompute choices
                kwargs.pop("compiler", None)
            fw, bw = base(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
            if regions and not has_regions(fw):  # a layer body, partitioned while tracing the graph that calls it
                return fw, bw
            inputs = [n.meta.get("val") for n in fw.graph.find_nodes(op="placeholder")]
            token_size = _token_size(inputs)
            if not isinstance(token_size, torch.SymInt):  # with static sizes any size equal to T looks like tokens
                report.saved_activations_note = "needs a dynamic token dimension (CompileConfig(dynamic=True))"
                return fw, bw
            table = saved_activations(fw, num_fwd_outputs, token_size)
            if self.config.offload == "off":
                report.passes.append(PassResult(OFFLOAD, disabled='CompileConfig.offload="off"'))
            elif regions:
                log.info("graph %d: offload pass off: %s", report.graph_id, REGIONS_HIDE_SAVED)
                report.passes.append(PassResult(OFFLOAD, disabled=REGIONS_HIDE_SAVED))
            else:
                result, table = apply_offload(fw, bw, num_fwd_outputs, table, token_size, contiguous_only=inductor)
                report.passes.append(result)
            report.saved_activations = table
            return fw, bw

        return partition

    def _graph_compiler(self, report: GraphReport, slot: str) -> Callable:
        def compile_graph(gm: fx.GraphModule, example_inputs: Any) -> Callable:
            if self.config.keep_graph_text:
                setattr(report, slot, gm.print_readable(print_output=False))
            return make_boxed_func(gm.forward)

        return compile_graph


def _refuse_unshardable(report: GraphReport) -> None:
    """A graph first compiled inside a shared or packed micro-batch must run every token mixer segment-aware.

    The runtime plans from the compile report, so this fires only for a graph that appears mid-step
    (a recompilation): better to stop than to read this rank's chunks only, or across the packed sequences.
    """
    ctx = current_context()
    if ctx is None or not (ctx.is_ring or len(ctx.seq_lens) > 1):
        return
    blockers = CompileReport(graphs=[report]).shard_blockers()
    if blockers:
        what = (
            f"shared by ranks {list(ctx.group)}"
            if ctx.is_ring and ctx.group is not None
            else f"a row of {len(ctx.seq_lens)} packed sequences"
        )
        raise ShardingError(
            f"micro-batch {ctx.micro_batch_id} is {what}, but a graph compiled for it cannot run "
            f"it: {'; '.join(blockers)}"
        )


def _nodes(gm: fx.GraphModule) -> Iterator[fx.Node]:
    """Every node of the graph and of the graphs nested in it (layer bodies compiled once)."""
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            yield from module.graph.nodes


def _attention_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [node for node in _nodes(gm) if node.target is torch.ops.bytescale.attention.default]


def _set_attention_backend(gm: fx.GraphModule, backend: str) -> None:
    """`CompileConfig.attention_backend` onto every attention op of the graph, which scopes its kernel calls (local and
    ring) with it when it runs: the graph, not the process, carries the model's choice."""
    if backend == "auto":
        return
    for node in _attention_nodes(gm):
        node.kwargs = {**node.kwargs, "backend": backend}
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            module.recompile()


def _op_arguments(node: fx.Node) -> dict[str, Any]:
    """The call's arguments by name, defaults filled in."""
    schema = node.target._schema
    defaults = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    return {**defaults, **dict(zip((a.name for a in schema.arguments), node.args)), **node.kwargs}


def _attention_choice(node: fx.Node) -> AttentionChoice | None:
    """What the attention table chooses for the node's q/k/v as self-attention segments of any packing (ring
    blocks choose per block when they run), in the dtype the op runs in: the autocast one under autocast.
    None when the trace recorded no values for them."""
    args = _op_arguments(node)
    q, k, v = (fake_value(args[name]) for name in ("q", "k", "v"))
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return None
    device_type = q.device.type
    autocast = device_type != "meta" and torch.is_autocast_enabled(device_type)  # meta: a memory probe, no autocast
    dtype = torch.get_autocast_dtype(device_type) if autocast else None
    dtypes = (dtype, dtype, dtype) if dtype is not None else (q.dtype, k.dtype, v.dtype)
    call = AttentionCall(
        q.device, dtypes, int(q.shape[-1]), int(v.shape[-1]), args["softcap"], AttentionMask(True, args["window"])
    )
    with attention_backend(args["backend"], source="CompileConfig.attention_backend"):
        return explain_attention(call)


def _kernel_choices(gm: fx.GraphModule, device_type: str) -> tuple[dict[str, str], dict[str, str]]:
    """(each of our `KERNEL_OPS` the graph calls, in nested regions too -> the kernels it runs on these inputs,
    recorded now rather than read back from the ops later; the attention op -> why the backends before its
    own in the table were passed over). A backend asked for by name that cannot serve the graph raises now."""
    called = {node.target.name() for node in _nodes(gm) if isinstance(node.target, torch._ops.OpOverload)}
    kernels = {op: choose(torch.device(device_type)) for op in KERNEL_OPS if op in called and op != ATTENTION_OP}
    kernels |= {op: "reference" for op in REFERENCE_OPS if op in called}
    choices = {c for c in map(_attention_choice, _attention_nodes(gm)) if c is not None}
    notes = {}
    if choices:
        kernels[ATTENTION_OP] = ", ".join(sorted({c.backend for c in choices}))
        passed_over = sorted({f"{name}: {why}" for c in choices for name, why in c.passed_over})
        if passed_over:
            notes[ATTENTION_OP] = "; ".join(passed_over)
    return kernels, notes


def _device_type(example_inputs: list[Any]) -> str:
    """The device the graph runs on: that of its first tensor input (CPU when it has none)."""
    return next((t.device.type for t in example_inputs if isinstance(t, torch.Tensor)), "cpu")


def _token_size(inputs: list[Any]) -> int | torch.SymInt | None:
    """The token dimension: dim 1 of the `[B, T]` integer input (input_ids), else the first dynamic dim 1."""
    tensors = [t for t in inputs if isinstance(t, torch.Tensor) and t.dim() >= 2]
    ids = [t for t in tensors if not t.is_floating_point() and t.dim() == 2]
    dynamic = [t for t in tensors if isinstance(t.shape[1], torch.SymInt)]
    for t in ids or dynamic:
        return t.shape[1]
    return None
