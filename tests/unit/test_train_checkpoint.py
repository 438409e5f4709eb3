"""Checkpoints in one process: the manifest, a damaged or incomplete checkpoint detected and fallen back from,
stale `.tmp` directories removed, another model's shape refused. Several ranks' checkpoints are in
tests/distributed/test_train_checkpoint.py."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from bytescale_compile.models.llama import tiny
from bytescale_compile.train.checkpoint import (
    COMPLETE_MARKER,
    MANIFEST_FILE,
    CheckpointError,
    checkpoint_dir,
    load_checkpoint,
    prune_checkpoints,
    remove_stale_tmp,
    resume_latest,
    save_checkpoint,
    select_checkpoint,
)
from tests.checkpoints import SHARD, flip_byte, tiny_step


def _fresh(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = tiny()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _save_steps(root: Path, steps: tuple[int, ...]) -> tuple[torch.nn.Module, dict[int, dict[str, torch.Tensor]]]:
    """Checkpoints of one model trained a step between each; returns it and its weights at each step."""
    model, optimizer = _fresh(0)
    weights = {}
    for step in steps:
        tiny_step(model, optimizer, step)
        save_checkpoint(root, step, model, optimizer, {"step": step})
        weights[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return model, weights


def test_keep_last_keeps_the_newest_up_to_the_step_saved(tmp_path: Path) -> None:
    """After a resume from step 2 passed over a damaged step 5, saving step 3 with keep_last 1 keeps step 3 (and
    leaves step 5 alone): the damaged one never takes a kept one's place."""
    _save_steps(tmp_path, (1, 2, 5))
    flip_byte(checkpoint_dir(tmp_path, 5))
    assert prune_checkpoints(tmp_path, 1, step=2) == [checkpoint_dir(tmp_path, 1)]
    model, optimizer = _fresh(0)
    tiny_step(model, optimizer, 3)
    save_checkpoint(tmp_path, 3, model, optimizer, {"step": 3}, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000005"]
    assert resume_latest(tmp_path, model, optimizer).path == checkpoint_dir(tmp_path, 3)


def _remove_shard(path: Path) -> None:
    (path / SHARD).unlink()


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "flipped byte": (flip_byte, f"file {SHARD} checksum differs"),
    "missing shard": (_remove_shard, f"file {SHARD} is missing"),
}


def test_manifest_lists_every_file_before_complete(tmp_path: Path) -> None:
    _save_steps(tmp_path, (1,))
    path = checkpoint_dir(tmp_path, 1)
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    assert manifest["world_size"] == 1
    assert set(manifest["files"]) == {".metadata", SHARD, "train_state.json"}
    assert manifest["files"][SHARD]["size"] == (path / SHARD).stat().st_size
    assert len(manifest["files"][SHARD]["sha256"]) == 64


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_shard_is_detected_and_resume_falls_back(tmp_path: Path, damage: str, caplog) -> None:
    _, weights = _save_steps(tmp_path, (1, 2))
    latest = checkpoint_dir(tmp_path, 2)
    harm, reason = DAMAGE[damage]
    harm(latest)
    model, optimizer = _fresh(1)
    with pytest.raises(CheckpointError, match=rf"{latest}: {reason}"):
        load_checkpoint(latest, model, optimizer)

    with caplog.at_level(logging.INFO):
        resumed = resume_latest(tmp_path, model, optimizer)
    assert resumed.path == checkpoint_dir(tmp_path, 1) and resumed.train_state == {"step": 1}
    assert [(s.path, reason in s.reason) for s in resumed.skipped] == [(latest, True)]
    assert f"skipping checkpoint {latest}" in caplog.text and reason in caplog.text
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights[1][name]), name


def test_checkpoint_without_complete_is_skipped_with_its_reason(tmp_path: Path, caplog) -> None:
    _save_steps(tmp_path, (1, 2))
    (checkpoint_dir(tmp_path, 2) / COMPLETE_MARKER).unlink()
    with caplog.at_level(logging.INFO):
        choice = select_checkpoint(tmp_path)
    assert choice.path == checkpoint_dir(tmp_path, 1)
    assert len(choice.skipped) == 1 and f"no {COMPLETE_MARKER} marker" in choice.skipped[0].reason
    assert f"skipping checkpoint {checkpoint_dir(tmp_path, 2)}" in caplog.text


def test_none_verifies_names_every_checkpoint_and_why(tmp_path: Path) -> None:
    _save_steps(tmp_path, (1, 2, 3))
    flip_byte(checkpoint_dir(tmp_path, 1))
    (checkpoint_dir(tmp_path, 2) / MANIFEST_FILE).unlink()
    (checkpoint_dir(tmp_path, 3) / COMPLETE_MARKER).unlink()
    model, optimizer = _fresh(1)
    with pytest.raises(CheckpointError) as info:
        resume_latest(tmp_path, model, optimizer)
    message = str(info.value)
    assert "tried 3" in message
    assert f"step_00000003: checkpoint directory {checkpoint_dir(tmp_path, 3)} has no {COMPLETE_MARKER}" in message
    assert f"{checkpoint_dir(tmp_path, 2)}: manifest {MANIFEST_FILE} missing" in message
    assert f"{checkpoint_dir(tmp_path, 1)}: file {SHARD} checksum differs" in message
    assert resume_latest(tmp_path / "none-yet", model, optimizer) is None


def test_stale_tmp_directories_are_removed_at_start(tmp_path: Path, caplog) -> None:
    _save_steps(tmp_path, (1,))
    stale = [tmp_path / "step_00000002.tmp", tmp_path / "step_00000007.tmp"]
    for path in stale:
        path.mkdir()
        (path / SHARD).write_text("half a shard")
    with caplog.at_level(logging.INFO):
        assert remove_stale_tmp(tmp_path) == stale
    assert not any(p.exists() for p in stale) and checkpoint_dir(tmp_path, 1).is_dir()
    assert all(str(p) in caplog.text for p in stale)
    assert remove_stale_tmp(tmp_path / "none-yet") == []


def test_another_model_shape_is_refused_and_another_world_size_reported(tmp_path: Path) -> None:
    _save_steps(tmp_path, (1,))
    path = checkpoint_dir(tmp_path, 1)
    torch.manual_seed(0)
    wider = type(tiny())(replace(tiny().config, hidden_size=32, intermediate_size=64))
    with pytest.raises(
        CheckpointError,
        match=r"another model .*embed_tokens\.weight: saved \[128, 64\], "
        r"this model \[128, 32\]",
    ):
        load_checkpoint(path, wider, torch.optim.AdamW(wider.parameters()))

    manifest = json.loads((path / MANIFEST_FILE).read_text())
    (path / MANIFEST_FILE).write_text(json.dumps({**manifest, "world_size": 2}))  # as if saved by 2 ranks
    model, optimizer = _fresh(1)
    resumed = resume_latest(tmp_path, model, optimizer)
    assert resumed is not None and resumed.resharded == (
        "saved by 2 rank(s), a replicated optimizer; loaded by 1 rank(s), a replicated optimizer"
    )
