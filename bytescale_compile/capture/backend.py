"""The `torch.compile` backend: passes on the Dynamo graph, AOTAutograd, passes on the partitioned graphs.

    Dynamo graph ──PassManager (attention, fused_loss)──▶ aot_module_simplified
        └─ joint graph ──partition hook (default or min-cut)──▶ forward graph + backward graph
                                 └─ saved-activation table ──offload pass──▶ offload/reload nodes

The partitioned graphs run as FX code over aten ops: the rewrites themselves are where the time and
memory go, and no code generation stands between a user and their eager model's numerics.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

import torch
from functorch.compile import make_boxed_func
from torch import fx
from torch._functorch.aot_autograd import aot_module_simplified
from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

from ..config import Config
from ..passes.attention import NAME as ATTENTION, rewrite_attention
from ..passes.loss import NAME as FUSED_LOSS, rewrite_loss
from ..passes.manager import Pass, PassContext, PassManager
from ..passes.offload import NAME as OFFLOAD, apply_offload
from ..passes.report import GraphReport, PassResult
from .saved import saved_activations

__all__ = ["Backend", "default_passes"]

log = logging.getLogger(__name__)
_graph_ids = itertools.count()


def default_passes() -> list[Pass]:
    """The pre-autograd passes in the order they run."""
    return [
        Pass(ATTENTION, rewrite_attention, enabled_by="attention"),
        Pass(FUSED_LOSS, rewrite_loss, enabled_by="fused_loss"),
    ]


class Backend:
    """One per optimized module and mode (train/eval), so reports and caches never mix."""

    def __init__(self, config: Config, training: bool, on_graph: Callable[[GraphReport], None]) -> None:
        self.config = config
        self.training = training
        self.on_graph = on_graph
        self.pass_manager = PassManager(default_passes())
        self.compilations = 0

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        self.compilations += 1
        report = GraphReport(graph_id=next(_graph_ids))
        keep_text = self.config.keep_graph_text
        if keep_text:
            report.graph_before = gm.print_readable(print_output=False)
        report.passes = self.pass_manager.run(gm, PassContext(self.config, self.training))
        if keep_text:
            report.graph_after = gm.print_readable(print_output=False)
        log.info("graph %d: %s", report.graph_id,
                 ", ".join(f"{p.name}: {len(p.rewrites)} rewritten" for p in report.passes))
        self.on_graph(report)
        return aot_module_simplified(
            gm,
            example_inputs,
            fw_compiler=self._graph_compiler(report, "forward_graph"),
            bw_compiler=self._graph_compiler(report, "backward_graph"),
            partition_fn=self._partition_fn(report),
            keep_inference_input_mutations=True,
        )

    def _partition_fn(self, report: GraphReport) -> Callable:
        base = min_cut_rematerialization_partition if self.config.partitioner == "min_cut" else default_partition

        def partition(joint: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **kwargs: Any):
            fw, bw = base(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
            inputs = [n.meta.get("val") for n in fw.graph.find_nodes(op="placeholder")]
            token_size = _token_size(inputs)
            if not isinstance(token_size, torch.SymInt):  # with static sizes any size equal to T looks like tokens
                report.saved_activations_note = "needs a dynamic token dimension (Config(dynamic=True))"
                return fw, bw
            table = saved_activations(fw, num_fwd_outputs, token_size)
            if self.config.offload == "off":
                report.passes.append(PassResult(OFFLOAD, disabled='Config.offload="off"'))
            else:
                result, table = apply_offload(fw, bw, num_fwd_outputs, table, token_size)
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


def _token_size(inputs: list[Any]) -> int | torch.SymInt | None:
    """The token dimension: dim 1 of the `[B, T]` integer input (input_ids), else the first dynamic dim 1."""
    tensors = [t for t in inputs if isinstance(t, torch.Tensor) and t.dim() >= 2]
    ids = [t for t in tensors if not t.is_floating_point() and t.dim() == 2]
    dynamic = [t for t in tensors if isinstance(t.shape[1], torch.SymInt)]
    for t in ids or dynamic:
        return t.shape[1]
    return None
