"""Megatron-LM's indexed datasets (`MMapIndexedDataset`, `megatron/core/datasets/indexed_dataset.py`), read in place.

`<prefix>.idx`, little-endian: the magic b"MMIDIDX\\x00\\x00" (9 bytes), the version <Q (1), the token dtype
code <B, the sequence count n <Q and the document count d <Q (34 bytes in all); then int32 sequence lengths
[n], int64 byte offsets of the sequences in `<prefix>.bin` [n] and int64 document indices [d] (0 first, n
last); multimodal datasets append int8 sequence modes [n], which are not read. `<prefix>.bin` holds the
tokens back to back. Both files are memory-mapped: opening reads the index, never a token.

Each Megatron *sequence* is one training sequence here, drawn, truncated to `--max-len` and planned on its
own. `tools/preprocess_data.py` writes one sequence per document, so that is one per document; with
`--split-sentences` it writes one per sentence, and the document index groups a document's consecutive
sequences. Megatron's GPTDataset concatenates documents and cuts fixed-length samples; HDP trains sequences
unpacked at their own lengths, which is the point of planning by length. The document index is checked and
exposed (`MegatronDataset.document_indices`), not used to draw batches.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .dataset import FlatTokens, TokenDataset, _frozen
from .spec import DataItem, DatasetError, _file
from .vocabulary import Vocabulary, resolve_vocabulary

__all__ = ["MEGATRON_MAGIC", "MegatronDataset", "MegatronIndex", "megatron_files", "read_index"]

MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")
"""Magic, version, dtype code, sequence count, document count: 34 bytes."""
_VERSION_AT, _DTYPE_AT, _COUNTS_AT = 9, 17, 18
_DTYPES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
"""Megatron's `DType` codes."""


def megatron_files(prefix: str | Path) -> tuple[Path, Path]:
    """The index and token files of the Megatron dataset at `prefix`."""
    prefix = Path(prefix)
    return _file(prefix, "idx"), _file(prefix, "bin")


@dataclass(frozen=True)
class MegatronIndex:
    """The arrays of a `.idx`, memory-mapped and checked against themselves (not yet against the `.bin`)."""

    path: Path
    dtype: np.dtype
    lengths: np.ndarray
    """int32 [n]: tokens per sequence."""
    pointers: np.ndarray
    """int64 [n]: byte offset of each sequence in the `.bin`."""
    document_indices: np.ndarray
    """int64 [d]: document j is sequences [document_indices[j], document_indices[j + 1])."""

    @property
    def pointers_at(self) -> int:
        """Byte offset of `pointers[0]` in the `.idx`."""
        return _HEADER.size + self.lengths.nbytes


