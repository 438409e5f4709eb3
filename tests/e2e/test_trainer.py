"""`python -m bytescale_compile.train`: tokenizer → data prepare → training of a Hugging Face Qwen2 built from a
config directory, on 2 ranks under torchrun against one process; final/ against the eager model; bf16; the
errors a user meets first; resuming, also after a rank is SIGKILLed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch

from bytescale_compile.data import TokenDataset, eval_prefix, write_dataset
from bytescale_compile.planner import CostModel
from bytescale_compile.train.__main__ import PROG, main
from bytescale_compile.train.checkpoint import COMPLETE_MARKER
from bytescale_compile.train.config import load_config
from bytescale_compile.train.inputs import CALIBRATED_COST_MODEL
from tests.trainer_runs import (
    ENV,
    GLOBAL_TOKENS,
    MAX_LEN,
    ROOT,
    held_out_loss,
    run_losses,
    run_metrics,
    run_trainer,
    torchrun_command,
    train_args,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")


def test_two_ranks_equal_one_process_and_final_loads(workspace, tmp_path):
    """3 steps on 2 ranks (C = 512: the long sequences go over both in a ring) give the losses of one process;
    final/ loads with from_pretrained, with the tokenizer, and its eager held-out loss is the run's."""
    two, one = tmp_path / "two", tmp_path / "one"
    run_trainer(torchrun_command(2, train_args(workspace, two, "--capacity", "512", "--eval-every", "3")))
    assert main(train_args(workspace, one, "--eval-every", "3")) == 0
    ran, reference = run_metrics(two), run_metrics(one)
    assert [r["step"] for r in ran] == [1, 2, 3]
    assert sum(r["p2p_bytes"] for r in ran) > 0, "no sequence was shared over the ranks"
    np.testing.assert_allclose([r["loss"] for r in ran], [r["loss"] for r in reference], rtol=1e-5)
    assert ran[-1]["eval_loss"] == pytest.approx(reference[-1]["eval_loss"], rel=1e-5)
    assert ran[0]["loss"] > ran[-1]["loss"] and [r["lr"] for r in ran] == pytest.approx([1e-3, 1e-3, 1e-4])

    final = two / "final"
    model = transformers.AutoModelForCausalLM.from_pretrained(final, local_files_only=True).eval()
    untrained = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(workspace.model))
    assert not torch.equal(model.lm_head.weight, untrained.lm_head.weight)
    held_out = TokenDataset.open(eval_prefix(workspace.data))
    assert held_out_loss(model, held_out) == pytest.approx(ran[-1]["eval_loss"], rel=1e-5)
    tokenizer = transformers.AutoTokenizer.from_pretrained(final, local_files_only=True)
    original = transformers.AutoTokenizer.from_pretrained(workspace.tokenizer, local_files_only=True)
    assert tokenizer("def self yield")["input_ids"] == original("def self yield")["input_ids"]
    assert load_config(two / "config.toml") == load_config(
        None,
        **{
            "model": str(workspace.model),
            "data": str(workspace.data),
            "out": str(two),
            "steps": 3,
            "global_tokens": GLOBAL_TOKENS,
            "capacity": 512,
            "max_len": MAX_LEN,
            "lr": 1e-3,
            "warmup": 1,
            "eval_every": 3,
            "calibrate": False,
            "decay_steps": 3,
        },
    )


