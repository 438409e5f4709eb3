"""What a step's MoE routers did on this rank: per layer, the tokens routed to each expert, and the load-balancing
loss (before its coefficient), tallied by the router ops while a `RouterTally` is ambient.

The ops add device tensors only: nothing here syncs with the host. The Runtime sums the tallies of every rank
once at the step's end (`engine/routing.py`), for the expert-load figures and the aux-loss-free bias update.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["RouterTally"]


@dataclass
class RouterTally:
    """One step's router figures on this rank.

    counts: [layers, experts] float64, tokens routed to each expert of each MoE layer (top-k assignments).
    aux_loss: this rank's part of the step's load-balancing loss, weighted as in the loss but before the model's
        `router_aux_loss_coef`.
    counted_by_routers: the counts come from the routers themselves (`bytescale::count_experts`, aux-loss-free
        balancing), so the load-balancing op does not count them again.
    """

    counted_by_routers: bool = False
    counts: Tensor | None = None
    aux_loss: Tensor | None = None

    def add_counts(self, first_layer: int, counts: Tensor) -> None:
        """Add `counts` [layers, experts] to the rows from `first_layer` on (growing the table as needed)."""
        counts = counts.detach().to(torch.float64)
        rows = first_layer + counts.shape[0]
        if self.counts is None:
            self.counts = torch.zeros(rows, counts.shape[1], dtype=torch.float64, device=counts.device)
        elif self.counts.shape[0] < rows:
            grown = torch.zeros(rows, self.counts.shape[1], dtype=torch.float64, device=self.counts.device)
            grown[: self.counts.shape[0]] = self.counts
            self.counts = grown
        self.counts[first_layer:rows] += counts

    def add_aux_loss(self, value: Tensor) -> None:
        value = value.detach().to(torch.float64)
        self.aux_loss = value if self.aux_loss is None else self.aux_loss + value
