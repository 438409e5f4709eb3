"""The trainer with `--tp`: TP 2 × HDP 2 on 4 ranks gives one process's losses, resumes, and saves whole weights in
final/; bad settings are refused before any work."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from bytescale_compile.data import TokenDataset, eval_prefix
from bytescale_compile.train.__main__ import main
from tests.trainer_runs import (
    held_out_loss,
    run_losses,
    run_metrics,
    run_trainer,
    torchrun_command,
    train_args,
)

transformers = pytest.importorskip("transformers")

COMMON = ("--capacity", "512", "--eval-every", "3", "--decay-steps", "3")


@pytest.mark.slow
def test_tp2_on_4_ranks_equals_one_process_resumes_and_saves_whole_weights(workspace, tmp_path):
    """TP 2 × HDP 2 and TP 2 × PP 2 give one process's losses and whole weights in final/ (its eager held-out
    loss is the run's); a run cut at a step-2 checkpoint resumes to the uninterrupted losses, and with tp 1 to one
    process's."""
    run_trainer(torchrun_command(4, train_args(workspace, tmp_path / "tp", "--tp", "2", *COMMON)))
    assert main(train_args(workspace, tmp_path / "one", "--eval-every", "3", "--decay-steps", "3")) == 0
    ran, reference = run_metrics(tmp_path / "tp"), run_metrics(tmp_path / "one")
    np.testing.assert_allclose([r["loss"] for r in ran], [r["loss"] for r in reference], rtol=1e-4)
    assert ran[-1]["eval_loss"] == pytest.approx(reference[-1]["eval_loss"], rel=1e-4)
    assert sum(r["p2p_bytes"] for r in ran) > 0, "no sequence was shared by the two HDP ranks"
    for r in ran:  # both TP ranks' K/V counted, as the cost model's TP group sends them
        assert r["p2p_bytes"] == pytest.approx(r["predicted_p2p_bytes"], rel=0.2), r

    held_out = TokenDataset.open(eval_prefix(workspace.data))
    for run in ("tp", "tp_pp"):
        if run == "tp_pp":  # TP 2 × PP 2: one HDP rank (of C 1024) of two stages of two TP ranks
            tp_pp = ("--tp", "2", "--pp", "2", *COMMON, "--capacity", "1024")
            run_trainer(torchrun_command(4, train_args(workspace, tmp_path / run, *tp_pp)))
            np.testing.assert_allclose(run_losses(tmp_path / run), [r["loss"] for r in reference], rtol=1e-4)
        final = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / run / "final", local_files_only=True)
        assert final.model.layers[1].self_attn.q_proj.weight.shape == (64, 64)  # whole, not a shard
        eval_loss = run_metrics(tmp_path / run)[-1]["eval_loss"]
        assert held_out_loss(final.eval(), held_out) == pytest.approx(eval_loss, rel=1e-5)

    cut = ("--tp", "2", "--steps", "2", "--checkpoint-every", "2", *COMMON)
    run_trainer(torchrun_command(4, train_args(workspace, tmp_path / "cut", *cut)))
    shutil.copytree(tmp_path / "cut", tmp_path / "cut_tp1")
    output = run_trainer(torchrun_command(4, train_args(workspace, tmp_path / "cut", "--resume", "--tp", "2", *COMMON)))
    assert "resumed from" in output and "step_00000002" in output
    np.testing.assert_allclose(run_losses(tmp_path / "cut"), run_losses(tmp_path / "tp"), rtol=1e-6, atol=0)

    # the TP 2 checkpoint resumed with tp 1 (HDP 4): resharded, the losses of one process
    output = run_trainer(torchrun_command(4, train_args(workspace, tmp_path / "cut_tp1", "--resume", *COMMON)))
    assert "tp: 2 -> 1 (topology: the checkpoint is resharded)" in output
    assert "saved by 4 rank(s), tp 2, a replicated optimizer; loaded by 4 rank(s), a replicated optimizer" in output
    np.testing.assert_allclose(run_losses(tmp_path / "cut_tp1"), [r["loss"] for r in reference], rtol=1e-5)


def _error(args: list[str], capsys) -> str:
    assert main(args) == 2
    return capsys.readouterr().err


def test_tensor_parallel_settings_that_cannot_run_are_refused_before_any_work(workspace, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    err = _error(train_args(workspace, out, "--tp", "2"), capsys)
    assert "tp = 2 needs a multiple of 2 processes (pp x HDP ranks x tp), but the job has 1" in err
    monkeypatch.setenv("WORLD_SIZE", "8")
    err = _error(train_args(workspace, out, "--tp", "8"), capsys)
    assert "tp = 8: model" in err and "4 attention heads are not divisible by tp 8" in err
    assert not out.exists()
