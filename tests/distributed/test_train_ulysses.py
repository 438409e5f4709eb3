"""A Runtime step whose shared micro-batches run u × r (Ulysses inside groups of u ranks, the ring among the r
groups) equals the single-process step, on Hugging Face Llama and Qwen2 with sliding-window layers; the
planner's choice is checked against the cost model in tests/unit/test_planner_split.py."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

import bytescale_compile as bsc
from bytescale_compile.engine.probe import default_cost_model
from bytescale_compile.planner import Hardware, Plan, PlanError, Topology, plan
from bytescale_compile.planner.plan import split_tokens
from bytescale_compile.testing import run_distributed
from tests.helpers import reference_step, rel_err
from tests.hf_models import VOCAB, build

LENGTHS = [120, 60, 10, 7, 3]  # with C = 32 on 4 ranks: one sequence over 4 ranks, one over 2, packed short ones
CAPACITY = 32


def _batch() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]


def with_splits(step_plan: Plan, ulysses_by_size: dict[int, int]) -> Plan:
    """`step_plan` with each shared micro-batch of D ranks split u × (D / u), u = `ulysses_by_size[D]`."""
    lengths = np.asarray(step_plan.sequences)

    def split(mb):  # type: ignore[no-untyped-def]
        u = ulysses_by_size.get(len(mb.ranks), 1) if mb.shared else 1
        tokens = split_tokens(lengths[list(mb.sequences)], len(mb.ranks), u) if mb.shared else mb.tokens_per_rank
        return dataclasses.replace(mb, ulysses=u, tokens_per_rank=tokens)

    return dataclasses.replace(step_plan, micro_batches=[split(mb) for mb in step_plan.micro_batches])


def _step_worker(rank: int, world: int, name: str, ulysses_by_size: dict[int, int]) -> None:
    model = build(name)
    reference = copy.deepcopy(model)
    runtime = bsc.Runtime(model, torch.optim.SGD(model.parameters(), lr=0.5), capacity=CAPACITY)
    step_plan = with_splits(runtime.plan(np.asarray(LENGTHS)), ulysses_by_size)
    splits = sorted({(mb.ulysses, mb.ring) for mb in step_plan.micro_batches if mb.shared})
    assert splits == sorted((u, d // u) for d, u in ulysses_by_size.items()), splits
    stats = runtime.step(_batch(), plan=step_plan)
    ref_loss, ref_params = reference_step(reference, _batch(), lr=0.5, hf=True)
    assert abs(stats.loss - ref_loss) <= 1e-5 * abs(ref_loss), (stats.loss, ref_loss)
    for param_name, p in model.named_parameters():
        assert rel_err(p, ref_params[param_name]) <= 1e-5, f"{name} rank {rank} {param_name}"
    assert stats.p2p_bytes > 0


@pytest.mark.parametrize(
    "name,ulysses_by_size",
    [
        ("qwen2-sliding", {4: 2, 2: 1}),  # (2, 2) and a plain 2-rank ring, windowed layers among them
        pytest.param("llama", {4: 4, 2: 2}, marks=pytest.mark.slow),  # (4, 1): u above the 2 KV heads; (2, 1)
    ],
)
def test_a_step_with_mixed_splits_equals_the_single_process_step(name, ulysses_by_size):
    run_distributed(_step_worker, 4, name, ulysses_by_size)


def _ring_bound(cost_model):  # type: ignore[no-untyped-def]
    """`cost_model` on one node of 4 ranks whose ring links are slow and whose all-to-all is fast: every shared
    micro-batch is ring-bound, so the planner's joint choice of group size and split takes u > 1."""
    slow, fast = 1e6, 1e15
    topology = Topology(
        devices_per_node=4,
        devices_per_switch=4,
        tp_size=1,
        device_link=slow,
        switch_uplink=slow,
        nic_bandwidth=slow,
        nics_per_node=4,
        all_to_all_link=fast,
    )
    return cost_model.replace(hardware=Hardware(name="ring-bound", network_bandwidth=slow, topology=topology))


def _planned_split_worker(rank: int, world: int, name: str) -> None:
    model = build(name)
    reference = copy.deepcopy(model)
    runtime = bsc.Runtime(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        capacity=CAPACITY,
        cost_model=_ring_bound(default_cost_model(model)),
    )
    step_plan = runtime.plan(np.asarray(LENGTHS))
    assert any(mb.ulysses > 1 for mb in step_plan.micro_batches if mb.shared), step_plan.micro_batches
    stats = runtime.step(_batch(), plan=step_plan)
    ref_loss, ref_params = reference_step(reference, _batch(), lr=0.5, hf=True)
    assert abs(stats.loss - ref_loss) <= 1e-5 * abs(ref_loss), (stats.loss, ref_loss)
    for param_name, p in model.named_parameters():
        assert rel_err(p, ref_params[param_name]) <= 1e-5, f"{name} rank {rank} {param_name}"


@pytest.mark.slow
def test_a_step_the_planner_splits_equals_the_single_process_step():
    """Group size and split chosen together by the planner (not forced): on ring-bound links it takes u > 1, and
    the step equals the single-process step."""
    run_distributed(_planned_split_worker, 4, "llama")


def test_a_split_the_heads_cannot_take_is_refused_before_any_step():
    """u = 3 does not divide Llama's 4 heads: the Runtime refuses such a plan, naming them, before it runs."""
    model = build("llama")
    runtime = bsc.Runtime(model, torch.optim.SGD(model.parameters(), lr=0.1), capacity=40)
    step_plan = plan([120, 7], world_size=4, capacity=40, cost_model=runtime.cost_model)
    assert {len(mb.ranks) for mb in step_plan.micro_batches if mb.shared} == {3}, step_plan
    with pytest.raises(PlanError, match="Ulysses degree u=3 .* does not divide the model.s 4 query heads"):
        runtime.step(
            [torch.zeros(120, dtype=torch.long), torch.zeros(7, dtype=torch.long)], plan=with_splits(step_plan, {3: 3})
        )
