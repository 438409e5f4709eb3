"""Plan: a micro-batch's Ulysses degree u (the u × r split) in JSON and in `validate`."""

from __future__ import annotations

import dataclasses
import json

import pytest

from bytescale_compile.planner.plan import (
    AutoChoice,
    BalanceSettings,
    MicroBatch,
    Plan,
    PlanError,
    StaticMesh,
    local_tokens,
    split_tokens,
)


def _plan(ulysses: int, ranks: int = 4, lens: tuple[int, ...] = (1000,)) -> Plan:
    mb = MicroBatch(
        id=0,
        ranks=tuple(range(ranks)),
        sequences=tuple(range(len(lens))),
        offload_ratio=0.0,
        tokens_per_rank=split_tokens(list(lens), ranks, ulysses) if ulysses > 0 and ranks % ulysses == 0 else 250,
        est_time=1.0,
        ulysses=ulysses,
    )
    return Plan("balance", ranks, 1000, 1, list(lens), [mb], [[0]] * ranks)


def test_json_round_trip_keeps_the_ulysses_degree():
    plan = _plan(ulysses=2)
    back = Plan.from_json(plan.to_json())
    assert back == plan and back.micro_batches[0].ulysses == 2 and back.micro_batches[0].ring == 2
    back.validate(heads=32, kv_heads=8)


def test_json_without_the_field_loads_as_the_plain_ring():
    data = json.loads(_plan(ulysses=1).to_json())
    del data["micro_batches"][0]["ulysses"]
    back = Plan.from_json(json.dumps(data))
    assert back.micro_batches[0].ulysses == 1 and back.micro_batches[0].ring == 4
    back.validate()


def test_split_tokens_cut_the_virtual_ranks_share_into_u_parts():
    lens = [1001, 37]
    assert split_tokens(lens, 4, 1) == local_tokens(lens, 4)
    assert split_tokens(lens, 4, 2) == -(-local_tokens(lens, 2) // 2)
    assert split_tokens(lens, 4, 4) == -(-sum(lens) // 4)


def test_validate_refuses_a_degree_that_does_not_divide_the_ranks():
    with pytest.raises(PlanError, match=r"u=3 on D\(s\)=4 ranks: u must divide D\(s\)"):
        _plan(ulysses=3).validate()


def test_validate_refuses_a_degree_that_does_not_divide_the_heads():
    plan = _plan(ulysses=4)
    plan.validate()  # heads unknown: only D(s) is checked
    plan.validate(heads=8, kv_heads=2)
    with pytest.raises(PlanError, match=r"u=4 \(D\(s\)=4\).*6 query heads \(H_kv=2\)"):
        plan.validate(heads=6, kv_heads=2)


def test_validate_refuses_a_bad_degree_and_a_wrong_token_count():
    with pytest.raises(PlanError, match="u=0"):
        _plan(ulysses=0).validate()
    plan = _plan(ulysses=2)
    mb = plan.micro_batches[0]
    plan.micro_batches[0] = MicroBatch(mb.id, mb.ranks, mb.sequences, 0.0, local_tokens([1000], 4) + 5, 1.0, 2)
    with pytest.raises(PlanError, match="tokens_per_rank"):
        plan.validate()


def test_how_a_plan_was_planned_round_trips_through_json():
    plan = dataclasses.replace(
        _plan(ulysses=2),
        sp="ulysses",
        offload=True,
        balance=BalanceSettings(delta=0.5, buckets=16, mode="pp"),
        shard_blockers=("a", "b"),
        auto=AutoChoice("balance", {"balance": 1.0, "static": 2.0}, 2.0, 1.5),
    )
    assert Plan.from_json(plan.to_json()) == plan
    static = dataclasses.replace(_plan(ulysses=1), mesh=StaticMesh(cp=4, dp=1, context_length=1000))
    assert Plan.from_json(static.to_json()) == static


def test_plans_written_with_a_meta_dict_load_into_the_typed_fields():
    data = json.loads(_plan(ulysses=1).to_json())
    for key in ("sp", "offload", "balance", "mesh", "shard_blockers", "auto"):
        del data[key]
    auto = {"chosen": "static", "step_time": {"static": 1.0}, "speedup_over_static": 1.0, "speedup_over_runner_up": 1.0}
    old = {"sp": "ring", "offload": False, "delta": 0.25, "buckets": 8, "balance": "dp", "auto": auto}
    back = Plan.from_json(json.dumps({**data, "meta": old}))
    assert (back.sp, back.offload, back.balance) == ("ring", False, BalanceSettings(delta=0.25, buckets=8, mode="dp"))
    assert back.auto == AutoChoice(**auto) and back.mesh is None and back.shard_blockers == ()
    static = Plan.from_json(json.dumps({**data, "meta": {"cp": 4, "dp": 1, "context_length": 900}}))
    assert static.mesh == StaticMesh(cp=4, dp=1, context_length=900) and static.sp == "auto"
    unsharded = Plan.from_json(json.dumps({**data, "meta": {"unsharded": "attention pass disabled"}}))
    assert unsharded.shard_blockers == ("attention pass disabled",)
