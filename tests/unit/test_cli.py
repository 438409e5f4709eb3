"""The `bytescale-compile` commands' runs: inspect (whole and per pipeline stage), plan and simulate, and how the
command modules assemble into one parser. Bad input and its one-line errors: test_cli_errors.py; memory:
test_cli_memory.py; the data commands: test_data_prepare.py and test_data_vocabulary.py."""

import json
import subprocess
import sys

import pytest

from bytescale_compile.cli import main
from bytescale_compile.cli.commands import COMMANDS, build_parser

COMMAND_NAMES = ["inspect", "plan", "simulate", "profile", "tokenizer", "data", "memory", "export"]


def test_every_command_module_registers_its_commands_in_the_order_help_lists_them():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert list(sub.choices) == COMMAND_NAMES
    assert len(COMMANDS) == len({module.__name__ for module in COMMANDS}) == 6


def test_python_dash_m_runs_the_command_line():
    result = subprocess.run(
        [sys.executable, "-m", "bytescale_compile.cli", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: bytescale-compile") and all(c in result.stdout for c in COMMAND_NAMES)


def test_protocol_inputs_moved_to_the_engine_and_still_imports_with_a_warning():
    from bytescale_compile import cli
    from bytescale_compile.engine.protocol import model_inputs

    with pytest.warns(DeprecationWarning, match="bytescale_compile.engine.protocol.model_inputs"):
        assert cli.protocol_inputs is model_inputs


def test_inspect_prints_report(capsys):
    assert main(["inspect", "bytescale_compile.models.llama:tiny", "--seq-len", "64"]) == 0
    out = capsys.readouterr().out
    assert "Pass `attention`: 2 rewritten" in out and "Pass `fused_loss`: 1 rewritten" in out


def test_inspect_json(capsys):
    assert main(["inspect", "bytescale_compile.models.llama:tiny", "--seq-len", "32", "--json", "--no-fused-loss"]) == 0
    report = json.loads(capsys.readouterr().out)
    passes = report["graphs"][0]["passes"]
    assert passes[1]["disabled"] == "CompileConfig.fused_loss=False"


@pytest.mark.parametrize(
    "target", ["bytescale_compile.models.llama:tiny", pytest.param("tests.helpers:hf_llama", marks=pytest.mark.slow)]
)
def test_inspect_reports_every_pipeline_stage(target, capsys):
    """--pp 2: one compiled stage per decoder layer; each rewrites its own attention, the last fuses the loss."""
    assert main(["inspect", target, "--seq-len", "32", "--pp", "2"]) == 0
    out = capsys.readouterr().out
    first, last = out.split("# Stage 1 of 2")
    assert first.startswith("# Stage 0 of 2: decoder layers 0-0, embedding")
    assert last.startswith(": decoder layers 1-1, final norm, lm_head and loss")
    assert "Pass `attention`: 1 rewritten" in first and "Pass `attention`: 1 rewritten" in last
    assert "Pass `fused_loss`: 1 rewritten" in last and "Pass `fused_loss`: 1 rewritten" not in first
    assert main(["inspect", target, "--pp", "3"]) == 2
    assert "--pp 3: pp_size 3 is larger than the model's 2 decoder layers" in capsys.readouterr().err


@pytest.mark.parametrize(
    "spec,message",
    [
        ("bytescale_compile.models.llama", "MODULE:FACTORY"),
        ("no_such_module:f", "cannot import module"),
        ("bytescale_compile.models.llama:nothing", "no callable"),
    ],
)
def test_bad_target(spec, message, capsys):
    assert main(["inspect", spec]) == 2
    assert message in capsys.readouterr().err


def test_rejects_models_outside_the_protocol(capsys):
    assert main(["inspect", "torch.nn:Identity", "--vocab-size", "10"]) == 2
    assert "does not take" in capsys.readouterr().err


def test_plan_json_is_a_valid_plan(capsys):
    from bytescale_compile.planner import Plan

    assert (
        main(
            [
                "plan",
                "--dataset",
                "github",
                "--global-tokens",
                "2M",
                "--ranks",
                "64",
                "--capacity",
                "8K",
                "--context",
                "256K",
                "--json",
            ]
        )
        == 0
    )
    plan = Plan.from_json(capsys.readouterr().out)
    plan.validate()
    assert plan.strategy == "balance" and plan.world_size == 64


def test_plan_too_long_for_the_cluster(capsys):
    assert main(["plan", "--dataset", "byted", "--global-tokens", "8M", "--ranks", "2", "--capacity", "1K"]) == 2
    assert "more than the" in capsys.readouterr().err


def test_simulate_writes_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    plot, timeline = tmp_path / "t.png", tmp_path / "tl.png"
    assert (
        main(
            [
                "simulate",
                "--dataset",
                "github",
                "--global-tokens",
                "2M",
                "--ranks",
                "64",
                "--context",
                "128K,256K",
                "--strategies",
                "static,balance",
                "--plot",
                str(plot),
                "--timeline",
                str(timeline),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "256K" in out and plot.stat().st_size > 0 and timeline.stat().st_size > 0


def test_inspect_of_a_model_without_a_vocabulary_asks_for_one(capsys):
    assert main(["inspect", "torch.nn:Identity"]) == 2
    assert "the model has no config.vocab_size: pass --vocab-size" in capsys.readouterr().err
