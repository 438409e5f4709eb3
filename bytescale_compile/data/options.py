"""What one dataset of `--data` says besides its path: the options of formats that do not record them.

Megatron's `.bin`/`.idx` and Hugging Face `datasets` hold token ids but not the vocabulary they index, so an
item may carry it after a `?`, as in a URL: `PATH?vocab_size=50304`, `PATH?tokenizer=DIR` (its size and
identity from the tokenizer directory), `PATH?column=tokens` (the token-id column of Arrow/Parquet/JSON
data, default `input_ids`), joined by `&`. Our own format records all of it and takes no options.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .dataset import DatasetError, TokenizerInfo
from .tokenizer import load_tokenizer

__all__ = ["DEFAULT_COLUMN", "OPTIONS", "DataItem", "Vocabulary", "resolve_vocabulary"]

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


@dataclass(frozen=True)
class Vocabulary:
    """The ids a dataset may hold (0..size-1) and, when known, the tokenizer that made them."""

    size: int
    tokenizer: TokenizerInfo | None = None


def resolve_vocabulary(data: Path, vocab_size: int | None, tokenizer: str | Path | None) -> Vocabulary:
    """The vocabulary of a dataset at `data` whose files do not record it: `vocab_size`, else the size of the
    tokenizer directory `tokenizer`; both given, `vocab_size` may exceed the tokenizer's (Megatron pads the
    embedding to a multiple of 128) but not fall short of it."""
    if vocab_size is not None and vocab_size < 1:
        raise DatasetError(f"{data}: vocab_size must be >= 1, got {vocab_size}")
    if tokenizer is None:
        if vocab_size is None:
            raise DatasetError(
                f"{data}: its files do not record the vocabulary the token ids index: give it as "
                f"'{data}?vocab_size=N', or name the tokenizer the data was made with as '{data}?tokenizer=DIR'"
            )
        return Vocabulary(vocab_size)
    loaded = load_tokenizer(tokenizer)
    if vocab_size is not None and vocab_size < loaded.vocab_size:
        raise DatasetError(
            f"{data}: vocab_size {vocab_size} is smaller than the {loaded.vocab_size} ids of tokenizer {tokenizer}"
        )
    return Vocabulary(loaded.vocab_size if vocab_size is None else vocab_size, loaded.info)
