"""`bytescale-compile export`: write a training checkpoint as a Hugging Face model directory (`train/export.py`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .arguments import CLIError, Subparsers, output_folder

__all__ = ["register"]


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "export",
        help="write a training checkpoint as a Hugging Face model directory (save_pretrained in fp32, with the "
        "tokenizer), as final/ is written at the end of a run",
    )
    p.add_argument(
        "checkpoint",
        metavar="CHECKPOINT",
        help="a checkpoint directory (RUN/checkpoints/step_N), or a run's --out: its newest checkpoint that "
        "verifies against its sha256 manifest",
    )
    p.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="the directory to write; AutoModelForCausalLM.from_pretrained loads it",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="the tokenizer to save with it (default: the run's --tokenizer, else the one its data was prepared with)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="write into a DIR that holds files (same names are replaced)"
    )
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from ..train.export import ExportError, export_checkpoint

    output_folder(Path(args.out), "--out", args.out)
    try:
        result = export_checkpoint(args.checkpoint, args.out, args.tokenizer, args.overwrite)
    except ExportError as e:
        raise CLIError(str(e)) from e
    print(result.summary())
    return 0