@pytest.mark.slow
def test_bf16_first_step_matches_fp32(workspace, tmp_path):
    """bf16 weights and the distributed optimizer on 2 ranks with a ring (K/V travel in bf16), after calibrating the
    cost model in the job (which trains nothing): finite losses, the first within 1e-2 of fp32's in one process;
    predicted peaks recorded, final/ saved in bf16."""
    run_trainer(
        torchrun_command(
            2,
            train_args(
                workspace, tmp_path / "bf16", "--steps", "2", "--capacity", "512", "--dtype", "bf16", "--calibrate"
            ),
        )
    )
    calibrated = CostModel.load(tmp_path / "bf16" / CALIBRATED_COST_MODEL)
    assert "calibrated" in calibrated.source and "calibrated" in calibrated.hardware.name
    assert main(train_args(workspace, tmp_path / "fp32", "--steps", "2")) == 0
    fp32, bf16 = run_losses(tmp_path / "fp32"), run_losses(tmp_path / "bf16")
    assert all(np.isfinite(bf16)) and abs(bf16[0] - fp32[0]) <= 1e-2, (bf16, fp32)
    assert bf16 != fp32, "bf16 computed exactly like fp32: autocast did not apply"
    records = run_metrics(tmp_path / "bf16")
    assert sum(r["p2p_bytes"] for r in records) > 0
    assert all(r["predicted_peak_bytes"] > 0 for r in records) and all(r["reduce_time"] >= 0 for r in records)
    final = safetensors.torch.load_file(str(tmp_path / "bf16" / "final" / "model.safetensors"))
    assert {t.dtype for t in final.values()} == {torch.bfloat16}  # final/ in the run's dtype


@pytest.mark.slow  # by default test_faults.py checks a failed save's one line and exit
def test_sigterm_to_2_bf16_ranks_whose_save_fails_exits_3_with_one_error_line(workspace, tmp_path):
    """`kill -TERM` to the launcher of 2 bf16 ranks, the checkpoint directory made unwritable first (a file where it
    goes): the stop's save fails on rank 0, and the launcher exits with the ranks' 3 after one `error:` line naming
    the step and the cause, and the traceback once."""
    out = tmp_path / "run"
    args = train_args(workspace, out, "--steps", "20", "--dtype", "bf16", "--checkpoint-every", "100")
    command = [sys.executable, "-m", "bytescale_compile.train", "--nproc-per-node", "2", *args]
    proc = subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not _metrics_written(out) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()
        (out / "checkpoints").write_text("not a directory")
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    errors = [line for line in stderr.splitlines() if line.startswith(f"{PROG}: error")]
    assert proc.returncode == 3, stderr[-3000:]
    step = len(run_metrics(out))
    assert len(errors) == 1 and stderr.count("Traceback") == 1, stderr[-3000:]
    assert (
        f"stopped by SIGTERM after step {step} without a checkpoint: the checkpoint of step {step} failed on rank 0"
        in errors[0]
    )
    assert "FileExistsError" in errors[0], errors[0]


def _metrics_written(out: Path) -> bool:
    metrics = out / "metrics.jsonl"
    return metrics.exists() and bool(metrics.read_text().strip())


def _error(args: list[str], capsys) -> str:
    assert main(args) == 2
    return capsys.readouterr().err


def test_missing_data_is_an_error_never_a_rebuild(workspace, tmp_path, capsys):
    err = _error(train_args(workspace, tmp_path / "out", "--data", str(tmp_path / "nothing")), capsys)
    assert "nothing.json not found" in err and "data prepare" in err
    assert not (tmp_path / "nothing.bin").exists() and not (tmp_path / "out").exists()


def test_missing_eval_split_is_an_error(workspace, tmp_path, capsys):
    write_dataset(tmp_path / "bytes", [bytes(range(200))] * 4, source="test")
    err = _error(
        train_args(workspace, tmp_path / "out", "--data", str(tmp_path / "bytes"), "--eval-every", "1"), capsys
    )
    assert "bytes_eval.json not found" in err and "eval_every = 0" in err


def test_vocabulary_mismatch_names_both(workspace, tmp_path, capsys):
    transformers.Qwen2Config(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    ).save_pretrained(tmp_path / "small")
    err = _error(train_args(workspace, tmp_path / "out", "--model", str(tmp_path / "small")), capsys)
    assert f"vocabulary of {workspace.vocab_size}" in err and "vocab_size of 256" in err


