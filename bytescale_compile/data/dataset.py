"""Token data on disk and the global-batch sampler.

A dataset is the layout Megatron's indexed datasets made standard: one flat token array
(`<prefix>.bin`) plus int64 offsets (`<prefix>.idx`, n + 1 entries), both memory-mapped, so every
rank learns all sequence lengths for the price of the index and reads only the token ranges of its own
micro-batches. `<prefix>.json` holds the metadata and is written last: a write that dies halfway
leaves no dataset that opens.

The token dtype is the smallest of uint8/uint16/uint32 that holds the vocabulary: `write_dataset` with
its default vocabulary stores bytes (uint8, vocab 256), which needs no tokenizer;
`bytescale_compile.data.prepare` writes tokenizer ids in the same format and records the tokenizer's
identity in the metadata. `python_source_files` lists the installed Python sources, a corpus every
machine has (the demo's).
"""

from __future__ import annotations

import json
import os
import sysconfig
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from .spec import DatasetError, _file, dataset_files

__all__ = [
    "DatasetError",
    "DatasetWriter",
    "FlatTokens",
    "GlobalBatch",
    "GlobalBatchSampler",
    "OutOfVocabulary",
    "SequenceSource",
    "TokenDataset",
    "TokenSpan",
    "TokenStore",
    "TokenizerInfo",
    "dataset_files",
    "eval_batches",
    "python_source_files",
    "token_dtype",
    "write_dataset",
]

TOKEN_DTYPES = (np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32))
"""Smallest first: a dataset uses the first that holds its vocabulary."""
_BYTE_VOCAB_SIZE = 256
SCAN_BLOCK = 1 << 24
"""Ids per piece of a whole-dataset scan (`max_token`, `check_tokens`): bounds the temporaries, not the reads."""
_SKIPPED_DIRS = frozenset({"__pycache__", "site-packages", "dist-packages"})
"""Not walked: bytecode only, or a nested site-packages the roots list on their own."""


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype holding ids 0..vocab_size-1: the .bin costs 1, 2 or 4 bytes a token."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    for dtype in TOKEN_DTYPES:
        if vocab_size <= np.iinfo(dtype).max + 1:
            return dtype
    raise ValueError(f"vocab_size {vocab_size} exceeds the {np.iinfo(TOKEN_DTYPES[-1]).max + 1} ids uint32 holds")


@dataclass(frozen=True)
class TokenizerInfo:
    """Which tokenizer produced a dataset's ids: a model must be trained and evaluated with the same one."""

    name_or_path: str
    sha256: str
    """Of the tokenizer's files (vocabulary, merges, configuration): renaming a directory keeps it."""
    eos_token_id: int
    """Appended to every document, so a model learns where documents end."""

    def to_dict(self) -> dict:
        return {"name_or_path": self.name_or_path, "sha256": self.sha256, "eos_token_id": self.eos_token_id}

    @classmethod
    def from_dict(cls, data: dict) -> TokenizerInfo:
        return cls(str(data["name_or_path"]), str(data["sha256"]), int(data["eos_token_id"]))


class SequenceSource(Protocol):
    """What batches, samplers and planners read of a dataset: a `TokenDataset`, or a mixture of several."""

    @property
    def prefix(self) -> str | Path: ...

    @property
    def lengths(self) -> np.ndarray: ...

    def tokens(self, index: int, start: int = 0, end: int | None = None) -> torch.Tensor: ...


def _check_range(start: int, end: int | None, length: int) -> tuple[int, int]:
    """Strict [start, end) within `length`: a bad range is a caller bug, not something to clamp."""
    end = length if end is None else end
    if not 0 <= start <= end <= length:
        raise IndexError(f"token range [{start}, {end}) outside a sequence of length {length}")
    return start, end


@dataclass(frozen=True)
class OutOfVocabulary:
    """A token id outside a vocabulary: sequence `sequence` of a dataset holds `token` at `position`."""

    sequence: int
    position: int
    token: int


