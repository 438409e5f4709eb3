"""Hugging Face `datasets` on disk, read in place: a folder written by `Dataset.save_to_disk`, or Arrow files
(`.arrow`, the format of `save_to_disk` and of `datasets`' own cache).

The Arrow files are memory-mapped with pyarrow (zero-copy, as `datasets.load_from_disk` maps them; `datasets`
itself is not imported). The token-id column (`input_ids` unless `?column=` names another) holds lists of
integers, and Arrow's list layout is our own: each record batch has the row offsets, which give every length
without touching a token, and one values buffer, a sequence's ids being a slice of it. Rows are sequences, in
file order (a `save_to_disk` folder's shards as its state.json lists them), empty rows included, so that
sequence i is row i.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .dataset import SCAN_BLOCK, DatasetError, TokenDataset, TokenSpan, _frozen
from .spec import DEFAULT_COLUMN, DataItem
from .vocabulary import Vocabulary, resolve_vocabulary

__all__ = ["HFDataset", "TokenLists", "arrow_files", "token_lists", "visible_files"]


@dataclass(frozen=True)
class TokenLists:
    """One record batch of a token-id column: row r's ids are `values[offsets[r]:offsets[r + 1]]`."""

    values: np.ndarray
    """A zero-copy view of the batch's values buffer."""
    offsets: np.ndarray
    """[rows + 1], positions in `values`."""


def token_lists(array: Any, path: Path, column: str, first_row: int) -> TokenLists:
    """A pyarrow list, large-list or fixed-size-list array of integers as `TokenLists`, without copying the
    ids; `first_row` (of the array in `path`) places a null in the error message."""
    import pyarrow as pa

    kind = array.type
    lists = pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
    if not (lists and pa.types.is_integer(kind.value_type)):
        text = (
            " (text: make token ids of it with `bytescale-compile data prepare`)"
            if pa.types.is_string(kind) or pa.types.is_large_string(kind)
            else ""
        )
        raise DatasetError(f"{path}: column {column!r} is {kind}, not lists of integer token ids{text}")
    if array.null_count:
        row = first_row + int(np.flatnonzero(array.is_null().to_numpy(zero_copy_only=False))[0])
        raise DatasetError(f"{path}: row {row}: column {column!r} is null, where a list of token ids belongs")
    if array.values.null_count:
        raise DatasetError(f"{path}: rows {first_row}..{first_row + len(array) - 1}: column {column!r} holds nulls")
    if pa.types.is_fixed_size_list(kind):
        offsets = (array.offset + np.arange(len(array) + 1, dtype=np.int64)) * kind.list_size
    else:
        offsets = array.offsets.to_numpy(zero_copy_only=True)
    return TokenLists(array.values.to_numpy(zero_copy_only=True), offsets)


@dataclass(frozen=True)
class _Chunk:
    path: Path
    lists: TokenLists
    byte_offset: int
    """Of `lists.values[0]` in `path`."""


@dataclass(frozen=True)
class _ArrowTokens:
    """The token column's record batches; sequence ids run through them in order."""

    chunks: tuple[_Chunk, ...]
    starts: tuple[int, ...]
    """The first sequence of each chunk."""

    @property
    def dtype(self) -> np.dtype:
        return self.chunks[0].lists.values.dtype

    def read(self, index: int, start: int, end: int) -> np.ndarray:
        chunk = bisect.bisect_right(self.starts, index) - 1
        lists = self.chunks[chunk].lists
        base = int(lists.offsets[index - self.starts[chunk]])
        return lists.values[base + start : base + end]

    def spans(self) -> Iterator[TokenSpan]:
        for chunk in self.chunks:
            values, (lo, hi) = chunk.lists.values, (int(chunk.lists.offsets[0]), int(chunk.lists.offsets[-1]))
            for at in range(lo, hi, SCAN_BLOCK):
                ids = values[at : min(at + SCAN_BLOCK, hi)]
                yield TokenSpan(chunk.path, chunk.byte_offset + at * values.itemsize, ids)


