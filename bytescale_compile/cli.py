"""`bytescale-compile`: command-line entry points (`inspect` now; plan, simulate, profile as they land)."""

from __future__ import annotations

import argparse
import importlib
import inspect as pyinspect
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .api import explain, optimize
from .config import Config

__all__ = ["main"]


class CLIError(Exception):
    """A command-line argument that cannot be used, with what to pass instead."""


def load_factory(spec: str) -> nn.Module:
    """`package.module:factory` → the model the factory builds (the current directory is importable)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise CLIError(f"expected MODULE:FACTORY (e.g. examples.models.llama:small), got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise CLIError(f"cannot import module {module_name!r}: {e}") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise CLIError(f"{module_name} has no callable {attr!r}")
    model = factory()
    if not isinstance(model, nn.Module):
        raise CLIError(f"{spec} returned {type(model).__name__}, not an nn.Module")
    return model


def protocol_inputs(model: nn.Module, seq_len: int, vocab_size: int | None = None) -> dict[str, Any]:
    """One packed row of the causal-LM protocol; Hugging Face extras only where forward takes them."""
    config = getattr(model, "config", None)
    vocab = vocab_size or getattr(config, "vocab_size", None)
    if vocab is None:
        raise CLIError("the model has no config.vocab_size: pass --vocab-size")
    ids = torch.randint(0, vocab, (1, seq_len))
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    inputs: dict[str, Any] = {"input_ids": ids, "position_ids": torch.arange(seq_len)[None],
                              "shift_labels": labels, "num_items_in_batch": torch.tensor(seq_len - 1)}
    params = pyinspect.signature(model.forward).parameters
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    missing = [name for name in inputs if name not in params and not takes_kwargs]
    if missing:
        raise CLIError(f"{type(model).__name__}.forward does not take {missing}: inspect calls models with the "
                       f"causal-LM protocol (input_ids, position_ids, shift_labels, num_items_in_batch)")
    if "labels" in params:
        inputs["labels"] = labels
    if "use_cache" in params:
        inputs["use_cache"] = False
    return inputs


def cmd_inspect(args: argparse.Namespace) -> int:
    if args.seq_len < 2:
        raise CLIError(f"--seq-len must be at least 2 (one token and its target), got {args.seq_len}")
    torch.manual_seed(0)
    model = load_factory(args.target)
    model.train(not args.eval)
    config = Config(attention=not args.no_attention, fused_loss=not args.no_fused_loss)
    report = explain(optimize(model, config), **protocol_inputs(model, args.seq_len, args.vocab_size))
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.to_markdown(graphs=args.graphs))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bytescale-compile", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="compile a model on one sequence and print what every pass did")
    p.add_argument("target", help="MODULE:FACTORY returning an nn.Module, e.g. examples.models.llama:small")
    p.add_argument("--seq-len", type=int, default=512, help="tokens in the sample row (default 512)")
    p.add_argument("--vocab-size", type=int, default=None, help="when the model has no config.vocab_size")
    p.add_argument("--eval", action="store_true", help="compile in eval mode (the loss is not fused)")
    p.add_argument("--no-attention", action="store_true", help="switch the attention pass off")
    p.add_argument("--no-fused-loss", action="store_true", help="switch the fused-loss pass off")
    p.add_argument("--graphs", action="store_true", help="append the graphs before/after as text")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_inspect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CLIError as e:
        print(f"bytescale-compile {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
