"""`bytescale-compile inspect`: compile a model on one sequence and print what every pass did (`explain`), or,
with --pp, each pipeline stage compiled alone as pipelined training runs it."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from .arguments import CLIError, Subparsers, int_at_least
from .targets import factory_model, sample_inputs

if TYPE_CHECKING:
    from torch import nn

    from ..config import CompileConfig
    from ..engine.stages import StageSpec
    from ..passes.report import CompileReport

__all__ = ["register"]


def register(sub: Subparsers) -> None:
    p = sub.add_parser("inspect", help="compile a model on one sequence and print what every pass did")
    p.add_argument("target", help="MODULE:FACTORY returning an nn.Module, e.g. bytescale_compile.models.llama:small")
    p.add_argument(
        "--seq-len",
        type=int_at_least(2),
        default=512,
        help="tokens in the sample row, at least 2: a token and its target (default 512)",
    )
    p.add_argument("--vocab-size", type=int_at_least(1), default=None, help="when the model has no config.vocab_size")
    p.add_argument("--eval", action="store_true", help="compile in eval mode (the loss is not fused)")
    p.add_argument("--no-attention", action="store_true", help="switch the attention pass off")
    p.add_argument("--no-fused-loss", action="store_true", help="switch the fused-loss pass off")
    p.add_argument("--graphs", action="store_true", help="append the graphs before/after as text")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--pp",
        type=int_at_least(1),
        default=1,
        help="split into this many pipeline stages at decoder layers and report each stage's compilation",
    )
    p.set_defaults(func=cmd_inspect)


def cmd_inspect(args: argparse.Namespace) -> int:
    import torch

    from ..api import explain, optimize
    from ..config import CompileConfig

    torch.manual_seed(0)
    model = factory_model(args.target)
    model.train(not args.eval)
    config = CompileConfig(attention=not args.no_attention, fused_loss=not args.no_fused_loss)
    inputs = sample_inputs(model, args.seq_len, args.vocab_size)
    if args.pp > 1:
        return _inspect_stages(model, config, inputs, args)
    report = explain(optimize(model, config), **inputs)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.to_markdown(graphs=args.graphs))
    return 0


def _inspect_stages(model: nn.Module, config: CompileConfig, inputs: dict[str, Any], args: argparse.Namespace) -> int:
    """Each pipeline stage compiled alone (`compile_stages`), fed the previous stage's hidden states; one report
    per stage."""
    from ..engine.stages import UnsupportedModelError, compile_stages, split_stages

    try:
        stages = split_stages(model, args.pp)
    except (UnsupportedModelError, ValueError) as e:
        raise CLIError(f"--pp {args.pp}: {e}") from e
    reports = compile_stages(stages, config, {name: value for name, value in inputs.items() if name != "use_cache"})
    print(_stages_json(reports) if args.json else _stages_markdown(reports, graphs=args.graphs))
    return 0


def _stages_json(reports: list[tuple[StageSpec, CompileReport]]) -> str:
    stages = [
        {
            "stage": spec.index,
            "pp_size": spec.pp_size,
            "layers": [spec.layers.start, spec.layers.stop],
            "report": report.to_dict(),
        }
        for spec, report in reports
    ]
    return json.dumps(stages, indent=2)


def _stages_markdown(reports: list[tuple[StageSpec, CompileReport]], *, graphs: bool) -> str:
    return "\n".join(
        f"# Stage {spec.index} of {spec.pp_size}: decoder layers {spec.layers.start}-{spec.layers.stop - 1}"
        f"{', embedding' if spec.is_first else ''}{', final norm, lm_head and loss' if spec.is_last else ''}\n\n"
        + report.to_markdown(graphs=graphs)
        for spec, report in reports
    )
