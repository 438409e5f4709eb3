"""PP-balance at 1024 GPUs for LLaMA-70B, simulated: what its balancing buys over the same micro-batches
dealt without it, over static DP x CP and over naive HDP.

Setup (the paper's PP setting, §6.1 and Table "models"): LLaMA-70B (80 layers, hidden 8192) at TP 8, on
the H100 NVLink cluster preset (`Hardware.preset("h100-nvlink", tp_size=8)`: the L20 preset's TP group
must fit its 4-GPU PCIe switch, and the paper hides its production cluster), so 1024 GPUs are
128 ranks = HDP x PP: 32 pipelines at pp = 4, 16 at pp = 8. Each HDP rank holds C = 8K x pp tokens (a stage holds 1/pp of the
layers: the convention of benchmarks/planner.py section 5); 32M tokens per step (the paper's global
batch), GitHub-like and Byted-like lengths (`sim.lengths`) up to the context length.

Per setting it prints, for each plan, the simulated step time (`sim.simulator.step_time`, stage-to-stage
sends charged), the mean 1F1B bubble rate over pipelines and its first-order estimate (`bubble_rates`),
the number of micro-batches, and how many shared micro-batches are chained (`chained_micro_batches`):
  balance    PP-balance (`plan(..., strategy="balance", pp_size=pp)`);
  unbalanced PP-balance's own micro-batches dealt without its balancing (`deal_unbalanced`): every
             shared micro-batch (a ring over several pipelines) stays on its ranks, each one-rank
             micro-batch goes to the next pipeline round-robin (pipeline 0, 1, ..., in the order the
             micro-batches were created, i.e. by id), and every pipeline runs its micro-batches by id.
             Ids follow creation, so all pipelines run the shared ones in one order (the plan stays
             valid, and chains stay chained, each in the order PP-balance placed its sequences,
             longest first) and the packed ones, created last, after them. What is lost is where
             PP-balance put each one-rank micro-batch (on the least-loaded pipeline, in the idle
             gaps before a chain) and its short-long-short order per pipeline;
  static     the DP x CP mesh (`strategy="static"`, the context length as its row);
  naive      naive HDP (Alg. 1 with offloading, `strategy="naive"`).
Every plan passes `Plan.validate()` before it is simulated.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bytescale_compile.planner import CostModel, Hardware, Plan, plan  # noqa: E402
from bytescale_compile.planner.pipeline_order import chained_micro_batches  # noqa: E402
from bytescale_compile.sim.lengths import sample_global_batch  # noqa: E402
from bytescale_compile.sim.simulator import bubble_rates, step_time  # noqa: E402
from bytescale_compile.units import parse_size  # noqa: E402

K = 2**10
GPUS, TP, MODEL, HARDWARE = 1024, 8, "llama-70b", "h100-nvlink"
CAPACITY_PER_STAGE = 8 * K
"""Tokens a rank holds with the whole model; a pipeline stage holds pp times as many."""
STRATEGIES = ("balance", "unbalanced", "static", "naive")


def deal_unbalanced(balanced: Plan) -> Plan:
    """`balanced`'s micro-batches without its balancing: shared ones on their own ranks, one-rank ones dealt
    round-robin to the pipelines by id, every pipeline running its micro-batches by id (see the module
    docstring). Sequences, micro-batch contents, offload ratios and estimates are unchanged."""
    pipelines, dealt, micro_batches = balanced.world_size, 0, []
    for m in sorted(balanced.micro_batches, key=lambda m: m.id):
        if not m.shared:
            m = dataclasses.replace(m, ranks=(dealt % pipelines,))
            dealt += 1
        micro_batches.append(m)
    schedule: list[list[int]] = [[] for _ in range(pipelines)]
    for m in micro_batches:
        for r in m.ranks:
            schedule[r].append(m.id)
    return dataclasses.replace(balanced, micro_batches=micro_batches, schedule=schedule)


def plans(lens, pipelines: int, capacity: int, cost: CostModel, pp: int, context: int) -> dict[str, Plan]:
    """The four plans of one setting, each validated."""
    balance = plan(lens, world_size=pipelines, capacity=capacity, cost_model=cost, strategy="balance", pp_size=pp)
    built = {
        "balance": balance,
        "unbalanced": deal_unbalanced(balance),
        "static": plan(
            lens,
            world_size=pipelines,
            capacity=capacity,
            cost_model=cost,
            strategy="static",
            pp_size=pp,
            context_length=context,
        ),
        "naive": plan(lens, world_size=pipelines, capacity=capacity, cost_model=cost, strategy="naive", pp_size=pp),
    }
    for p in built.values():
        p.validate()
    return built


def report(cost: CostModel, pps: list[int], datasets: list[str], contexts: list[int], tokens: int, seed: int) -> None:
    print(
        f"{MODEL}, {GPUS} GPUs = TP {TP} x {GPUS // TP} ranks (HDP x PP), {HARDWARE} preset, "
        f"{tokens / 2**20:g}M tokens per step, seed {seed}"
    )
    print(
        f"{'pp':>3} {'HDP':>4} {'C':>5} {'data':>7} {'context':>8} {'plan':>11} {'step s':>8} {'vs static':>9} "
        f"{'bubble':>7} {'1st ord':>7} {'mbs':>5} {'shared':>6} {'chained':>7}"
    )
    for pp in pps:
        pipelines, capacity = GPUS // TP // pp, CAPACITY_PER_STAGE * pp
        for dataset in datasets:
            for context in contexts:
                lens = sample_global_batch(dataset, tokens, seed=seed, max_len=context)
                built = plans(lens, pipelines, capacity, cost, pp, context)
                steps = {name: step_time(p, cost) for name, p in built.items()}
                for name, p in built.items():
                    bubble, first = bubble_rates(p, cost)
                    shared = sum(m.shared for m in p.micro_batches)
                    print(
                        f"{pp:>3} {pipelines:>4} {capacity // K:>4}K {dataset:>7} {context // K:>7}K {name:>11} "
                        f"{steps[name]:>8.2f} {steps['static'] / steps[name]:>8.2f}x {bubble:>7.3f} {first:>7.3f} "
                        f"{len(p.micro_batches):>5} {shared:>6} {len(chained_micro_batches(p)):>7}"
                    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, nargs="+", default=[4, 8], help="pipeline depths (each divides 128)")
    parser.add_argument("--datasets", nargs="+", default=["github", "byted"])
    parser.add_argument("--contexts", nargs="+", default=["256K", "1M"], help="context lengths, e.g. 256K 512K")
    parser.add_argument("--tokens", default="32M", help="tokens per step")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    bad = [pp for pp in args.pp if pp < 1 or (GPUS // TP) % pp]
    if bad:
        parser.error(f"--pp {bad} must divide the {GPUS // TP} ranks of TP {TP}")
    cost = CostModel.preset(MODEL, Hardware.preset(HARDWARE, tp_size=TP))
    report(cost, args.pp, args.datasets, [parse_size(c) for c in args.contexts], parse_size(args.tokens), args.seed)


if __name__ == "__main__":
    main()