def read_index(path: Path) -> MegatronIndex:
    """Read and check a `.idx`; a bad one raises `DatasetError` naming the file and the byte offset of the fault."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        header = f.read(_HEADER.size)
    if header[: len(MEGATRON_MAGIC)] != MEGATRON_MAGIC:
        raise DatasetError(
            f"{path}: byte 0: expected Megatron's magic {MEGATRON_MAGIC!r}, found {header[: len(MEGATRON_MAGIC)]!r}: "
            "not the index of a Megatron indexed dataset"
        )
    if len(header) < _HEADER.size:
        raise DatasetError(f"{path}: byte {size}: the file ends inside the {_HEADER.size}-byte header (truncated)")
    _, version, code, n, d = _HEADER.unpack(header)
    if version != _VERSION:
        raise DatasetError(f"{path}: byte {_VERSION_AT}: index version {version} is not supported (only {_VERSION})")
    dtype = _DTYPES.get(code)
    if dtype is None or dtype.kind == "f":
        found = "unknown" if dtype is None else f"{dtype}: no token ids"
        readable = {c: t.name for c, t in _DTYPES.items() if t.kind != "f"}
        raise DatasetError(f"{path}: byte {_DTYPE_AT}: dtype code {code} ({found}) is not one of {readable}")
    expected = _HEADER.size + 12 * n + 8 * d
    if size < expected:
        raise DatasetError(
            f"{path}: byte {size}: truncated: {n} sequences and {d} documents need {expected} bytes, the file has {size}"
        )
    if size not in (expected, expected + n):
        raise DatasetError(
            f"{path}: byte {expected}: {size - expected} bytes follow the document index, where the file ends or "
            f"{n} int8 sequence modes follow"
        )
    if n == 0 or d == 0:
        raise DatasetError(f"{path}: byte {_COUNTS_AT}: {n} sequences and {d} documents: the dataset is empty")
    lengths = np.memmap(path, np.int32, "r", _HEADER.size, (n,))
    pointers = np.memmap(path, np.int64, "r", _HEADER.size + 4 * n, (n,))
    documents = np.memmap(path, np.int64, "r", _HEADER.size + 12 * n, (d,))
    index = MegatronIndex(path, dtype, lengths, pointers, documents)
    _check_documents(index, n)
    if (negative := np.flatnonzero(lengths < 0)).size:
        i = int(negative[0])
        raise DatasetError(f"{path}: byte {_HEADER.size + 4 * i}: sequence {i} has length {lengths[i]}")
    return index


def _check_documents(index: MegatronIndex, n: int) -> None:
    documents, at = index.document_indices, _HEADER.size + 12 * n
    if documents[0] != 0:
        raise DatasetError(f"{index.path}: byte {at}: the document index starts at {documents[0]}, not 0")
    if (falling := np.flatnonzero(documents[1:] < documents[:-1])).size:
        j = int(falling[0]) + 1
        raise DatasetError(
            f"{index.path}: byte {at + 8 * j}: document index {j} is {documents[j]}, below the {documents[j - 1]} "
            "before it"
        )
    if documents[-1] != n:
        raise DatasetError(
            f"{index.path}: byte {at + 8 * (len(documents) - 1)}: the document index ends at {documents[-1]}, "
            f"not at the sequence count {n}"
        )


def _check_pointers(index: MegatronIndex, bin_path: Path) -> None:
    """Every sequence lies inside the `.bin`, at a whole token."""
    size, itemsize = bin_path.stat().st_size, index.dtype.itemsize
    ends = index.pointers + index.lengths.astype(np.int64) * itemsize
    bad = np.flatnonzero((index.pointers < 0) | (index.pointers % itemsize != 0) | (ends > size))
    if bad.size:
        i = int(bad[0])
        pointer, length = int(index.pointers[i]), int(index.lengths[i])
        where = (
            f"is not a multiple of the {itemsize}-byte {index.dtype} tokens"
            if pointer % itemsize
            else f"+ {length} tokens x {itemsize} bytes ends at byte {int(ends[i])}, past the {size} bytes of {bin_path}"
        )
        raise DatasetError(f"{index.path}: byte {index.pointers_at + 8 * i}: sequence {i} at byte {pointer} {where}")


@dataclass(frozen=True)
class MegatronDataset(TokenDataset):
    """A Megatron indexed dataset (module docstring); Megatron's sequences are its sequences."""

    document_indices: np.ndarray = field(repr=False, compare=False)
    """int64, memory-mapped: document j is sequences [document_indices[j], document_indices[j + 1])."""

    @classmethod
    def open(
        cls, prefix: str | Path, vocab_size: int | None = None, tokenizer: str | Path | None = None
    ) -> MegatronDataset:
        """Map `<prefix>.idx` and `<prefix>.bin` after checking them. The files do not record the vocabulary:
        give `vocab_size`, or `tokenizer` (the directory the data was made with, which also records its
        identity for the run's final/); refused with neither."""
        prefix = Path(prefix)
        for path in megatron_files(prefix):
            if not path.is_file():
                raise FileNotFoundError(f"Megatron dataset file {path} not found")
        return cls.with_vocabulary(prefix, resolve_vocabulary(prefix, vocab_size, tokenizer))

    @classmethod
    def with_vocabulary(cls, prefix: Path, vocabulary: Vocabulary) -> MegatronDataset:
        """`open` with the vocabulary resolved: how a pickled dataset reopens, without loading a tokenizer."""
        idx_path, bin_path = megatron_files(prefix)
        index = read_index(idx_path)
        _check_pointers(index, bin_path)
        size, itemsize = bin_path.stat().st_size, index.dtype.itemsize
        ids = (
            np.memmap(bin_path, index.dtype, "r", shape=(size // itemsize,))
            if size >= itemsize
            else np.zeros(0, index.dtype)
        )
        documents = len(index.document_indices) - 1
        return cls(
            prefix,
            vocabulary.size,
            vocabulary.tokenizer,
            f"Megatron indexed dataset {prefix} ({index.dtype}, {documents} documents)",
            _frozen(index.lengths),
            FlatTokens(bin_path, ids.view(np.ndarray), index.pointers // itemsize),
            index.document_indices,
        )

    def __reduce__(self):
        """Pickle as the prefix and vocabulary: a worker reopens the maps, without loading the tokenizer."""
        return (MegatronDataset.with_vocabulary, (self.prefix, Vocabulary(self.vocab_size, self.tokenizer)))

    @property
    def spec(self) -> str:
        tokenizer = None if self.tokenizer is None else self.tokenizer.name_or_path
        return str(DataItem(str(self.prefix), self.vocab_size, tokenizer))
