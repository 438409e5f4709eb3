"""The trainer's settings together, as users combine them: dtype x checkpoint mode x --tp x gradient checkpointing,
plus --pp 2 once. Each case trains a step on two HDP ranks with a shared sequence (C = 512), saves, resumes for a
second step, and must give one process's losses: a crash at the save, a resume that loses state, or a rewrite the
passes miss (a checkpointed layer trained without the ring) all show up as a failure here.

Every case is slow (three trainer runs each, one to two minutes on 2 cores). By default each setting is checked on
its own: bf16 saved in the background (tests/distributed/test_checkpoint_async.py), checkpointed layers on 2 ranks
(test_architectures.py), TP (test_tensor_parallel.py), pipelines (test_train_pipeline.py)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from bytescale_compile.train.__main__ import main
from bytescale_compile.train.checkpoint import COMPLETE_MARKER
from tests.trainer_runs import cut_and_resume, run_losses, train_args

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

STEPS = 2
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}
"""Losses against one process: fp32 to rounding; bf16 packs and rings sequences differently from one process, so its
sums round differently (bf16's own step is within 1e-2 of fp32's, see test_trainer)."""
CASES = [
    *itertools.product(("fp32", "bf16"), ("sync", "async"), (1, 2), (False, True)),
    ("bf16", "async", "pp2", True),
]


def _flags(dtype: str, mode: str, layout: int | str, checkpointed: bool) -> tuple[int, tuple[str, ...]]:
    """(processes, flags) for two HDP ranks."""
    split = ("--pp", "2") if layout == "pp2" else ("--tp", str(layout))
    processes = 2 * (2 if layout == "pp2" else int(layout))
    flags = (
        "--dtype",
        dtype,
        "--checkpoint-async" if mode == "async" else "--no-checkpoint-async",
        "--gradient-checkpointing" if checkpointed else "--no-gradient-checkpointing",
        "--capacity",
        "512",
        *split,
    )
    return processes, flags


@pytest.fixture(scope="module")
def one_process(workspace, tmp_path_factory):
    """Losses of the two steps in one process, per dtype, computed once."""
    losses: dict[str, list[float]] = {}

    def of(dtype: str) -> list[float]:
        if dtype not in losses:
            out = tmp_path_factory.mktemp(f"one-{dtype}")
            assert main(train_args(workspace, out, "--steps", str(STEPS), "--dtype", dtype)) == 0
            losses[dtype] = run_losses(out)
        return losses[dtype]

    return of


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    CASES,
    ids=lambda case: "-".join(str(part) for part in case).replace("True", "ckpt").replace("False", "nockpt"),
)
def test_save_and_resume_equal_one_process(case, workspace, tmp_path, one_process):
    dtype = case[0]
    processes, flags = _flags(*case)
    out = tmp_path / "run"
    cut_and_resume(workspace, out, STEPS, (processes, flags), (processes, flags))
    committed = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert committed == ["step_00000001", "step_00000002"], committed
    assert all((out / "checkpoints" / name / COMPLETE_MARKER).is_file() for name in committed)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert sum(r["p2p_bytes"] for r in records) > 0, "no sequence was shared over the ranks"
    np.testing.assert_allclose(run_losses(out), one_process(dtype), rtol=0, atol=TOLERANCE[dtype])
