"""`bytescale-compile tokenizer train`, `data prepare` and `data check`: train a tokenizer on your own text, prepare
token datasets from it, and check any dataset's token ids against a vocabulary (`bytescale_compile.data`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from .arguments import CLIError, Subparsers, int_at_least, output_folder

if TYPE_CHECKING:
    from ..data import TokenDataset

__all__ = ["register"]


def register(sub: Subparsers) -> None:
    inputs = "JSONL/JSON/Parquet/text files, directories of them, or `datasets` directories (save_to_disk)"
    tokenizer = sub.add_parser("tokenizer", help="train a tokenizer on your own text").add_subparsers(
        dest="action", required=True
    )
    p = tokenizer.add_parser(
        "train",
        help="train a byte-level BPE; AutoTokenizer.from_pretrained(OUT) loads it "
        "(special tokens: <|endoftext|> = EOS, <|pad|> = pad)",
    )
    p.add_argument("--input", nargs="+", required=True, metavar="PATH", help=inputs)
    p.add_argument("--vocab-size", type=int, required=True, help="at most this many tokens (>= 258)")
    p.add_argument("--out", required=True, metavar="DIR", help="the tokenizer directory to write")
    p.add_argument("--text-field", default="text", help="the record field holding the text (default text)")
    p.add_argument(
        "--min-frequency", type=int_at_least(1), default=2, help="merge only pairs seen this often (default 2)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace a tokenizer already in DIR")
    p.set_defaults(func=cmd_tokenizer_train)

    data = sub.add_parser("data", help="prepare token datasets from your own text, check any").add_subparsers(
        dest="action", required=True
    )
    p = data.add_parser(
        "prepare",
        help="tokenize text into PREFIX.{bin,idx,json} (training) and PREFIX_eval.{bin,idx,json} (held-out split)",
    )
    p.add_argument("--input", nargs="+", required=True, metavar="PATH", help=inputs)
    p.add_argument("--tokenizer", required=True, metavar="DIR", help="a Hugging Face tokenizer directory with an EOS")
    p.add_argument("--out", required=True, metavar="PREFIX", help="dataset prefix; the eval split goes to PREFIX_eval")
    p.add_argument("--text-field", default="text", help="the record field holding the text (default text)")
    p.add_argument("--workers", type=int_at_least(1), default=1, help="tokenizing processes (default 1)")
    p.add_argument("--max-len", type=int, default=None, help="tokens per document at most, EOS included")
    p.add_argument(
        "--long-docs",
        choices=("split", "drop"),
        default="split",
        help="what happens to documents over --max-len (default split)",
    )
    p.add_argument(
        "--eval-fraction",
        type=float,
        default=0.01,
        help="share of documents held out for evaluation (default 0.01; 0: no eval split)",
    )
    p.add_argument("--seed", type=int_at_least(0), default=0, help="draws the eval split (default 0)")
    p.add_argument("--overwrite", action="store_true", help="replace existing datasets at PREFIX and PREFIX_eval")
    p.set_defaults(func=cmd_data_prepare)
    p = data.add_parser(
        "check",
        help="open --data as training does (converting Parquet/JSON Lines once) and check every token id against "
        "the vocabulary",
    )
    p.add_argument(
        "--data",
        required=True,
        metavar="SPEC",
        help="as training's --data: PREFIX, PATH?vocab_size=N, PATH?tokenizer=DIR, or a mixture a:0.7,b:0.3",
    )
    against = p.add_mutually_exclusive_group()
    against.add_argument(
        "--vocab-size",
        type=int_at_least(1),
        default=None,
        help="hold every id against this vocabulary (a model's embedding rows) instead of the dataset's own",
    )
    against.add_argument(
        "--model", metavar="DIR", default=None, help="hold every id against the vocab_size of DIR/config.json"
    )
    p.set_defaults(func=cmd_data_check)


_DATA_ERRORS = (OSError, ValueError)
"""What the tokenizer and data commands report as usage errors: missing, unreadable or existing paths,
bad inputs (SourceError, TokenizerError and DatasetError are ValueErrors) and bad options; each names
the path or option to fix."""


def cmd_tokenizer_train(args: argparse.Namespace) -> int:
    from ..data import train_tokenizer

    if Path(args.out).is_file():
        raise CLIError(f"--out {args.out} is a file; give the tokenizer directory to write")
    output_folder(Path(args.out), "--out", args.out)
    try:
        trained = train_tokenizer(
            args.input,
            args.vocab_size,
            args.out,
            text_field=args.text_field,
            min_frequency=args.min_frequency,
            overwrite=args.overwrite,
            progress=True,
        )
    except _DATA_ERRORS as e:
        raise CLIError(str(e)) from e
    print(trained.summary())
    return 0


def cmd_data_prepare(args: argparse.Namespace) -> int:
    from ..data import prepare

    output_folder(Path(args.out).parent, "--out", args.out)
    try:
        report = prepare(
            args.input,
            args.tokenizer,
            args.out,
            text_field=args.text_field,
            workers=args.workers,
            max_len=args.max_len,
            long_docs=args.long_docs,
            eval_fraction=args.eval_fraction,
            seed=args.seed,
            overwrite=args.overwrite,
            progress=True,
        )
    except _DATA_ERRORS as e:
        raise CLIError(str(e)) from e
    print(report.summary())
    return 0


def cmd_data_check(args: argparse.Namespace) -> int:
    from ..data import MixedDataset, open_data

    try:
        vocab, of = _checked_vocabulary(args.vocab_size, args.model)
        data, _ = open_data(args.data)
        for part in data.parts if isinstance(data, MixedDataset) else (data,):
            print(_checked_part(part, vocab, of))
    except _DATA_ERRORS as e:
        raise CLIError(str(e)) from e
    return 0


def _checked_part(part: TokenDataset, vocab: int | None, of: str) -> str:
    """One dataset's line, once every id of it is found below `vocab` (None: the vocabulary it declares), which
    `of` says where it comes from; the first id outside is an error naming where it is."""
    low, high = part.id_range()
    if vocab is None and (low < 0 or high >= part.vocab_size):
        part.check_tokens()  # names the file and byte of the first id outside its declared vocabulary
    elif vocab is not None and (low < 0 or high >= vocab):
        found = part.first_outside(vocab)
        assert found is not None  # id_range saw one
        raise CLIError(
            f"{part.spec}: sequence {found.sequence} holds token id {found.token} at position "
            f"{found.position} (ids {low} to {high} in all), outside the vocabulary of {vocab} ({of}; the "
            f"dataset declares vocab_size {part.vocab_size}): give the vocabulary the data was tokenized "
            "with (PATH?vocab_size=N or PATH?tokenizer=DIR) and a model whose vocab_size covers it"
        )
    tokenizer = "none" if part.tokenizer is None else part.tokenizer.name_or_path
    below = f"{vocab} ({of}; the dataset declares {part.vocab_size})" if vocab else str(part.vocab_size)
    return (
        f"{part.spec}: {len(part)} sequences, {int(part.lengths.sum())} tokens ({part.dtype}), max id {high}, "
        f"every id below vocab_size {below}; tokenizer {tokenizer}; {part.source}"
    )


def _checked_vocabulary(vocab_size: int | None, model: str | None) -> tuple[int | None, str]:
    """The vocabulary size `data check` holds the ids against, and where it comes from: --vocab-size, the
    `vocab_size` of --model's config.json, or (None) each dataset's own."""
    if vocab_size is not None:
        return vocab_size, "--vocab-size"
    if model is None:
        return None, "the dataset's"
    path = Path(model) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise CLIError(f"--model {model}: cannot read {path} ({e}): give a Hugging Face model directory") from e
    vocab = config.get("vocab_size", config.get("text_config", {}).get("vocab_size"))
    if not isinstance(vocab, int) or vocab < 1:
        raise CLIError(f"--model {model}: {path} has no vocab_size: pass --vocab-size")
    return vocab, f"model {model}"