@dataclass(frozen=True)
class TokenSpan:
    """A run of token ids as stored, and where: what an id check names when one is out of range."""

    path: Path
    byte_offset: int
    """Of `ids[0]` in `path`."""
    ids: np.ndarray


class TokenStore(Protocol):
    """Where a dataset's token ids live: one memory-mapped array (ours, Megatron's `.bin`), or one per Arrow
    record batch (Hugging Face `datasets`). The dataset checks ranges; a store only reads."""

    @property
    def dtype(self) -> np.dtype: ...

    def read(self, index: int, start: int, end: int) -> np.ndarray:
        """Ids [start, end) of sequence `index`, in the stored dtype (a view where the storage allows)."""
        ...

    def spans(self) -> Iterator[TokenSpan]:
        """Every stored id once, in bounded pieces, for whole-dataset scans."""
        ...


@dataclass(frozen=True)
class FlatTokens:
    """All ids in one memory-mapped array; sequence i starts at element `starts[i]`."""

    path: Path
    ids: np.ndarray
    """A plain ndarray view of the map (still backed by it): slicing an `np.memmap` costs about 4x as much."""
    starts: np.ndarray

    @property
    def dtype(self) -> np.dtype:
        return self.ids.dtype

    def read(self, index: int, start: int, end: int) -> np.ndarray:
        base = int(self.starts[index])
        return self.ids[base + start : base + end]

    def spans(self) -> Iterator[TokenSpan]:
        for lo in range(0, self.ids.size, SCAN_BLOCK):
            yield TokenSpan(self.path, lo * self.ids.itemsize, self.ids[lo : lo + SCAN_BLOCK])