def arrow_files(path: Path) -> list[Path]:
    """The Arrow files of `path`: itself, a `save_to_disk` folder's shards, or a folder's `.arrow` files."""
    if path.is_file():
        return [path]
    state = path / "state.json"
    if not state.is_file():
        return [p for p in visible_files(path) if p.suffix.lower() == ".arrow"]
    try:
        names = [entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
    except (ValueError, KeyError, TypeError) as e:
        raise DatasetError(f"{state}: not the state.json of `Dataset.save_to_disk` ({e!r})") from e
    return [path / name for name in names]


def visible_files(folder: Path) -> list[Path]:
    """The files under `folder`, recursively and sorted, but none under a hidden name (.git, .cache)."""
    return sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )


def _map_table(path: Path) -> tuple[Any, int]:
    """The Arrow table in `path`, memory-mapped (IPC stream, as `datasets` writes, or IPC file), and the
    address where the mapping starts, which places a buffer in the file."""
    import pyarrow as pa

    try:
        source = pa.memory_map(str(path))
        try:
            table = pa.ipc.open_stream(source).read_all()
        except pa.ArrowInvalid:
            source.seek(0)
            table = pa.ipc.open_file(source).read_all()
        source.seek(0)
        return table, source.read_buffer(1).address
    except (pa.ArrowException, OSError) as e:
        raise DatasetError(f"{path}: not a readable Arrow file ({e})") from e


def _chunks(files: Sequence[Path], column: str) -> list[_Chunk]:
    chunks: list[_Chunk] = []
    for path in files:
        if not path.is_file():
            raise FileNotFoundError(f"Arrow file {path} not found")
        table, base = _map_table(path)
        if column not in table.column_names:
            raise DatasetError(
                f"{path}: no column {column!r} (it has {table.column_names}): name the token-id column as "
                f"'PATH?column=NAME'"
            )
        row = 0
        for array in table.column(column).chunks:
            if len(array):
                lists = token_lists(array, path, column, row)
                chunks.append(_Chunk(path, lists, lists.values.ctypes.data - base))
            row += len(array)
    return chunks


@dataclass(frozen=True)
class HFDataset(TokenDataset):
    """A Hugging Face dataset on disk (module docstring): its rows' token-id lists are the sequences."""

    column: str = field(default=DEFAULT_COLUMN, compare=False)
    """The token-id column read."""

    @classmethod
    def open(
        cls,
        path: str | Path,
        vocab_size: int | None = None,
        tokenizer: str | Path | None = None,
        column: str = DEFAULT_COLUMN,
    ) -> HFDataset:
        """Map a `save_to_disk` folder, an `.arrow` file or a folder of them. `datasets` does not record the
        vocabulary: give `vocab_size`, or `tokenizer` (the directory that made the ids); refused with neither."""
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"Hugging Face dataset {path} not found")
        return cls.with_vocabulary(path, resolve_vocabulary(path, vocab_size, tokenizer), column)

    @classmethod
    def with_vocabulary(cls, path: Path, vocabulary: Vocabulary, column: str = DEFAULT_COLUMN) -> HFDataset:
        """`open` with the vocabulary resolved: how a pickled dataset reopens, without loading a tokenizer."""
        files = arrow_files(path)
        chunks = _chunks(files, column)
        if not chunks:
            raise DatasetError(f"{path}: no rows in {[str(f) for f in files] or 'no .arrow files'}")
        dtypes = sorted({chunk.lists.values.dtype.name for chunk in chunks})
        if len(dtypes) > 1:
            raise DatasetError(f"{path}: column {column!r} holds ids of several types {dtypes} across its files")
        lengths = [np.diff(chunk.lists.offsets) for chunk in chunks]
        starts = np.concatenate(([0], np.cumsum([len(part) for part in lengths])[:-1])).tolist()
        return cls(
            path,
            vocabulary.size,
            vocabulary.tokenizer,
            f"Hugging Face dataset {path}, column {column!r} ({len(files)} Arrow files)",
            _frozen(np.concatenate(lengths)),
            _ArrowTokens(tuple(chunks), tuple(starts)),
            column,
        )

    def __reduce__(self):
        """Pickle as the path, vocabulary and column: a worker maps the files again, without the tokenizer."""
        return (HFDataset.with_vocabulary, (self.prefix, Vocabulary(self.vocab_size, self.tokenizer), self.column))

    @property
    def spec(self) -> str:
        tokenizer = None if self.tokenizer is None else self.tokenizer.name_or_path
        column = None if self.column == DEFAULT_COLUMN else self.column
        return str(DataItem(str(self.prefix), self.vocab_size, tokenizer, column))
