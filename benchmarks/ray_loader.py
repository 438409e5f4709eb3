"""The remote dataloader on Ray (paper §6): start-up cost, scheduler scale, prefetch on the demo.

Prints:
  1. Ray's start-up cost on this machine: `ray.init` of a local head (dashboard off), the scheduler and its
     data servers on the demo data up to the first planned step a client holds, and `ray.shutdown`;
  2. scheduler scale: one process planning a 32M-token Byted-like batch (LLaMA-7B cost model, C = 8K) for
     1,024 and 12,288 simulated clients: plan + validate, then one `ray.put` per client of its plan slice
     (its micro-batches and their sequences' lengths), the bytes each slice holds, and the full plan's bytes
     and its one `ray.put` (what `--loader ray` broadcasts today, one object all ranks read), against every
     rank planning itself
     (each reads all lengths and spends the whole planning time on its critical path);
  3. data_wait_s per step on the demo (examples/configs/demo.toml, 4 CPU ranks, strategy balance) with
     `--loader ray` without prefetch (--prefetch-steps 0), with prefetch (2), and `--loader local`.
Needs `make demo`'s data and cost model (.cache/demo); section 3 runs torchrun.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402

from bytescale_compile.data import GlobalBatchSampler, TokenDataset  # noqa: E402
from bytescale_compile.planner import CostModel, MicroBatch, PlanRequest, plan  # noqa: E402
from bytescale_compile.sim.lengths import sample_global_batch  # noqa: E402
from bytescale_compile.train.remote import RemoteBatches, connect_ray, scheduler_for  # noqa: E402

M, K = 2**20, 2**10
DEMO_CONFIG = ROOT / "examples/configs/demo.toml"
DEMO_DATA = ROOT / ".cache/demo/data"


@dataclass(frozen=True)
class PlanSlice:
    """What one client needs of a step's plan: its micro-batches and the lengths of their sequences."""

    rank: int
    micro_batches: list[MicroBatch]
    lengths: dict[int, int]


def startup(out: Path) -> None:
    print("1. Ray start-up on this machine (2 CPUs, dashboard off)")
    began = time.perf_counter()
    connect_ray(None, 2)
    init = time.perf_counter() - began
    dataset = TokenDataset.open(DEMO_DATA)
    sampler = GlobalBatchSampler(dataset, 8 * K, seed=0, max_len=4 * K)
    cost = CostModel.load(ROOT / ".cache/demo/cost_cpu.json")
    request = PlanRequest(world_size=4, capacity=2 * K, cost_model=cost, strategy="balance")
    began = time.perf_counter()
    scheduler = scheduler_for(out / "startup", dataset, 2, 8 * K, 0, 4 * K, sampler.state_dict(), 1, request, 2)
    client = RemoteBatches(scheduler, 0, 1)
    next(client)
    first = time.perf_counter() - began
    client.close()
    ray.kill(scheduler)
    print(f"   ray.init {init:.2f} s; scheduler + 2 servers to the first planned step at a client {first:.2f} s")


def scheduler_scale(seeds: int) -> None:
    print("\n2. scheduler scale: 32M Byted-like tokens, LLaMA-7B, C=8K; median over seeds")
    print(
        f"{'clients':>8} {'plan ms':>8} {'put ms':>8} {'plan+put ms':>12} {'slice B (mean/max)':>20} "
        f"{'full plan B':>12} {'its put ms':>10} {'every-rank-plans: ms/rank, B read/rank':>40}"
    )
    cost = CostModel.preset("llama-7b")
    for clients in (1024, 12288):
        rows = [_scale_row(sample_global_batch("byted", 32 * M, seed=seed), clients, cost) for seed in range(seeds)]
        med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        print(
            f"{clients:>8} {med['plan']:>8.1f} {med['put']:>8.1f} {med['plan'] + med['put']:>12.1f} "
            f"{med['slice_mean']:>10.0f} / {med['slice_max']:<7.0f} {med['full']:>12.0f} {med['put_full']:>10.1f} "
            f"{med['plan']:>25.1f} ms, {med['lengths']:.0f} B"
        )


def _scale_row(lengths: np.ndarray, clients: int, cost: CostModel) -> dict[str, float]:
    began = time.perf_counter()
    step_plan = plan(lengths, world_size=clients, capacity=8 * K, cost_model=cost, strategy="balance")
    step_plan.validate()
    planned = time.perf_counter() - began
    slices = [
        PlanSlice(r, mbs, {s: int(lengths[s]) for mb in mbs for s in mb.sequences})
        for r, mbs in ((r, step_plan.micro_batches_of(r)) for r in range(clients))
    ]
    began = time.perf_counter()
    refs = [ray.put(s) for s in slices]
    put = time.perf_counter() - began
    del refs
    began = time.perf_counter()
    whole = ray.put(step_plan)
    put_full = time.perf_counter() - began
    del whole
    sizes = [len(pickle.dumps(s)) for s in slices]
    return {
        "plan": planned * 1e3,
        "put": put * 1e3,
        "slice_mean": float(np.mean(sizes)),
        "slice_max": max(sizes),
        "full": len(pickle.dumps(step_plan)),
        "put_full": put_full * 1e3,
        "lengths": lengths.nbytes,
    }


def demo_prefetch(out: Path, steps: int) -> None:
    print(
        f"\n3. data_wait_s per step on the demo (4 CPU ranks, balance, {steps} steps; step 1 holds start-up "
        f"and compilation)"
    )
    runs = {
        "ray, no prefetch": ("--loader", "ray", "--prefetch-steps", "0"),
        "ray, prefetch 2": ("--loader", "ray", "--prefetch-steps", "2"),
        "local": ("--loader", "local"),
    }
    for name, options in runs.items():
        directory = out / name.replace(", ", "-").replace(" ", "")
        torchrun = Path(sys.executable).with_name("torchrun")
        command = [
            str(torchrun),
            "--nproc_per_node=4",
            "-m",
            "bytescale_compile.train",
            "--config",
            str(DEMO_CONFIG),
            "--strategy",
            "balance",
            "--steps",
            str(steps),
            "--eval-every",
            "0",
            "--out",
            str(directory),
            "--ray-cpus",
            "2",
            *options,
        ]
        result = subprocess.run(
            command, cwd=ROOT, capture_output=True, text=True, timeout=1800, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
        if result.returncode != 0:
            raise RuntimeError(f"{name}: {result.stderr[-2000:]}")
        records = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
        waits = " ".join(f"{r['data_wait_s'] * 1e3:.1f}" for r in records)
        later = records[1:]
        share = sum(r["data_wait_s"] for r in later) / sum(r["time"] + r["data_wait_s"] for r in later)
        plan_ms = statistics.median(r["plan_time_s"] * 1e3 for r in later)
        step_s = statistics.median(r["time"] for r in later)
        print(
            f"   {name:<17} data_wait ms per step: {waits}; steps 2+: wait {share:.1%} of step time, "
            f"median step {step_s:.2f} s, plan {plan_ms:.1f} ms"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "runs/ray_loader")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--demo-steps", type=int, default=6)
    args = parser.parse_args()
    startup(args.out)
    scheduler_scale(args.seeds)
    began = time.perf_counter()
    ray.shutdown()
    print(f"\n   ray.shutdown {time.perf_counter() - began:.2f} s")
    demo_prefetch(args.out, args.demo_steps)


if __name__ == "__main__":
    main()
