"""A run resumed on another number of ranks, pipeline stages or ZeRO setting continues with the losses of the
uninterrupted run: the global batch is fixed in tokens and the loss is token-level, so a step's gradient does not
depend on how the ranks split it, and the checkpoint is resharded by parameter name on load."""

from __future__ import annotations

import numpy as np
import pytest

from tests.trainer_runs import cut_and_resume, run_losses, run_trainer, torchrun_command, train_args

pytest.importorskip("transformers")

STEPS = 4


@pytest.mark.slow
def test_resumed_on_other_world_sizes_and_stages_the_losses_are_the_uninterrupted_ones(workspace, tmp_path):
    whole = ("--steps", str(STEPS), "--decay-steps", str(STEPS), "--zero")
    run_trainer(torchrun_command(4, train_args(workspace, tmp_path / "whole", *whole)))
    uninterrupted = run_losses(tmp_path / "whole")

    output = cut_and_resume(workspace, tmp_path / "4to2", STEPS, (4, ("--zero",)), (2, ("--zero",)))
    assert "saved by 4 rank(s), ZeRO-1 optimizer shards; loaded by 2 rank(s), ZeRO-1 optimizer shards" in output
    np.testing.assert_allclose(run_losses(tmp_path / "4to2"), uninterrupted, rtol=1e-5)

    output = cut_and_resume(workspace, tmp_path / "2to4", STEPS, (2, ()), (4, ("--zero",)))
    assert "zero: False -> True (topology: the checkpoint is resharded)" in output
    np.testing.assert_allclose(run_losses(tmp_path / "2to4"), uninterrupted, rtol=1e-5)

    output = cut_and_resume(workspace, tmp_path / "pp2to1", STEPS, (2, ("--pp", "2")), (2, ()))
    assert "pp: 2 -> 1 (topology: the checkpoint is resharded)" in output
    assert "saved by 2 rank(s), pp 2, a replicated optimizer; loaded by 2 rank(s), a replicated optimizer" in output
    np.testing.assert_allclose(run_losses(tmp_path / "pp2to1"), uninterrupted, rtol=1e-5)


@pytest.mark.slow
def test_bf16_saved_in_the_background_on_tp_2_resumes_on_other_ranks_and_tp(workspace, tmp_path):
    """bf16 with the distributed optimizer, its checkpoint saved asynchronously (the default) on 4 ranks at tp 2 and
    resumed on 2 ranks at tp 1: the losses of the uninterrupted run, to bf16 rounding (the reductions run in
    another order)."""
    bf16 = ("--dtype", "bf16")
    whole = ("--steps", str(STEPS), "--decay-steps", str(STEPS), "--tp", "2", *bf16)
    run_trainer(torchrun_command(4, train_args(workspace, tmp_path / "whole", *whole)))
    output = cut_and_resume(workspace, tmp_path / "tp2to1", STEPS, (4, ("--tp", "2", *bf16)), (2, bf16))
    assert "tp: 2 -> 1 (topology: the checkpoint is resharded)" in output
    assert "saved by 4 rank(s), tp 2, distributed-optimizer shards (bf16 weights); loaded by 2 rank(s)" in output
    np.testing.assert_allclose(run_losses(tmp_path / "tp2to1"), run_losses(tmp_path / "whole"), rtol=1e-2)
