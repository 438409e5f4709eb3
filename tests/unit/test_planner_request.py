"""One way to plan: a `PlanRequest` plans exactly as `plan()` with the same settings, the planners take every
argument after the lengths by keyword, and the modules the planner was split into keep the old paths importable
(with a warning) for one release."""

from __future__ import annotations

import dataclasses
import importlib
import pickle
import sys

import numpy as np
import pytest

from bytescale_compile.planner import CostModel, Hardware, PlanRequest, Topology, plan
from bytescale_compile.planner.auto import plan_auto
from bytescale_compile.planner.balance import plan_balance
from bytescale_compile.planner.naive import plan_naive
from bytescale_compile.planner.static import plan_static
from bytescale_compile.planner.unsharded import plan_unsharded
from bytescale_compile.sim.lengths import sample_global_batch
from bytescale_compile.sim.simulator import step_time

COST = CostModel.preset("llama-7b", Hardware.preset("l20", 2))
LENS = sample_global_batch("github", 1_000_000, seed=4, max_len=128 * 1024)


@pytest.mark.parametrize(
    "settings",
    [
        {"strategy": "balance"},
        {"strategy": "naive", "offload": False, "sp": "ring"},
        {"strategy": "static", "context_length": 128 * 1024},
        {"strategy": "auto", "pp_size": 2, "step_time": step_time},
        {"strategy": "auto", "shard_blockers": ("an attention the ring cannot run",)},
    ],
    ids=["balance", "naive", "static", "auto", "unsharded"],
)
def test_a_request_plans_as_plan_does_with_the_same_settings(settings):
    lens = np.minimum(LENS, 16 * 1024) if settings.get("shard_blockers") else LENS
    request = PlanRequest(world_size=16, capacity=16 * 1024, cost_model=COST, **settings)
    assert (
        request.plan(lens).to_json()
        == plan(lens, world_size=16, capacity=16 * 1024, cost_model=COST, **settings).to_json()
    )


def test_a_request_is_frozen_checked_and_travels_to_the_scheduler():
    request = PlanRequest(world_size=4, capacity=8192, cost_model=COST, strategy="auto", step_time=step_time)
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.capacity = 1  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(request)) == request  # Ray pickles it to the scheduler actor
    with pytest.raises(ValueError, match="step_time"):
        PlanRequest(world_size=4, capacity=8192, cost_model=COST, strategy="auto")
    with pytest.raises(ValueError, match="strategy must be one of"):
        PlanRequest(world_size=4, capacity=8192, cost_model=COST, strategy="fastest")
    with pytest.raises(ValueError, match="sp must be one of"):
        PlanRequest(world_size=4, capacity=8192, cost_model=COST, sp="heads")
    with pytest.raises(TypeError, match="shard_blockers must be a tuple of strings"):
        PlanRequest(world_size=4, capacity=8192, cost_model=COST, shard_blockers="a; b")  # type: ignore[arg-type]
    listed = PlanRequest(world_size=4, capacity=8192, cost_model=COST, shard_blockers=["why"])  # type: ignore[arg-type]
    assert listed.shard_blockers == ("why",)


@pytest.mark.parametrize("planner", [plan, plan_balance, plan_naive, plan_static, plan_auto, plan_unsharded])
def test_every_planner_takes_the_arguments_after_the_lengths_by_keyword(planner):
    with pytest.raises(TypeError, match="positional argument"):
        planner(np.array([100, 200]), 2, 1024, COST)


def test_plans_of_unshardable_models_keep_every_blocker():
    blockers = ("attention pass disabled", "a sliding window the ring cannot run")
    planned = plan([100, 300], world_size=2, capacity=1024, cost_model=COST, strategy="auto", shard_blockers=blockers)
    assert planned.shard_blockers == blockers and planned.auto is None
    with pytest.raises(Exception, match="attention pass disabled; a sliding window"):
        plan([2048], world_size=2, capacity=1024, cost_model=COST, shard_blockers=blockers)


@pytest.mark.parametrize(
    "old,new", [("hdp", "naive"), ("common", "builder")], ids=["hdp is naive", "common is builder"]
)
def test_the_former_module_paths_import_with_a_warning(old, new):
    sys.modules.pop(f"bytescale_compile.planner.{old}", None)
    with pytest.warns(DeprecationWarning, match=rf"planner\.{old} moved to bytescale_compile\.planner\.{new}"):
        module = importlib.import_module(f"bytescale_compile.planner.{old}")
    assert module is importlib.import_module(f"bytescale_compile.planner.{new}")


@pytest.mark.parametrize(
    "name,home",
    [("Hardware", "hardware"), ("ModelShape", "model_shape"), ("PRESETS", "model_shape"), ("EXPRS", "equations")]
    + [("tp_all_reduce_time", "equations"), ("CEIL_RTOL", "equations"), ("Topology", "topology")],
)
def test_names_moved_out_of_the_cost_model_module_import_with_a_warning(name, home):
    from bytescale_compile.planner import cost_model

    with pytest.warns(DeprecationWarning, match=rf"cost_model\.{name} moved to bytescale_compile\.planner\.{home}\."):
        value = getattr(cost_model, name)
    assert value is getattr(importlib.import_module(f"bytescale_compile.planner.{home}"), name)
    assert Topology is importlib.import_module("bytescale_compile.planner.topology").Topology
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        cost_model.nothing  # noqa: B018