def test_byte_data_beyond_a_preset_vocabulary_is_refused(workspace, tmp_path, capsys):
    write_dataset(tmp_path / "bytes", [bytes(range(256))], source="test")
    err = _error(train_args(workspace, tmp_path / "out", "--model", "tiny", "--data", str(tmp_path / "bytes")), capsys)
    assert "vocabulary of 256 (bytes)" in err and "model tiny's vocab_size of 128" in err


def test_model_directory_without_config_json(workspace, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    err = _error(train_args(workspace, tmp_path / "out", "--model", str(tmp_path / "empty")), capsys)
    assert f"model directory {tmp_path / 'empty'} has no config.json" in err
    err = _error(train_args(workspace, tmp_path / "out", "--model", str(tmp_path / "typo")), capsys)
    assert "neither a directory nor a preset" in err


def test_new_run_refuses_an_earlier_runs_checkpoints(workspace, tmp_path, capsys):
    earlier = tmp_path / "out" / "checkpoints" / "step_00000002"
    earlier.mkdir(parents=True)
    (earlier / COMPLETE_MARKER).write_text("step 2\n")
    err = _error(train_args(workspace, tmp_path / "out"), capsys)
    assert str(earlier) in err and "--resume" in err


def test_config_file_errors_name_the_key(workspace, tmp_path, capsys):
    (tmp_path / "run.toml").write_text("learning_rate = 1e-3\n")
    err = _error(["--config", str(tmp_path / "run.toml"), *train_args(workspace, tmp_path / "out")], capsys)
    assert "unknown setting(s) ['learning_rate']" in err and "run.toml" in err


@pytest.mark.slow
def test_resume_after_step_2_equals_an_uninterrupted_run(workspace, tmp_path):
    """Both on 2 ranks with ZeRO-1 (the optimizer state is saved shard by shard): steps 1-2, a checkpoint, a new
    process resuming for steps 3-5, against steps 1-5 in one go. The schedule spans 5 steps in both."""
    common = ("--capacity", "512", "--decay-steps", "5", "--zero")
    run_trainer(torchrun_command(2, train_args(workspace, tmp_path / "full", "--steps", "5", *common)))
    run_trainer(
        torchrun_command(2, train_args(workspace, tmp_path / "cut", "--steps", "2", "--checkpoint-every", "2", *common))
    )
    output = run_trainer(
        torchrun_command(2, train_args(workspace, tmp_path / "cut", "--steps", "5", "--resume", *common))
    )
    assert "resumed from" in output and "step_00000002" in output
    assert [r["step"] for r in run_metrics(tmp_path / "cut")] == [1, 2, 3, 4, 5]
    np.testing.assert_allclose(run_losses(tmp_path / "cut"), run_losses(tmp_path / "full"), rtol=1e-6, atol=0)
    again = train_args(workspace, tmp_path / "cut", "--steps", "6", "--resume", "--seed", "1", *common)
    other_seed = subprocess.run(
        torchrun_command(2, again), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600
    )
    assert other_seed.returncode != 0 and "seed: 0 -> 1" in other_seed.stderr, other_seed.stderr[-2000:]


@pytest.mark.slow
def test_pipelines_on_4_ranks_equal_one_process_resume_and_save_final(workspace, tmp_path):
    """--pp 2 on 4 ranks (2 HDP ranks of 2 stages, ZeRO-1 per stage, the cost model calibrated on the whole
    model first): the losses and held-out loss of one process; final/ holds both stages' trained weights (its
    eager loss is the run's); a run cut at a step-2 checkpoint and resumed gives the uninterrupted run's
    losses."""
    common = ("--pp", "2", "--capacity", "512", "--zero", "--eval-every", "3", "--decay-steps", "3")
    run_trainer(torchrun_command(4, train_args(workspace, tmp_path / "pp", *common, "--calibrate")))
    assert CostModel.load(tmp_path / "pp" / CALIBRATED_COST_MODEL).boundary_bytes_per_token == 64 * 4
    assert main(train_args(workspace, tmp_path / "one", "--eval-every", "3")) == 0
    ran, reference = run_metrics(tmp_path / "pp"), run_metrics(tmp_path / "one")
    np.testing.assert_allclose([r["loss"] for r in ran], [r["loss"] for r in reference], rtol=1e-5)
    assert ran[-1]["eval_loss"] == pytest.approx(reference[-1]["eval_loss"], rel=1e-5)
    assert all(len(r["bubbles"]) == 2 and len(r["predicted_bubbles"]) == 2 and r["stage_bytes"] > 0 for r in ran)
    assert sum(r["p2p_bytes"] for r in ran) > 0, "no sequence was shared by the pipelines"
    final = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "pp" / "final", local_files_only=True)
    held_out = TokenDataset.open(eval_prefix(workspace.data))
    assert held_out_loss(final.eval(), held_out) == pytest.approx(ran[-1]["eval_loss"], rel=1e-5)

    run_trainer(
        torchrun_command(4, train_args(workspace, tmp_path / "cut", "--steps", "2", "--checkpoint-every", "2", *common))
    )
    output = run_trainer(torchrun_command(4, train_args(workspace, tmp_path / "cut", "--resume", *common)))
    assert "resumed from" in output and "step_00000002" in output
    np.testing.assert_allclose(run_losses(tmp_path / "cut"), run_losses(tmp_path / "pp"), rtol=1e-6, atol=0)


