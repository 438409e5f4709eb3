"""Losses of runs resumed on another topology, side by side with the uninterrupted run's.

On the trainer workspace of the tests (a tiny Qwen2, a BPE and a prepared corpus), 6 steps on CPU ranks: the
uninterrupted run on 4 ranks with ZeRO-1, and runs cut at step 3 and resumed on another number of ranks, ZeRO
setting, pipeline stages or tensor parallelism. Figures are printed, never asserted
(tests/e2e/test_resume_anywhere.py asserts 1e-5).

    python benchmarks/resume_anywhere.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/

from tests.trainer_runs import (  # noqa: E402
    cut_and_resume,
    make_workspace,
    run_losses,
    run_trainer,
    torchrun_command,
    train_args,
)

STEPS = 6
RUNS = {
    "4 ranks ZeRO -> 2 ranks ZeRO": ((4, ("--zero",)), (2, ("--zero",))),
    "2 ranks -> 4 ranks ZeRO": ((2, ()), (4, ("--zero",))),
    "2 ranks pp 2 -> 2 ranks": ((2, ("--pp", "2")), (2, ())),
    "4 ranks tp 2 -> 4 ranks": ((4, ("--tp", "2", "--capacity", "512")), (4, ("--capacity", "512"))),
}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ws = make_workspace(root)
        whole = ("--steps", str(STEPS), "--decay-steps", str(STEPS), "--zero")
        run_trainer(torchrun_command(4, train_args(ws, root / "whole", *whole)))
        losses = {"uninterrupted, 4 ranks ZeRO": run_losses(root / "whole")}
        for i, (name, (before, after)) in enumerate(RUNS.items()):
            cut_and_resume(ws, root / f"run{i}", STEPS, before, after)
            losses[name] = run_losses(root / f"run{i}")
    reference = losses["uninterrupted, 4 ranks ZeRO"]
    print(f"{STEPS} steps, resumed at step {STEPS // 2}; max relative difference from the uninterrupted run")
    print("| run | " + " | ".join(f"step {s}" for s in range(1, STEPS + 1)) + " | max rel. diff |")
    print("|---" * (STEPS + 2) + "|")
    for name, values in losses.items():
        worst = max(abs(a - b) / abs(b) for a, b in zip(values, reference))
        print(f"| {name} | " + " | ".join(f"{v:.6f}" for v in values) + f" | {worst:.1e} |")


if __name__ == "__main__":
    main()
