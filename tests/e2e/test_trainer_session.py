"""What a new user of `python -m bytescale_compile.train` met, one test per defect: a too-long sequence caught
before step 1, SIGTERM saving and exiting 0, extending --steps on resume, one error line from rank 0 only,
configs that load from anywhere, checkpoints kept and resumed as asked, and a --help that loads no torch."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bytescale_compile.data import TokenDataset
from bytescale_compile.train.__main__ import PROG, main
from bytescale_compile.train.config import load_config
from bytescale_compile.train.inputs import setup
from tests.trainer_runs import (
    ENV,
    MAX_LEN,
    ROOT,
    interrupt_after_first_step,
    qwen2_config,
    run_losses,
    run_metrics,
    torchrun_command,
    train_args,
)

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")


def _run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(f"{PROG}: error")]


# -- checked before step 1 -------------------------------------------------------------------------------


def _too_long_positions(data: Path, limit: int) -> list[int]:
    used = np.minimum(TokenDataset.open(data).lengths, MAX_LEN)
    return np.flatnonzero(used > limit).tolist()


@pytest.mark.slow
@pytest.mark.parametrize("pp", [1, 2])
def test_too_long_sequence_fails_before_step_1_with_its_dataset_position(workspace, tmp_path, pp):
    """Capacity 256 on 2 processes holds no 1024-token sequence (a 2-layer model cannot offload): the run stops
    before any step with one line from rank 0 naming the dataset positions and the ways out."""
    out = tmp_path / f"pp{pp}"
    result = _run(torchrun_command(2, train_args(workspace, out, "--capacity", "256", "--pp", str(pp))))
    assert result.returncode != 0
    errors = _error_lines(result.stderr)
    assert len(errors) == 1, result.stderr[-3000:]
    hdp = 2 // pp
    positions = _too_long_positions(workspace.data, hdp * 256)
    assert positions and f"positions {positions[0]}" in errors[0], errors[0]
    for way_out in ("--max-len", "--capacity", "ranks", "--long-docs split"):
        assert way_out in errors[0], (way_out, errors[0])
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip()


# -- runs that survive and extend --------------------------------------------------------------------------


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_exits_0_and_resumes_exactly(workspace, tmp_path):
    """SIGTERM during step 1 or 2: the run finishes that step, saves it and exits 0 naming it; a resume then
    ends with the losses of an uninterrupted run."""
    args = ("--steps", "5", "--decay-steps", "5")
    assert main(train_args(workspace, tmp_path / "full", *args)) == 0
    out = tmp_path / "cut"
    command = [sys.executable, "-m", "bytescale_compile.train", *train_args(workspace, out, *args)]
    status, stderr = interrupt_after_first_step(command, out, signal.SIGTERM)
    step = len(run_metrics(out))
    assert status == 0 and step < 5, stderr[-3000:]
    assert f"stopped by SIGTERM after step {step}: checkpoint" in stderr, stderr[-3000:]
    assert (out / "checkpoints" / f"step_{step:08d}" / "COMPLETE").exists()
    assert main(train_args(workspace, out, *args, "--resume")) == 0
    np.testing.assert_allclose(run_losses(out), run_losses(tmp_path / "full"), rtol=1e-6, atol=0)


@pytest.mark.slow
def test_longer_steps_on_resume_continue_the_learning_rate(workspace, tmp_path, capsys):
    """A finished 3-step run (its checkpoint written at the last step) extended to 5: no config change to
    accept, the learning rate stays at the schedule's end instead of jumping back up (and --log-every 4 prints
    steps 4 and 5 only); a resume asking for fewer steps than the checkpoint holds is refused."""
    out = tmp_path / "run"
    assert main(train_args(workspace, out)) == 0
    capsys.readouterr()
    assert main(train_args(workspace, out, "--steps", "5", "--resume", "--log-every", "4")) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if "] step " in line]
    assert [line.split("step ")[1].split(":")[0] for line in printed] == ["4", "5"]  # every 4th and the last
    lrs = [r["lr"] for r in run_metrics(out)]
    assert [r["step"] for r in run_metrics(out)] == [1, 2, 3, 4, 5]
    assert lrs[2:] == pytest.approx([1e-4] * 3) and lrs[:2] == pytest.approx([1e-3, 1e-3])
    capsys.readouterr()
    final = (out / "final" / "model.safetensors").stat().st_mtime_ns
    assert main(train_args(workspace, out, "--steps", "4", "--resume")) == 2
    err = capsys.readouterr().err
    assert "step_00000005 is of step 5, past --steps 4" in err and "--steps 5" in err
    assert (out / "final" / "model.safetensors").stat().st_mtime_ns == final


@pytest.mark.slow
def test_resume_with_nothing_to_resume_says_so_and_auto_starts(workspace, tmp_path, capsys):
    """--resume with no checkpoint is an error; --resume=auto starts. --keep-last 2 keeps the newest two."""
    assert main(train_args(workspace, tmp_path / "new", "--resume")) == 2
    assert "--resume: no checkpoint under" in capsys.readouterr().err
    args = ("--resume=auto", "--steps", "4", "--checkpoint-every", "1", "--keep-last", "2")
    assert main(train_args(workspace, tmp_path / "new", *args)) == 0
    assert [p.name for p in sorted((tmp_path / "new" / "checkpoints").iterdir())] == ["step_00000003", "step_00000004"]


# -- one clear line per failure --------------------------------------------------------------------------


@pytest.mark.slow
def test_only_rank_0_prints_a_config_error(workspace, tmp_path):
    """A setting every rank finds wrong alike, on 2 ranks our launcher starts: one line in all, exit 2 (under
    torchrun, the one line is followed by torchrun's report: see the too-long test)."""
    args = ["--nproc-per-node", "2", *train_args(workspace, tmp_path / "out", "--model", "tiny")]
    result = _run([sys.executable, "-m", "bytescale_compile.train", *args])
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr[-3000:]
    assert _error_lines(result.stderr)[0].endswith("or data tokenized for this model"), result.stderr


def test_out_naming_a_file_is_a_one_line_error(workspace, tmp_path, capsys):
    (tmp_path / "file").write_text("not a directory")
    assert main(train_args(workspace, tmp_path / "file")) == 2
    err = capsys.readouterr().err
    assert (
        err.strip()
        == f"{PROG}: error: --out {tmp_path / 'file'} is a file: pass a directory (it is created if missing)"
    )


# -- portable configs --------------------------------------------------------------------------------------


def test_moved_config_still_loads(workspace, tmp_path, monkeypatch):
    """A run started with relative paths, on a mixture of two datasets: each step records the tokens of each,
    and its config.toml loads, copied elsewhere, from another working directory: its paths are absolute. The
    mixture evaluates on both held-out splits, by weight."""
    (tmp_path / "copy").mkdir()
    for split in ("", "_eval"):
        for suffix in (".bin", ".idx", ".json"):
            source = workspace.data.with_name(workspace.data.name + split + suffix)
            shutil.copy(source, tmp_path / "copy" / f"code{split}{suffix}")
    monkeypatch.chdir(tmp_path)
    data = f"{os.path.relpath(workspace.data)}:0.7,copy/code:0.3"
    out = Path("runs") / "relative"
    assert (
        main(train_args(workspace, out, "--steps", "2", "--model", os.path.relpath(workspace.model), "--data", data))
        == 0
    )
    for record in run_metrics(out):
        assert sum(record["dataset_tokens"].values()) == record["tokens"] and len(record["dataset_tokens"]) == 2
    moved = tmp_path / "elsewhere" / "config.toml"
    moved.parent.mkdir()
    shutil.copy(out / "config.toml", moved)
    monkeypatch.chdir(moved.parent)
    config = load_config(moved, out=str(tmp_path / "second"))
    assert config.data == f"{workspace.data}:0.7,{tmp_path / 'copy' / 'code'}:0.3"
    assert Path(config.model) == workspace.model
    inputs = setup(load_config(moved, out=str(tmp_path / "second"), eval_every=2))
    assert [part.prefix for part in inputs.train_data.parts] == [workspace.data, tmp_path / "copy" / "code"]
    held_out = {Path(part.prefix).name: 0 for part in inputs.eval_data.parts}
    for batch in inputs.held_out:  # each held-out split its weight's share of the evaluated tokens
        held_out[Path(batch.dataset.prefix).name] += batch.num_tokens
    assert set(held_out) == {"data_eval", "code_eval"} and held_out["data_eval"] > held_out["code_eval"] > 0


# -- the usual instruments ---------------------------------------------------------------------------------


def test_help_shows_defaults_and_presets_without_loading_torch():
    code = (
        "import runpy, sys\n"
        "sys.argv = ['train', '--help']\n"
        "try:\n    runpy.run_module('bytescale_compile.train', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO TORCH')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert result.stdout.strip().endswith("NO TORCH"), result.stdout[-500:] + result.stderr[-2000:]
    text = " ".join(result.stdout.split())
    assert "(default: 100)" in text and "tiny (our LLaMA" in text and "--resume [auto]" in text


@pytest.mark.slow
def test_ctrl_c_on_2_ranks_prints_one_line(workspace, tmp_path):
    """Ctrl-C as a terminal sends it, to the launcher and the ranks at once: the ranks finish the step, save it
    and exit; rank 0 says so in the only line printed, and the exit status is 130."""
    out = tmp_path / "run"
    args = ["--nproc-per-node", "2", *train_args(workspace, out, "--steps", "50")]
    command = [sys.executable, "-m", "bytescale_compile.train", *args]
    status, stderr = interrupt_after_first_step(command, out, signal.SIGINT)
    step = len(run_metrics(out))
    assert status == 130 and stderr.strip().splitlines() == [
        f"stopped by SIGINT after step {step}: checkpoint {out / 'checkpoints' / f'step_{step:08d}'} saved; "
        "continue with --resume"
    ], stderr[-3000:]


@pytest.mark.parametrize("dtype,activation_bytes", [("fp32", 4), ("bf16", 2)])
def test_default_cost_model_counts_the_bytes_the_run_moves(workspace, tmp_path, dtype, activation_bytes):
    """K/V in the run's activation dtype, gradients in fp32 (the master weights): what the ring and the
    all-reduce send, so that the calibrated predictions of P2P bytes and all-reduce time are the measured ones."""
    cost = setup(load_config(None, **_settings(workspace, tmp_path, dtype=dtype))).cost_model
    kv_heads, head_dim, params = 2, 64 // 4, sum(p.numel() for p in _qwen2().parameters())
    assert cost.kv_bytes_per_token == 2 * kv_heads * head_dim * activation_bytes
    assert cost.param_bytes == pytest.approx(4 * params, rel=0.05)  # ModelShape counts the matrices


def _settings(workspace, tmp_path, **overrides) -> dict:
    return {"model": str(workspace.model), "data": str(workspace.data), "out": str(tmp_path / "out"), **overrides}


def _qwen2():
    import transformers

    return transformers.AutoModelForCausalLM.from_config(qwen2_config(max_position_embeddings=MAX_LEN))


def test_a_run_without_a_cost_model_calibrates_and_predicts(workspace, tmp_path, capsys):
    """The default: no --cost-model, so the job refits the analytic one before step 1 and every step line holds
    a prediction from it; with --no-calibrate on a CPU the lines hold none, and one line says why."""
    default = [arg for arg in train_args(workspace, tmp_path / "run", "--steps", "2") if arg != "--no-calibrate"]
    assert main(default) == 0
    printed = capsys.readouterr().out
    assert (
        tmp_path / "run" / "calibrated_cost_model.json"
    ).is_file() and "cost model calibrated in this job" in printed
    assert all("(predicted " in line for line in printed.splitlines() if "] step " in line)
    assert main(train_args(workspace, tmp_path / "uncalibrated", "--steps", "2")) == 0
    printed = capsys.readouterr().out
    assert "steps print no predicted time: the cost model is the analytic one of h100, not of this cpu" in printed
    assert not any("(predicted " in line for line in printed.splitlines() if "] step " in line)
