"""Faults end to end: several ranks, the trainer as a user runs it, and processes that die.

Checkpoints: a damaged shard of another rank detected on every rank alike; through the trainer's entry point,
a resume that skips a damaged checkpoint and a crashed save's `.tmp`, and a resume whose first save fails.
The command line: a profile of a Hugging Face config directory in several processes. Run time: a ring peer
that dies mid-ring. The one-process cases are beside their modules' tests in tests/unit: test_train_checkpoint,
test_train_trainer (a resume's settings), test_cli_errors, test_runtime_p2p, test_engine_runtime (the
cost-model warning, the Runtime's arguments), test_api, test_planner_profiler and test_planner_cost_model; the
NaN/no-target step and input validation at `step()` in tests/distributed/test_train_engine.py, ring group
validation in tests/distributed/test_runtime_ring_attention.py."""

from __future__ import annotations

import datetime
import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bytescale_compile.cli import main
from bytescale_compile.models.llama import tiny
from bytescale_compile.planner import CostModel
from bytescale_compile.runtime import ring_attention
from bytescale_compile.runtime.layout import zigzag_layout
from bytescale_compile.runtime.ring_attention import packed_ring_attention
from bytescale_compile.testing import free_port, run_distributed
from bytescale_compile.train.checkpoint import (
    MANIFEST_FILE,
    CheckpointError,
    checkpoint_dir,
    load_checkpoint,
    save_checkpoint,
)
from bytescale_compile.train.config import TrainConfig, load_config
from bytescale_compile.train.inputs import CONFIG_FILE, setup
from tests.checkpoints import SHARD, flip_byte, tiny_step

# === checkpoints: several ranks, and resumes through the trainer ===================================


def _zero_rank1_shard_flipped(rank: int, world: int, root: str) -> None:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    torch.manual_seed(0)
    model = tiny()
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
    tiny_step(model, optimizer, 0)
    path = save_checkpoint(root, 1, model, optimizer, {"step": 1})
    files = set(json.loads((path / MANIFEST_FILE).read_text())["files"])
    assert {SHARD, "__1_0.distcp"} <= files, files  # rank 1's own optimizer shard is covered
    torch.distributed.barrier()
    if rank == 0:
        data = bytearray((path / "__1_0.distcp").read_bytes())
        data[-9] ^= 0x01
        (path / "__1_0.distcp").write_bytes(bytes(data))
    torch.distributed.barrier()
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp checksum differs"):  # on every rank alike
        load_checkpoint(path, model, optimizer)
    Path(root, f"ok_{rank}").touch()


@pytest.mark.slow
def test_two_ranks_manifest_covers_every_ranks_shard(tmp_path: Path) -> None:
    run_distributed(_zero_rank1_shard_flipped, 2, str(tmp_path))
    assert (tmp_path / "ok_0").exists() and (tmp_path / "ok_1").exists()


def _tiny_args(saved_run: TrainConfig, *extra: str) -> list[str]:
    return [
        *("--model", "tiny", "--data", saved_run.data, "--out", saved_run.out, "--global-tokens", "256"),
        *("--capacity", "256", "--max-len", "64", "--lr", "1e-3", "--decay-steps", "4", "--checkpoint-every", "1"),
        *extra,
    ]


def test_a_resume_whose_first_save_fails_keeps_config_toml_and_says_so_once(
    saved_run: TrainConfig, capsys, monkeypatch
) -> None:
    """A resume with a changed setting whose first checkpoint cannot be committed: exit 3, one `error:` line naming
    the rank, the step and the cause, the traceback once; config.toml still holds the saved run's settings, so the
    next resume finds the change again."""
    from bytescale_compile.train import checkpoint
    from bytescale_compile.train.__main__ import main as train

    out = Path(saved_run.out)
    (out / CONFIG_FILE).unlink()
    assert train(_tiny_args(saved_run, "--steps", "1")) == 0
    saved = (out / CONFIG_FILE).read_text()

    def full_disk(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "commit", full_disk)
    capsys.readouterr()
    assert train(_tiny_args(saved_run, "--steps", "2", "--resume", "--lr", "2e-3", "--allow-config-change")) == 3
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if ": error" in line]
    assert len(errors) == 1 and err.count("Traceback") == 1, err
    assert "checkpoint of step 2 failed on rank 0: OSError: [Errno 28] No space left on device" in errors[0], err
    assert (out / CONFIG_FILE).read_text() == saved
    again = replace(load_config(out / CONFIG_FILE), resume=True, lr=2e-3, steps=2, allow_config_change=True)
    assert setup(again).config_changes == ("lr: 0.001 -> 0.002",)


