"""What `--data` says: the datasets, each a path with the options its format needs, and their weights.

Read before torch loads (the trainer checks its settings first), so this module imports the standard library
only. Megatron's `.bin`/`.idx` and Hugging Face `datasets` hold token ids but not the vocabulary they index, so
an item may carry it after a `?`, as in a URL: `PATH?vocab_size=50304`, `PATH?tokenizer=DIR` (its size and
identity from the tokenizer directory), `PATH?column=tokens` (the token-id column of Arrow/Parquet/JSON data,
default `input_ids`), joined by `&`. Our own format records all of it and takes no options. Several datasets
are mixed by weight: `a:0.7,b:0.3` (`mixture.py`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DEFAULT_COLUMN",
    "OPTIONS",
    "DataItem",
    "DatasetError",
    "dataset_files",
    "format_data_spec",
    "parse_data_spec",
]


class DatasetError(ValueError):
    """A dataset file that is truncated, corrupt or inconsistent with the others; names the file."""


def _file(prefix: Path, ext: str) -> Path:
    """`<prefix>.<ext>`, appended rather than `with_suffix`, so prefixes may contain dots."""
    return prefix.with_name(f"{prefix.name}.{ext}")


def dataset_files(prefix: str | Path) -> tuple[Path, Path, Path]:
    """The metadata, index and token files of the dataset at `prefix`, in that order."""
    prefix = Path(prefix)
    return _file(prefix, "json"), _file(prefix, "idx"), _file(prefix, "bin")


DEFAULT_COLUMN = "input_ids"
"""What Hugging Face tokenizers name the ids, and so most tokenized datasets."""
OPTIONS = ("vocab_size", "tokenizer", "column")


@dataclass(frozen=True)
class DataItem:
    """One dataset of `--data`: where it is, and the options its format needs (None: not given)."""

    path: str
    vocab_size: int | None = None
    tokenizer: str | None = None
    """A local tokenizer directory, made absolute on parsing: it is read on every rank and on resume."""
    column: str | None = None

    @classmethod
    def parse(cls, text: str) -> DataItem:
        """`PATH` or `PATH?key=value&key=value` (keys in `OPTIONS`). A tail after the last '?' without '='
        is part of the path."""
        path, mark, query = text.rpartition("?")
        if not mark or "=" not in query:
            return cls(text)
        options: dict[str, str] = {}
        for pair in query.split("&"):
            key, equals, value = pair.partition("=")
            key, value = key.strip(), value.strip()
            if not equals or key not in OPTIONS or not value:
                raise DatasetError(
                    f"--data {text}: option {pair!r} is not KEY=VALUE with KEY one of {list(OPTIONS)} "
                    f"(e.g. {path}?vocab_size=50304)"
                )
            if key in options:
                raise DatasetError(f"--data {text}: option {key!r} given twice")
            options[key] = value
        vocab_size = options.get("vocab_size")
        if vocab_size is not None and not (vocab_size.isdigit() and int(vocab_size) >= 1):
            raise DatasetError(f"--data {text}: vocab_size must be an integer >= 1, got {vocab_size!r}")
        tokenizer = options.get("tokenizer")
        return cls(
            path,
            None if vocab_size is None else int(vocab_size),
            None if tokenizer is None else os.path.abspath(tokenizer),
            options.get("column"),
        )

    def __str__(self) -> str:
        """The text `parse` reads back as this item."""
        values = {"vocab_size": self.vocab_size, "tokenizer": self.tokenizer, "column": self.column}
        query = "&".join(f"{key}={value}" for key, value in values.items() if value is not None)
        return f"{self.path}?{query}" if query else self.path

    @property
    def options(self) -> list[str]:
        """The names of the options given."""
        return [key for key in OPTIONS if getattr(self, key) is not None]


_ACCEPTED = "expected PREFIX, or PREFIX:WEIGHT,PREFIX:WEIGHT,... with every weight a number > 0"
_NORMALISED = 1e-9
"""Weights summing to 1 within this are kept as written: dividing by a sum an ulp off 1 would change the spec
`format_data_spec` writes each time it is read back (a saved run's config must read back unchanged)."""


def parse_data_spec(spec: str) -> list[tuple[str, float]]:
    """`PREFIX` or `a:0.7,b:0.3` as (prefix, weight) pairs, the weights normalised to sum 1. A prefix may carry
    options (`PATH?vocab_size=N`, `options.DataItem`), checked and written back normalised.

    An item splits at its last ':' only where a number follows: a path with a ':' (a Windows drive, an
    odd file name) stays whole. Either every item has a weight or none has (equal shares)."""
    items = [item.strip() for item in spec.split(",")]
    if not all(items):
        raise DatasetError(f"--data {spec}: empty item; {_ACCEPTED}")
    parsed = [(str(DataItem.parse(prefix)), weight) for prefix, weight in (_parse_item(spec, item) for item in items)]
    unweighted = [prefix for prefix, weight in parsed if weight is None]
    if unweighted and len(unweighted) < len(parsed):
        raise DatasetError(f"--data {spec}: {unweighted} have no weight; give every dataset a weight or none")
    seen: set[Path] = set()
    for prefix, _ in parsed:
        if Path(prefix) in seen:
            raise DatasetError(f"--data {spec}: dataset {prefix!r} given twice; name each dataset once")
        seen.add(Path(prefix))
    weights = [1.0 if weight is None else weight for _, weight in parsed]
    total = math.fsum(weights)
    if abs(total - 1) > _NORMALISED:
        weights = [weight / total for weight in weights]
    return [(prefix, weight) for (prefix, _), weight in zip(parsed, weights)]


def format_data_spec(items: Sequence[tuple[str, float]]) -> str:
    """The spec `parse_data_spec` reads back as `items`: one prefix alone as itself; otherwise each with its
    weight, which also keeps a prefix containing ':' whole."""
    for prefix, _ in items:
        if "," in prefix:
            raise DatasetError(f"dataset prefix {prefix!r} contains ',', which separates the datasets of --data")
    if len(items) == 1 and ":" not in items[0][0]:
        return items[0][0]
    return ",".join(f"{prefix}:{weight!r}" for prefix, weight in items)


def _parse_item(spec: str, item: str) -> tuple[str, float | None]:
    prefix, colon, tail = item.rpartition(":")
    if not colon or dataset_files(item)[0].is_file():  # a dataset whose name has a ':' stays whole
        return item, None
    prefix, tail = prefix.strip(), tail.strip()
    try:
        weight = float(tail)
    except ValueError:
        if "/" in tail or "\\" in tail:
            return item, None
        raise DatasetError(
            f"--data {spec}: weight of {prefix!r} must be a number > 0, got {tail!r} "
            f"(nor is {item!r} a dataset prefix); {_ACCEPTED}"
        ) from None
    if not prefix:
        raise DatasetError(f"--data {spec}: item {item!r} has a weight but no dataset prefix; {_ACCEPTED}")
    if not (math.isfinite(weight) and weight > 0):
        raise DatasetError(f"--data {spec}: weight of {prefix!r} must be a number > 0, got {tail!r}; {_ACCEPTED}")
    return prefix, weight
