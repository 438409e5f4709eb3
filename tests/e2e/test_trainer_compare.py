"""The comparison of every strategy (`python -m bytescale_compile.train.compare`, what `make demo` runs) apart from
the trainer, which trains one: each strategy of the comparison trains from the same initial weights, so each
equals the trainer's run of that strategy alone; the table and the projection follow. The trainer refuses
strategy = all, naming the comparison's entry point."""

from __future__ import annotations

import pytest

from bytescale_compile.train.__main__ import PROG, main
from bytescale_compile.train.compare import main as compare
from tests.trainer_runs import run_losses, train_args

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

STRATEGIES = ("balance", "naive", "static", "auto")


def test_the_trainer_refuses_strategy_all_and_names_the_comparison(tmp_path, capsys):
    out = tmp_path / "all"
    assert main(["--model", "tiny", "--data", str(tmp_path / "data"), "--out", str(out), "--strategy", "all"]) == 2
    err = capsys.readouterr().err
    assert f"{PROG}: error: strategy = all retrains every strategy" in err
    assert "-m bytescale_compile.train.compare" in err and not out.exists()


def test_each_compared_strategy_equals_its_run_alone_and_the_table_and_projection_follow(workspace, tmp_path, capsys):
    """Static trains third, after balance and naive changed the weights: it equals the trainer's static run only if
    the comparison restored the initial weights before it."""
    out = tmp_path / "compare"
    assert compare(train_args(workspace, out, "--strategy", "all", "--steps", "2")) == 0
    printed = capsys.readouterr().out
    assert main(train_args(workspace, tmp_path / "static", "--strategy", "static", "--steps", "2")) == 0
    assert run_losses(out / "static") == run_losses(tmp_path / "static")
    losses = [run_losses(out / strategy) for strategy in STRATEGIES]
    assert all(len(run) == 2 for run in losses)
    assert [run[0] for run in losses] == pytest.approx([losses[0][0]] * len(STRATEGIES), rel=1e-5)
    assert (out / "config.toml").is_file() and not (tmp_path / "static" / "static").exists()
    table = printed[printed.index("---- measured ----") :]
    assert all(f"[{strategy}] metrics: {out / strategy}" in table for strategy in STRATEGIES)
    assert "speedup over static: balance" in table
    assert "SIMULATED projection, not measured" in table.split("speedup over static")[1]
