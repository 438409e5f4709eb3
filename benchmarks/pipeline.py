"""Pipelines on 4 CPU ranks (PP 2 x HDP 2) through the `Runtime`: measured bubble fraction per pipeline against
the simulator's stage-by-stage prediction for the same plan, and the step time of PP-balance against the same
micro-batches dealt without balancing (`benchmarks/pp_balance.py`'s `deal_unbalanced`) and against static
(figures: benchmarks/history/pipelines.md).

Every rank builds the same 4-layer LLaMA, the job calibrates a cost model on the whole model first
(`train/calibrate.py`, pp = 1 over the 4 ranks), then plans PP-balance and static at pp = 2 over 2 HDP
ranks and runs each plan `--repeats` times through a Runtime over its stage (after one warm-up step that
compiles; SGD at lr 0, so every repeat trains the same weights). A pipeline's measured bubble is 1 - (its
stages' busy seconds) / (pp x the slowest rank's forward-backward seconds) (`StepStats.bubbles`); the
simulated one is `sim.simulator.pipeline_bubbles` (stage-to-stage sends charged at the calibrated link).

    python benchmarks/pipeline.py [--tokens 12288] [--capacity 1024] [--repeats 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/, benchmarks/

import bytescale_compile as bsc  # noqa: E402
from benchmarks.pp_balance import deal_unbalanced  # noqa: E402
from bytescale_compile.engine.pipeline import pipeline_stage  # noqa: E402
from bytescale_compile.models.llama import LlamaConfig, LlamaForCausalLM  # noqa: E402
from bytescale_compile.planner import plan  # noqa: E402
from bytescale_compile.sim.lengths import sample_global_batch  # noqa: E402
from bytescale_compile.sim.simulator import pipeline_bubbles, step_time  # noqa: E402
from bytescale_compile.testing import run_distributed  # noqa: E402
from bytescale_compile.train.calibrate import calibrate  # noqa: E402

PP, HDP = 2, 2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4, num_kv_heads=2)
    )


def _worker(rank: int, world: int, tokens: int, capacity: int, repeats: int) -> None:
    torch.set_num_threads(1)
    whole = bsc.optimize(_model())
    runtime = bsc.Runtime(whole, torch.optim.SGD(whole.parameters(), lr=0.0), capacity=capacity)
    cost = calibrate(runtime, repeats=1).cost_model
    lengths = sample_global_batch("github", tokens, seed=0, max_len=4 * capacity)
    g = torch.Generator().manual_seed(0)
    batch = [torch.randint(0, 512, (int(n),), generator=g) for n in lengths]
    stage = pipeline_stage(_model(), PP)
    pipelines = bsc.Runtime(stage, torch.optim.SGD(stage.parameters(), lr=0.0), cost_model=cost, capacity=capacity * PP)
    balance = plan(lengths, world_size=HDP, capacity=capacity * PP, cost_model=cost, strategy="balance", pp_size=PP)
    plans = {
        "balance": balance,
        "unbalanced": deal_unbalanced(balance),
        "static": plan(
            lengths,
            world_size=HDP,
            capacity=capacity * PP,
            cost_model=cost,
            strategy="static",
            pp_size=PP,
            context_length=4 * capacity,
        ),
    }
    rows = []
    for name, step_plan in plans.items():
        runs = [pipelines.step(batch, plan=step_plan) for _ in range(repeats + 1)][1:]
        measured = np.mean([s.bubbles for s in runs], axis=0).tolist()
        rows.append(
            (
                name,
                statistics.median(s.time for s in runs),
                step_time(step_plan, cost),
                measured,
                pipeline_bubbles(step_plan, cost),
                [len(ids) for ids in step_plan.schedule],
            )
        )
    if rank == 0:
        print(
            f"{len(lengths)} sequences, {int(sum(lengths))} tokens; PP {PP} x HDP {HDP} on 4 CPU ranks, "
            f"C = {capacity} per stage x {PP}, median of {repeats}"
        )
        print(
            f"{'plan':>10} {'step s':>7} {'sim s':>7}  {'micro-batches':>13}  bubble per pipeline: measured / simulated"
        )
        for name, seconds, simulated, measured, predicted, counts in rows:
            pairs = ", ".join(f"{m:.2f} / {p:.2f}" for m, p in zip(measured, predicted))
            print(f"{name:>10} {seconds:>7.2f} {simulated:>7.2f}  {str(counts):>13}  {pairs}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=12288)
    parser.add_argument("--capacity", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    run_distributed(_worker, PP * HDP, args.tokens, args.capacity, args.repeats)


if __name__ == "__main__":
    main()