@dataclass(frozen=True)
class TokenDataset:
    """Sequences of token ids: their lengths in memory, their ids read on demand from `_store`.

    `TokenDataset.open` reads our own format (`data prepare`, `write_dataset`): `<prefix>.bin`: all tokens,
    flat; `<prefix>.idx`: int64 offsets [n + 1] (np.save format); `<prefix>.json`: {"dtype", "vocab_size",
    "num_sequences", "num_tokens", "source", "tokenizer"}, where "dtype" is uint8, uint16 or uint32 and
    "tokenizer" is null for bytes (absent in older datasets) or `TokenizerInfo.to_dict()`. Both arrays are
    memory-mapped. Other formats subclass it (`megatron.py`, `hf_datasets.py`), so samplers, planners and the
    trainer read every format alike."""

    prefix: Path
    vocab_size: int = field(compare=False)
    tokenizer: TokenizerInfo | None = field(compare=False)
    """None: byte-level (token = byte), or a dataset given a vocabulary size without its tokenizer."""
    source: str = field(repr=False, compare=False)
    _lengths: np.ndarray = field(repr=False, compare=False)
    _store: TokenStore = field(repr=False, compare=False)

    @classmethod
    def open(cls, prefix: str | Path) -> TokenDataset:
        """Map the files after checking they agree, so a bad file fails here, naming itself."""
        prefix = Path(prefix)
        meta_path, idx_path, bin_path = dataset_files(prefix)
        for path in (meta_path, idx_path, bin_path):
            if not path.is_file():
                raise FileNotFoundError(f"dataset file {path} not found")
        meta = _read_meta(meta_path)
        offsets = _read_offsets(idx_path, meta["num_sequences"], meta["num_tokens"])
        tokens = _map_tokens(bin_path, np.dtype(meta["dtype"]), meta["num_tokens"])
        info = meta.get("tokenizer")
        return cls(
            prefix,
            meta["vocab_size"],
            None if info is None else TokenizerInfo.from_dict(info),
            str(meta["source"]),
            _frozen(np.diff(offsets)),
            FlatTokens(bin_path, tokens.view(np.ndarray), offsets.view(np.ndarray)),
        )

    def __reduce__(self):
        """Pickle as the prefix: a worker reopens the maps instead of receiving a copy of the tokens."""
        return (TokenDataset.open, (self.prefix,))

    def __len__(self) -> int:
        return len(self._lengths)

    @property
    def spec(self) -> str:
        """The `--data` item that opens this dataset again (`formats.open_dataset`)."""
        return str(self.prefix)

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per sequence (int64, read-only): all a planner needs, without touching the tokens."""
        return self._lengths

    @property
    def dtype(self) -> np.dtype:
        """Of the tokens on disk; `tokens()` always returns int64."""
        return self._store.dtype

    def max_token(self) -> int:
        """The largest token id present (reads every token once): what a model's vocabulary must cover."""
        return self.id_range()[1]

    def id_range(self) -> tuple[int, int]:
        """The smallest and largest token id present, (0, -1) when there is none (reads every token once)."""
        ranges = [(int(s.ids.min()), int(s.ids.max())) for s in self._store.spans() if s.ids.size]
        return (min(r[0] for r in ranges), max(r[1] for r in ranges)) if ranges else (0, -1)

    def first_outside(self, vocab_size: int, indices: Iterable[int] | None = None) -> OutOfVocabulary | None:
        """The first of the sequences `indices` (default: all, in order) that holds an id outside
        0..vocab_size-1, and where; None when every id fits. Reads those sequences whole."""
        for index in range(len(self)) if indices is None else indices:
            ids = self._store.read(int(index), 0, int(self._lengths[index]))
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
                at = int(np.flatnonzero((ids < 0) | (ids >= vocab_size))[0])
                return OutOfVocabulary(int(index), at, int(ids[at]))
        return None

    def check_tokens(self) -> None:
        """Raise `DatasetError` at the first id outside 0..vocab_size-1, naming its file and byte offset (reads
        every token once): formats that do not record their vocabulary are only checked when asked."""
        for span in self._store.spans():
            ids = span.ids
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
                at = int(np.flatnonzero((ids < 0) | (ids >= self.vocab_size))[0])
                raise DatasetError(
                    f"{span.path}: byte {span.byte_offset + at * ids.itemsize}: token id {ids[at]} is outside "
                    f"the vocabulary 0..{self.vocab_size - 1} of {self.spec}"
                )

    def tokens(self, index: int, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Tokens [start, end) of sequence `index` as int64; reads only that slice from disk."""
        if not 0 <= index < len(self):
            raise IndexError(f"sequence {index} outside a dataset of {len(self)} sequences")
        start, end = _check_range(start, end, int(self._lengths[index]))
        return torch.from_numpy(self._store.read(index, start, end).astype(np.int64))


def _read_meta(path: Path) -> dict:
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DatasetError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(meta, dict):
        raise DatasetError(f"{path}: expected a JSON object, found {type(meta).__name__}")
    keys = ("dtype", "vocab_size", "num_sequences", "num_tokens", "source")
    missing = [k for k in keys if k not in meta]
    if missing:
        raise DatasetError(f"{path}: missing keys {missing}")
    not_ints = [k for k in ("vocab_size", "num_sequences", "num_tokens") if not isinstance(meta[k], int)]
    if not_ints:
        raise DatasetError(f"{path}: {not_ints} must be integers")
    names = [dtype.name for dtype in TOKEN_DTYPES]
    if meta["dtype"] not in names:
        raise DatasetError(f"{path}: token dtype {meta['dtype']!r} is not one of {names}")
    if not 1 <= meta["vocab_size"] <= np.iinfo(meta["dtype"]).max + 1:
        raise DatasetError(f"{path}: vocab_size {meta['vocab_size']} does not fit token dtype {meta['dtype']}")
    if meta["num_sequences"] < 1:
        raise DatasetError(f"{path}: the dataset holds no sequences")
    _check_tokenizer_meta(path, meta.get("tokenizer"))
    return meta


def _check_tokenizer_meta(path: Path, info: object) -> None:
    if info is None:
        return
    fields = ("name_or_path", "sha256", "eos_token_id")
    if not isinstance(info, dict) or any(k not in info for k in fields):
        raise DatasetError(f'{path}: "tokenizer" must be null or an object with keys {list(fields)}, found {info!r}')


def _read_offsets(path: Path, num_sequences: int, num_tokens: int) -> np.ndarray:
    """The index must be n + 1 non-decreasing int64 offsets from 0 to num_tokens."""
    try:
        offsets = np.load(path, mmap_mode="r")
    except (ValueError, OSError, EOFError) as e:
        raise DatasetError(f"{path}: not a readable .npy offsets array ({e})") from e
    if offsets.dtype != np.int64 or offsets.shape != (num_sequences + 1,):
        raise DatasetError(
            f"{path}: expected int64 offsets of shape ({num_sequences + 1},), "
            f"found {offsets.dtype} of shape {offsets.shape}"
        )
    if offsets[0] != 0 or offsets[-1] != num_tokens:
        raise DatasetError(
            f"{path}: offsets must run from 0 to num_tokens={num_tokens}, found {offsets[0]} to {offsets[-1]}"
        )
    if np.any(np.diff(offsets) < 0):
        first = int(np.flatnonzero(np.diff(offsets) < 0)[0])
        raise DatasetError(f"{path}: offsets decrease at sequence {first} ({offsets[first]} -> {offsets[first + 1]})")
    return offsets


def _map_tokens(path: Path, dtype: np.dtype, num_tokens: int) -> np.ndarray:
    expected, actual = num_tokens * dtype.itemsize, path.stat().st_size
    if actual != expected:
        raise DatasetError(f"{path}: expected {expected} bytes ({num_tokens} tokens of {dtype}), found {actual} bytes")
    return np.memmap(path, dtype=dtype, mode="r", shape=(num_tokens,))


class DatasetWriter:
    """Appends sequences to `<prefix>.bin` one at a time; `finish` writes the index, then the metadata.

    Only the offsets stay in memory. Any old metadata goes first and the new one is written last, so
    leaving the `with` block without `finish` leaves nothing that opens; leaving it by an exception
    removes the files written, so a rerun finds no half dataset in its way.
    """

    def __init__(
        self, prefix: str | Path, vocab_size: int = _BYTE_VOCAB_SIZE, tokenizer: TokenizerInfo | None = None
    ) -> None:
        self.prefix = Path(prefix)
        self.vocab_size = vocab_size
        self.dtype = token_dtype(vocab_size)
        self.tokenizer = tokenizer
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        _file(self.prefix, "json").unlink(missing_ok=True)
        self._bin = open(_file(self.prefix, "bin"), "wb")
        self._offsets = array("q", [0])
        self._finished = False

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self._bin.close()
        if exc_type is not None and not self._finished:
            for path in dataset_files(self.prefix):
                path.unlink(missing_ok=True)

    @property
    def num_sequences(self) -> int:
        return len(self._offsets) - 1

    @property
    def num_tokens(self) -> int:
        return self._offsets[-1]

    def append(self, tokens: bytes | np.ndarray) -> None:
        """One sequence: bytes (token = byte) or a 1-D array of integer ids below `vocab_size`."""
        ids = np.frombuffer(tokens, dtype=np.uint8) if isinstance(tokens, bytes) else np.asarray(tokens)
        self.extend(ids, np.array([0, ids.size]))

    def extend(self, ids: np.ndarray, offsets: np.ndarray) -> None:
        """Many sequences at once, sequence i being `ids[offsets[i]:offsets[i + 1]]` (Arrow's list layout):
        one check and one write for all of them, where `append` costs a Python call per sequence."""
        ids, offsets = np.asarray(ids), np.asarray(offsets, dtype=np.int64)
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "ui"):
            raise TypeError(
                f"{self.prefix}: a sequence must be bytes or a 1-D integer array, got {ids.dtype} of shape {ids.shape}"
            )
        if (
            offsets.ndim != 1
            or not offsets.size
            or offsets[0] < 0
            or offsets[-1] > ids.size
            or np.any(offsets[1:] < offsets[:-1])
        ):
            raise ValueError(f"{self.prefix}: offsets must be one or more non-decreasing positions in 0..{ids.size}")
        used = ids[offsets[0] : offsets[-1]]
        if used.size and not (0 <= used.min() and used.max() < self.vocab_size):
            bad = int(np.flatnonzero((used < 0) | (used >= self.vocab_size))[0]) + int(offsets[0])
            seq = int(np.searchsorted(offsets, bad, side="right")) - 1
            doc = ids[offsets[seq] : offsets[seq + 1]]
            raise DatasetError(
                f"{self.prefix}: sequence {self.num_sequences + seq} holds ids {doc.min()}..{doc.max()}, "
                f"outside the vocabulary 0..{self.vocab_size - 1}"
            )
        self._bin.write(np.ascontiguousarray(used, dtype=self.dtype).data)
        self._offsets.frombytes((offsets[1:] - offsets[0] + self.num_tokens).tobytes())

    def finish(self, source: str) -> TokenDataset:
        """Close the token file, write the index and the metadata; returns the dataset opened."""
        self._bin.close()
        if self.num_sequences == 0:
            raise DatasetError(f"{self._bin.name}: no non-empty documents to write (source: {source})")
        with open(_file(self.prefix, "idx"), "wb") as out:  # a file object: np.save would append ".npy" to a path
            np.save(out, np.frombuffer(self._offsets, dtype=np.int64))
        meta = {
            "dtype": self.dtype.name,
            "vocab_size": self.vocab_size,
            "num_sequences": self.num_sequences,
            "num_tokens": self.num_tokens,
            "source": source,
            "tokenizer": None if self.tokenizer is None else self.tokenizer.to_dict(),
        }
        _file(self.prefix, "json").write_text(json.dumps(meta, indent=1) + "\n")
        self._finished = True
        return TokenDataset.open(self.prefix)


def write_dataset(
    prefix: str | Path,
    documents: Iterable[bytes | np.ndarray],
    source: str,
    vocab_size: int = _BYTE_VOCAB_SIZE,
    tokenizer: TokenizerInfo | None = None,
) -> TokenDataset:
    """Stream `documents` (bytes, or 1-D arrays of ids below `vocab_size`; empty ones skipped) to
    `prefix` in the smallest dtype holding `vocab_size`; returns it opened. See `DatasetWriter`."""
    with DatasetWriter(prefix, vocab_size, tokenizer) as writer:
        for doc in documents:
            if len(doc):
                writer.append(doc)
        return writer.finish(source)


def python_source_files(max_bytes: int | None = None) -> list[Path]:
    """The running interpreter's `.py` files (stdlib, then site-packages, each in sorted order), stopping
    before the file that would pass `max_bytes` in all: a corpus every machine has, bounded for demos."""
    chosen, total = [], 0
    for path in (path for root in _python_source_roots() for path in _python_files(root)):
        total += path.stat().st_size
        if max_bytes is not None and total > max_bytes:
            break
        chosen.append(path)
    return chosen


def _python_source_roots() -> list[Path]:
    paths = sysconfig.get_paths()
    roots = dict.fromkeys(Path(paths[k]).resolve() for k in ("stdlib", "purelib", "platlib"))
    return [root for root in roots if root.is_dir()]


def _python_files(directory: Path) -> list[Path]:
    """`.py` files under `directory`, sorted by relative path parts (a stable, platform-free order)."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_DIRS]
        found.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    found = [p for p in found if p.is_file()]  # drops broken symlinks
    return sorted(found, key=lambda p: p.relative_to(directory).parts)


@dataclass(frozen=True)
class GlobalBatch:
    """One step's sequences: every rank holds the same object (lengths are cheap) and reads only
    the tokens of its own micro-batches."""

    dataset: SequenceSource
    indices: np.ndarray
    """Dataset sequence ids, int64."""
    lengths: np.ndarray
    """Tokens used from each sequence (<= max_len: longer ones are truncated)."""

    def tokens(self, seq: int, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Tokens [start, end) of the batch's `seq`-th sequence, within its used length."""
        start, end = _check_range(start, end, int(self.lengths[seq]))
        return self.dataset.tokens(int(self.indices[seq]), start, end)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


def check_sampling(global_tokens: int, min_len: int, max_len: int | None) -> None:
    """A sampler's token budget and length bounds, as every sampler takes them."""
    if global_tokens < 1:
        raise ValueError(f"global_tokens must be >= 1, got {global_tokens}")
    if min_len < 1 or (max_len is not None and max_len < min_len):
        raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")


class GlobalBatchSampler:
    """Global batches by token budget.

    Each epoch visits the sequences of at least `min_len` tokens in a random order seeded by (seed,
    epoch); a batch takes them in that order until the budget is reached (the last one may
    overshoot: sequences are never split), each truncated to `max_len`. An epoch's tail too short
    for the budget is left out, so every step gets the full budget; the next epoch's reshuffle
    places those sequences elsewhere. Every rank constructs it with the same arguments and gets the
    same batches; iteration continues from the current state.
    """

    def __init__(
        self,
        dataset: SequenceSource,
        global_tokens: int,
        seed: int = 0,
        max_len: int | None = None,
        min_len: int = 2,
    ) -> None:
        check_sampling(global_tokens, min_len, max_len)
        lengths = dataset.lengths
        self.dataset = dataset
        self.global_tokens = global_tokens
        self.seed = seed
        self._used = lengths if max_len is None else np.minimum(lengths, max_len)
        self._eligible = np.flatnonzero(lengths >= min_len)
        usable = int(self._used[self._eligible].sum())
        if usable < global_tokens:
            raise ValueError(
                f"{dataset.prefix}: only {usable} tokens in sequences of >= {min_len} tokens, "
                f"fewer than global_tokens={global_tokens}"
            )
        self._epoch = 0
        self._position = 0

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self._eligible)

    def __iter__(self) -> Iterator[GlobalBatch]:
        """Infinite: epochs repeat, each reshuffled."""
        while True:
            order = self._order(self._epoch)
            used = self._used[order]
            ends = np.concatenate(([0], np.cumsum(used)))
            # the first end whose prefix sum reaches the budget: one sequence fewer stays below it
            while (end := int(np.searchsorted(ends, ends[self._position] + self.global_tokens))) < len(ends):
                taken = slice(self._position, end)
                self._position = end
                yield GlobalBatch(self.dataset, _frozen(order[taken]), _frozen(used[taken]))
            self._epoch, self._position = self._epoch + 1, 0

    def state_dict(self) -> dict:
        """Epoch and position after the last batch handed out: enough to resume exactly."""
        return {"epoch": self._epoch, "position": self._position}

    def load_state_dict(self, state: dict) -> None:
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self._eligible):
            raise ValueError(f"sampler state {state} outside {len(self._eligible)} sequences per epoch")
        self._epoch, self._position = epoch, position


def eval_batches(
    dataset: SequenceSource,
    global_tokens: int,
    max_len: int | None = None,
    max_tokens: int | None = None,
    min_len: int = 2,
) -> list[GlobalBatch]:
    """The sequences of at least `min_len` tokens in dataset order, each truncated to `max_len`, as batches
    of about `global_tokens` (the last may be smaller), until `max_tokens` tokens in all: the same held-out
    tokens at every evaluation."""
    if global_tokens < 1 or (max_tokens is not None and max_tokens < 1):
        raise ValueError(f"global_tokens and max_tokens must be >= 1, got {global_tokens} and {max_tokens}")
    used = dataset.lengths if max_len is None else np.minimum(dataset.lengths, max_len)
    eligible = np.flatnonzero(dataset.lengths >= min_len)
    if max_tokens is not None:
        eligible = eligible[: int(np.searchsorted(np.cumsum(used[eligible]), max_tokens)) + 1]
    batches, start = [], 0
    ends = np.concatenate(([0], np.cumsum(used[eligible])))
    while start < len(eligible):
        end = min(int(np.searchsorted(ends, ends[start] + global_tokens)), len(eligible))
        batches.append(GlobalBatch(dataset, _frozen(eligible[start:end]), _frozen(used[eligible[start:end]])))
        start = end
    return batches


def _frozen(values: np.ndarray) -> np.ndarray:
    """A read-only copy: a batch is shared by every consumer and must not drift."""
    values = values.astype(np.int64)
    values.flags.writeable = False
    return values
