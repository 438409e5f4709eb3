"""Where a global rank sits in the world laid out (pp, hdp, tp), tp innermost.

global rank = (stage × hdp + hdp_rank) × tp + tp_rank, so a TP group is adjacent ranks (one node). An HDP
rank of the paper is a TP group: plans are made for `hdp` ranks, every rank of a group runs the group's
micro-batches, a ring runs among the HDP ranks that share a TP index, and gradients are summed over
those same ranks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .stages import stage_spec

__all__ = ["ReplicaGroupError", "TrainMesh", "hdp_group", "replica_group", "tp_group", "tp_size_of"]


class ReplicaGroupError(ValueError):
    """A process group given to sum a tensor-parallel model's gradients or shard its optimizer state over holds
    ranks of different TP indices, which hold different shards."""


def tp_size_of(model: nn.Module) -> int:
    """Ranks of the TP group the model's DTensor parameters live on (1 without tensor parallelism)."""
    return next((p.device_mesh.size() for p in model.parameters() if isinstance(p, DTensor)), 1)


def tp_group(model: nn.Module) -> dist.ProcessGroup:
    """The process group of the TP group the model's DTensor parameters live on."""
    mesh = next((p.device_mesh for p in model.parameters() if isinstance(p, DTensor)), None)
    if mesh is None:
        raise ValueError(f"{type(model).__name__} has no DTensor parameter: it is not tensor-parallel")
    return mesh.get_group()


@dataclass(frozen=True)
class TrainMesh:
    pp: int
    hdp: int
    tp: int
    rank: int
    """This process's global rank."""

    @classmethod
    def of_world(cls, tp: int = 1, pp: int = 1) -> TrainMesh:
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        if world % (tp * pp):
            raise ValueError(
                f"world size {world} is not divisible by tp × pp = {tp} × {pp}: the world is laid out (pp, hdp, tp)"
            )
        return cls(pp, world // (tp * pp), tp, rank)

    @property
    def stage(self) -> int:
        return self.rank // (self.hdp * self.tp)

    @property
    def hdp_rank(self) -> int:
        return (self.rank // self.tp) % self.hdp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    def global_rank(self, hdp_rank: int) -> int:
        """The global rank of HDP rank `hdp_rank` with this rank's stage and TP index (a ring peer)."""
        return (self.stage * self.hdp + hdp_rank) * self.tp + self.tp_rank


def hdp_group(mesh: TrainMesh) -> dist.ProcessGroup:
    """The process group of the HDP ranks sharing this rank's stage and TP index (they hold the same parameters).
    The first call creates every (stage, TP index) group, on every rank at once (a collective)."""
    return _hdp_groups(mesh.pp, mesh.hdp, mesh.tp)[(mesh.stage, mesh.tp_rank)]


def replica_group(model: nn.Module, group: dist.ProcessGroup | None = None) -> dist.ProcessGroup | None:
    """The ranks holding the same parameters as `model` (a whole model or a pipeline stage) on this one, which sum
    gradients and share the optimizer state: `group` as given (checked to hold one TP index), else every rank
    (None) without tensor parallelism and `hdp_group` with it. A collective on the first call with tensor
    parallelism."""
    tp = tp_size_of(model)
    if tp == 1:
        return group
    if group is None:
        spec = stage_spec(model)
        return hdp_group(TrainMesh.of_world(tp=tp, pp=spec.pp_size if spec is not None else 1))
    ranks = dist.get_process_group_ranks(group)
    if len({r % tp for r in ranks}) > 1:
        raise ReplicaGroupError(
            f"the process group of global ranks {ranks} mixes TP indices (tp {tp}), whose ranks hold different "
            f"shards: pass hdp_group(TrainMesh.of_world(tp={tp}, pp=...)), or None for it"
        )
    return group


@functools.cache
def _hdp_groups(pp: int, hdp: int, tp: int) -> dict[tuple[int, int], dist.ProcessGroup]:
    return {(s, t): dist.new_group([(s * hdp + r) * tp + t for r in range(hdp)]) for s in range(pp) for t in range(tp)}
