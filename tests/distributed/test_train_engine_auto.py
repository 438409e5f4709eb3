"""strategy="auto" in the runtime, the trainer's config and its reports, and the demo's simulated projection."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import bytescale_compile as bsc
from bytescale_compile.models.llama import tiny
from bytescale_compile.planner import ModelShape
from bytescale_compile.planner.auto import CANDIDATES
from bytescale_compile.sim.simulator import simulate
from bytescale_compile.testing import run_distributed
from bytescale_compile.train.__main__ import build_parser
from bytescale_compile.train.compare import comparison, summarize
from bytescale_compile.train.config import load_config
from bytescale_compile.train.metrics import StepRecord
from bytescale_compile.train.projection import RANKS, project, resample_lengths
from tests.helpers import reference_step, rel_err

LENGTHS = [90, 60, 10, 12, 7, 20, 3]
CAPACITY = 64
"""Two ranks of 64 tokens hold the 90-token sequence, so static (CP 2) is among auto's candidates."""


def _batch() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 128, (n,), generator=g) for n in LENGTHS]


def _check_choice(stats: bsc.StepStats, runtime: bsc.Runtime) -> None:
    auto = stats.plan.auto
    assert stats.strategy == "auto" and stats.plan.strategy in ("balance", "static")
    assert stats.auto_choice == auto.chosen and stats.auto_choice in {c.name for c in CANDIDATES}
    assert stats.auto_speedup == auto.speedup_over_static and stats.auto_speedup >= 1.0
    assert runtime.predict(stats).time == min(auto.step_time.values())


def _auto_worker(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = tiny()
    reference = copy.deepcopy(model)
    runtime = bsc.Runtime(model, torch.optim.SGD(model.parameters(), lr=0.5), strategy="auto", capacity=CAPACITY)
    stats = runtime.step(_batch())
    ref_loss, ref_params = reference_step(reference, _batch(), lr=0.5)
    assert abs(stats.loss - ref_loss) <= 1e-5 * abs(ref_loss), (stats.loss, ref_loss)
    for name, p in model.named_parameters():
        assert rel_err(p, ref_params[name]) <= 1e-5, f"auto rank {rank} {name}"
    assert set(stats.plan.auto.step_time) == {c.name for c in CANDIDATES}
    _check_choice(stats, runtime)


def test_auto_step_on_two_ranks_equals_single_process_step():
    run_distributed(_auto_worker, 2)


def test_auto_choice_reaches_metrics_and_the_predicted_time_is_the_simulators():
    torch.manual_seed(0)
    model = tiny()
    runtime = bsc.Runtime(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy="auto", capacity=128)
    stats = runtime.step(_batch())
    _check_choice(stats, runtime)
    record = StepRecord.from_stats(stats, 0.1, runtime.cost_model)
    assert record.predicted_time == simulate(stats.plan, runtime.cost_model).step_time
    line = record.to_dict()
    assert (line["auto_choice"], line["auto_speedup"]) == (stats.auto_choice, stats.auto_speedup)
    assert f"ran {stats.auto_choice} (" in record.summary()


def test_auto_on_a_model_that_cannot_be_sharded_plans_the_one_unsharded_plan():
    model = tiny()
    runtime = bsc.Runtime(
        bsc.optimize(model, attention=False), torch.optim.SGD(model.parameters(), lr=0.1), strategy="auto", capacity=128
    )
    step_plan = runtime.plan(np.array(LENGTHS))
    assert step_plan.shard_blockers and step_plan.auto is None


def test_runtime_names_auto_among_its_strategies():
    with pytest.raises(ValueError, match="'static', 'auto'\\), got 'fast'"):
        bsc.Runtime(tiny(), torch.optim.SGD(tiny().parameters(), lr=0.1), strategy="fast")


def test_trainer_accepts_auto_and_all_runs_it_last():
    args = vars(build_parser().parse_args(["--model", "tiny", "--data", "corpus", "--strategy", "auto"]))
    assert load_config(args.pop("config"), **args).strategies == ("auto",)
    assert load_config(None, model="tiny", data="corpus", strategy="all").strategies == (
        "balance",
        "naive",
        "static",
        "auto",
    )


def _record(step: int, strategy: str, choice: str | None) -> StepRecord:
    return StepRecord(
        step=step,
        strategy=strategy,
        loss=2.0,
        tokens=1000,
        tokens_per_second=1000.0,
        lr=1e-3,
        time=1.0,
        grad_norm=1.0,
        skipped=False,
        busy_spread=1.0,
        micro_batches=[1, 1],
        p2p_bytes=0,
        offloaded_bytes=0,
        predicted_time=0.5,
        predicted_busy_spread=1.0,
        predicted_p2p_bytes=0.0,
        auto_choice=choice,
        auto_speedup=1.5 if choice else None,
    )


def test_comparison_labels_auto_with_its_choices_and_other_lines_leave_the_fields_out():
    auto = summarize(
        [_record(1, "auto", "balance"), _record(2, "auto", "balance"), _record(3, "auto", "balance-nooffload")], None
    )
    static = summarize([_record(i, "static", None) for i in (1, 2, 3)], None)
    table = comparison([static, auto])
    assert "\nauto (balance 2/balance-nooffload 1/static 0) " in table
    assert "\nstatic " in table and "auto 1.00x measured" in table
    assert "auto_choice" not in _record(1, "static", None).to_dict()


def test_projection_plans_every_strategy_at_512_ranks_and_auto_is_never_slower_than_static():
    shape = ModelShape("demo", 4, 256, 8, 4, 688, 4096)
    lengths = [300, 1800, 4000, 6000, 120, 2500]
    result = project(shape, lengths, tokens=512 * 2048, capacity=2048, context_length=4096)
    steps = {s.strategy: s for s in result.steps}
    assert list(steps) == ["static", "naive", "balance", "auto"] and result.ranks == RANKS == 512
    assert steps["static"].speedup == 1.0 and steps["auto"].step_time <= steps["static"].step_time
    assert steps["auto"].chosen in {c.name for c in CANDIDATES} and steps["balance"].chosen is None
    assert result.tokens >= 512 * 2048
    report = result.report()
    assert report.startswith("SIMULATED projection, not measured") and f"auto ({steps['auto'].chosen})" in report


def test_resample_lengths_draws_from_the_data_until_the_budget():
    drawn = resample_lengths(np.array([5, 50, 500]), 10_000, seed=3)
    assert set(drawn.tolist()) <= {5, 50, 500} and drawn.sum() >= 10_000 > drawn[:-1].sum()
    assert np.array_equal(drawn, resample_lengths(np.array([5, 50, 500]), 10_000, seed=3))
    with pytest.raises(ValueError, match="non-empty array of positive sequence lengths"):
        resample_lengths(np.array([], dtype=np.int64), 10)
