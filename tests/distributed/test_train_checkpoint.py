"""Checkpoints with torch.distributed.checkpoint: exact round trips (1 process and 2 gloo ranks), atomicity,
optimizer state stored by parameter name whatever the layout (ZeRO shards, pipeline stages), layouts and the
older format refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.optim import ZeroRedundancyOptimizer

import bytescale_compile as bsc
from bytescale_compile.engine.optim import build_optimizer
from bytescale_compile.engine.pipeline import pipeline_stage, stage_group
from bytescale_compile.engine.protocol import next_token_labels
from bytescale_compile.engine.stages import full_model_name
from bytescale_compile.models.llama import tiny
from bytescale_compile.testing import run_distributed
from bytescale_compile.train.checkpoint import (
    COMPLETE_MARKER,
    MANIFEST_FILE,
    CheckpointError,
    checkpoint_dir,
    latest_checkpoint,
    load_checkpoint,
    resume_latest,
    save_checkpoint,
)

TRAIN_STATE = {"step": 2, "sampler": {"epoch": 0, "cursor": 17}, "seeds": [1, 2], "config": {"lr": 1e-3}}


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, 128, (2, 16), generator=g)
        labels = next_token_labels(ids)
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
    (tmp_path / "step_00000200.tmp").mkdir()  # a crashed save in progress
    (tmp_path / "step_00000200.tmp" / COMPLETE_MARKER).write_text("")
    (tmp_path / "step_00000100").mkdir()  # renamed but never marked (foreign / partial)
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
    replicated_model, replicated = _fresh(1)  # each rank reads every rank's ZeRO shard into a replicated AdamW
    load_checkpoint(saved, replicated_model, replicated)
    assert replicated.param_groups[0]["lr"] == 5e-3
    _train(replicated_model, replicated, 1, seed=1)
    for (name, p), q in zip(model.named_parameters(), replicated_model.parameters()):
        assert torch.equal(p, q), name
    Path(root, f"ok_{rank}").touch()


def test_zero_shards_round_trip_two_gloo_ranks(tmp_path: Path) -> None:
    run_distributed(_zero_round_trip, 2, str(tmp_path))
    assert (tmp_path / "ok_0").exists() and (tmp_path / "ok_1").exists()


def _keys(path: Path) -> set[str]:
    return set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def _optimizer_state_names(path: Path) -> list[str]:
    """The parameter of every stored Adam first moment, in key order."""
    prefix, suffix = "app.optim.state.", ".exp_avg"
    return sorted(k[len(prefix) : -len(suffix)] for k in _keys(path) if k.startswith(prefix) and k.endswith(suffix))


def test_state_is_stored_by_parameter_name(tmp_path: Path) -> None:
    model, optimizer = _fresh(0)
    _train(model, optimizer, 1)
    path = save_checkpoint(tmp_path, 1, model, optimizer, {"step": 1})
    names = sorted(name for name, _ in model.named_parameters())
    assert _optimizer_state_names(path) == names
    keys = _keys(path)
    assert {f"app.model.{name}" for name in model.state_dict()} <= keys
    assert {f"app.optim.param_groups.{name}.lr" for name in names} <= keys
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    assert (manifest["version"], manifest["world_size"], manifest["pp_size"], manifest["zero"]) == (2, 1, 1, False)


def test_older_format_is_refused(tmp_path: Path) -> None:
    """A checkpoint of format 1 (per-shard keys) does not verify: loading says so, a resume names it."""
    model, optimizer = _fresh(0)
    _train(model, optimizer, 1)
    path = save_checkpoint(tmp_path, 1, model, optimizer, {"step": 1})
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    (path / MANIFEST_FILE).write_text(json.dumps({**manifest, "version": 1}))
    with pytest.raises(CheckpointError, match=rf"{path} is in checkpoint format 1, this version reads format 2"):
        load_checkpoint(path, model, optimizer)
    with pytest.raises(CheckpointError, match=r"no checkpoint .* verifies, tried 1: step_00000001: .* format 1"):
        resume_latest(tmp_path, model, optimizer)


def _zero_groups(model: torch.nn.Module) -> ZeroRedundancyOptimizer:
    """ZeRO-1 over two groups, the second of one parameter: one rank's share of it is empty."""
    rest = [p for name, p in model.named_parameters() if name != "norm.weight"]
    return ZeroRedundancyOptimizer(
        [{"params": rest}, {"params": [model.norm.weight], "lr": 2e-2}],
        optimizer_class=torch.optim.AdamW,
        lr=1e-2,
        weight_decay=0.1,
    )


