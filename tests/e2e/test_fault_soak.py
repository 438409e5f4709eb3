"""The fault soak (`tests/fault_soak.py`) on 4 CPU ranks: a rank SIGKILLed mid-step, SIGTERM to the job, a
checkpoint write killed halfway, a full disk, a corrupted shard, a Ray data server killed and (seeds 0 and 2) a
resume on 2 ranks and back, in an order and at steps drawn from the seed. Every fault is survived or refused with
its message, the losses are the uninterrupted run's, and the final weights are bit-identical to its (after a 2-rank
segment, within `ROUNDING_DW`). 30 steps, a checkpoint every 3 (`benchmarks/fault_soak.py` runs 60): about
5 minutes a seed on 2 cores, plus the uninterrupted run the seeds share. `-rP` prints each seed's table."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fault_soak import KINDS, SoakConfig, draw_slots, reference_run, run_soak

pytest.importorskip("transformers")

CONFIG = SoakConfig(steps=30, checkpoint_every=3)
SEEDS = (0, 1, 2)


def test_the_seeds_draw_every_kind_and_runs_with_and_without_2_ranks():
    drawn = [{slot.fault.kind for slot in draw_slots(seed, CONFIG)} for seed in SEEDS]
    assert set().union(*drawn) == set(KINDS)
    assert any("two-ranks" in kinds for kinds in drawn) and any("two-ranks" not in kinds for kinds in drawn)
    for seed in SEEDS:
        slots = draw_slots(seed, CONFIG)
        assert "two-ranks" not in (slots[0].fault.kind, slots[-1].fault.kind)  # it resumes from 4 ranks and back
        assert slots[0].fault.step > CONFIG.checkpoint_every and slots[-1].end == CONFIG.steps


@pytest.fixture(scope="module")
def uninterrupted(workspace, tmp_path_factory) -> tuple[Path, float]:
    out = tmp_path_factory.mktemp("soak") / "uninterrupted"
    return out, reference_run(workspace, CONFIG, out)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the job's processes through /proc")
@pytest.mark.parametrize("seed", SEEDS)
def test_every_fault_is_survived_and_the_run_ends_as_an_uninterrupted_one(workspace, uninterrupted, tmp_path, seed):
    pytest.importorskip("ray")
    reference, reference_wall_s = uninterrupted
    result = run_soak(workspace, CONFIG, tmp_path, seed, reference, reference_wall_s)
    print(result.table())
    assert [r.fault.kind for r in result.reports] == [s.fault.kind for s in result.slots], result.table()
    assert not result.problems(), result.table()
