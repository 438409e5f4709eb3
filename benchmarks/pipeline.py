"""Pipelines on 4 CPU ranks (PP 2 x HDP 2): measured bubble fraction per pipeline against the simulator's
stage-by-stage prediction for the same plan, and the step time of balance against static (ByteScale issue 16).

Every rank builds the same 4-layer LLaMA, the job calibrates a cost model on the whole model first
(`train/calibrate.py`, pp = 1 over the 4 ranks), then plans each strategy at pp = 2 over 2 HDP ranks and runs
`PipelineExecutor.forward_backward` on it (after one warm-up run that compiles): a pipeline's measured bubble
is 1 - (its stages' busy seconds) / (pp x the step's seconds). The simulation leaves the stage-to-stage sends
out (`sends=False`): it sizes them by the hidden width it reads back from the cost model's attention coefficient,
which only an analytic model holds (a calibrated CPU one would make them megabytes per token).

    python benchmarks/pipeline.py [--tokens 6144] [--capacity 1024] [--repeats 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/

import bytescale_compile as bsc  # noqa: E402
from bytescale_compile.planner import plan
from bytescale_compile.runtime.spawn import run_distributed
from bytescale_compile.sim.lengths import sample_global_batch
from bytescale_compile.sim.simulator import pipeline_bubbles, step_time
from bytescale_compile.train.calibrate import calibrate
from bytescale_compile.train.engine import ListBatch
from bytescale_compile.train.pipeline import PipelineExecutor
from bytescale_compile.train.stages import split_stages
from examples.models.llama import LlamaConfig, LlamaForCausalLM

PP, HDP = 2, 2
STRATEGIES = ("balance", "static")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=4,
                                        num_heads=4, num_kv_heads=2))


def _worker(rank: int, world: int, tokens: int, capacity: int, repeats: int) -> None:
    torch.set_num_threads(1)
    model = _model()
    whole = bsc.optimize(model)
    runtime = bsc.Runtime(whole, torch.optim.SGD(whole.parameters(), lr=0.0), capacity=capacity)
    cost = calibrate(runtime, repeats=1).cost_model
    lengths = sample_global_batch("github", tokens, seed=0, max_len=4 * capacity)
    g = torch.Generator().manual_seed(0)
    batch = [torch.randint(0, 512, (int(n),), generator=g) for n in lengths]
    stage = bsc.optimize(split_stages(_model(), PP)[rank // HDP])
    executor = PipelineExecutor(stage, torch.optim.SGD(stage.parameters(), lr=0.0))
    rows = []
    for strategy in STRATEGIES:
        step_plan = plan(lengths, HDP, capacity * PP, cost, strategy=strategy, pp_size=PP,
                         context_length=4 * capacity)
        times, bubbles = [], []
        for i in range(repeats + 1):
            executor.optimizer.zero_grad()
            dist.barrier()
            began = time.perf_counter()
            work = executor.forward_backward(step_plan, ListBatch(batch, 512))
            dist.barrier()
            seconds = time.perf_counter() - began
            busy = torch.zeros(world, dtype=torch.float64)
            busy[rank] = work.busy
            dist.all_reduce(busy)
            if i:
                times.append(seconds)
                per_stage = busy.view(PP, HDP)
                bubbles.append((1 - per_stage.sum(0) / (PP * seconds)).tolist())
        predicted = pipeline_bubbles(step_plan, cost, sends=False)
        measured = np.mean(bubbles, axis=0).tolist()
        rows.append((strategy, statistics.median(times), step_time(step_plan, cost, sends=False), measured, predicted,
                     [len(ids) for ids in step_plan.schedule]))
    if rank == 0:
        print(f"{len(lengths)} sequences, {int(sum(lengths))} tokens; PP {PP} x HDP {HDP} on 4 CPU ranks, "
              f"C = {capacity} per stage x {PP}, median of {repeats}")
        print(f"{'strategy':>9} {'step s':>7} {'sim s':>7}  {'micro-batches':>13}  bubble per pipeline: measured / simulated")
        for strategy, seconds, simulated, measured, predicted, counts in rows:
            pairs = ", ".join(f"{m:.2f} / {p:.2f}" for m, p in zip(measured, predicted))
            print(f"{strategy:>9} {seconds:>7.2f} {simulated:>7.2f}  {str(counts):>13}  {pairs}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=6144)
    parser.add_argument("--capacity", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    run_distributed(_worker, PP * HDP, args.tokens, args.capacity, args.repeats)


if __name__ == "__main__":
    main()