def _fake_steps(module: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    """Optimizer steps on seeded gradients: a pipeline stage cannot run alone."""
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        for p in module.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        optimizer.step()


def _layouts_worker(rank: int, world: int, root: str) -> None:
    # ZeRO over 2 ranks: each rank writes the state of its own parameters, under their names
    torch.manual_seed(0)
    model = tiny()
    optimizer = _zero_groups(model)
    _train(model, optimizer, 2)
    optimizer.param_groups[1]["lr"] = 5e-3
    zero = save_checkpoint(Path(root, "zero"), 2, model, optimizer, {"step": 2})
    at_save = {name: p.detach().clone() for name, p in model.named_parameters()}
    assert _optimizer_state_names(zero) == sorted(name for name, _ in model.named_parameters())
    files = {
        index.fqn: info.relative_path
        for index, info in dcp.FileSystemReader(str(zero)).read_metadata().storage_data.items()
    }
    mine = {id(p) for group in optimizer.optim.param_groups for p in group["params"]}
    assert all(
        files[f"app.optim.state.{name}.exp_avg"] == f"__{rank}_0.distcp"
        for name, p in model.named_parameters()
        if id(p) in mine
    )
    torch.manual_seed(100 + rank)
    model2 = tiny()
    optimizer2 = _zero_groups(model2)
    load_checkpoint(zero, model2, optimizer2)
    saved, loaded = optimizer.optim.state_dict(), optimizer2.optim.state_dict()
    assert saved["state"].keys() == loaded["state"].keys()
    for i, state in saved["state"].items():
        for key, value in state.items():
            assert torch.equal(value, loaded["state"][i][key]), (i, key)
    for group, group2 in zip(saved["param_groups"], loaded["param_groups"]):
        assert group2 == group or not group["params"]  # this rank saved no group it holds nothing of
    holds_norm = bool(optimizer.optim.param_groups[1]["params"])
    assert optimizer2.param_groups[1]["lr"] == (5e-3 if holds_norm else 2e-2)
    _train(model, optimizer, 1, seed=1)
    _train(model2, optimizer2, 1, seed=1)
    for (name, p), q in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(p, q), name

    # 2 pipeline stages (one rank each, ZeRO over each stage's ranks): stored under the whole model's names
    torch.manual_seed(0)
    stage = pipeline_stage(tiny(), 2)
    stage_optimizer = build_optimizer(stage, 1e-2, 0.1, (0.9, 0.95), zero=True, process_group=stage_group(stage.spec))
    _fake_steps(stage, stage_optimizer, 2)
    staged = save_checkpoint(Path(root, "pp"), 2, stage, stage_optimizer, {"step": 2})
    assert _optimizer_state_names(staged) == _optimizer_state_names(zero)  # every layer once, numbered as in the model
    torch.manual_seed(100 + rank)
    stage2 = pipeline_stage(tiny(), 2)
    stage_optimizer2 = build_optimizer(
        stage2, 1e-3, 0.1, (0.9, 0.95), zero=True, process_group=stage_group(stage2.spec)
    )
    load_checkpoint(staged, stage2, stage_optimizer2)
    _assert_same(stage, stage_optimizer.optim, stage2, stage_optimizer2.optim)

    # resharded both ways: 2 stages into the whole model (ZeRO over 2 ranks), and ZeRO's whole model into stages
    load_checkpoint(staged, model2, optimizer2)
    whole = dict(model2.named_parameters())
    for name, p in stage.named_parameters():
        assert torch.equal(whole[full_model_name(stage.spec, name)], p), name
    load_checkpoint(zero, stage2, stage_optimizer2)
    for name, p in stage2.named_parameters():
        assert torch.equal(at_save[full_model_name(stage2.spec, name)], p), name
    Path(root, f"ok_{rank}").touch()


def test_zero_groups_and_pipeline_stages_two_gloo_ranks(tmp_path: Path) -> None:
    run_distributed(_layouts_worker, 2, str(tmp_path))
    assert (tmp_path / "ok_0").exists() and (tmp_path / "ok_1").exists()
