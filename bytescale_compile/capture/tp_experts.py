"""Hugging Face MoE experts sharded inside the TP group, in one of two layouts.

Hugging Face 5.x holds a layer's experts as one module with fused parameters (`gate_up_proj` [E, 2I, H],
`down_proj` [E, H, I], gpt-oss transposed and with biases) that its plans mark `moe_tp_experts` (or
`ep_dispatch_experts` in `base_model_ep_plan`). `tensor_parallel` shards such a module itself, as DTensors:

    ep   expert-parallel inside the TP group: each rank holds E/tp whole experts (Shard(0) of every parameter)
    tp   TP experts: each expert split like a dense MLP, gate_up by columns (gate and up halves alike:
         `_StridedShard(1, split_factor=2)`) and down by rows (Shard(2))

A TP group's ranks hold the same tokens, so in both layouts each rank computes its share of the output for
every token (its experts' tokens, or its slice of every expert) and one all-reduce sums the shares: the
row-parallel all-reduce a dense MLP does. No all-to-all, and no lockstep across HDP ranks, whose micro-batch
counts differ (see docs/tensor-parallel.md). The local forward is `capture/tensor_parallel.py`'s.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from ..strategies import ExpertLayout, chosen_expert_layout
from .tensor_parallel import EXPERTS_LAYOUT, TensorParallelError

__all__ = ["ExpertLayout", "ExpertsStyle", "EXPERTS_STYLE", "experts_style", "shard_experts"]

log = logging.getLogger(__name__)

EXPERTS_STYLE = "moe_tp_experts"
"""The plan style (Hugging Face's name) of an experts module; its parameters' own entries
(`experts.gate_up_proj: packed_colwise`, `experts.down_proj: rowwise`) are what the layout below does."""


@dataclass(frozen=True)
class ExpertsStyle:
    """How one experts module is sharded: the layout and each parameter's placement."""

    layout: Literal["ep", "tp"]
    num_experts: int
    placements: dict[str, Placement]


def _recognised(module: nn.Module) -> bool:
    """A Hugging Face experts module (`@use_experts_implementation`): fused 3-D parameters, one row per expert."""
    params = module._parameters
    weights = ("gate_up_proj", "down_proj") if getattr(module, "has_gate", None) else ("up_proj", "down_proj")
    return (
        isinstance(getattr(module, "num_experts", None), int)
        and hasattr(module, "is_transposed")
        and all(params.get(w) is not None and params[w].dim() == 3 for w in weights)
        and all(p.shape[0] == module.num_experts for p in params.values() if p is not None)
    )


def experts_style(path: str, module: nn.Module, tp_size: int, layout: ExpertLayout) -> ExpertsStyle:
    """The style of the experts module at `path`, after refusing what would split unevenly or wrongly."""
    where = f"experts `{path}` ({type(module).__name__})"
    if not _recognised(module):
        raise TensorParallelError(
            f"{where}: not a Hugging Face experts module this compiler knows (fused 3-D gate_up_proj/down_proj, one "
            f"row per expert, from @use_experts_implementation); shard it with your own plan or train without tp"
        )
    if getattr(module, "has_post_expert_norm", False):
        raise TensorParallelError(
            f"{where}: a norm after each expert (has_post_expert_norm) needs every expert's whole output and sums "
            f"its gradient over the experts, which neither layout does; train this model without tp"
        )
    experts = int(module.num_experts)  # type: ignore[arg-type]
    chosen = chosen_expert_layout(layout, experts=experts, tp=tp_size)
    if layout == "auto":
        log.info("%s: %s layout (%d experts, tp %d)", where, chosen, experts, tp_size)
    if chosen == "ep":
        if experts % tp_size:
            raise TensorParallelError(
                f"{where}: {experts} experts are not divisible by tp {tp_size}, so the TP ranks cannot hold whole "
                f"experts each; use expert_layout='tp' (--expert-layout tp: every expert split like a dense MLP)"
            )
        return ExpertsStyle("ep", experts, {n: Shard(0) for n, p in module._parameters.items() if p is not None})
    return ExpertsStyle("tp", experts, _split_placements(where, module, tp_size))


def _split_placements(where: str, module: nn.Module, tp_size: int) -> dict[str, Placement]:
    """TP experts: the intermediate dimension split, gate and up halves alike."""
    if getattr(module, "has_bias", False) or getattr(module, "is_transposed", False):
        raise TensorParallelError(
            f"{where}: TP experts need untransposed experts without biases (gpt-oss has both); use "
            f"expert_layout='ep' with a tp that divides the number of experts"
        )
    down = module._parameters["down_proj"]
    assert down is not None
    intermediate = down.shape[2]
    if intermediate % tp_size:
        raise TensorParallelError(
            f"{where}: the experts' intermediate size {intermediate} is not divisible by tp {tp_size}"
        )
    if getattr(module, "has_gate", True):
        packed = _StridedShard(1, split_factor=2) if getattr(module, "is_concatenated", True) else Shard(1)
        return {"gate_up_proj": packed, "down_proj": Shard(2)}
    return {"up_proj": Shard(1), "down_proj": Shard(2)}


def shard_experts(module: nn.Module, style: ExpertsStyle, mesh: DeviceMesh) -> None:
    """Replace the module's parameters by DTensors of `style`, and mark it for the local forward."""
    for name, placement in style.placements.items():
        p = module._parameters[name]
        assert p is not None
        module._parameters[name] = nn.Parameter(
            distribute_tensor(p.data, mesh, [placement]), requires_grad=p.requires_grad
        )
    setattr(module, EXPERTS_LAYOUT, style.layout)
