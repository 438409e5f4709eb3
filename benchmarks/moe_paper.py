"""The paper's MoE rows (Mistral-8x7B and 8x22B, TP 8 x PP 4), from their shapes' counts: bytes per device, and a
simulated 2M-context step, balance against static.

Cluster: the paper's L20 servers (`Hardware.preset("l20", tp_size=8)`, the draft text of §6.1: 48 GB per GPU, 4
GPUs per PCIe switch, so a TP group of 8 spans two switches), 12,288 GPUs (the paper's "more than 12,000"): 384
HDP ranks of TP 8 x PP 4. bf16 with the distributed optimizer over the 384 HDP ranks, 32M tokens per step.

Prints:
  1. per model and expert layout (ep: each TP rank holds E/tp whole experts, the default; tp: every expert split
     like a dense MLP), one device of the largest pipeline stage (`planner.memory.shape_memory_model`): its
     parameters, weights, gradients, main weights and Adam moments, the activations a token costs on the stage
     (its layers, 4 micro-batches in flight under 1F1B), the capacity C a 48 GB device allows without and with
     offload, and the HDP ranks one 2M-token sequence needs: 2M / C without offload, 2M / (longest share at
     r = 1) with it;
  2. per model and dataset (GitHub- and Byted-like, 2M context, seeds 0..SEEDS-1): the simulated step of static
     (at its C without offload) and balance (at its C with offload), and the speedup. "-" where static cannot
     plan a 2M row on the cluster (the reason printed below).

    python benchmarks/moe_paper.py [--seeds 2]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bytescale_compile.planner import CostModel, Hardware, PlanError  # noqa: E402
from bytescale_compile.planner.memory import MemoryModel, ParallelLayout, shape_memory_model  # noqa: E402
from bytescale_compile.planner.model_shape import PRESETS, ExpertLayout  # noqa: E402
from bytescale_compile.sim.experiments import run_strategy  # noqa: E402
from bytescale_compile.sim.lengths import sample_global_batch  # noqa: E402
from bytescale_compile.strategies import STRATEGY_SPECS  # noqa: E402

K, M, GiB = 2**10, 2**20, 2**30
TP, PP, GPUS = 8, 4, 12_288
HDP = GPUS // (TP * PP)
TOKENS, CONTEXT = 32 * M, 2 * M
MODELS = ("mistral-8x7b", "mistral-8x22b")
HARDWARE = Hardware.preset("l20", tp_size=TP)
BUDGET = round(HARDWARE.hbm_bytes / TP)
"""One L20's 48 GB."""


def device_memory(name: str, expert_layout: ExpertLayout) -> MemoryModel:
    layout = ParallelLayout(tp=TP, pp=PP, hdp=HDP, expert_layout=expert_layout)
    return shape_memory_model(PRESETS[name], layout, dtype="bf16", budget=BUDGET, expandable=True)


def bytes_per_device() -> None:
    print(f"1. one device of the largest stage, bf16, N = {HDP} HDP ranks, budget {BUDGET / 1e9:.0f} GB")
    print(
        f"{'model':<14} {'layout':>6} {'params':>8} {'weights':>8} {'grads':>8} {'main+Adam':>9} {'act/token':>10} "
        f"{'C':>15} {'2M needs ranks':>15}"
    )
    for name in MODELS:
        layouts: tuple[ExpertLayout, ...] = ("ep", "tp")
        for layout in layouts:
            m = device_memory(name, layout)
            s = m.static
            per_token = m.activation_bytes(1)
            c_plain, c_offload = m.capacity(BUDGET, offload=False), m.capacity(BUDGET, offload=True)
            ranks = (math.ceil(CONTEXT / c_plain), math.ceil(CONTEXT / m.longest_per_rank(BUDGET)))
            print(
                f"{name:<14} {layout:>6} {m.params / 1e9:>7.2f}B {s.weights / GiB:>4.2f} GiB {s.gradients / GiB:>4.2f} GiB "
                f"{(s.master + s.optimizer) / GiB:>5.2f} GiB {per_token / 2**20:>6.2f} MiB "
                f"{c_plain:>7,} / {c_offload:>5,} {ranks[0]:>6} / {ranks[1]:>4}"
            )


def step(name: str, dataset: str, seeds: range) -> None:
    cost = CostModel.preset(name, HARDWARE)
    memory = device_memory(name, "auto")
    capacity = {offload: memory.capacity(BUDGET, offload) for offload in (False, True)}
    times: dict[str, list[float]] = {"static": [], "balance": []}
    refused: dict[str, str] = {}
    for seed in seeds:
        lens = sample_global_batch(dataset, TOKENS, seed=seed, max_len=CONTEXT)
        for strategy in times:
            c = capacity[STRATEGY_SPECS[strategy][1]]
            try:
                times[strategy].append(run_strategy(strategy, lens, HDP, c, cost, CONTEXT, pp_size=PP).step_time)
            except (PlanError, ValueError) as e:
                refused[strategy] = str(e)
    mean = {s: float(np.mean(t)) if t and s not in refused else None for s, t in times.items()}
    static, balance = mean["static"], mean["balance"]
    cells = " ".join(f"{t:>9.1f} s" if t else f"{'-':>11}" for t in (static, balance))
    speedup = f"{static / balance:>6.2f}x" if static and balance else f"{'-':>7}"
    tokens_per_second = f"{TOKENS / balance:>13,.0f}" if balance else f"{'-':>13}"
    print(f"{name:<14} {dataset:>7} {capacity[False]:>9,} {capacity[True]:>9,} {cells} {speedup} {tokens_per_second}")
    for strategy, reason in refused.items():
        print(f"  {strategy} cannot plan it: {reason}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=2)
    args = parser.parse_args()
    print(f"L20 cluster, {GPUS:,} GPUs = {HDP} HDP ranks x TP {TP} x PP {PP}, {TOKENS // M}M tokens per step")
    bytes_per_device()
    print(f"\n2. simulated step at {CONTEXT // M}M context, mean of {args.seeds} seeds (static at C without offload)")
    print(
        f"{'model':<14} {'dataset':>7} {'C static':>9} {'C balance':>9} {'static':>11} {'balance':>11} "
        f"{'speedup':>7} {'balance tok/s':>13}"
    )
    for name in MODELS:
        for dataset in ("github", "byted"):
            step(name, dataset, range(args.seeds))


if __name__ == "__main__":
    main()
