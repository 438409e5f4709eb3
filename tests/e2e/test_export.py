"""`bytescale-compile export`: a checkpoint of a one-process run, written as a Hugging Face directory, has the
run's held-out loss at that step; a run directory exports its newest checkpoint that verifies (final/'s weights);
relative paths of a run's config resolve beside its config.toml. Refused in one line: a preset model, a
checkpoint that does not match its manifest, an --out that holds files (unless --overwrite) or is a file."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from bytescale_compile.cli import main
from bytescale_compile.data import TokenDataset, eval_prefix
from bytescale_compile.models.llama import tiny
from bytescale_compile.train.checkpoint import checkpoint_dir, save_checkpoint
from tests.helpers import rel_err
from tests.trainer_runs import Workspace, held_out_loss, run_metrics, run_trainer, train_args

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

SHARD = "__0_0.distcp"


@pytest.fixture(scope="module")
def run(workspace: Workspace, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 steps in one process, checkpointed and evaluated every 2."""
    out = tmp_path_factory.mktemp("export") / "run"
    args = train_args(workspace, out, "--steps", "4", "--checkpoint-every", "2", "--eval-every", "2")
    run_trainer([sys.executable, "-m", "bytescale_compile.train", *args])
    return out


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()  # not what earlier loads printed
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bytescale-compile export: error: "), captured.err
    return lines[0]


def _load(directory: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True).eval()


def test_an_exported_step_has_the_runs_held_out_loss_at_that_step(workspace, run, tmp_path, capsys):
    out = tmp_path / "step2"
    assert main(["export", str(checkpoint_dir(run / "checkpoints", 2)), "--out", str(out)]) == 0
    assert f"exported step 2 from {checkpoint_dir(run / 'checkpoints', 2)} to {out}" in capsys.readouterr().out
    model = _load(out)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    eval_loss = {r["step"]: r["eval_loss"] for r in run_metrics(run) if r.get("eval_loss") is not None}
    loss = torch.tensor(held_out_loss(model, TokenDataset.open(eval_prefix(workspace.data))))
    assert rel_err(loss, torch.tensor(eval_loss[2])) < 1e-5, (loss, eval_loss)
    assert rel_err(loss, torch.tensor(eval_loss[4])) > 1e-3, "step 2 exported the weights of step 4"
    tokenizer = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    original = transformers.AutoTokenizer.from_pretrained(workspace.tokenizer, local_files_only=True)
    assert tokenizer("def self yield")["input_ids"] == original("def self yield")["input_ids"]


def test_a_run_exports_its_newest_checkpoint_and_overwrites_only_when_asked(run, tmp_path, capsys):
    out = tmp_path / "latest"
    assert main(["export", str(run), "--out", str(out)]) == 0
    assert "exported step 4" in capsys.readouterr().out
    final, exported = _load(run / "final").state_dict(), _load(out).state_dict()
    assert final.keys() == exported.keys() and all(torch.equal(final[k], exported[k]) for k in final)

    line = _error(["export", str(run), "--out", str(out)], capsys)
    assert f"--out {out} exists and is not empty" in line and "--overwrite" in line
    assert main(["export", str(checkpoint_dir(run / "checkpoints", 2)), "--out", str(out), "--overwrite"]) == 0
    assert not torch.equal(_load(out).lm_head.weight, final["lm_head.weight"])
    (tmp_path / "a_file").write_text("")
    assert "is a file" in _error(["export", str(run), "--out", str(tmp_path / "a_file")], capsys)


def test_a_damaged_checkpoint_is_refused_and_a_run_falls_back_to_the_previous(run, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(run / "checkpoints", copy / "checkpoints")
    newest = checkpoint_dir(copy / "checkpoints", 4)
    data = bytearray((newest / SHARD).read_bytes())
    data[len(data) // 2] ^= 0x01
    (newest / SHARD).write_bytes(bytes(data))

    line = _error(["export", str(newest), "--out", str(tmp_path / "refused")], capsys)
    assert f"file {SHARD} checksum differs from the manifest" in line and str(newest) in line
    assert not (tmp_path / "refused").exists()
    assert main(["export", str(copy), "--out", str(tmp_path / "fallback")]) == 0
    printed = capsys.readouterr().out
    assert f"skipped {newest}" in printed and "exported step 2" in printed


def test_relative_paths_resolve_beside_the_runs_config(workspace, tmp_path, capsys):
    """An older run's config kept its paths as given; the run directory moved along with its model and data."""
    moved = tmp_path / "moved"
    shutil.copytree(workspace.model, moved / "qwen2")
    (moved / "config.toml").write_text('model = "qwen2"\ndata = "data"\n')
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(workspace.model))
    config = {"model": "qwen2", "seed": 0, "data": "data"}
    save_checkpoint(
        moved / "checkpoints", 1, model, torch.optim.AdamW(model.parameters()), {"step": 1, "config": config}
    )

    line = _error(["export", str(moved), "--out", str(tmp_path / "out")], capsys)
    assert "'data'" in line and "--tokenizer" in line  # the data is not there: which tokenizer is unknown
    argv = ["export", str(moved), "--out", str(tmp_path / "out"), "--tokenizer", str(workspace.tokenizer)]
    assert main(argv) == 0
    assert f"in the config of {moved / 'qwen2'}" in capsys.readouterr().out
    assert torch.equal(_load(tmp_path / "out").lm_head.weight, model.lm_head.weight)

    for file in workspace.data.parent.glob(f"{workspace.data.name}.*"):
        shutil.copy(file, moved)
    assert main(["export", str(moved), "--out", str(tmp_path / "out2")]) == 0
    assert f"the tokenizer of {workspace.tokenizer.resolve()}" in capsys.readouterr().out


def test_a_preset_models_checkpoint_is_refused(workspace, tmp_path, capsys):
    model = tiny()
    config = {"model": "tiny", "seed": 0, "data": str(workspace.data)}
    save_checkpoint(
        tmp_path / "checkpoints", 1, model, torch.optim.AdamW(model.parameters()), {"step": 1, "config": config}
    )
    line = _error(["export", str(checkpoint_dir(tmp_path / "checkpoints", 1)), "--out", str(tmp_path / "out")], capsys)
    assert "'tiny'" in line and "preset or MODULE:FACTORY" in line and "Hugging Face directory" in line
    assert not (tmp_path / "out").exists()
