"""Checkpoints with torch.distributed.checkpoint: exact round trips (1 process and 2 gloo ranks), atomicity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import bytescale_compile as bsc
from bytescale_compile.train.checkpoint import (
    COMPLETE_MARKER,
    CheckpointError,
    checkpoint_dir,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from bytescale_compile.runtime.spawn import run_distributed
from examples.models.llama import tiny

TRAIN_STATE = {"step": 2, "sampler": {"epoch": 0, "cursor": 17}, "seeds": [1, 2], "config": {"lr": 1e-3}}


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, 128, (2, 16), generator=g)
        labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=ids, shift_labels=labels).loss.backward()
        optimizer.step()


def _fresh(seed: int, opt: str = "adamw") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = tiny()
    if opt == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    return model, optimizer


def _assert_same(model_a, opt_a, model_b, opt_b) -> None:
    sa, sb = model_a.state_dict(), model_b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    oa, ob = opt_a.state_dict(), opt_b.state_dict()
    assert oa["param_groups"] == ob["param_groups"]
    assert oa["state"].keys() == ob["state"].keys() and oa["state"]
    for i in oa["state"]:
        assert oa["state"][i].keys() == ob["state"][i].keys()
        for k, v in oa["state"][i].items():
            w = ob["state"][i][k]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, (i, k)


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_round_trip_single_process(tmp_path: Path, opt: str) -> None:
    model, optimizer = _fresh(0, opt)
    _train(model, optimizer, 2)
    path = save_checkpoint(tmp_path, 2, model, optimizer, TRAIN_STATE)
    assert path == tmp_path / "step_00000002" == checkpoint_dir(tmp_path, 2)
    assert (path / COMPLETE_MARKER).is_file() and not (tmp_path / "step_00000002.tmp").exists()
    assert latest_checkpoint(tmp_path) == path

    model2, optimizer2 = _fresh(1, opt)  # different init, optimizer never stepped
    assert not torch.equal(model.lm_head.weight, model2.lm_head.weight)
    state = load_checkpoint(path, model2, optimizer2)
    assert state == TRAIN_STATE
    _assert_same(model, optimizer, model2, optimizer2)

    # and training continues identically from there
    _train(model, optimizer, 2, seed=5)
    _train(model2, optimizer2, 2, seed=5)
    _assert_same(model, optimizer, model2, optimizer2)


def test_round_trip_optimized_module(tmp_path: Path) -> None:
    model, optimizer = _fresh(0)
    _train(model, optimizer, 2)
    wrapped = bsc.optimize(model)
    path = save_checkpoint(tmp_path, 7, wrapped, optimizer, {"step": 7})
    model2, optimizer2 = _fresh(1)
    assert load_checkpoint(path, bsc.optimize(model2), optimizer2) == {"step": 7}
    _assert_same(model, optimizer, model2, optimizer2)


def test_latest_checkpoint_skips_tmp_and_incomplete(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "nothing-here") is None
    assert latest_checkpoint(tmp_path) is None
    model, optimizer = _fresh(0)
    _train(model, optimizer, 1)
    for step in (3, 10):
        save_checkpoint(tmp_path, step, model, optimizer, {"step": step})
    (tmp_path / "step_00000200.tmp").mkdir()           # a crashed save in progress
    (tmp_path / "step_00000200.tmp" / COMPLETE_MARKER).write_text("")
    (tmp_path / "step_00000100").mkdir()               # renamed but never marked (foreign / partial)
    (tmp_path / "step_00000050").write_text("a file")  # not a directory
    (tmp_path / "step_abc").mkdir()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000010"
    # re-saving an existing step replaces it
    save_checkpoint(tmp_path, 10, model, optimizer, {"step": 10, "again": True})
    model2, optimizer2 = _fresh(1)
    assert load_checkpoint(latest_checkpoint(tmp_path), model2, optimizer2) == {"step": 10, "again": True}
    assert not (tmp_path / "step_00000010.old").exists()


def test_stale_tmp_is_replaced(tmp_path: Path) -> None:
    stale = tmp_path / "step_00000004.tmp"
    stale.mkdir(parents=True)
    (stale / "__9_0.distcp").write_text("garbage from a crashed save")
    model, optimizer = _fresh(0)
    _train(model, optimizer, 1)
    path = save_checkpoint(tmp_path, 4, model, optimizer, {"step": 4})
    assert not stale.exists() and not (path / "__9_0.distcp").exists()


def test_incomplete_directory_raises(tmp_path: Path) -> None:
    model, optimizer = _fresh(0)
    _train(model, optimizer, 1)
    path = save_checkpoint(tmp_path, 1, model, optimizer, {"step": 1})
    (path / COMPLETE_MARKER).unlink()
    with pytest.raises(CheckpointError, match=rf"{path}.*missing {COMPLETE_MARKER}"):
        load_checkpoint(path, model, optimizer)
    assert latest_checkpoint(tmp_path) is None

    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "step_00000099", model, optimizer)

    path = save_checkpoint(tmp_path, 2, model, optimizer, {"step": 2})
    (path / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"missing \.metadata"):
        load_checkpoint(path, model, optimizer)


def test_mismatched_model_raises(tmp_path: Path) -> None:
    model, optimizer = _fresh(0)
    _train(model, optimizer, 1)
    path = save_checkpoint(tmp_path, 1, model, optimizer, {"step": 1})
    other = torch.nn.Linear(3, 3)
    with pytest.raises(CheckpointError, match=str(path)):
        load_checkpoint(path, other, torch.optim.AdamW(other.parameters()))


def test_bad_train_state_fails_before_writing(tmp_path: Path) -> None:
    model, optimizer = _fresh(0)
    with pytest.raises(TypeError, match="JSON"):
        save_checkpoint(tmp_path, 1, model, optimizer, {"bad": object()})
    assert not tmp_path.joinpath("step_00000001.tmp").exists()


def _distributed_round_trip(rank: int, world: int, root: str, wrap: bool) -> None:
    model, optimizer = _fresh(0)  # same seed: replicated identically on every rank
    _train(model, optimizer, 2)  # same batches on every rank, so still identical
    saved = save_checkpoint(root, 2, bsc.optimize(model) if wrap else model, optimizer, {"step": 2, "world": world})
    assert latest_checkpoint(root) == saved, (rank, saved)
    model2, optimizer2 = _fresh(100 + rank)
    state = load_checkpoint(saved, bsc.optimize(model2) if wrap else model2, optimizer2)
    assert state == {"step": 2, "world": world}
    _assert_same(model, optimizer, model2, optimizer2)
    Path(root, f"ok_{rank}").write_text(json.dumps(sorted(p.name for p in saved.iterdir())))


@pytest.mark.parametrize("wrap", [False, True])
def test_round_trip_two_gloo_ranks(tmp_path: Path, wrap: bool) -> None:
    run_distributed(_distributed_round_trip, 2, str(tmp_path), wrap)
    assert (tmp_path / "ok_0").exists() and (tmp_path / "ok_1").exists()
    files = json.loads((tmp_path / "ok_0").read_text())
    assert {COMPLETE_MARKER, ".metadata", "train_state.json"} <= set(files)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("step_")] == ["step_00000002"]


def _zero(model: torch.nn.Module) -> torch.optim.Optimizer:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2, weight_decay=0.1)


def _zero_round_trip(rank: int, world: int, root: str) -> None:
    torch.manual_seed(0)
    model = tiny()
    optimizer = _zero(model)
    _train(model, optimizer, 2)
    optimizer.param_groups[0]["lr"] = 5e-3  # a scheduler's change must survive the round trip
    saved = save_checkpoint(root, 2, model, optimizer, {"step": 2})
    torch.manual_seed(100 + rank)
    model2 = tiny()
    optimizer2 = _zero(model2)
    load_checkpoint(saved, model2, optimizer2)
    _assert_same(model, optimizer.optim, model2, optimizer2.optim)  # this rank's shard, not a gathered copy
    assert optimizer2.param_groups[0]["lr"] == 5e-3
    _train(model, optimizer, 1, seed=1)
    _train(model2, optimizer2, 1, seed=1)
    for (name, p), q in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(p, q), name
    replicated_model, replicated = _fresh(0)
    with pytest.raises(CheckpointError, match="holds ZeRO optimizer shards"):
        load_checkpoint(saved, replicated_model, replicated)
    Path(root, f"ok_{rank}").touch()


def test_zero_shards_round_trip_two_gloo_ranks(tmp_path: Path) -> None:
    run_distributed(_zero_round_trip, 2, str(tmp_path))
    assert (tmp_path / "ok_0").exists() and (tmp_path / "ok_1").exists()
