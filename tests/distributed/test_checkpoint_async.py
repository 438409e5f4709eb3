"""Async checkpoints (`Checkpointer.save_async`): the saving call returns once the state is copied, so the training
may change the weights while the files are written; a write that fails or is cut off leaves the previous
checkpoint as the newest that verifies; across ranks the background save runs on its own group and every rank
hashes the files it wrote.

The writer is held on an event, so the order of events is fixed by the test, not by timing."""

from __future__ import annotations

import errno
import json
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from bytescale_compile.engine.dist_optim import DistributedOptimizer
from bytescale_compile.models.llama import tiny
from bytescale_compile.testing import run_distributed
from bytescale_compile.train import checkpoint
from bytescale_compile.train.checkpoint import (
    MANIFEST_FILE,
    Checkpointer,
    CheckpointError,
    CheckpointSaveError,
    checkpoint_dir,
    load_checkpoint,
    select_checkpoint,
    verify_checkpoint,
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
def saver() -> Checkpointer:
    return Checkpointer()


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch, saver: Checkpointer) -> Iterator[tuple[_HeldWriter, list[str]]]:
    timeline: list[str] = []
    writer = _HeldWriter(monkeypatch, timeline)
    yield writer, timeline
    writer.release.set()
    try:
        saver.wait()
    except CheckpointError:
        pass


def test_the_step_waits_only_for_the_copy(
    tmp_path: Path, held: tuple[_HeldWriter, list[str]], saver: Checkpointer
) -> None:
    writer, timeline = held
    model, optimizer = _trained()
    at_save = _weights(model)
    pending = saver.save_async(tmp_path, 1, model, optimizer, {"step": 1})
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
    tmp_path: Path, held: tuple[_HeldWriter, list[str]], saver: Checkpointer
) -> None:
    writer, _ = held
    model, optimizer = _trained()
    writer.release.set()
    first = saver.save_async(tmp_path, 1, model, optimizer, {"step": 1}).result()
    writer.release.clear()
    writer.fail = OSError(errno.ENOSPC, "No space left on device")
    pending = saver.save_async(tmp_path, 2, model, optimizer, {"step": 2})
    writer.release.set()
    with pytest.raises(CheckpointError, match=r"step 2 failed .*No space left on device.*previous checkpoint"):
        pending.result()
    assert select_checkpoint(tmp_path).path == first
    assert (tmp_path / "step_00000002.tmp").is_dir() and not checkpoint_dir(tmp_path, 2).exists()


def test_the_next_save_waits_for_the_one_in_flight_and_reports_its_failure(
    tmp_path: Path, held: tuple[_HeldWriter, list[str]], saver: Checkpointer
) -> None:
    writer, _ = held
    model, optimizer = _trained()
    writer.fail = OSError(errno.EIO, "Input/output error")
    saver.save_async(tmp_path, 1, model, optimizer, {"step": 1})
    writer.release.set()
    with pytest.raises(CheckpointError, match="step 1 failed .*Input/output error"):
        saver.save(tmp_path, 2, model, optimizer, {"step": 2})
    writer.fail = None
    assert saver.save(tmp_path, 2, model, optimizer, {"step": 2}) == checkpoint_dir(tmp_path, 2)


def _two_ranks_async(rank: int, world: int, root: str) -> None:
    """Both ranks save asynchronously twice (the second waits for the first), each hashing the files it wrote."""
    model, optimizer = _trained()
    saver = Checkpointer()
    saver.save_async(root, 1, model, optimizer, {"step": 1})
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    at_second = _weights(model)
    second = saver.save_async(root, 2, model, optimizer, {"step": 2}, keep_last=1)
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


def _bf16_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.LayerNorm(10), torch.nn.Linear(10, 5, bias=False))


def _bf16_inputs(step: int, world: int) -> list[torch.Tensor]:
    """Each rank's input of `step`: rank r's is the r-th, whatever the number of ranks that trains on them."""
    g = torch.Generator().manual_seed(step)
    return list(torch.randn(world, 3, 6, generator=g))


