"""The trainer's memory model: --capacity auto fits C to a memory budget, plans are checked against it, and a
budget that cannot hold the model is refused before any step, naming both. Under gradient checkpointing the
predicted peak holds one recomputed layer (measured on CPU by the profiler's memory timeline), and the cost
model predicts the ring P2P the recompute sends again."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import bytescale_compile as bsc
from bytescale_compile.train.__main__ import main
from bytescale_compile.train.memory import memory_model
from tests.helpers import hf_llama, protocol_batch
from tests.trainer_runs import run_metrics, run_trainer, torchrun_command, train_args


def test_capacity_auto_fits_the_budget(workspace, tmp_path, capsys):
    budget = 64 * 2**20
    assert (
        main(train_args(workspace, tmp_path / "run", "--steps", "2", "--capacity", "auto", "--memory-budget", "64M"))
        == 0
    )
    printed = capsys.readouterr().out
    found = re.search(r"--capacity auto: C = ([\d,]+) tokens per rank", printed)
    assert found, printed
    assert all(0 < r["predicted_peak_bytes"] <= budget for r in run_metrics(tmp_path / "run"))
    assert "peak memory" in printed and 'capacity = "auto"' in (tmp_path / "run" / "config.toml").read_text()


@pytest.mark.slow
def test_budgets_that_cannot_hold_the_run_are_refused_before_step_1(workspace, tmp_path, capsys):
    assert main(train_args(workspace, tmp_path / "a", "--capacity", "auto")) == 2
    assert "--memory-budget" in capsys.readouterr().err
    assert main(train_args(workspace, tmp_path / "b", "--capacity", "auto", "--memory-budget", "1M")) == 2
    err = capsys.readouterr().err
    assert "1.00 MiB" in err and "static" in err, err
    assert main(train_args(workspace, tmp_path / "c", "--capacity", "64K", "--memory-budget", "8M")) == 2
    err = capsys.readouterr().err
    assert "--capacity 65536" in err and "8.00 MiB" in err and "--capacity auto" in err, err
    assert not (tmp_path / "c" / "metrics.jsonl").exists()


def _measured_peak(model: torch.nn.Module, batch: dict, tmp_path) -> int:
    """Peak bytes allocated on the CPU over one forward and backward, weights and gradients included (the
    profiler's memory timeline, every category summed)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        model(**batch).loss.backward()
    prof.export_memory_timeline(str(tmp_path / "timeline.json"), device="cpu")
    _, sizes = json.loads((tmp_path / "timeline.json").read_text())
    return int(np.asarray(sizes).sum(axis=1).max())


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::FutureWarning")  # export_memory_timeline, gradient_checkpointing_enable
def test_checkpointed_peak_is_predicted_with_one_recomputed_layer(tmp_path):
    model = hf_llama(2).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimized = bsc.optimize(model, codegen="none")
    batch = protocol_batch([200, 56], 128, hf=True)
    optimized(**batch).loss.backward()  # compiles; the gradients stay allocated, as in training
    memory = memory_model(optimized, total_layers=2, hdp=1, dtype="fp32")
    assert memory.recomputed_bytes_per_token > 4 * memory.layer_bytes_per_token > 0  # a layer saves its input
    measured = _measured_peak(optimized, batch, tmp_path) + memory.static.optimizer  # no optimizer ran here
    tokens = 256
    assert memory.peak(tokens) >= measured
    assert memory.peak(tokens) - memory.recomputed_bytes_per_token * tokens < measured  # the layer is needed


@pytest.mark.slow
def test_checkpointed_run_on_two_ranks_predicts_its_p2p_and_fits_its_budget(workspace, tmp_path):
    """--gradient-checkpointing, C = 512: long sequences go round a 2-rank ring, whose forward P2P the
    backward's recompute sends again (4/3 of the bytes without)."""
    budget = 64 * 2**20
    args = ("--capacity", "512", "--memory-budget", "64M", "--gradient-checkpointing")
    run_trainer(torchrun_command(2, train_args(workspace, tmp_path / "run", *args)))
    ran = run_metrics(tmp_path / "run")
    assert sum(r["p2p_bytes"] for r in ran) > 0, "no sequence was shared over the ranks"
    for r in ran:
        assert r["p2p_bytes"] == pytest.approx(r["predicted_p2p_bytes"], rel=0.2), r
        assert 0 < r["predicted_peak_bytes"] <= budget