@pytest.mark.slow
def test_trainer_removes_stale_tmp_and_resumes_from_the_last_verified(saved_run: TrainConfig, capsys) -> None:
    """Through `python -m bytescale_compile.train`: a damaged latest checkpoint and a crashed save's `.tmp`."""
    from bytescale_compile.train.__main__ import main

    out = Path(saved_run.out)
    args = [
        "--model",
        "tiny",
        "--data",
        saved_run.data,
        "--out",
        str(out),
        "--global-tokens",
        "256",
        "--capacity",
        "256",
        "--max-len",
        "64",
        "--lr",
        "1e-3",
        "--decay-steps",
        "4",
        "--checkpoint-every",
        "1",
    ]
    (out / CONFIG_FILE).unlink()
    assert main([*args, "--steps", "2"]) == 0
    checkpoints = out / "checkpoints"
    flip_byte(checkpoint_dir(checkpoints, 2))
    (checkpoints / "step_00000003.tmp").mkdir()
    capsys.readouterr()
    assert main([*args, "--steps", "3", "--resume"]) == 0
    printed = capsys.readouterr().out
    assert f"removed {checkpoints / 'step_00000003.tmp'}" in printed
    assert f"skipped checkpoint {checkpoint_dir(checkpoints, 2)}: " in printed and "checksum differs" in printed
    assert f"resumed from {checkpoint_dir(checkpoints, 1)} at step 1" in printed
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


# === the command line: a profile in several processes ============================================


def test_profile_takes_a_hugging_face_config_directory(tmp_path, capsys):
    """Random init from config.json, also in the processes of --ranks-per-device (which rebuild it by name)."""
    pytest.importorskip("transformers")
    from tests.trainer_runs import qwen2_config

    qwen2_config().save_pretrained(tmp_path / "qwen2")
    out = tmp_path / "cost.json"
    argv = ["profile", str(tmp_path / "qwen2"), "--lengths", "64,128,256", "--repeats", "1", "--out", str(out)]
    assert main([*argv, "--ranks-per-device", "2"]) == 0
    assert "cost model of cpu, 2 processes" in capsys.readouterr().out
    cost = CostModel.load(out)
    assert (cost.layers, cost.kv_bytes_per_token) == (2, 2 * 2 * 16 * 4)  # K and V, 2 KV heads of 16, fp32


# === run time: a ring peer killed mid-ring =========================================================

_WORLD, _VICTIM, _RING_TIMEOUT_S = 3, 2, 5.0
_MARGIN_S = 10.0
"""Slack over `timeout_s` for a loaded 2-core CI machine: the error must come by timeout_s + margin."""
_HARD_LIMIT_S = 120.0
"""The whole test: every process still alive after this is killed and the test fails (never a hang)."""


def _die_at_post(call: int) -> None:
    """Make this rank exit without cleanup right before its `call`-th ring post (1 and 2: the forward's K/V of
    steps 1 and 2; 3 and 4: the backward's; 5 and 6: its dK/dV going back)."""
    original, calls = ring_attention.Ring.post, []

    def post(ring: Any, *args: Any) -> list[Any]:
        calls.append(1)
        if len(calls) == call:
            os._exit(1)
        return original(ring, *args)

    ring_attention.Ring.post = post


def _killed_peer_worker(rank: int, port: int, die_at: int, results: Any) -> None:
    """Run one ring forward and backward; report (rank, "raised", type, message, seconds) or "finished"."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=_WORLD, timeout=datetime.timedelta(seconds=60))
    if rank == _VICTIM:
        _die_at_post(die_at)
    torch.manual_seed(rank)
    layout = zigzag_layout([24, 12], _WORLD)
    tokens = layout.rank(rank).num_tokens
    q, k, v = (torch.randn(tokens, 2, 8, requires_grad=True) for _ in range(3))
    began = time.monotonic()
    try:
        packed_ring_attention(q, k, v, layout, list(range(_WORLD)), timeout_s=_RING_TIMEOUT_S).sum().backward()
        results.put((rank, "finished", "", "", time.monotonic() - began))
    except Exception as e:  # reported to the parent, which checks the type
        results.put((rank, "raised", type(e).__name__, str(e), time.monotonic() - began))
    os._exit(0)  # transfers to the dead rank may still be posted: skip the process-group teardown


def _run_with_hard_limit(die_at: int) -> tuple[list[Any], list[int], dict[int, tuple]]:
    """Start the ranks, wait at most `_HARD_LIMIT_S` in all, kill whatever is left: (processes, hung ranks, reports)."""
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_killed_peer_worker, args=(r, port, die_at, results), daemon=True) for r in range(_WORLD)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + _HARD_LIMIT_S
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    reports = {}
    while not results.empty():
        rank, *report = results.get()
        reports[rank] = tuple(report)
    return procs, hung, reports


@pytest.mark.slow
@pytest.mark.parametrize("die_at", [2, 5], ids=["forward-step-2", "backward-dkdv"])
def test_survivors_raise_ring_error_when_a_peer_dies_mid_ring(die_at):
    procs, hung, reports = _run_with_hard_limit(die_at)
    assert not hung, f"ranks {hung} still running after {_HARD_LIMIT_S:.0f}s: a survivor hangs; reports {reports}"
    assert procs[_VICTIM].exitcode == 1 and _VICTIM not in reports
    for rank in set(range(_WORLD)) - {_VICTIM}:
        assert rank in reports, f"rank {rank} died without reporting (exit code {procs[rank].exitcode})"
        outcome, kind, message, seconds = reports[rank]
        assert outcome == "raised" and kind in ("P2PError", "P2PTimeoutError"), (rank, outcome, kind, message)
        assert f"ring group [0, 1, 2]: rank {rank}" in message, message
        assert seconds < _RING_TIMEOUT_S + _MARGIN_S, f"rank {rank} raised after {seconds:.1f}s: {message}"
