"""The command line's bad input: argument and input errors in one line with exit status 2 (a traceback only
with --debug), output paths checked before the work, profiles that record their device, and a torch-free
start for the planner commands."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bytescale_compile.cli import CLIError, main
from bytescale_compile.planner import CostModel

SMALL_PLAN = ["--dataset", "github", "--global-tokens", "256K", "--ranks", "16", "--capacity", "8K"]


def one_line_error(capsys, prog: str) -> str:
    """The stderr of a refused call: exactly one line, naming the (sub)command."""
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), captured.err
    assert "Traceback" not in captured.err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["plan", "--capacity", "0"], ("--capacity", "'0'")),
        (["plan", "--ranks", "-4"], ("--ranks", "-4")),
        (["plan", "--pp", "0"], ("--pp", "0")),
        (["plan", "--seed", "-1"], ("--seed", "-1")),
        (["plan", "--global-tokens", "1M,2M"], ("--global-tokens", "'1M,2M'")),
        (["plan", "--strategy", "fastest"], ("'fastest'", "balance")),
        (["plan", "--hardware", "tpu"], ("'tpu'", "l20")),
        (["simulate", "--context", "lots"], ("--context", "'LOTS'")),
        (["simulate", "--tp", "0"], ("--tp", "0")),
        (["inspect", "bytescale_compile.models.llama:tiny", "--seq-len", "1"], ("--seq-len", "1")),
        (["inspect", "no_such_module:factory"], ("'no_such_module'",)),
        (["profile", "bytescale_compile.models.llama:tiny", "--repeats", "0"], ("--repeats", "0")),
        (["profile", "bytescale_compile.models.llama:tiny", "--lengths", ""], ("--lengths",)),
        (["profile", "bytescale_compile.models.llama:tiny", "--min-time", "-1"], ("--min-time", "-1")),
        (
            ["tokenizer", "train", "--input", "x", "--vocab-size", "300", "--out", "o", "--min-frequency", "0"],
            ("--min-frequency", "0"),
        ),
        (["data", "prepare", "--input", "x", "--tokenizer", "t", "--out", "o", "--workers", "0"], ("--workers", "0")),
    ],
)
def test_argument_errors_are_one_line_with_status_2(capsys, argv, names):
    assert main(argv) == 2
    command = argv[:2] if argv[0] in ("tokenizer", "data") else argv[:1]
    line = one_line_error(capsys, " ".join(["bytescale-compile", *command]))
    assert all(name in line for name in names), line


def test_unknown_options_and_missing_commands_are_one_line(capsys):
    assert main(["plan", "--bogus"]) == 2
    assert "--bogus" in one_line_error(capsys, "bytescale-compile")
    assert main(["tokenizer"]) == 2
    assert "action" in one_line_error(capsys, "bytescale-compile tokenizer")


def test_a_cost_model_missing_a_key_names_the_key_and_the_file(tmp_path, capsys):
    path = tmp_path / "cost.json"
    CostModel.preset("llama-7b").save(path)
    data = json.loads(path.read_text())
    del data["layers"]
    path.write_text(json.dumps(data))
    assert main(["plan", *SMALL_PLAN, "--model", str(path)]) == 2
    line = one_line_error(capsys, "bytescale-compile plan")
    assert "'layers'" in line and str(path) in line

    del data["coefficients"]["beta2"]
    data["layers"] = 32
    path.write_text(json.dumps(data))
    assert main(["simulate", "--model", str(path)]) == 2
    assert "'beta2'" in one_line_error(capsys, "bytescale-compile simulate")


def test_a_missing_or_malformed_cost_model_is_one_line(tmp_path, capsys):
    missing = tmp_path / "none.json"
    assert main(["plan", *SMALL_PLAN, "--model", str(missing)]) == 2
    assert str(missing) in one_line_error(capsys, "bytescale-compile plan")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert main(["plan", *SMALL_PLAN, "--model", str(broken)]) == 2
    assert str(broken) in one_line_error(capsys, "bytescale-compile plan")


def test_debug_shows_the_traceback(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text("{}")
    with pytest.raises(CLIError, match="broken.json") as caught:
        main(["--debug", "plan", *SMALL_PLAN, "--model", str(broken)])
    assert isinstance(caught.value.__cause__, ValueError)


@pytest.mark.parametrize("bad", ["a_file/x.png", "a_dir"])
def test_simulate_refuses_an_unwritable_plot_before_simulating(tmp_path, capsys, monkeypatch, bad):
    (tmp_path / "a_file").write_text("")
    (tmp_path / "a_dir").mkdir()

    def never(*args, **kwargs):
        raise AssertionError("simulated although --plot cannot be written")

    monkeypatch.setattr("bytescale_compile.sim.experiments.run_strategy", never)
    assert main(["simulate", "--plot", str(tmp_path / bad)]) == 2
    assert capsys.readouterr().out == ""


def test_simulate_creates_the_missing_folders_of_its_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "missing" / "dir" / "x.png"
    assert main(["simulate", *SMALL_PLAN, "--context", "64K", "--strategies", "balance", "--plot", str(plot)]) == 0
    assert plot.stat().st_size > 0 and str(plot) in capsys.readouterr().out


def test_output_paths_of_the_data_commands_are_checked_first(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert main(["tokenizer", "train", "--input", "x", "--vocab-size", "300", "--out", str(a_file)]) == 2
    assert str(a_file) in one_line_error(capsys, "bytescale-compile tokenizer")
    assert main(["data", "prepare", "--input", "x", "--tokenizer", "t", "--out", str(a_file / "ds")]) == 2
    assert "is a file" in one_line_error(capsys, "bytescale-compile data")


@pytest.mark.slow  # by default tests/e2e/test_faults.py profiles a Hugging Face config directory
def test_profile_records_the_device(tmp_path, capsys):
    out = tmp_path / "new" / "cost.json"
    assert (
        main(
            [
                "profile",
                "bytescale_compile.models.llama:tiny",
                "--lengths",
                "32,64,128",
                "--min-time",
                "0",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert "cost model of cpu written to" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["device"] == "cpu" and data["hardware"]["name"] == "cpu"
    loaded = CostModel.load(out)
    assert loaded.device == "cpu" and loaded.source == "profiled"


def test_profile_target_neither_a_directory_nor_a_factory_names_both(tmp_path, capsys):
    for target in (str(tmp_path / "missing"), str(tmp_path)):
        assert main(["profile", target, "--out", str(tmp_path / "cost.json")]) == 2
        line = one_line_error(capsys, "bytescale-compile profile")
        assert "Hugging Face config.json" in line and "MODULE:FACTORY" in line and target in line
    assert not (tmp_path / "cost.json").exists()


def test_the_cli_plans_without_importing_torch():
    """The planner commands start fast because neither the package nor the CLI imports torch for them."""
    code = (
        "import sys, contextlib, io\n"
        "from bytescale_compile.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n"
        "        main(['--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        f"    assert main(['plan', *{SMALL_PLAN!r}]) == 0\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'matplotlib') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
