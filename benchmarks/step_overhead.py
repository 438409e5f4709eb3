"""Host time a training step spends outside forward and backward: planning and the step's predictions.

The model is the demo's (examples/configs/llama-demo, compiled here once on the CPU: its compile report is what the
old path read every step), its cost model the demo's profile (.cache/demo/cost_cpu.json, from `make demo`) when
present, else the analytic one of its shape. Global batches are the demo's, scaled with the ranks: 2K tokens per
rank (C = 2K, at most 4K per sequence) of the installed Python sources' lengths (`sim.lengths`, "python"), planned
for 4 ranks (the demo) and simulated at 64 and 1024, one process, no torch.distributed: the planner, the probe and
the diagnostics are called as the Runtime calls them.

Per step and rank, each part the least of `--repeats` runs, the median over `--seeds` batches (ms):
  before: what the old code ran on every rank at every step: the shard blockers read from the compile report with
          the mixer costs rebuilt (`CompileReport.mixer_costs`, `OptimizedModule.shard_blockers`), the plan, the
          simulator's step time in `Runtime.step` (`step_time`) and a second simulation in `StepRecord.from_stats`
          (`simulate`, `busy_times`, `p2p_bytes`, `ulysses_bytes`);
  after:  the plan with the setup probe's blockers (`PlanRequest.plan`), plus, on a logged step of rank 0, one
          prediction (`engine.diagnostics.predict`); a rank that logs nothing plans only.
The plan is today's planner in both columns. Timings are printed, never asserted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bytescale_compile as bsc  # noqa: E402
from bytescale_compile.api import OptimizedModule  # noqa: E402
from bytescale_compile.engine.diagnostics import predict  # noqa: E402
from bytescale_compile.engine.probe import SetupProbe, probe  # noqa: E402
from bytescale_compile.passes.report import CompileReport  # noqa: E402
from bytescale_compile.planner import CostModel, Plan, PlanRequest  # noqa: E402
from bytescale_compile.sim.lengths import sample_global_batch  # noqa: E402
from bytescale_compile.sim.simulator import busy_times, p2p_bytes, simulate, step_time, ulysses_bytes  # noqa: E402
from examples.models.hf import llama_demo  # noqa: E402

K = 1024
TOKENS_PER_RANK, CAPACITY, MAX_LEN = 2 * K, 2 * K, 4 * K
"""The demo's 8K tokens over 4 ranks, C = 2K, 4K context (examples/configs/demo.toml)."""
RANKS = (4, 64, 1024)
STRATEGIES = ("balance", "naive", "static", "auto")
"""The demo's strategy "all"."""
DEMO_COST = Path(".cache/demo/cost_cpu.json")


def least_ms(call: Callable[[], object], repeats: int) -> float:
    """Milliseconds of `call`, the least of `repeats` runs (the processes sharing the cores only ever add time)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, (time.perf_counter() - start) * 1e3)
    return best


def old_blockers(model: OptimizedModule) -> None:
    """`Runtime.shard_blockers()` as it ran on every plan: the mixer costs rebuilt from the report (its "once" guard
    never tripped for a model without mixers), then the blockers read from every compiled graph."""
    CompileReport(graphs=model.compiled_graphs).mixer_costs()
    model.shard_blockers()


def old_predictions(step_plan: Plan, cost_model: CostModel) -> None:
    """The simulator twice: `Runtime.step`'s predicted time, and `StepRecord.from_stats`' timeline and bytes."""
    step_time(step_plan, cost_model)
    timeline = simulate(step_plan, cost_model)
    busy_times(timeline)
    p2p_bytes(step_plan, cost_model) + ulysses_bytes(step_plan, cost_model)


def request(probed: SetupProbe, ranks: int, strategy: str) -> PlanRequest:
    """What the trainer's Runtime plans with (`Runtime.plan_request`): static and auto get the context length."""
    return PlanRequest(
        world_size=ranks,
        capacity=CAPACITY,
        cost_model=probed.cost_model,
        strategy=strategy,
        context_length=MAX_LEN if strategy in ("static", "auto") else None,
        shard_blockers=probed.shard_blockers,
        step_time=step_time,
    )


def row(model: OptimizedModule, probed: SetupProbe, ranks: int, strategy: str, seeds: int, repeats: int) -> str:
    """One line of the table: each part's median over the seeds' batches."""
    parts: dict[str, list[float]] = {"report": [], "plan": [], "old": [], "new": []}
    planner = request(probed, ranks, strategy)
    for seed in range(seeds):
        lengths = sample_global_batch("python", TOKENS_PER_RANK * ranks, seed=seed, max_len=MAX_LEN)
        step_plan = planner.plan(lengths)
        parts["report"].append(least_ms(partial(old_blockers, model), repeats))
        parts["plan"].append(least_ms(partial(planner.plan, lengths), repeats))
        parts["old"].append(least_ms(partial(old_predictions, step_plan, probed.cost_model), repeats))
        parts["new"].append(least_ms(partial(predict, step_plan, probed.cost_model), repeats))
    report, planned, old, new = (statistics.median(parts[k]) for k in ("report", "plan", "old", "new"))
    before, logged = report + planned + old, planned + new
    return (
        f"{ranks:>6} {strategy:>8} {planned:>9.2f}   {report:>9.2f} {old:>9.2f} {before:>9.2f}   "
        f"{new:>9.2f} {logged:>9.2f} {planned:>9.2f}   {before - logged:>9.2f} {before - planned:>9.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, nargs="+", default=list(RANKS))
    args = parser.parse_args()
    model = bsc.optimize(llama_demo())
    cost = CostModel.load(DEMO_COST) if DEMO_COST.is_file() else None
    start = time.perf_counter()
    probed = probe(model, cost)
    print(
        f"demo model compiled and probed once at setup in {time.perf_counter() - start:.1f} s "
        f"({len(model.compiled_graphs)} graph(s)); cost model {probed.cost_model.source!r}"
    )
    print(
        f"per step and rank, ms (median over {args.seeds} batches of 2K tokens per rank, each part the least of "
        f"{args.repeats} runs)"
    )
    print(
        f"{'':>25}   {'------- before: every rank -----':>29}   {'-------------- after ------------':>29}   "
        f"{'----- saved -----':>19}"
    )
    print(
        f"{'ranks':>6} {'strategy':>8} {'plan':>9}   {'blockers':>9} {'2 x sim':>9} {'total':>9}   "
        f"{'1 x sim':>9} {'rank 0':>9} {'others':>9}   {'rank 0':>9} {'others':>9}"
    )
    for ranks in args.ranks:
        for strategy in STRATEGIES:
            print(row(model, probed, ranks, strategy, args.seeds, args.repeats), flush=True)
    print(
        "plan: in both totals. rank 0: a logged step (plan + one prediction); others: a rank that logs nothing "
        "(plan only). Steps 2 and 3 predict on rank 0 for the cost-model check; a logged step reuses that prediction."
    )


if __name__ == "__main__":
    main()
