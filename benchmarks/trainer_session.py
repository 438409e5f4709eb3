"""What a user of `python -m bytescale_compile.train` sees: lines printed on a config error and on Ctrl-C with
4 ranks, under torchrun and under the trainer's own `--nproc-per-node`, and how long `--help` takes.

On the trainer workspace of the tests (a tiny Qwen2 config directory, a BPE and a prepared corpus):
- a config error (a preset whose vocabulary is smaller than the data's) on 4 ranks: the lines on stderr,
  ours (`python -m bytescale_compile.train: ...`) and torchrun's;
- Ctrl-C sent to torchrun's process group once the first step is logged, as a terminal does: the lines
  ours and torchrun's print, the exit status, and the step whose checkpoint was saved;
- `--help` of the trainer and of the CLI: median wall seconds of 5 runs each.

Figures are printed, never asserted.

    python benchmarks/trainer_session.py
"""

from __future__ import annotations

import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/

from bytescale_compile.train.__main__ import PROG  # noqa: E402
from tests.trainer_runs import (  # noqa: E402
    ENV,
    ROOT,
    interrupt_after_first_step,
    make_workspace,
    torchrun_command,
    train_args,
)

RANKS = 4


def _split(stderr: str) -> tuple[int, int]:
    """(our lines, torchrun's lines) of a run's stderr; torchrun's are its log records and traceback."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    ours = [line for line in lines if line.startswith((PROG, "stopped by", "interrupted"))]
    return len(ours), len(lines) - len(ours)


def _command(launcher: str, args: list[str]) -> list[str]:
    if launcher == "torchrun":
        return torchrun_command(RANKS, args)
    return [sys.executable, "-m", "bytescale_compile.train", "--nproc-per-node", str(RANKS), *args]


def config_error(ws, out: Path, launcher: str) -> str:
    command = _command(launcher, train_args(ws, out, "--model", "tiny"))
    result = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    ours, theirs = _split(result.stderr)
    return f"| config error | {launcher} | {ours} | {theirs} | {result.returncode} | - |"


def ctrl_c(ws, out: Path, launcher: str) -> str:
    command = _command(launcher, train_args(ws, out, "--steps", "50", "--capacity", "512"))
    status, stderr = interrupt_after_first_step(command, out, signal.SIGINT)
    ours, theirs = _split(stderr)
    saved = sorted(p.name for p in (out / "checkpoints").glob("step_*")) if (out / "checkpoints").is_dir() else []
    return f"| Ctrl-C after step 1 | {launcher} | {ours} | {theirs} | {status} | {', '.join(saved)} |"


def help_seconds(command: list[str]) -> float:
    times = []
    for _ in range(5):
        began = time.perf_counter()
        subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, check=True)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ws = make_workspace(Path(tmp))
        print(f"{RANKS} ranks")
        print("| case | launcher | our lines | torchrun's lines | exit status | checkpoints |")
        print("|---|---|---|---|---|---|")
        for launcher in ("torchrun", "--nproc-per-node"):
            print(config_error(ws, Path(tmp) / launcher / "error", launcher), flush=True)
            print(ctrl_c(ws, Path(tmp) / launcher / "interrupted", launcher), flush=True)
    trainer = help_seconds([sys.executable, "-m", "bytescale_compile.train", "--help"])
    cli = help_seconds([sys.executable, "-m", "bytescale_compile.cli", "--help"])
    print(f"\n--help: trainer {trainer:.3f} s, bytescale-compile {cli:.3f} s (median of 5)")


if __name__ == "__main__":
    main()
