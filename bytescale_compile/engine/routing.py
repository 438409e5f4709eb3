"""A Runtime's MoE routers: the load-balancing loss per sequence, the step's router figures, and DeepSeek-V3's
aux-loss-free balancing.

Each rank tallies its routers' expert counts and its part of the load-balancing loss while it runs its
micro-batches (`runtime/expert_load.py`, device tensors only). At the step's end one all-reduce over the world sums
the tallies, which every rank reaches whatever its micro-batch count (a rank without one adds zeros); the figures
come to the host with the step's other gathered figures. Aux-loss-free balancing (DeepSeek-V3, arXiv 2412.19437
§2.1.2) then moves each routed expert's bias by `expert_bias_update` towards balance: up for an expert that got
fewer than the mean of its layer's tokens, down for one that got more, the same on every rank.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..capture.routers import (
    RouterLossError,
    adapt_load_balancing,
    aux_loss_enabled,
    bias_routers,
    count_routed_experts,
    expert_bias,
    num_experts,
    router_layers,
)
from ..runtime.context import enter, leave
from ..runtime.expert_load import RouterTally

__all__ = ["AUX_LOSS_SCOPES", "RouterFigures", "RouterTraining", "RouterLossError"]

log = logging.getLogger(__name__)

AUX_LOSS_SCOPES = ("sequence",)
"""Over what a load-balancing loss is computed: each sequence's own tokens (the only scope made exact)."""
_REFUSED_SCOPES = {
    "global": "a global-batch loss needs every rank's expert counts before any micro-batch's backward can start, "
    "so it is not computed exactly by a step that runs micro-batches one after another",
    "micro_batch": "a micro-batch's loss mixes whatever sequences the planner packed or split, so the step would "
    "depend on the plan",
}


@dataclass(frozen=True)
class RouterFigures:
    """A step's router figures, summed over every rank."""

    aux_loss: float
    """Of the step's loss: the load-balancing loss times the model's `router_aux_loss_coef` (0 without it)."""
    expert_load: list[float] | None
    """Per MoE layer: tokens routed to its busiest expert over the mean per expert (1: balanced); None without
    counts."""


@dataclass
class RouterTraining:
    """What a Runtime does for its model's routers (nothing for a dense model)."""

    aux_coef: float
    """The model's `router_aux_loss_coef` where it adds the load-balancing loss, else 0."""
    layers: int | None
    """MoE layers tallied (rows of the counts), None where not known: then only the aux loss is summed."""
    experts: int | None
    routers: list[nn.Module]
    """Routers whose expert bias aux-loss-free balancing updates (empty when it is off)."""
    bias_update: float | None

    @classmethod
    def of(
        cls, model: nn.Module, *, pp_size: int, bias_update: float | None = None, scope: str = "sequence"
    ) -> RouterTraining:
        """Adapt `model`'s routers (before it compiles); `RouterLossError` for what cannot be made exact."""
        name = type(model).__name__
        if scope in _REFUSED_SCOPES:
            raise RouterLossError(f"router_aux_loss={scope!r} is refused: {_REFUSED_SCOPES[scope]}; use 'sequence'")
        if scope not in AUX_LOSS_SCOPES:
            raise ValueError(f"router_aux_loss must be one of {AUX_LOSS_SCOPES}, got {scope!r}")
        routers: list[nn.Module] = []
        if bias_update is not None:
            if isinstance(bias_update, bool) or not isinstance(bias_update, (int, float)) or not bias_update > 0:
                raise ValueError(f"expert_bias_update must be None or a number > 0, got {bias_update!r}")
            routers = bias_routers(model)
            if not routers:
                raise RouterLossError(
                    f"expert_bias_update needs routers with an expert bias (e_score_correction_bias, as DeepSeek-V3's), "
                    f"and {name} has none: train it with its load-balancing loss instead"
                )
            if pp_size > 1:
                raise RouterLossError(
                    f"expert_bias_update sums expert counts over the world, but pipeline stages (pp_size {pp_size}) "
                    f"hold different layers: train {name} without pipelines"
                )
            count_routed_experts(routers)
        swapped = adapt_load_balancing(model, pp_size=pp_size)
        if swapped:
            log.info("%s: load-balancing loss per sequence in %s", name, ", ".join(swapped))
        aux_coef = float(getattr(getattr(model, "config", None), "router_aux_loss_coef", 0.0) or 0.0)
        aux_coef = aux_coef if aux_loss_enabled(model) else 0.0
        layers: int | None
        experts: int | None
        if routers:
            layers, experts = len(routers), int(expert_bias(routers[0]).shape[0])
        else:
            layers = router_layers(model) if aux_coef else None
            experts = num_experts(model) if layers else None
        return cls(aux_coef, layers, experts, routers, bias_update)

    @property
    def active(self) -> bool:
        """The model has routers whose figures a step reports."""
        return bool(self.aux_coef or self.routers)

    @contextlib.contextmanager
    def tally(self) -> Iterator[RouterTally | None]:
        """Make a fresh tally ambient over a step's micro-batches (None for a dense model)."""
        if not self.active:
            yield None
            return
        tally = RouterTally(counted_by_routers=bool(self.routers))
        enter(tally)
        try:
            yield tally
        finally:
            leave(tally)

    def reduce(self, tally: RouterTally | None, device: torch.device, tp_size: int = 1) -> Tensor | None:
        """[aux, counts...] summed over every rank (a TP group's ranks, which ran the same tokens, counted once); an
        all-reduce queued on the device, read by `finish` after the step's figures came to the host."""
        if tally is None:
            return None
        width = (self.layers or 0) * (self.experts or 0)
        flat = torch.zeros(1 + width, dtype=torch.float64, device=device)
        if tally.aux_loss is not None:
            flat[0] = tally.aux_loss
        if width and tally.counts is not None:
            assert self.layers is not None and self.experts is not None
            if tuple(tally.counts.shape) != (self.layers, self.experts):
                raise RouterLossError(
                    f"the routers counted {tuple(tally.counts.shape)} layers x experts, the model was read as "
                    f"{self.layers} x {self.experts}"
                )
            flat[1:] = tally.counts.reshape(-1)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flat)
        return flat / tp_size

    def finish(self, reduced: Tensor | None, *, update: bool) -> RouterFigures | None:
        """The step's figures from `reduce`'s sums; with `update` (the optimizer stepped), the expert biases move."""
        if reduced is None:
            return None
        host = reduced.cpu()
        counts = host[1:].view(self.layers, self.experts) if self.layers and self.experts else None
        load = None
        if counts is not None:
            mean = counts.mean(dim=1)
            load = (counts.max(dim=1).values / mean.clamp(min=1e-12)).tolist()
        if update and self.bias_update is not None and counts is not None:
            with torch.no_grad():
                for router, row in zip(self.routers, counts):
                    bias = expert_bias(router)
                    step = torch.sign(row.mean() - row).to(bias.device, bias.dtype)
                    bias.add_(step, alpha=self.bias_update)
        return RouterFigures(aux_loss=float(host[0]) * self.aux_coef, expert_load=load)
