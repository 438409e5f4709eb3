"""The HDP planner: cost models, plans and the strategies behind one entry point (`plan()`, or a `PlanRequest`
that fixes a run's settings once)."""

from __future__ import annotations

from ..lazy import alias_moved_modules
from ..strategies import AUTO, BALANCE, NAIVE, RUNTIME_STRATEGIES, STATIC, STRATEGIES, STRATEGY_SPECS
from .auto import StepTime
from .cost_model import CostModel
from .hardware import Hardware
from .limits import LengthLimit, length_limit
from .model_shape import ModelShape
from .plan import AutoChoice, BalanceSettings, MicroBatch, Plan, PlanError, StaticMesh
from .request import PlanRequest, plan
from .split import DEFAULT_SP, SP_MODES, check_sp, choose_split, validate_splits
from .topology import Topology

__all__ = [
    "plan",
    "length_limit",
    "AUTO",
    "BALANCE",
    "NAIVE",
    "STATIC",
    "AutoChoice",
    "BalanceSettings",
    "CostModel",
    "Hardware",
    "LengthLimit",
    "ModelShape",
    "Plan",
    "MicroBatch",
    "PlanError",
    "PlanRequest",
    "RUNTIME_STRATEGIES",
    "DEFAULT_SP",
    "SP_MODES",
    "StaticMesh",
    "check_sp",
    "choose_split",
    "validate_splits",
    "STRATEGIES",
    "STRATEGY_SPECS",
    "StepTime",
    "Topology",
]

alias_moved_modules(
    {
        "bytescale_compile.planner.hdp": "bytescale_compile.planner.naive",
        "bytescale_compile.planner.common": "bytescale_compile.planner.builder",
    }
)
