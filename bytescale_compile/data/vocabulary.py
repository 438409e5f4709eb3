"""The vocabulary of a dataset whose files do not record it, from the options of its `--data` item
(`spec.DataItem`): a size, or the tokenizer directory the data was made with."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .dataset import DatasetError, TokenizerInfo
from .tokenizer import load_tokenizer

__all__ = ["Vocabulary", "resolve_vocabulary"]


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
