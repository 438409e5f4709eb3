"""Token ids in Parquet or JSON Lines files (what `load_dataset("parquet" | "json", data_files=...,
streaming=True)` reads), converted once into our own format and then memory-mapped like a prepared dataset.

A stream does not fit training by token budget: drawing and planning a global batch needs every sequence's
length up front and any sequence on demand, and Parquet's compressed pages make a random read cost a page's
decode. So, as `datasets` builds its Arrow cache on the first `load_dataset`, the first open converts the
token column into `<cache>/<name>-<key>/<name>` (.json/.idx/.bin). The key hashes the files' paths, sizes and
modification times, the column and the vocabulary: later opens and the other ranks reuse the conversion, and
a changed file gets a new one. One process converts while the others wait on a lock; it writes beside the
cache entry and renames it into place, so a conversion that dies leaves nothing that opens. The cache is
`$BYTESCALE_DATA_CACHE`, else `~/.cache/bytescale_compile/data`; entries are never evicted (delete them).

Rows become sequences in file order, empty rows included, so that sequence i is row i; ids are checked
against the vocabulary while converting.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from .dataset import DatasetWriter, TokenDataset
from .hf_datasets import TokenLists, token_lists
from .spec import DatasetError, dataset_files
from .vocabulary import Vocabulary

__all__ = ["CACHE_ENV", "TOKEN_FILE_SUFFIXES", "cache_dir", "convert_token_files"]

CACHE_ENV = "BYTESCALE_DATA_CACHE"
TOKEN_FILE_SUFFIXES = {".parquet": "Parquet", ".jsonl": "JSON Lines", ".ndjson": "JSON Lines", ".json": "JSON Lines"}
"""File suffixes converted, and their format (JSON: one record per line, as `datasets` reads `.json` files too)."""
_BATCH_ROWS = 65536
_CONVERSION = 1
"""Part of the cache key: raised whenever a conversion would write something else."""


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "bytescale_compile" / "data")


def convert_token_files(
    files: Sequence[Path], name: str, vocabulary: Vocabulary, column: str, cache: Path | None = None
) -> TokenDataset:
    """The token column of `files` (Parquet or JSON Lines, in this order) as a dataset of our own format in
    `cache` (default `cache_dir()`), converted on the first call (module docstring)."""
    cache = cache_dir() if cache is None else cache
    entry = f"{name}-{_key(files, vocabulary, column)}"
    prefix = cache / entry / name
    if not dataset_files(prefix)[0].is_file():
        try:
            cache.mkdir(parents=True, exist_ok=True)
            with _locked(cache / f"{entry}.lock"):
                if not dataset_files(prefix)[0].is_file():
                    _convert(files, column, vocabulary, cache / f".{entry}.tmp", name)
                    shutil.rmtree(cache / entry, ignore_errors=True)  # an entry whose metadata was deleted
                    os.rename(cache / f".{entry}.tmp", cache / entry)
        except PermissionError as e:
            raise DatasetError(f"cannot write the conversion of {name} into {cache} ({e}): set {CACHE_ENV}") from e
    return TokenDataset.open(prefix)


def _key(files: Sequence[Path], vocabulary: Vocabulary, column: str) -> str:
    stats = [(str(path.resolve()), path.stat().st_size, path.stat().st_mtime_ns) for path in files]
    tokenizer = None if vocabulary.tokenizer is None else vocabulary.tokenizer.to_dict()
    identity = [_CONVERSION, column, vocabulary.size, tokenizer, stats]
    return hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:16]


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _convert(files: Sequence[Path], column: str, vocabulary: Vocabulary, directory: Path, name: str) -> None:
    shutil.rmtree(directory, ignore_errors=True)  # what a conversion that died left
    shown = ", ".join(map(str, files[:5])) + (f" and {len(files) - 5} more" if len(files) > 5 else "")
    with DatasetWriter(directory / name, vocabulary.size, vocabulary.tokenizer) as writer:
        for path in files:
            row = 0
            for lists in _token_lists(path, column):
                _check_vocabulary(lists, vocabulary.size, path, row)
                writer.extend(lists.values, lists.offsets)
                row += len(lists.offsets) - 1
        formats = " and ".join(sorted({_format(path) for path in files}))
        writer.finish(f"{shown}, column {column!r}, converted from {formats}")


def _check_vocabulary(lists: TokenLists, vocab_size: int, path: Path, first_row: int) -> None:
    """Ids outside the vocabulary, named by their file and row (the writer would name its own files)."""
    ids = lists.values[lists.offsets[0] : lists.offsets[-1]]
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        at = int(np.flatnonzero((ids < 0) | (ids >= vocab_size))[0]) + int(lists.offsets[0])
        row = first_row + int(np.searchsorted(lists.offsets, at, side="right")) - 1
        raise DatasetError(
            f"{path}: row {row}: token id {lists.values[at]} is outside the vocabulary 0..{vocab_size - 1}"
        )


def _token_lists(path: Path, column: str) -> Iterator[TokenLists]:
    """The token column of one file, a record batch at a time."""
    import pyarrow as pa

    try:
        if _format(path) == "Parquet":
            import pyarrow.parquet as pq

            table = pq.ParquetFile(path)
            names = table.schema_arrow.names
            batches = (
                (b.column(0) for b in table.iter_batches(_BATCH_ROWS, columns=[column])) if column in names else None
            )
        else:
            import pyarrow.json as pj

            whole = pj.read_json(path)
            names = whole.column_names
            batches = iter(whole.column(column).chunks) if column in names else None
        if batches is None:
            raise DatasetError(
                f"{path}: no column {column!r} (it has {names}): name the token-id column as 'PATH?column=NAME'"
            )
        row = 0
        for array in batches:
            yield token_lists(array, path, column, row)
            row += len(array)
    except (pa.ArrowException, OSError) as e:
        raise DatasetError(f"{path}: not readable as {_format(path)} ({e})") from e


def _format(path: Path) -> str:
    return TOKEN_FILE_SUFFIXES[path.suffix.lower()]
