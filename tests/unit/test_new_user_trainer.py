"""What a new user meets first in the trainer's output: one-line usage errors, a warning when --global-tokens is
not the step's size, the world size refused before any weight loads, memory advice that names only what fits,
other libraries' bars on rank 0 only, config errors before torch loads, plurals, a comparison table without
another device's predictions, and the demo's note on what CPU ratios show."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from bytescale_compile.planner.memory import MemoryModel
from bytescale_compile.train import __main__ as train_main
from bytescale_compile.train import inputs as train_inputs
from bytescale_compile.train.calibrate import _ranks_worth
from bytescale_compile.train.compare import cpu_ratios_note
from bytescale_compile.train.config import ConfigError, TrainConfig
from bytescale_compile.train.inputs import GlobalTokensWarning, _warn_short_global_batch, setup
from bytescale_compile.train.prepared import _over_budget
from bytescale_compile.train.summary import StrategySummary, comparison

REPO = Path(__file__).resolve().parents[2]
PROG = train_main.PROG


def _stderr_lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return capsys.readouterr().err.splitlines()


@pytest.mark.parametrize(
    ("argv", "first"),
    [
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--steps", "x"], "argument --steps: invalid int value: 'x'"),
        (["--nproc-per-node", "0"], "argument --nproc-per-node: must be an integer >= 1, got '0'"),
    ],
)
def test_usage_error_is_one_line_pointing_at_help(argv, first, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        train_main.main(argv)
    assert exited.value.code == train_main.USAGE_EXIT
    lines = _stderr_lines(capsys)
    assert lines == [f"{PROG}: error: {first} (see {PROG} --help)"]


def test_usage_error_of_a_rank_above_0_prints_nothing(capsys, monkeypatch) -> None:
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit):
        train_main.main(["--bogus"])
    assert _stderr_lines(capsys) == []


def test_global_tokens_below_the_longest_sequence_warns_with_the_effective_figure() -> None:
    config = TrainConfig(model="tiny", data="d", global_tokens=100, max_len=2048)
    lengths = np.array([10, 3000, 500, 90])
    with pytest.warns(GlobalTokensWarning) as caught:
        _warn_short_global_batch(config, lengths)
    assert len(caught) == 1
    message = str(caught[0].message)
    longest, mean = 2048, np.minimum(lengths, 2048).mean()  # a step's tokens as the sampler truncates them
    assert message.startswith(f"--global-tokens 100 is below the longest sequence ({longest:,} tokens at max_len")
    assert f"steps train up to {longest:,} tokens (the mean sequence has {mean:,.0f})" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _warn_short_global_batch(replace(config, global_tokens=longest), lengths)  # the step's size: no warning


def test_global_tokens_below_the_longest_sequence_warns_once_per_setup(saved_run: TrainConfig) -> None:
    with pytest.warns(GlobalTokensWarning) as caught:
        setup(replace(saved_run, global_tokens=4))
    assert len([w for w in caught if issubclass(w.category, GlobalTokensWarning)]) == 1


def test_world_size_is_checked_before_any_weight_loads(saved_run: TrainConfig, monkeypatch) -> None:
    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded before the world size was checked")

    monkeypatch.setattr(train_inputs, "load_model", no_load)
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=r"tp = 2 needs a multiple of 2 processes .* the job has 3"):
        setup(replace(saved_run, tp=2))


def test_nproc_per_node_that_tp_does_not_divide_starts_no_rank(tmp_path, capsys, monkeypatch) -> None:
    from bytescale_compile.train import launch

    def no_launch(*args, **kwargs):
        raise AssertionError("ranks started for a world size the run refuses")

    monkeypatch.setattr(launch, "launch_local", no_launch)
    argv = ["--nproc-per-node", "3", "--tp", "2", "--model", "tiny", "--data", str(tmp_path / "d")]
    assert train_main.main(argv) == train_main.USAGE_EXIT
    assert _stderr_lines(capsys) == [
        f"{PROG}: error: tp = 2 needs a multiple of 2 processes (pp x HDP ranks x tp), but the job has 3: "
        "run --nproc-per-node with a multiple of 2"
    ]


def _memory() -> MemoryModel:
    """1M fp32 parameters (16 MB of weights, gradients and AdamW state), 1,100 activation bytes per token."""
    return MemoryModel(
        params=1_000_000,
        hdp_size=1,
        dtype="fp32",
        layers=2,
        layer_bytes_per_token=500.0,
        other_bytes_per_token=100.0,
        workspace_bytes=1_000_000,
    )


def test_memory_budget_advice_names_the_capacity_that_fits() -> None:
    memory = _memory()
    budget = int(memory.peak(3000))
    fits = max(c for c in range(1, 4000) if memory.peak(c) <= budget)  # the reference: the peak itself
    message = _over_budget(memory, 4096, budget, offload=False)
    assert message.startswith("--capacity 4096: a micro-batch of that many tokens per rank has a predicted peak")
    assert f"pass --capacity {fits} or less (the largest that fits)" in message


def test_memory_budget_advice_names_no_capacity_when_the_static_bytes_do_not_fit() -> None:
    memory = _memory()
    budget = memory.static.total // 2  # below the weights, gradients and optimizer state alone
    message = _over_budget(memory, 2048, budget, offload=False)
    assert "no --capacity fits it, auto neither" in message
    assert "does not hold this rank's static bytes" in message and "a larger budget" in message
    assert "pass --capacity" not in message and "--tp or --pp" in message


def test_other_libraries_bars_and_warnings_are_rank_0s_only() -> None:
    on_terminal: dict[str, str] = {}
    assert train_main.quiet_libraries(on_terminal, rank=0, terminal=True) == [] and on_terminal == {}
    logged: dict[str, str] = {}
    train_main.quiet_libraries(logged, rank=0, terminal=False)  # a bar without a terminal is noise in a log
    assert logged == {"HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    other: dict[str, str] = {}
    train_main.quiet_libraries(other, rank=1, terminal=True)
    assert other == {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    chosen = {"HF_HUB_DISABLE_PROGRESS_BARS": "0"}
    train_main.quiet_libraries(chosen, rank=1, terminal=True)
    assert chosen["HF_HUB_DISABLE_PROGRESS_BARS"] == "0"  # the user's setting stands


def test_other_libraries_bars_are_off_on_ranks_above_0_once_loaded() -> None:
    hf_logging = pytest.importorskip("transformers.utils.logging")
    hf_logging.enable_progress_bar()
    try:
        train_main.quiet_libraries({}, rank=1, terminal=True)
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()


def test_python_warnings_are_printed_by_rank_0_only(capsys, monkeypatch) -> None:
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    train_main._warnings_once(PROG)
    monkeypatch.setenv("RANK", "1")
    warnings.showwarning("a library's warning", UserWarning, "f.py", 1)
    assert _stderr_lines(capsys) == []
    monkeypatch.setenv("RANK", "0")
    warnings.showwarning("a library's warning", UserWarning, "f.py", 1)
    assert _stderr_lines(capsys) == [f"{PROG}: warning: a library's warning"]


def test_another_librarys_warning_names_it() -> None:
    assert train_main._library("/venv/lib/python3.11/site-packages/torch/_dynamo/utils.py") == "torch"
    assert train_main._library("/usr/lib/python3/dist-packages/six.py") == "six"
    assert train_main._library("/venv/lib/python3.11/site-packages/bytescale_compile/engine/runtime.py") is None
    assert train_main._library("/home/me/train.py") is None


def test_tokenizer_training_and_data_prepare_print_no_progress_bar_without_a_terminal(tmp_path, capfd) -> None:
    pytest.importorskip("tokenizers")
    from bytescale_compile.data import prepare, train_tokenizer

    text = tmp_path / "a.txt"
    text.write_text("\n".join(f"alpha beta gamma {i} delta" for i in range(200)), encoding="utf-8")
    capfd.readouterr()
    train_tokenizer([text], 300, tmp_path / "tok", progress=True)  # stderr here is a file, not a terminal
    assert capfd.readouterr().err == ""
    prepare([text], tmp_path / "tok", tmp_path / "ds", eval_fraction=0, progress=True)
    assert capfd.readouterr().err == ""


_NO_TORCH = """
import sys
from bytescale_compile.train.__main__ import main
status = main(sys.argv[1:])
print(sorted(name for name in ("torch", "transformers") if name in sys.modules))
sys.exit(status)
"""


@pytest.mark.parametrize(
    ("options", "first"),
    [
        (["--lr", "-1"], "lr must be a finite number > 0.0, got -1.0"),
        (["--global-tokens", "1Q"], "global_tokens: expected a size like"),
        (["--nproc-per-node", "3", "--tp", "2"], "tp = 2 needs a multiple of 2 processes"),
        (["--data", "corpus:0"], "--data corpus:0: weight of 'corpus' must be a number > 0"),
    ],
)
def test_config_error_is_printed_before_torch_loads(tmp_path, options, first) -> None:
    argv = ["--model", "tiny", "--data", str(tmp_path / "d"), "--out", str(tmp_path / "out"), *options]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    done = subprocess.run(
        [sys.executable, "-c", _NO_TORCH, *argv], capture_output=True, text=True, env=env, cwd=REPO, timeout=60
    )
    assert done.returncode == train_main.USAGE_EXIT
    assert json.loads(done.stdout.replace("'", '"')) == []  # neither torch nor transformers loaded
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{PROG}: error: {first}")


@pytest.mark.parametrize(("slots", "said"), [(1, "1 rank's worth"), (2, "2 ranks' worth"), (1.5, "1.5 ranks' worth")])
def test_ranks_worth_of_cores_agrees_in_number(slots, said) -> None:
    assert _ranks_worth(slots) == said


def _summary(strategy: str, tokens_per_second: float) -> StrategySummary:
    return StrategySummary(
        strategy=strategy,
        first_step=2,
        last_step=4,
        tokens_per_second=tokens_per_second,
        busy_spread=1.1,
        p2p_mib=2.0,
        step_time=1.0,
        predicted_tokens_per_second=5_032_370.0,
        predicted_busy_spread=1.0,
        predicted_p2p_mib=2.0,
        predicted_step_time=0.001,
        final_loss=4.0,
        eval_loss=None,
    )


def test_comparison_without_this_devices_predictions_prints_none_and_says_why() -> None:
    why = "the cost model is the analytic one of h100, not of this cpu"
    table = comparison([_summary("static", 7_000.0), _summary("balance", 7_206.0)], why).splitlines()
    assert len(table) == 7
    assert "predicted" not in table[0] and "5,032,370" not in "\n".join(table)
    assert table[5] == f"no predicted figures: {why}"
    assert table[6] == "speedup over static: balance 1.03x measured"


def test_comparison_of_this_devices_predictions_prints_them() -> None:
    table = comparison([_summary("static", 7_000.0), _summary("balance", 7_206.0)]).splitlines()
    assert len(table) == 6 and "predicted" in table[0] and "5,032,370" in table[2]
    assert table[5] == "speedup over static: balance 1.03x measured, 1.00x predicted"


def test_demo_closing_lines_say_what_cpu_ratios_show() -> None:
    lines = cpu_ratios_note(4, 2, predicted=True, projected_speedup=3.25).splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("What the measured ratios above can show, on 4 CPU ranks and 2 cores: that")
    assert lines[0].endswith("and how well the cost model predicts these steps.")
    assert lines[1].startswith("What they cannot show: the method's gain. Here ranks sharing cores wait")
    assert lines[2].startswith("The gain at scale is the SIMULATED projection above (balance 3.25x static)")
    assert lines[2].endswith("benchmarks/RESULTS.md.") and (REPO / "benchmarks" / "RESULTS.md").is_file()
    none = cpu_ratios_note(4, 2, predicted=True, projected_speedup=0.82).splitlines()[2]
    assert none.startswith("Nor does the SIMULATED projection above show one for this model (balance 0.82x static)")
    assert "benchmarks/planner.py" in none
    assert cpu_ratios_note(4, 2, predicted=True, projected_speedup=None).splitlines()[2] == (
        "Measured figures, GPU ones included, are in benchmarks/RESULTS.md."
    )
    alone = cpu_ratios_note(1, 1, predicted=False, projected_speedup=1.5).splitlines()
    assert alone[0].startswith("What the measured ratios above can show, on 1 CPU rank and 1 core:")
    assert "predicts" not in alone[0] and alone[1].startswith("What they cannot show: the method's gain. Here one rank")
