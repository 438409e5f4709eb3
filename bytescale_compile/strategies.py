"""The strategy names, defined once: what builds a plan, what a run may ask for, and what the simulator compares.

Everything that names a strategy (the planner, the Runtime, the training config, the simulator, the CLI and
the projection) imports it from here, so a new strategy is added in one place."""

from __future__ import annotations

from typing import Literal, get_args

__all__ = [
    "AUTO",
    "BALANCE",
    "DEFAULT_SP",
    "EXPERT_LAYOUTS",
    "ExpertLayout",
    "chosen_expert_layout",
    "ExpertLayout",
    "NAIVE",
    "RUNTIME_STRATEGIES",
    "SP_AUTO",
    "SP_MODES",
    "SP_RING",
    "SP_ULYSSES",
    "STATIC",
    "STRATEGIES",
    "STRATEGY_SPECS",
]

BALANCE, NAIVE, STATIC, AUTO = "balance", "naive", "static", "auto"

STRATEGIES = (BALANCE, NAIVE, STATIC)
"""The planners that build a plan: what `Plan.strategy` may be."""
RUNTIME_STRATEGIES = (*STRATEGIES, AUTO)
"""What `plan()` and a Runtime accept: "auto" builds candidates of the others and keeps the fastest, so its
plans carry the winner's name."""
STRATEGY_SPECS: dict[str, tuple[str, bool]] = {
    STATIC: (STATIC, False),
    "naive-nooffload": (NAIVE, False),
    NAIVE: (NAIVE, True),
    BALANCE: (BALANCE, True),
    AUTO: (AUTO, True),
}
"""What the simulator and the CLI compare, name -> (planner strategy, offload): "naive-nooffload" is the
paper's communication-only ablation; "auto" the fastest of balance and static candidates under the simulator."""

SP_RING, SP_ULYSSES, SP_AUTO = "ring", "ulysses", "auto"
SP_MODES = (SP_RING, SP_ULYSSES, SP_AUTO)
"""How a shared micro-batch splits its D(s) ranks u × r (`planner/split.py`): "ring" keeps u = 1, "ulysses"
takes the largest u allowed, "auto" the cheapest the cost model predicts."""
DEFAULT_SP = SP_AUTO
"""Per micro-batch, the split the cost model predicts fastest: a Ulysses degree only where it wins."""

ExpertLayout = Literal["auto", "ep", "tp"]
"""How a TP group holds an MoE layer's experts (`capture/tp_experts.py`): "ep" E/tp whole experts per rank, "tp"
a 1/tp slice of every expert, "auto" "ep" where tp divides E, else "tp"."""
EXPERT_LAYOUTS: tuple[str, ...] = get_args(ExpertLayout)


def chosen_expert_layout(layout: ExpertLayout, *, experts: int, tp: int) -> Literal["ep", "tp"]:
    """The layout "auto" stands for: whole experts per rank where tp divides them."""
    if layout != "auto":
        return layout
    return "ep" if experts % tp == 0 else "tp"
