"""`bytescale-compile plan` and `simulate`: plan one global batch, or simulate strategies over context lengths, on a
cost model (a preset or a profiled JSON file) of a cluster of HDP ranks. Neither imports torch."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from ..strategies import DEFAULT_SP, SP_MODES
from ..units import format_tokens
from .arguments import CLIError, Subparsers, created, int_at_least, output_file, size, sizes

if TYPE_CHECKING:
    import numpy as np

    from ..sim.experiments import Outcome

__all__ = ["register"]

DATASETS = ("byted", "github", "python")


class _HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default after its help; none for flags, nor where the help says what an unset option means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.nargs == 0:
            return action.help
        return super()._get_help_string(action)


class _Presets:
    """The cost-model presets, named in `--model`'s help only when help is printed: listing them at start-up would
    load the planner (and sympy) on every command."""

    def __str__(self) -> str:
        from ..planner.model_shape import PRESETS

        return ", ".join(PRESETS)


def _model_argument(p: argparse.ArgumentParser) -> None:
    action = p.add_argument(
        "--model", default="llama-7b", help="cost-model preset (%(presets)s) or a cost-model JSON file (profiled)"
    )
    action.presets = _Presets()  # type: ignore[attr-defined]


def _batch_arguments(p: argparse.ArgumentParser, *, dataset: str) -> None:
    p.add_argument(
        "--dataset",
        choices=DATASETS,
        default=dataset,
        help="the sampler of sequence lengths: byted, github (the paper's §3.1 statistics), python (this machine's "
        "installed Python sources)",
    )
    p.add_argument("--global-tokens", type=size, default="32M", help="tokens of the global batch, sampled")
    p.add_argument("--pp", type=int_at_least(1), default=1, help="pipeline stages per HDP rank")
    p.add_argument("--seed", type=int_at_least(0), default=0, help="seed of the length sampler")


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "plan",
        help="plan one global batch and print a summary or the plan JSON",
        formatter_class=_HelpWithDefaults,
    )
    _batch_arguments(p, dataset="byted")
    _add_cluster_arguments(p)
    p.add_argument("--strategy", default="balance", help="the planner's strategy (an unknown name lists them)")
    _model_argument(p)
    p.add_argument(
        "--context",
        type=size,
        default=None,
        help="context length: truncates longer samples, and is the static mesh's row (default: none, samples kept "
        "whole)",
    )
    p.add_argument(
        "--json", action="store_true", help="print the plan as JSON (the assumptions line goes to stderr then)"
    )
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser(
        "simulate",
        help="simulate strategies over context lengths and print tokens/s",
        formatter_class=_HelpWithDefaults,
    )
    _model_argument(p)
    _batch_arguments(p, dataset="github")
    p.add_argument(
        "--context", type=sizes, default="256K,512K,1M,2M", help="comma-separated context lengths, one batch each"
    )
    _add_cluster_arguments(p)
    p.add_argument(
        "--strategies",
        default="static,naive,balance",
        help="comma-separated planner strategies (an unknown name lists them)",
    )
    p.add_argument("--plot", default=None, help="write a throughput-vs-context PNG here (missing folders are created)")
    p.add_argument("--timeline", default=None, help="write per-rank timelines of the last context here (PNG)")
    p.set_defaults(func=cmd_simulate)


def _add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    """plan's and simulate's cluster: --ranks counts HDP ranks (the planner's world size), each a TP group of
    --tp GPUs of the --hardware preset, as `Hardware.preset` builds one rank, holding C tokens."""
    p.add_argument(
        "--ranks",
        type=int_at_least(1),
        default=1024,
        help="HDP ranks, the planner's world size; each is a TP group of --tp GPUs, so ranks x tp GPUs in all",
    )
    p.add_argument(
        "--hardware",
        default=None,
        help="cluster preset for the ranks: l20 | h100-nvlink (default: the hardware a --model JSON file saved, "
        "e.g. a calibrated topology, else private 25 GB/s links per rank; given with a JSON file, it replaces it)",
    )
    p.add_argument(
        "--tp",
        type=int_at_least(1),
        default=1,
        help="GPUs per HDP rank on the --hardware cluster (needed when > 1; must divide the GPUs per switch, or "
        "span whole switches of a node): "
        "each layer's TP all-reduces are charged on their intra-node links",
    )
    p.add_argument("--capacity", type=size, default="8K", help="tokens per HDP rank (its TP group's), C")
    p.add_argument(
        "--sp",
        choices=SP_MODES,
        default=DEFAULT_SP,
        help="how a sequence shared by D(s) ranks splits them u x r: ring (u = 1), ulysses (the largest u: an "
        "all-to-all over heads in groups of u ranks inside a node, the ring between the groups), auto (per "
        "micro-batch, the group size and split the cost model predicts fastest)",
    )


def _cost_model(name: str, hardware: str | None = None, tp: int = 1) -> Any:
    """A preset or profiled cost model; `hardware` puts its ranks on a cluster preset of TP `tp`, whose
    all-reduces T(s) charges on the cluster's intra-node links. TP > 1 without a cluster is refused: there
    is no link to charge them on, and ignoring --tp would plan a TP group as one GPU. A JSON file keeps its
    own hardware (a calibrated one its measured topology) unless --hardware is given: the flag wins, as a
    command-line flag does over a config file, and a note on stderr says what it replaced."""
    import dataclasses

    from ..planner import CostModel, Hardware

    if tp > 1 and not hardware:
        raise CLIError(
            f"--tp {tp} needs --hardware (l20 | h100-nvlink): the cluster preset gives the TP group's devices "
            f"and the intra-node link its all-reduces run on"
        )
    try:
        cluster = Hardware.preset(hardware, tp_size=tp) if hardware else None
    except ValueError as e:
        raise CLIError(f"--hardware {hardware} --tp {tp}: {e}") from e
    try:
        cost = CostModel.load(name) if name.endswith(".json") else CostModel.preset(name, cluster)
    except (OSError, ValueError) as e:
        raise CLIError(str(e)) from e
    if cluster and name.endswith(".json"):
        print(
            f"note: --hardware {hardware} replaces the hardware saved in {name} ({cost.hardware.name}: its links, "
            f"latency and compute slots); leave --hardware out to plan on the saved one",
            file=sys.stderr,
        )
        return dataclasses.replace(cost, hardware=cluster)
    return cost


def _check_layout(args: argparse.Namespace, cost_model: Any) -> None:
    """A pipeline deeper than the model's layers, refused before planning (the planner would give stages none)."""
    if args.pp > cost_model.layers:
        raise CLIError(
            f"--pp {args.pp} is larger than the model's {cost_model.layers} decoder layers: every pipeline stage "
            f"needs at least one layer"
        )


def _strategy(name: str) -> str:
    """A strategy `run_strategy` knows, checked before any planning or output."""
    from ..planner import STRATEGY_SPECS

    if name not in STRATEGY_SPECS:
        raise CLIError(f"unknown strategy {name!r}; strategies: {', '.join(STRATEGY_SPECS)}")
    return name


def _assumptions(args: argparse.Namespace, cost_model: Any, contexts: str) -> str:
    """Every figure the command assumed, in one line: what its numbers can be matched against."""
    hardware = cost_model.hardware
    topology = hardware.topology
    links = (
        f"nodes of {topology.ranks_per_node} ranks, {topology.rank_link / 1e9:.3g} GB/s inside a node, "
        f"{topology.rank_rail / 1e9:.3g} GB/s rails"
        if topology is not None
        else f"no topology: every rank its own {hardware.network_bandwidth / 1e9:.3g} GB/s link"
    )
    return (
        f"assumed: model {args.model} ({cost_model.source}); hardware {hardware.name} ({links}); {args.ranks} HDP "
        f"ranks x TP {args.tp}, C={format_tokens(args.capacity)}, pp {args.pp}, sp {args.sp}; batch: {args.dataset}, "
        f"{format_tokens(args.global_tokens)} global tokens, seed {args.seed}, context {contexts}"
    )


def _cluster(args: argparse.Namespace, cost_model: Any) -> dict[str, Any]:
    """`run_strategy`'s cluster arguments from plan's and simulate's options."""
    return {
        "world_size": args.ranks,
        "capacity": args.capacity,
        "cost_model": cost_model,
        "pp_size": args.pp,
        "sp": args.sp,
    }


def cmd_plan(args: argparse.Namespace) -> int:
    from ..planner import PlanError
    from ..sim.experiments import run_strategy
    from ..sim.lengths import sample_global_batch

    tokens, context, strategy = args.global_tokens, args.context, _strategy(args.strategy)
    cost_model = _cost_model(args.model, args.hardware, args.tp)
    _check_layout(args, cost_model)
    lens = sample_global_batch(args.dataset, tokens, seed=args.seed, max_len=context)
    try:
        outcome = run_strategy(strategy, lens, **_cluster(args, cost_model), context_length=context)
        outcome.plan.validate()
    except (PlanError, ValueError) as e:
        raise CLIError(str(e)) from e
    assumed = _assumptions(args, cost_model, format_tokens(context) if context else "none (samples kept whole)")
    if args.json:
        print(assumed, file=sys.stderr)
        print(outcome.plan.to_json())
    else:
        print("\n".join([assumed, *_summary(args, lens, outcome)]))
    return 0


def _summary(args: argparse.Namespace, lens: np.ndarray, outcome: Outcome) -> list[str]:
    """plan's lines: the batch and cluster, the micro-batches, the simulated step, and auto's choice."""
    mbs = outcome.plan.micro_batches
    shared = [m for m in mbs if m.shared]
    where = f"{args.ranks} HDP ranks" + (f" x TP {args.tp} ({args.ranks * args.tp} GPUs)" if args.tp > 1 else "")
    largest = max((len(m.ranks) for m in shared), default=1)
    lines = [
        f"{args.strategy}: {len(lens)} sequences, {int(lens.sum())} tokens over {where} (C={args.capacity})",
        f"  micro-batches: {len(mbs)} ({len(shared)} shared, largest group {largest})",
        f"  per-rank micro-batches: {min(map(len, outcome.plan.schedule))}..{max(map(len, outcome.plan.schedule))}",
    ]
    if shared:
        splits = outcome.plan.splits()
        lines.append(
            f"  shared splits u x r (--sp {args.sp}): "
            + ", ".join(f"{k} {n / len(shared):.0%}" for k, n in splits.items())
        )
    lines.append(
        f"  planned in {outcome.plan_seconds * 1e3:.1f} ms; simulated step {outcome.step_time:.3f} s, "
        f"{outcome.tokens_per_second:,.0f} tokens/s, busy spread {outcome.busy_spread:.2f}"
    )
    auto = outcome.plan.auto
    if auto is not None:
        over_static = auto.speedup_over_static
        lines.append(
            f"  auto chose {auto.chosen}: "
            + (f"{over_static:.2f}x static, " if over_static is not None else "static cannot plan this batch, ")
            + f"{auto.speedup_over_runner_up:.3f}x the runner-up; simulated step per candidate: "
            + ", ".join(f"{k} {v:.3f} s" for k, v in auto.step_time.items())
        )
    return lines


def cmd_simulate(args: argparse.Namespace) -> int:
    from ..planner import PlanError
    from ..sim.experiments import run_strategy
    from ..sim.lengths import sample_global_batch
    from ..sim.timeline import plot_throughput, plot_timelines

    plot = output_file(args.plot, "--plot") if args.plot else None
    timeline = output_file(args.timeline, "--timeline") if args.timeline else None
    tokens, contexts = args.global_tokens, args.context
    strategies = [_strategy(s) for s in args.strategies.split(",") if s]
    cost_model = _cost_model(args.model, args.hardware, args.tp)
    _check_layout(args, cost_model)
    table: dict[str, list[float]] = {s: [] for s in strategies}
    print(_assumptions(args, cost_model, ",".join(format_tokens(c) for c in contexts)))
    print(f"{'context':>8} " + " ".join(f"{s + ' tok/s':>22}" for s in strategies) + "   speedup over first")
    last: list[Outcome] = []
    for context in contexts:
        lens = sample_global_batch(args.dataset, tokens, seed=args.seed, max_len=context)
        try:
            last = [run_strategy(s, lens, **_cluster(args, cost_model), context_length=context) for s in strategies]
        except (PlanError, ValueError) as e:
            raise CLIError(str(e)) from e
        for o in last:
            table[o.name].append(o.tokens_per_second)
        speedups = " ".join(f"{o.tokens_per_second / last[0].tokens_per_second:.2f}x" for o in last)
        print(f"{context // 1024:>7}K " + " ".join(f"{o.tokens_per_second:>22,.0f}" for o in last) + f"   {speedups}")
    if plot:
        plot_throughput(contexts, table, str(created(plot)), title=f"{args.model}, {args.dataset}, {args.ranks} ranks")
        print(f"throughput plot: {plot}")
    if timeline and last:
        plot_timelines(
            [o.timeline for o in last],
            str(created(timeline)),
            title=f"{args.model}, {args.dataset}, context {contexts[-1] // 1024}K, {args.ranks} ranks",
        )
        print(f"timelines: {timeline}")
    return 0
