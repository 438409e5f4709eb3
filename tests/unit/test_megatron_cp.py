"""benchmarks/megatron_cp.py: Megatron-Core's hybrid-CP groups as our plans, and their step as executed.

The converter is fed hand-written Megatron-shaped schedules (per group, per GPU, the sample ids it runs in
order), so no wheel is needed; the loader is checked on a stand-in wheel holding a schedule file that imports
what Megatron's does. Fast: no Megatron, no GPU.
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from benchmarks import megatron_cp
from benchmarks.megatron_cp import (
    SCHEDULE_FILE,
    STUB_MODULES,
    WheelNotFoundError,
    check_coverage,
    find_wheel,
    group_makespan,
    group_sample_ids,
    load_scheduler,
    megatron_groups,
    megatron_plans,
    megatron_step_time,
)
from bytescale_compile.planner import CostModel, Hardware, PlanError
from bytescale_compile.planner.plan import local_tokens
from bytescale_compile.sim.simulator import optimizer_shards, step_time

C = 1024
LENS = np.array([2000, 3000, 500, 400, 300, 200, 100, 800, 600, 1500])
GROUPS = [
    [[0, 2], [0], [3, 4], [5]],  # sample 0 on GPUs 0-1 (CP 2), then 2 alone on GPU 0
    [[1], [1], [1, 7], [1]],  # sample 1 on all four (CP 4), then 7 alone on GPU 2
    [[6, 9], [8, 9], [], []],  # 6 and 8 alone, then 9 on GPUs 0-1 once both are free
]
"""Megatron-shaped: per group, per GPU, the samples it runs in order."""
CP = {0: 2, 1: 4, 9: 2}
"""The samples split over several GPUs, and over how many."""


def plans_of(cost: CostModel) -> list:
    return megatron_plans(GROUPS, LENS, world_size=4, capacity=C, cost_model=cost)


def times_by_sample(plans) -> dict[int, float]:
    """Seconds the simulator charges each sample's micro-batch without a topology: its estimate plus the fixed
    cost of a micro-batch (the simulator's rule)."""
    out = {}
    for group, plan in zip(GROUPS, plans):
        ids = group_sample_ids(group)
        for m in plan.micro_batches:
            (i,) = m.sequences
            out[ids[i]] = m.est_time
    return out


def test_each_group_becomes_a_valid_plan_of_one_micro_batch_per_sample_in_megatrons_order():
    cost = CostModel.preset("llama-7b")
    plans = plans_of(cost)
    assert len(plans) == len(GROUPS)
    runs = []
    for group, plan in zip(GROUPS, plans):
        plan.validate()
        ids = group_sample_ids(group)
        assert plan.sequences == LENS[ids].tolist() and plan.world_size == 4 and plan.capacity == C
        by_id = {m.id: m for m in plan.micro_batches}
        for gpu, samples in enumerate(group):
            assert [ids[by_id[i].sequences[0]] for i in plan.schedule[gpu]] == samples
        for m in plan.micro_batches:
            (i,) = m.sequences
            sample, d = ids[i], len(m.ranks)
            assert d == CP.get(sample, 1) and m.ulysses == 1 and m.offload_ratio == 0.0
            assert m.tokens_per_rank == local_tokens([int(LENS[sample])], d) <= C
            runs.append(sample)
    assert sorted(runs) == list(range(len(LENS)))  # every sequence in exactly one micro-batch


def test_the_step_is_the_groups_makespans_one_after_another_then_one_allreduce_and_optimizer_step():
    cost = CostModel.preset("llama-7b")  # no topology: a micro-batch takes its estimate plus the fixed cost
    plans = plans_of(cost)
    t = {s: e + cost.micro_batch_overhead for s, e in times_by_sample(plans).items()}
    makespans = [
        max(t[0] + t[2], t[3] + t[4], t[5]),
        t[1] + t[7],
        max(t[6], t[8]) + t[9],  # 9 waits for both of its GPUs
    ]
    assert [group_makespan(p, cost) for p in plans] == pytest.approx(makespans, rel=1e-12)
    expected = sum(makespans) + cost.allreduce_time() + cost.optimizer_time(4)
    assert megatron_step_time(plans, cost) == pytest.approx(expected, rel=1e-12)


def test_with_a_topology_each_group_ends_where_its_own_step_less_allreduce_and_optimizer_does():
    cost = CostModel.preset("llama-7b", Hardware.preset("h100-nvlink", 1))
    plans = plans_of(cost)
    tail = cost.allreduce_time() + cost.optimizer_time(optimizer_shards(plans[0], cost))
    makespans = [step_time(p, cost) - tail for p in plans]
    assert [group_makespan(p, cost) for p in plans] == pytest.approx(makespans, rel=1e-12)
    assert megatron_step_time(plans, cost) == pytest.approx(sum(makespans) + tail, rel=1e-12)


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        ([GROUPS[0], GROUPS[1]], "sample 6 runs in no group"),
        ([GROUPS[0], GROUPS[1], GROUPS[2], [[2], [], [], []]], r"sample 2 runs in groups \[0, 3\]"),
        ([[[0, 10]], []], "sample 10, outside the batch's"),
    ],
)
def test_a_sample_missing_or_run_twice_is_refused(groups, message):
    with pytest.raises(PlanError, match=message):
        check_coverage(groups, len(LENS))