def _bf16_steps(model: torch.nn.Module, optimizer: DistributedOptimizer, steps: range, share: slice) -> list[Any]:
    """Train `steps` on this rank's `share` of every step's inputs; the bf16 weights after each step."""
    weights = []
    for step in steps:
        parts = _bf16_inputs(step, 2)[share]
        optimizer.start(len(parts))
        for x in parts:
            model(x.to(torch.bfloat16)).float().pow(2).sum().backward()
        optimizer.finish()
        optimizer.step()
        weights.append(torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]))
    return weights


def _bf16_async_worker(rank: int, world: int, root: str) -> None:
    """The distributed optimizer (fp32 main weights and moments as ShardedTensors of fragment pieces) saved in the
    background twice while the training goes on, the uninterrupted weights kept for the resume to compare with; read
    back on 2 ranks without torch's ShardedTensor warning; a host copy that fails on rank 1 fails the save on both."""
    model = _bf16_model()
    optimizer = DistributedOptimizer(model, 0.1, 0.1, (0.9, 0.95), bucket_bytes=64)
    saver = Checkpointer()
    _bf16_steps(model, optimizer, range(1), slice(rank, rank + 1))
    saver.save_async(root, 1, model, optimizer, {"step": 1})
    _bf16_steps(model, optimizer, range(1, 2), slice(rank, rank + 1))  # while step 1 is written
    at_save = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    pending = saver.save_async(root, 2, model, optimizer, {"step": 2})
    uninterrupted = _bf16_steps(model, optimizer, range(2, 4), slice(rank, rank + 1))
    assert pending.result() == checkpoint_dir(root, 2)
    if rank == 0:
        torch.save({"at_save": at_save, "uninterrupted": uninterrupted}, Path(root, "uninterrupted.pt"))
    fresh = _bf16_model()
    with warnings.catch_warnings(record=True) as caught:  # torch's ShardedTensor deprecation is ours to silence
        load_checkpoint(pending.path, fresh, DistributedOptimizer(fresh, 0.1, 0.1, (0.9, 0.95), bucket_bytes=64))
    assert not [str(w.message) for w in caught if "ShardedTensor" in str(w.message)]
    assert torch.equal(torch.cat([p.detach().float().reshape(-1) for p in fresh.parameters()]), at_save)

    def copy_fails_on_rank_1(stager: checkpoint._Stager, state_dict: dict[str, Any]) -> dict[str, Any]:
        if rank == 1:
            raise RuntimeError("host copy refused")
        return staged(stager, state_dict)

    staged = checkpoint._Stager.stage
    checkpoint._Stager.stage = copy_fails_on_rank_1  # type: ignore[method-assign]
    with pytest.raises(CheckpointSaveError) as failed:  # on both ranks, neither left waiting in the write
        saver.save_async(root, 3, model, optimizer, {"step": 3})
    assert [f.rank for f in failed.value.failures] == [1], failed.value.failures
    assert "step 3 failed on rank 1: RuntimeError: host copy refused" in str(failed.value)
    assert select_checkpoint(root).path == checkpoint_dir(root, 2)


def test_bf16_distributed_optimizer_saves_in_the_background_and_resumes_on_one_rank(tmp_path: Path) -> None:
    """Saved on 2 ranks, resumed in one process: the main weights round to the bf16 weights at the save, and the
    next steps equal the uninterrupted ones to bf16 rounding (the gradient sums run in another order)."""
    root = tmp_path / "ckpt"
    run_distributed(_bf16_async_worker, 2, str(root))
    expected = torch.load(root / "uninterrupted.pt")
    model = _bf16_model()
    optimizer = DistributedOptimizer(model, 0.1, 0.1, (0.9, 0.95), bucket_bytes=64)
    assert load_checkpoint(checkpoint_dir(root, 2), model, optimizer) == {"step": 2}
    assert torch.equal(torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]), expected["at_save"])
    for resumed, uninterrupted in zip(
        _bf16_steps(model, optimizer, range(2, 4), slice(0, 2)), expected["uninterrupted"]
    ):
        torch.testing.assert_close(resumed, uninterrupted, rtol=1e-2, atol=1e-2)
