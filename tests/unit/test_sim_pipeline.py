"""1F1B stage by stage: the textbook makespan for equal micro-batches, the cost of mixing lengths in one
pipeline (Insight 1), and the simulator's bubble rates."""

from __future__ import annotations

import pytest

from bytescale_compile.planner import CostModel, plan
from bytescale_compile.sim.lengths import sample_global_batch
from bytescale_compile.sim.pipeline import first_order_bubble, one_f_one_b
from bytescale_compile.sim.simulator import bubble_rates, simulate


@pytest.mark.parametrize("m", [1, 2, 5, 8])
@pytest.mark.parametrize("pp", [1, 2, 4])
def test_equal_micro_batches_take_m_plus_pp_minus_one_slots(m, pp):
    run = one_f_one_b([3.0] * m, pp)
    assert run.makespan == pytest.approx((m + pp - 1) * 3.0 / pp)
    assert run.bubble_rate == pytest.approx((pp - 1) / (m + pp - 1))


def test_mixing_lengths_in_one_pipeline_costs_more_than_the_first_order_model_says():
    mixed, grouped = [10, 1] * 3, [10] * 3 + [1] * 3
    assert one_f_one_b(mixed, 4).makespan > 1.25 * first_order_bubble(mixed, 4).makespan
    assert one_f_one_b(grouped, 4).makespan < one_f_one_b(mixed, 4).makespan


def test_sends_between_stages_are_paid_on_the_critical_path():
    # one micro-batch through 3 stages: 3 forwards, 3 backwards and 2 sends each way
    assert one_f_one_b([9.0], 3, send=0.5).makespan == pytest.approx(9.0 + 4 * 0.5)


def test_simulator_reports_stage_level_bubbles():
    cost = CostModel.preset("llama-7b")
    lens = sample_global_batch("github", 2**21, seed=2, max_len=64 * 1024)
    piped = plan(lens, world_size=8, capacity=8192 * 4, cost_model=cost, strategy="balance", pp_size=4)
    staged, first = bubble_rates(piped, cost)
    assert 0 < staged < 1 and 0 < first < 1
    flat = plan(lens, world_size=8, capacity=8192, cost_model=cost, strategy="balance")
    assert bubble_rates(flat, cost) == (0.0, 0.0)
    per_rank_work = max(sum(m.est_time for m in piped.micro_batches if r in m.ranks) for r in range(8)) / 4
    assert simulate(piped, cost).step_time > per_rank_work