@pytest.mark.parametrize(
    ("group", "message"),
    [
        ([[0, 9], [9, 0], [], []], "deadlock"),  # two shared samples in opposite orders on their GPUs
        ([[1], [1], [], []], "exceed the capacity"),  # 3000 tokens over 2 GPUs of C = 1024
        ([[0], [0]], "lists 2 GPUs, the world has 4"),
    ],
)
def test_a_group_megatron_could_not_run_is_refused(group, message):
    listed = set(group_sample_ids(group))
    rest = [[s for s in range(len(LENS)) if s not in listed], [], [], []]  # the others, each alone on GPU 0
    with pytest.raises(PlanError, match=message):
        megatron_plans([group, rest], LENS, world_size=4, capacity=C, cost_model=CostModel.preset("llama-7b"))


SCHEDULE = """
import torch
from megatron.core import parallel_state
from megatron.core.rerun_state_machine import RerunDataIterator


class BalancedCPScheduler:
    def __init__(self, max_seq_len_per_rank, dp_cp_group):
        self.max_seq_len_per_rank = max_seq_len_per_rank
        self.total_hdp_gpus = dp_cp_group.size()

    def get_groups_and_subsamples(self, sample_id_seqlens, config):
        gpus = [[] for _ in range(self.total_hdp_gpus)]
        for sample_id, seq_len in sorted(sample_id_seqlens, key=lambda x: x[1], reverse=True):
            assert seq_len <= self.max_seq_len_per_rank
            gpus[sample_id % self.total_hdp_gpus].append(sample_id)
        return [[[0] * len(ids) for ids in gpus]], [gpus]
"""
"""Shaped as Megatron's schedule file: its module-level imports, the class and the two calls the benchmark makes."""


def wheel_with(tmp_path: Path, files: dict[str, str]) -> Path:
    wheel = tmp_path / "megatron_core-0.19.2-cp312-cp312-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return wheel


def test_the_scheduler_loads_from_the_wheel_with_megatron_stubbed_only_while_it_loads(tmp_path):
    absent = [name for name in STUB_MODULES if name not in sys.modules]
    scheduler = load_scheduler(wheel_with(tmp_path, {SCHEDULE_FILE: SCHEDULE}))
    assert scheduler.__name__ == "BalancedCPScheduler"
    assert [name for name in absent if name in sys.modules] == []
    groups = megatron_groups(scheduler, np.array([5, 40, 7, 9, 30]), world_size=2, capacity=64)
    assert groups == [[[4, 2, 0], [1, 3]]]  # longest first, sample i on GPU i % 2
    assert all(isinstance(s, int) for s in groups[0][0])


def test_a_wheel_without_the_schedule_says_how_to_fetch_the_right_one(tmp_path):
    with pytest.raises(WheelNotFoundError, match="pip download --no-deps --python-version 3.12"):
        load_scheduler(wheel_with(tmp_path, {"megatron/core/__init__.py": ""}))
    (tmp_path / "broken.whl").write_text("not a zip")
    with pytest.raises(WheelNotFoundError, match="not a Megatron-Core wheel"):
        load_scheduler(tmp_path / "broken.whl")


def test_find_wheel_looks_in_the_cache_and_prints_the_download_command_when_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(megatron_cp, "CACHE_DIR", tmp_path)
    with pytest.raises(WheelNotFoundError, match=r"megatron-core==0\.19\.2 -d"):
        find_wheel()
    with pytest.raises(WheelNotFoundError, match="no such file"):
        find_wheel(tmp_path / "missing.whl")
    wheel = wheel_with(tmp_path, {SCHEDULE_FILE: SCHEDULE})
    assert find_wheel() == wheel and find_wheel(wheel) == wheel