def test_pipeline_stages_that_do_not_fit_the_job_or_the_model_are_refused(workspace, tmp_path, capsys, monkeypatch):
    err = _error(train_args(workspace, tmp_path / "out", "--pp", "2"), capsys)
    assert "pp = 2 needs a multiple of 2 processes (pp x HDP ranks x tp), but the job has 1" in err
    monkeypatch.setenv("WORLD_SIZE", "3")
    err = _error(train_args(workspace, tmp_path / "out", "--pp", "3"), capsys)
    assert "cannot be split into pipeline stages" in err and "larger than the model's 2 decoder layers" in err


def _worker_pids(torchrun_pid: int) -> list[int]:
    """The training processes torchrun started (its children running bytescale_compile.train)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = stat.with_name("cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == torchrun_pid and b"bytescale_compile.train" in cmdline:
            pids.append(int(stat.parent.name))
    return sorted(pids)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds torchrun's workers through /proc")
def test_killed_rank_restarts_from_the_last_checkpoint(workspace, tmp_path):
    """SIGKILL one rank mid-run: torchrun restarts both, they resume from the last complete checkpoint
    (ZeRO shards included) and the run ends with the losses of an uninterrupted one."""
    common = ("--steps", "8", "--capacity", "512", "--zero")
    run_trainer(torchrun_command(2, train_args(workspace, tmp_path / "full", *common)))
    out = tmp_path / "killed"
    cmd = torchrun_command(
        2,
        train_args(workspace, out, *common, "--checkpoint-every", "2", "--keep-last", "0", "--resume=auto"),
        "--max-restarts=1",
    )
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )  # its own process group: a failure below kills the workers too
    try:
        first = out / "checkpoints" / "step_00000002" / COMPLETE_MARKER
        deadline = time.monotonic() + 300
        while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first.exists(), "no checkpoint at step 2"
        victims = _worker_pids(proc.pid)
        assert len(victims) == 2, victims
        os.kill(victims[1], signal.SIGKILL)
        output, _ = proc.communicate(timeout=600)
    finally:
        with contextlib.suppress(ProcessLookupError):  # nothing left of the group is fine
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, output
    assert "resumed from" in output, output
    assert first.exists()  # nothing written before the kill is lost
    assert [r["step"] for r in run_metrics(out)] == list(range(1, 9))
    np.testing.assert_allclose(run_losses(out), run_losses(tmp_path / "full"), rtol=1e-6, atol=0)
