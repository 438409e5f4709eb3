"""The paper's setup side by side with its figures (§6.2 scaling, §6.3 case study, §6.4 ablation), simulated.

Cluster: the L20 preset (`Hardware.preset("l20", tp_size=2)`, the draft text of §6.1); LLaMA-7B, C = 8K,
32M tokens per step. The case study's "8 micro-batches, d_cp = 256" at 2M context and 32M tokens is
16 rows of 2M over DP 2 x CP 256: 512 HDP ranks of TP 2, i.e. 1024 GPUs.

Prints, per cluster model:
  1. the ablation chain: step time and speedup over static of naive without offload, naive with offload,
     balance and auto, next to the paper's 1.59x / 2.01x / 3.69x (3.89x adds the remote dataloader, which
     the simulator does not model) and the case study's 520 / 272 / 157 s;
  2. the context-length scaling 256K -> 2M (GitHub- and Byted-like): tokens/s and the mean slowdown per
     context doubling next to the paper's (GitHub: static ~2x, naive 1.23x, balance 1.08x).
Cluster models: the L20 datasheet; and the same with the ring at the bandwidth the paper's own trace
implies (its static micro-batch: 520 s / 8, 97.6% of it ring P2P of a 2M row over 256 ranks).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bytescale_compile.planner import STRATEGY_SPECS, CostModel, Hardware  # noqa: E402
from bytescale_compile.sim.experiments import run_strategy  # noqa: E402
from bytescale_compile.sim.lengths import sample_global_batch  # noqa: E402

K, M = 2**10, 2**20
TOKENS, CAPACITY, RANKS, TP = 32 * M, 8 * K, 512, 2
CHAIN = list(STRATEGY_SPECS)
"""The ablation chain, static first (every speedup is over it), in the order the planner lists the strategies."""
PAPER_SPEEDUP = {"static": 1.0, "naive-nooffload": 1.59, "naive": 2.01, "balance": 3.69}
PAPER_SECONDS = {"static": 520.0, "naive": 272.0, "balance": 157.0}
PAPER_STATIC_MICRO_BATCH = 520.0 / 8
PAPER_STATIC_COMM_SHARE = 0.976
PAPER_SLOWDOWN = {"github": {"static": "~2", "naive": "1.23", "balance": "1.08"}}
CONTEXTS = [256 * K, 512 * K, M, 2 * M]


def paper_ring_bandwidth(cost: CostModel) -> float:
    """Bytes/s per rank the paper's static trace implies: a 2M row's ring P2P over d_cp = 256 ranks takes
    97.6% of a 65 s micro-batch."""
    seconds = PAPER_STATIC_MICRO_BATCH * PAPER_STATIC_COMM_SHARE
    return float(cost.ring_bytes(2 * M // 256, 256)) / seconds


def clusters(model: str) -> dict[str, CostModel]:
    hw = Hardware.preset("l20", tp_size=TP)
    datasheet = CostModel.preset(model, hw)
    ring = paper_ring_bandwidth(datasheet)
    topology = dataclasses.replace(
        hw.topology,
        switch_uplink=ring,
        nic_bandwidth=ring / TP * hw.topology.devices_per_node / hw.topology.nics_per_node,
    )
    slowed = dataclasses.replace(hw, name=f"{hw.name}-paper-ring", topology=topology)
    return {
        "L20 datasheet": datasheet,
        f"L20, ring at the paper's implied {ring / 1e9:.1f} GB/s per rank": CostModel.preset(model, slowed),
    }


def ablation(cost: CostModel, seeds: range) -> None:
    steps = {s: [] for s in CHAIN}
    chosen: list[str] = []
    for seed in seeds:
        lens = sample_global_batch("byted", TOKENS, seed=seed, max_len=2 * M)
        for s in CHAIN:
            outcome = run_strategy(s, lens, RANKS, CAPACITY, cost, 2 * M)
            steps[s].append(outcome.step_time)
            if s == "auto":
                chosen.append(outcome.plan.auto.chosen)
    static = np.mean(steps["static"])
    print(f"  ablation, Byted-like 2M, mean of {len(seeds)} seeds (auto chose: {', '.join(sorted(set(chosen)))})")
    print(f"  {'strategy':>16} {'step s':>8} {'paper s':>8} {'speedup':>8} {'paper':>6}")
    for s in CHAIN:
        mean = float(np.mean(steps[s]))
        paper_s = f"{PAPER_SECONDS[s]:.0f}" if s in PAPER_SECONDS else "-"
        paper_x = f"{PAPER_SPEEDUP[s]:.2f}x" if s in PAPER_SPEEDUP else "-"
        print(f"  {s:>16} {mean:>8.1f} {paper_s:>8} {static / mean:>7.2f}x {paper_x:>6}")
    print(f"  {'+remote loader':>16} {'-':>8} {'-':>8} {'-':>8} {'3.89x':>6}   (data loading: not simulated)")


def scaling(cost: CostModel, seed: int) -> None:
    print(f"  context scaling 256K -> 2M, tokens/s (seed {seed}); slowdown = mean per context doubling")
    for dataset in ("github", "byted"):
        rows = {s: [] for s in ("static", "naive", "balance")}
        for context in CONTEXTS:
            lens = sample_global_batch(dataset, TOKENS, seed=seed, max_len=context)
            for s in rows:
                rows[s].append(run_strategy(s, lens, RANKS, CAPACITY, cost, context).tokens_per_second)
        print(f"  {dataset:>8} {'strategy':>9} " + " ".join(f"{c // K:>9}K" for c in CONTEXTS) + "  slowdown  paper")
        for s, row in rows.items():
            slowdown = float(np.exp(np.mean(np.log(np.array(row[:-1]) / np.array(row[1:])))))
            paper = PAPER_SLOWDOWN.get(dataset, {}).get(s, "-")
            print(f"  {'':>8} {s:>9} " + " ".join(f"{t:>10,.0f}" for t in row) + f"  {slowdown:>7.2f}x  {paper}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-7b")
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    print(f"{args.model}, {RANKS} HDP ranks x TP {TP} = {RANKS * TP} GPUs, C = {CAPACITY // K}K, 32M tokens per step")
    for name, cost in clusters(args.model).items():
        print(f"\n== {name} ==")
        ablation(cost, range(args.seeds))
        scaling(cost, seed=0)


if __name__ == "__main__":
    main()
