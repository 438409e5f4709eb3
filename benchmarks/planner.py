"""Planner speed, balance quality, and the paper's case study, on the simulator.

Prints:
  1. planning time (min / median / max over 10 seeds of Byted- and GitHub-like 32M-token batches, each
     the least of 3 runs) at 1024 and 12,288 ranks per strategy, auto at 1024, and per seed auto's CPU
     time over balance's (goal for balance: <= 50 ms at 1024, <= 500 ms at 12,288 on the project's
     2-core machine; auto within 3x of balance);
  2. balance quality: simulated step time / lower bound (max(total work / ranks, heaviest sequence's
     fastest share on any group size and u x r split) + all-reduce), per strategy, for Byted- and GitHub-like
     batches at 256K..2M context, on private 25 GB/s links and on h100-nvlink; balance twice, its groups as
     plain rings ("ring-only") and with group size and Ulysses x ring split chosen together ("joint"; goal:
     Byted-like 256K and 512K within 3% of the bound);
  3. the case study (LLaMA-7B, Byted-like, 2M context, C = 8K): step time and speedup over static of naive
     without offload, naive with offload and balance (paper: 1.59x / 2.01x / 3.69x) on 1024 ranks of private
     links, and on the paper's L20 cluster (512 ranks of TP 2), balance ring-only and joint;
  4. GitHub-like throughput from 256K to 2M per strategy and the mean slowdown per context doubling
     (paper: static ~2x, naive 1.23x, balance 1.08x; goal for balance: <= 1.10x on h100-nvlink), with the
     lower bound's own slowdown: what no schedule can beat;
  5. pipelines (8M tokens, 128K context, 32 pipelines, C = 8K x pp): step time and mean 1F1B bubble rate
     per strategy, with the stage-to-stage activation sends charged and without, and the first-order bubble;
  6. beside Megatron-Core's own hybrid-CP scheduler as executed (`benchmarks/megatron_cp.py`; needs its
     wheel, see there): balance's step over Megatron's and over the bound (goal: median <= 0.6, each <= 0.8).
With --figures DIR it also writes the case-study timelines and the throughput plot as PNG.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bytescale_compile.planner import AUTO, STRATEGY_SPECS, CostModel, Hardware, plan  # noqa: E402
from bytescale_compile.sim.experiments import run_strategy  # noqa: E402
from bytescale_compile.sim.lengths import sample_global_batch  # noqa: E402
from bytescale_compile.sim.simulator import bubble_rates, lower_bound, step_time  # noqa: E402
from bytescale_compile.strategies import SP_AUTO, SP_RING  # noqa: E402

K, M = 2**10, 2**20
TOKENS, CAPACITY = 32 * M, 8 * K
STRATEGIES = [name for name in STRATEGY_SPECS if name != AUTO]
REPEATS = 3
"""Each planning time is the least of this many runs: the other processes sharing the 2 cores only ever add time."""
AUTO_GOAL = 3.0
"""auto's CPU time over balance's, per batch."""
CLUSTERS = {"private links": None, "h100-nvlink": "h100-nvlink"}
"""Sections 2 and 4 run on both: private 25 GB/s links per rank (the default `Hardware`, where the ring binds) and
8-GPU NVLink nodes on 50 GB/s rails."""
COLUMNS = [(name, SP_AUTO, name) for name in STRATEGIES if name != "balance"] + [
    ("balance", SP_RING, "balance ring-only"),
    ("balance", SP_AUTO, "balance joint"),
]
"""(strategy, sp, label) of the side-by-side tables: balance with its groups as plain rings, and with group
size and u x r split chosen together (the default)."""
BYTED_GOAL, DOUBLING_GOAL = 1.03, 1.10


def _plan_ms(lens: np.ndarray, ranks: int, cost: CostModel, names: list[str], clock) -> dict[str, float]:
    """Milliseconds to plan `lens` with each strategy of `names`, the least of `REPEATS` runs, taken in
    turns so that all of them meet the same load from the processes sharing the cores."""
    best = dict.fromkeys(names, float("inf"))
    for _ in range(REPEATS):
        for name in names:
            strategy, offload = STRATEGY_SPECS[name]
            start = clock()
            plan(
                lens,
                world_size=ranks,
                capacity=CAPACITY,
                cost_model=cost,
                strategy=strategy,
                offload=offload,
                step_time=step_time,
            )
            best[name] = min(best[name], (clock() - start) * 1e3)
    return best


def _spread(values: list[float], digits: int = 1) -> str:
    """min / median / max, one column each."""
    return " ".join(f"{v:>6.{digits}f}" for v in (min(values), statistics.median(values), max(values)))


def planning_times(cost: CostModel, seeds: int) -> None:
    """Wall and CPU time (other processes share the 2 cores) over `seeds` batches of each dataset."""
    print(
        f"1. planning time, 32M tokens, C=8K, {seeds} seeds per dataset, least of {REPEATS} runs each: "
        "min / median / max (ms)"
    )
    print(f"{'ranks':>7} {'dataset':>8} {'strategy':>16} {'wall':>22} {'cpu':>22}  goal")
    for ranks in (1024, 12288):
        goal = 50 if ranks == 1024 else 500
        for dataset in ("byted", "github"):
            batches = [sample_global_batch(dataset, TOKENS, seed=seed) for seed in range(seeds)]
            names = ["balance", *(["auto"] if ranks == 1024 else []), *(s for s in STRATEGIES if s != "balance")]
            wall = [_plan_ms(lens, ranks, cost, names, time.perf_counter) for lens in batches]
            cpu = [_plan_ms(lens, ranks, cost, names, time.process_time) for lens in batches]
            for name in names:
                ms = [t[name] for t in cpu]
                verdict = f"<= {goal}: " + ("met" if max(ms) <= goal else "NOT met") if name == "balance" else ""
                print(
                    f"{ranks:>7} {dataset:>8} {name:>16} {_spread([t[name] for t in wall]):>22} {_spread(ms):>22}  "
                    f"{verdict}"
                )
            if "auto" in names:
                ratio = [t["auto"] / t["balance"] for t in cpu]
                verdict = f"<= {AUTO_GOAL:g}: " + ("met" if max(ratio) <= AUTO_GOAL else "NOT met")
                print(f"{ranks:>7} {dataset:>8} {'auto / balance':>16} {'':>22} {_spread(ratio, 2):>22}  {verdict}")


def _cost(model: str, cluster: str | None) -> CostModel:
    return CostModel.preset(model, None if cluster is None else Hardware.preset(cluster, 1))


def balance_quality(model: str) -> None:
    print("\n2. simulated step / lower bound, 32M tokens, 1024 ranks, C=8K")
    for cluster, preset in CLUSTERS.items():
        cost = _cost(model, preset)
        print(f"{cluster}\n{'batch':>14} " + " ".join(f"{label:>17}" for _, _, label in COLUMNS))
        for dataset in ("byted", "github"):
            for context in (256 * K, 512 * K, M, 2 * M):
                lens = sample_global_batch(dataset, TOKENS, seed=0, max_len=context)
                bound = lower_bound(lens, 1024, CAPACITY, cost)
                ratios = [
                    run_strategy(name, lens, 1024, CAPACITY, cost, context, sp=sp).step_time / bound
                    for name, sp, _ in COLUMNS
                ]
                verdict = ""
                if dataset == "byted" and context <= 512 * K:
                    verdict = f"  joint <= {BYTED_GOAL}: " + ("met" if ratios[-1] <= BYTED_GOAL else "NOT met")
                label = f"{dataset} {context // K}K"
                print(f"{label:>14} " + " ".join(f"{r:>17.3f}" for r in ratios) + verdict)


def case_study(model: str, figures: Path | None) -> None:
    print("\n3. case study: LLaMA-7B, Byted-like, 2M context, C=8K")
    lens = sample_global_batch("byted", TOKENS, seed=0, max_len=2 * M)
    paper = {"static": "1.00x", "naive-nooffload": "1.59x", "naive": "2.01x", "balance": "3.69x"}
    print(
        f"{'cluster':>26} {'strategy':>18} {'step s':>9} {'tokens/s':>12} {'speedup':>8} {'paper':>6} {'busy max/min':>13}"
    )
    for cluster, cost, ranks in (
        ("1024 ranks, private links", _cost(model, None), 1024),
        ("512 L20 ranks of TP 2", CostModel.preset(model, Hardware.preset("l20", tp_size=2)), 512),
    ):
        outcomes = [
            (label, run_strategy(name, lens, ranks, CAPACITY, cost, 2 * M, sp=sp)) for name, sp, label in COLUMNS
        ]
        static = outcomes[0][1].step_time
        for label, o in outcomes:
            print(
                f"{cluster:>26} {label:>18} {o.step_time:>9.2f} {o.tokens_per_second:>12,.0f} "
                f"{static / o.step_time:>7.2f}x {paper[o.name]:>6} {o.busy_spread:>13.2f}"
            )
        if figures and ranks == 1024:
            from bytescale_compile.sim.timeline import plot_timelines

            path = figures / "case_study_timelines.png"
            plot_timelines(
                [o.timeline for label, o in outcomes if label != "balance ring-only"],
                str(path),
                title="LLaMA-7B, Byted-like, 2M context, 1024 ranks",
            )
            print(f"timelines: {path}")


def _per_doubling(row: list[float]) -> float:
    """Mean slowdown per context doubling of throughputs `row` (one per doubling of context)."""
    return float(np.exp(np.mean(np.log(np.array(row[:-1]) / np.array(row[1:])))))


def github_scaling(model: str, figures: Path | None) -> None:
    print("\n4. GitHub-like throughput (tokens/s), 32M tokens, 1024 ranks, C=8K")
    contexts = [256 * K, 512 * K, M, 2 * M]
    paper = {"static": "~2x", "naive": "1.23x", "balance": "1.08x", "naive-nooffload": "-"}
    for cluster, preset in CLUSTERS.items():
        cost = _cost(model, preset)
        table: dict[str, list[float]] = {label: [] for _, _, label in COLUMNS}
        bound: list[float] = []
        for context in contexts:
            lens = sample_global_batch("github", TOKENS, seed=0, max_len=context)
            bound.append(float(lens.sum()) / lower_bound(lens, 1024, CAPACITY, cost))
            for name, sp, label in COLUMNS:
                table[label].append(run_strategy(name, lens, 1024, CAPACITY, cost, context, sp=sp).tokens_per_second)
        print(
            f"{cluster}\n{'strategy':>18} " + " ".join(f"{c // K:>10}K" for c in contexts) + "   slowdown per doubling"
        )
        for (name, _, label), row in zip(COLUMNS, table.values()):
            goal = ""
            if label == "balance joint" and preset is not None:
                goal = f", goal <= {DOUBLING_GOAL}x: " + ("met" if _per_doubling(row) <= DOUBLING_GOAL else "NOT met")
            print(
                f"{label:>18} "
                + " ".join(f"{t:>11,.0f}" for t in row)
                + f"   {_per_doubling(row):.2f}x (paper {paper[name]}{goal})"
            )
        print(f"{'lower bound':>18} " + " ".join(f"{t:>11,.0f}" for t in bound) + f"   {_per_doubling(bound):.2f}x")
        if figures and preset is None:
            from bytescale_compile.sim.timeline import plot_throughput

            path = figures / "github_throughput.png"
            plot_throughput(contexts, table, str(path), title="LLaMA-7B, GitHub-like, 1024 ranks")
            print(f"throughput: {path}")


def pipelines(cost: CostModel) -> None:
    print("\n5. pipelines: 8M tokens, 128K context, 32 pipelines, C = 8K x pp (seed 0)")
    print(
        f"{'data':>7} {'pp':>3} {'strategy':>8} {'step s':>8} {'no sends':>9} {'bubble':>7} {'no sends':>9} {'1st order':>9}"
    )
    for dataset in ("github", "byted"):
        lens = sample_global_batch(dataset, 8 * M, seed=0, max_len=128 * K)
        for pp in (2, 4):
            for name in ("balance", "static", "naive", "auto"):
                strategy, offload = STRATEGY_SPECS[name]
                p = plan(
                    lens,
                    world_size=32,
                    capacity=CAPACITY * pp,
                    cost_model=cost,
                    strategy=strategy,
                    pp_size=pp,
                    context_length=128 * K,
                    offload=offload,
                    step_time=step_time,
                )
                (staged, first), (unsent, _) = bubble_rates(p, cost), bubble_rates(p, cost, sends=False)
                print(
                    f"{dataset:>7} {pp:>3} {name:>8} {step_time(p, cost):>8.2f} {step_time(p, cost, sends=False):>9.2f} "
                    f"{staged:>7.3f} {unsent:>9.3f} {first:>9.3f}"
                )


def megatron(wheel: Path | None) -> None:
    print("\n6. beside Megatron-Core's hybrid-CP scheduler, as executed (benchmarks/megatron_cp.py)")
    from benchmarks import megatron_cp

    try:
        scheduler = megatron_cp.load_scheduler(megatron_cp.find_wheel(wheel))
    except megatron_cp.WheelNotFoundError as e:
        print(f"skipped: {e}")
        return
    cost = megatron_cp.cost_model()
    print(megatron_cp.HEADER)
    comparisons = []
    for batch in megatron_cp.BATCHES:
        comparisons.append(megatron_cp.compare(batch, scheduler, cost))
        print(megatron_cp.format_row(comparisons[-1]), flush=True)
    print(megatron_cp.summary(comparisons))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-7b")
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--figures", type=Path, default=None, help="write PNG figures into this directory")
    parser.add_argument("--megatron-wheel", type=Path, default=None, help="megatron-core's wheel (section 6)")
    parser.add_argument("--sections", type=int, nargs="*", default=None, help="only these sections (1-6)")
    args = parser.parse_args()
    if args.figures:
        args.figures.mkdir(parents=True, exist_ok=True)
    cost = CostModel.preset(args.model)
    sections = {
        1: lambda: planning_times(cost, args.seeds),
        2: lambda: balance_quality(args.model),
        3: lambda: case_study(args.model, args.figures),
        4: lambda: github_scaling(args.model, args.figures),
        5: lambda: pipelines(cost),
        6: lambda: megatron(args.megatron_wheel),
    }
    for number, section in sections.items():
        if args.sections is None or number in args.sections:
            section()


if __name__ == "__main__":
    main()
