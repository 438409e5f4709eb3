"""What the planning commands assume is printed, and every option says what it does: `plan`, `simulate` and
`memory` print their assumptions first, `--help` gives every option's text and default, `--model` names the
presets, and `memory` says why the C with offload can be the lower one."""

import json

import pytest

from bytescale_compile.cli import main
from bytescale_compile.planner.model_shape import PRESETS

SMALL = ["--global-tokens", "2M", "--ranks", "64", "--capacity", "8K"]


def _assumed(line: str, *parts: str) -> None:
    assert line.startswith("assumed: "), line
    for part in parts:
        assert part in line, (part, line)


def test_plan_prints_every_assumption_first(capsys):
    assert main(["plan", *SMALL, "--hardware", "h100-nvlink", "--seed", "3", "--context", "256K"]) == 0
    lines = capsys.readouterr().out.splitlines()
    _assumed(
        lines[0],
        "model llama-7b",
        "hardware h100-nvlink-tp1 (nodes of 8 ranks",
        "64 HDP ranks x TP 1",
        "C=8K",
        "sp auto",
        "byted",
        "2M global tokens",
        "seed 3",
        "context 256K",
    )
    assert lines[1].startswith("balance: ")


def test_plan_without_a_cluster_says_its_ranks_have_private_links(capsys):
    assert main(["plan", *SMALL]) == 0
    _assumed(capsys.readouterr().out.splitlines()[0], "no topology: every rank its own 25 GB/s link", "context none")


def test_plan_json_keeps_its_assumptions_off_stdout(capsys):
    assert main(["plan", *SMALL, "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["world_size"] == 64
    _assumed(captured.err.splitlines()[0], "2M global tokens")


def test_simulate_prints_every_assumption_first(capsys):
    assert main(["simulate", *SMALL, "--context", "128K,256K", "--strategies", "balance"]) == 0
    lines = capsys.readouterr().out.splitlines()
    _assumed(lines[0], "github", "2M global tokens", "C=8K", "seed 0", "context 128K,256K", "sp auto")
    assert lines[1].split()[0] == "context" and len(lines) == 4


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_every_planning_option_has_help_and_its_default(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option in ("--dataset", "--global-tokens", "--pp", "--seed", "--context", "--ranks", "--capacity", "--sp"):
        at = text.index(f" {option} ", text.index("options:"))
        assert "(default: " in text[at : at + 400] or "default: none" in text[at : at + 400], option
    assert f"cost-model preset ({', '.join(PRESETS)})" in text


def test_memory_says_why_c_with_offload_is_lower(capsys):
    assert main(["memory", "llama-7b", "--device-memory", "80G", "--dtype", "bf16", "--hdp", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("llama-7b: 32 decoder layers, bf16, tp 1, pp 1, 8 HDP ranks, distributed optimizer")
    without, with_offload = (int(line.split(": ")[1].split()[0].replace(",", "")) for line in lines[-4:-2])
    assert with_offload < without
    assert lines[-1].startswith("  why C with offload is lower: ")
