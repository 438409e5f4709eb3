"""A fault soak of the trainer on 4 CPU ranks: every fault kind of `tests/fault_soak.py` once, in an order and at
steps drawn from `--seed` (a rank SIGKILLed mid-step, SIGTERM to the job, a checkpoint write killed halfway, a
corrupted shard, a full disk, a Ray data server killed, and in half the seeds, seed 0 among them, a resume on 2
ranks and back to 4), then the run compared with an uninterrupted one of the same config: each fault survived (or
refused with its message), the steps it cost, the losses step by step, max |dw| of the final weights, and the wall
time.

On the trainer workspace of the tests (a tiny Qwen2 config directory, a BPE and a prepared corpus); launches via
torchrun `--max-restarts=1 ... --resume=auto`, a checkpoint every `--checkpoint-every` steps. Figures are printed,
never asserted (`tests/e2e/test_fault_soak.py` asserts them, on fewer steps).

    python benchmarks/fault_soak.py --seed 0 [--steps 60] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/

from tests.fault_soak import SoakConfig, draw_slots, reference_run, run_soak  # noqa: E402
from tests.trainer_runs import make_workspace  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--out", type=Path, help="keep the runs and every launch's output here (default: a temp dir)")
    args = parser.parse_args()
    config = SoakConfig(args.steps, args.checkpoint_every)
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        began = time.monotonic()
        (out / "workspace").mkdir(exist_ok=True)
        ws = make_workspace(out / "workspace")
        for slot in draw_slots(args.seed, config):
            print(f"slot to step {slot.end}: {slot.fault.kind} at step {slot.fault.step}", flush=True)
        reference = out / "uninterrupted"
        reference_wall_s = reference_run(ws, config, reference)
        print(f"uninterrupted run: {reference_wall_s:.0f} s", flush=True)
        soak = out / f"seed_{args.seed}"
        soak.mkdir(exist_ok=True)
        result = run_soak(ws, config, soak, args.seed, reference, reference_wall_s)
        print()
        print(result.table())
        print(f"\nin all {time.monotonic() - began:.0f} s (the workspace included)")
        if args.out:
            print(f"each launch's output: {soak}/launch_<k>.log")


if __name__ == "__main__":
    main()
