"""The trainer's memory model: --capacity auto fits C to a memory budget, plans are checked against it, and a
budget that cannot hold the model is refused before any step, naming both."""

from __future__ import annotations

import re

from bytescale_compile.train.__main__ import main
from tests.trainer_runs import run_metrics, train_args


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
