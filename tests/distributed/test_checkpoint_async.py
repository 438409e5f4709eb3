"""Async checkpoints (`save_checkpoint_async`): the saving call returns once the state is copied, so the training
may change the weights while the files are written; a write that fails or is cut off leaves the previous
checkpoint as the newest that verifies; across ranks the background save runs on its own group and every rank
hashes the files it wrote.

The writer is held on an event, so the order of events is fixed by the test, not by timing."""

from __future__ import annotations

import errno
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from bytescale_compile.models.llama import tiny
from bytescale_compile.testing import run_distributed
from bytescale_compile.train.checkpoint import (
    MANIFEST_FILE,
    CheckpointError,
    checkpoint_dir,
    load_checkpoint,
    save_checkpoint,
    save_checkpoint_async,
    select_checkpoint,
    verify_checkpoint,
    wait_for_checkpoint,
)


def _trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 128, (2, 16))
    model(input_ids=ids, shift_labels=torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)).loss.backward()
    optimizer.step()
    return model, optimizer


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


class _HeldWriter:
    """Patches DCP's file system writer: each write logs to `timeline`, then waits for `release` and, when
    `fail` is set, raises it after writing half of its first file (a write cut off by a full disk)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, timeline: list[str]) -> None:
        self.release = threading.Event()
        self.fail: OSError | None = None
        original = FileSystemWriter.write_data

        def write_data(writer: FileSystemWriter, plan: Any, planner: Any) -> Any:
            timeline.append("write begins")
            assert self.release.wait(60), "the test never released the writer"
            if self.fail is not None:
                Path(writer.path, "__0_0.distcp").write_bytes(b"\0" * 100)
                timeline.append("write fails")
                raise self.fail
            written = original(writer, plan, planner)
            timeline.append("write ends")
            return written

        monkeypatch.setattr(FileSystemWriter, "write_data", write_data)


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[_HeldWriter, list[str]]]:
    timeline: list[str] = []
    writer = _HeldWriter(monkeypatch, timeline)
    yield writer, timeline
    writer.release.set()
    try:
        wait_for_checkpoint()
    except CheckpointError:
        pass


def test_the_step_waits_only_for_the_copy(tmp_path: Path, held: tuple[_HeldWriter, list[str]]) -> None:
    writer, timeline = held
    model, optimizer = _trained()
    at_save = _weights(model)
    pending = save_checkpoint_async(tmp_path, 1, model, optimizer, {"step": 1})
    timeline.append("save returned")
    with torch.no_grad():  # the next step changes the weights in place while the copy is written
        for p in model.parameters():
            p.add_(1.0)
    timeline.append("weights changed")
    assert not pending.done() and not pending.path.exists()
    writer.release.set()
    assert pending.result() == checkpoint_dir(tmp_path, 1)
    assert timeline.index("save returned") < timeline.index("weights changed") < timeline.index("write ends")
    verify_checkpoint(pending.path)
    fresh, fresh_optimizer = _trained(seed=1)
    load_checkpoint(pending.path, fresh, fresh_optimizer)
    assert all(torch.equal(p, at_save[name]) for name, p in fresh.named_parameters())
    assert pending.staged_s > 0


def test_a_failed_background_write_leaves_the_previous_checkpoint(
    tmp_path: Path, held: tuple[_HeldWriter, list[str]]
) -> None:
    writer, _ = held
    model, optimizer = _trained()
    writer.release.set()
    first = save_checkpoint_async(tmp_path, 1, model, optimizer, {"step": 1}).result()
    writer.release.clear()
    writer.fail = OSError(errno.ENOSPC, "No space left on device")
    pending = save_checkpoint_async(tmp_path, 2, model, optimizer, {"step": 2})
    writer.release.set()
    with pytest.raises(CheckpointError, match=r"step 2 failed .*No space left on device.*previous checkpoint"):
        pending.result()
    assert select_checkpoint(tmp_path).path == first
    assert (tmp_path / "step_00000002.tmp").is_dir() and not checkpoint_dir(tmp_path, 2).exists()


def test_the_next_save_waits_for_the_one_in_flight_and_reports_its_failure(
    tmp_path: Path, held: tuple[_HeldWriter, list[str]]
) -> None:
    writer, _ = held
    model, optimizer = _trained()
    writer.fail = OSError(errno.EIO, "Input/output error")
    save_checkpoint_async(tmp_path, 1, model, optimizer, {"step": 1})
    writer.release.set()
    with pytest.raises(CheckpointError, match="step 1 failed .*Input/output error"):
        save_checkpoint(tmp_path, 2, model, optimizer, {"step": 2})
    writer.fail = None
    assert save_checkpoint(tmp_path, 2, model, optimizer, {"step": 2}) == checkpoint_dir(tmp_path, 2)


def _two_ranks_async(rank: int, world: int, root: str) -> None:
    """Both ranks save asynchronously twice (the second waits for the first), each hashing the files it wrote."""
    model, optimizer = _trained()
    save_checkpoint_async(root, 1, model, optimizer, {"step": 1})
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    at_second = _weights(model)
    second = save_checkpoint_async(root, 2, model, optimizer, {"step": 2}, keep_last=1)
    torch.distributed.all_reduce(torch.ones(1))  # the training's collectives meanwhile, on the default group
    path = second.result()
    assert sorted(p.name for p in Path(root).iterdir()) == ["step_00000002"]
    files = json.loads((path / MANIFEST_FILE).read_text())["files"]
    assert {".metadata", "train_state.json"} <= set(files)
    verify_checkpoint(path)
    fresh, fresh_optimizer = _trained(seed=1)
    load_checkpoint(path, fresh, fresh_optimizer)
    assert all(torch.equal(p, at_second[name]) for name, p in fresh.named_parameters())
    Path(root, f"ok_{rank}").touch()


def test_two_ranks_save_in_the_background(tmp_path: Path) -> None:
    run_distributed(_two_ranks_async, 2, str(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt" / "ok_0").exists() and (tmp_path / "ckpt" / "ok_1").exists()
