"""The static baseline: a fixed DP×CP mesh, as Megatron-style long-context training runs it.

CP is the smallest divisor of the world size whose ranks can hold one context-length row
(CP·C ≥ context length); sequences are packed to the context length and every packed row is
zigzag-sharded over its whole CP group, short sequences included — the redundant communication
HDP removes (§3.2). A row of sequences all shorter than CP tokens runs on the first ranks of its group,
one per token of its longest sequence: the zigzag layout would leave the others without a token to run.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

import numpy as np

from ..strategies import STATIC
from .builder import PlanBuilder, best_fit_pack
from .limits import mesh_reason, mesh_row, refuse, static_reason
from .plan import Plan, PlanError, StaticMesh
from .split import DEFAULT_SP

if TYPE_CHECKING:
    from .cost_model import CostModel

__all__ = ["plan_static", "cp_degree"]


def cp_degree(world_size: int, capacity: int, context_length: int) -> int:
    """Smallest divisor of the world size with CP·C ≥ context length."""
    if context_length > mesh_row(world_size, capacity):
        raise PlanError(f"context length {context_length} needs {mesh_reason(world_size, capacity)(context_length)}")
    return next(cp for cp in range(1, world_size + 1) if world_size % cp == 0 and cp * capacity >= context_length)


def plan_static(
    lens: np.ndarray,
    *,
    world_size: int,
    capacity: int,
    cost_model: CostModel,
    pp_size: int = 1,
    context_length: int | None = None,
    sp: str = DEFAULT_SP,
) -> Plan:
    """`context_length` is the mesh's row length (default: the longest sequence); `sp` how shared micro-batches
    split u x r."""
    context = int(context_length or (lens.max() if lens.size else capacity))
    refuse(lens, lens > context, static_reason(context))
    cp = cp_degree(world_size, capacity, context)
    builder = PlanBuilder(STATIC, lens, world_size, capacity, cost_model, pp_size, sp=sp)
    tokens = [(0, g) for g in range(world_size // cp)]  # heap of (tokens, DP group)
    for row in best_fit_pack(lens, np.arange(lens.size), context):
        t, g = heapq.heappop(tokens)
        width = min(cp, int(lens[row].max()))  # zigzag gives group rank i tokens only of sequences longer than i
        builder.add(range(g * cp, g * cp + width), row)
        heapq.heappush(tokens, (t + int(lens[row].sum()), g))
    return builder.build(mesh=StaticMesh(cp=cp, dp=world_size // cp, context_length=context))
