"""Token data on disk and the global-batch sampler (issue 5, item 1).

A dataset is the layout Megatron's indexed datasets made standard: one flat token array
(`<prefix>.bin`) plus int64 offsets (`<prefix>.idx`, n + 1 entries), both memory-mapped, so every
rank learns all sequence lengths for the price of the index and reads only the token ranges of its own
micro-batches. `<prefix>.json` holds the metadata and is written last: a write that dies halfway
leaves no dataset that opens.

Tokens are bytes (vocab 256): the corpus needs no tokenizer, and the installed Python sources, one
sample per file or per package directory, give a real skewed length distribution with a long tail.
"""

from __future__ import annotations

import itertools
import json
import os
import sysconfig
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "DatasetError",
    "GlobalBatch",
    "GlobalBatchSampler",
    "TokenDataset",
    "build_from_python_sources",
    "build_from_text_files",
    "write_dataset",
]

_TOKEN_DTYPE = np.dtype(np.uint8)
_VOCAB_SIZE = 256
_SKIPPED_DIRS = frozenset({"__pycache__", "site-packages", "dist-packages"})
"""Not walked: bytecode only, or a nested site-packages the roots list on their own."""


class DatasetError(ValueError):
    """A dataset file that is truncated, corrupt or inconsistent with the others; names the file."""


def _file(prefix: Path, ext: str) -> Path:
    """`<prefix>.<ext>`, appended rather than `with_suffix`, so prefixes may contain dots."""
    return prefix.with_name(f"{prefix.name}.{ext}")


def _check_range(start: int, end: int | None, length: int) -> tuple[int, int]:
    """Strict [start, end) within `length`: a bad range is a caller bug, not something to clamp."""
    end = length if end is None else end
    if not 0 <= start <= end <= length:
        raise IndexError(f"token range [{start}, {end}) outside a sequence of length {length}")
    return start, end


@dataclass(frozen=True)
class TokenDataset:
    """`<prefix>.bin`: all tokens, flat; `<prefix>.idx`: int64 offsets [n + 1] (np.save format);
    `<prefix>.json`: {"dtype", "vocab_size", "num_sequences", "num_tokens", "source"}.
    Both arrays are memory-mapped; build one with `TokenDataset.open`."""

    prefix: Path
    _meta: dict = field(repr=False, compare=False)
    _offsets: np.ndarray = field(repr=False, compare=False)
    _lengths: np.ndarray = field(repr=False, compare=False)
    _tokens: np.ndarray = field(repr=False, compare=False)

    @classmethod
    def open(cls, prefix: str | Path) -> TokenDataset:
        """Map the files after checking they agree, so a bad file fails here, naming itself."""
        prefix = Path(prefix)
        meta_path, idx_path, bin_path = (_file(prefix, ext) for ext in ("json", "idx", "bin"))
        for path in (meta_path, idx_path, bin_path):
            if not path.is_file():
                raise FileNotFoundError(f"dataset file {path} not found")
        meta = _read_meta(meta_path)
        offsets = _read_offsets(idx_path, meta["num_sequences"], meta["num_tokens"])
        tokens = _map_tokens(bin_path, np.dtype(meta["dtype"]), meta["num_tokens"])
        lengths = np.diff(offsets)
        lengths.flags.writeable = False
        return cls(prefix, meta, offsets, lengths, tokens)

    def __reduce__(self):
        """Pickle as the prefix: a worker reopens the maps instead of receiving a copy of the tokens."""
        return (TokenDataset.open, (self.prefix,))

    def __len__(self) -> int:
        return len(self._lengths)

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per sequence (int64, read-only): all a planner needs, without touching the tokens."""
        return self._lengths

    @property
    def vocab_size(self) -> int:
        return int(self._meta["vocab_size"])

    @property
    def source(self) -> str:
        return str(self._meta["source"])

    def max_token(self) -> int:
        """The largest token id present (reads every token once): what a model's vocabulary must cover."""
        return int(self._tokens.max()) if self._tokens.size else -1

    def tokens(self, index: int, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Tokens [start, end) of sequence `index` as int64; reads only that slice from disk."""
        if not 0 <= index < len(self):
            raise IndexError(f"sequence {index} outside a dataset of {len(self)} sequences")
        start, end = _check_range(start, end, int(self._lengths[index]))
        base = int(self._offsets[index])
        return torch.from_numpy(self._tokens[base + start : base + end].astype(np.int64))


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
    try:
        dtype = np.dtype(meta["dtype"])
    except TypeError as e:
        raise DatasetError(f"{path}: unknown dtype {meta['dtype']!r}") from e
    if dtype.kind != "u":
        raise DatasetError(f"{path}: token dtype {dtype} is not an unsigned integer type")
    if meta["num_sequences"] < 1:
        raise DatasetError(f"{path}: the dataset holds no sequences")
    return meta


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
        raise DatasetError(
            f"{path}: offsets decrease at sequence {first} ({offsets[first]} -> {offsets[first + 1]})"
        )
    return offsets


def _map_tokens(path: Path, dtype: np.dtype, num_tokens: int) -> np.ndarray:
    expected, actual = num_tokens * dtype.itemsize, path.stat().st_size
    if actual != expected:
        raise DatasetError(
            f"{path}: expected {expected} bytes ({num_tokens} tokens of {dtype}), found {actual} bytes"
        )
    return np.memmap(path, dtype=dtype, mode="r", shape=(num_tokens,))


def write_dataset(prefix: str | Path, documents: Iterable[bytes], source: str) -> TokenDataset:
    """Stream `documents` (one byte string each; empty ones skipped) to `prefix`; returns it opened.

    Only one document and the offsets are in memory at a time. Any old metadata goes first and the
    new one is written last, so a failure mid-stream leaves nothing that opens as a dataset.
    """
    prefix = Path(prefix)
    meta_path, idx_path, bin_path = (_file(prefix, ext) for ext in ("json", "idx", "bin"))
    prefix.parent.mkdir(parents=True, exist_ok=True)
    meta_path.unlink(missing_ok=True)
    offsets = array("q", [0])
    with open(bin_path, "wb") as out:
        for doc in documents:
            if doc:
                out.write(doc)
                offsets.append(offsets[-1] + len(doc))
    if len(offsets) == 1:
        raise DatasetError(f"{bin_path}: no non-empty documents to write (source: {source})")
    with open(idx_path, "wb") as out:  # a file object: np.save would append ".npy" to a path
        np.save(out, np.frombuffer(offsets, dtype=np.int64))
    meta = {
        "dtype": _TOKEN_DTYPE.name,
        "vocab_size": _VOCAB_SIZE,
        "num_sequences": len(offsets) - 1,
        "num_tokens": offsets[-1],
        "source": source,
    }
    meta_path.write_text(json.dumps(meta, indent=1) + "\n")
    return TokenDataset.open(prefix)


def build_from_text_files(
    prefix: str | Path, paths: Sequence[str | Path], jsonl_key: str = "text"
) -> TokenDataset:
    """One document per file, except `.jsonl`: one per line, the UTF-8 bytes of its `jsonl_key` field."""
    paths = [Path(p) for p in paths]
    documents = itertools.chain.from_iterable(
        _jsonl_documents(p, jsonl_key) if p.suffix == ".jsonl" else [p.read_bytes()] for p in paths
    )
    return write_dataset(prefix, documents, source="text files: " + ", ".join(map(str, paths)))


def _jsonl_documents(path: Path, key: str) -> Iterator[bytes]:
    with open(path, "rb") as lines:
        for lineno, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}, line {lineno}: not valid JSON ({e.msg})") from e
            if not isinstance(record, dict) or key not in record:
                raise DatasetError(f"{path}, line {lineno}: no {key!r} field")
            if not isinstance(record[key], str):
                kind = type(record[key]).__name__
                raise DatasetError(f"{path}, line {lineno}: field {key!r} is {kind}, not a string")
            yield record[key].encode("utf-8")


def build_from_python_sources(
    prefix: str | Path, per: str = "package", max_documents: int | None = None
) -> TokenDataset:
    """The running interpreter's Python sources (stdlib, then site-packages), one document per `.py`
    file (`per="file"`) or per top-level package directory, its files concatenated in sorted order
    (`per="package"`: repository-level samples, the long tail). Same machine, same order."""
    if per not in ("file", "package"):
        raise ValueError(f"per must be 'file' or 'package', got {per!r}")
    roots = _python_source_roots()
    documents = (doc for root in roots for doc in _source_documents(root, per) if doc)
    if max_documents is not None:
        documents = itertools.islice(documents, max_documents)
    source = f"python sources, one document per {per}: " + ", ".join(map(str, roots))
    return write_dataset(prefix, documents, source)


def _python_source_roots() -> list[Path]:
    paths = sysconfig.get_paths()
    roots = dict.fromkeys(Path(paths[k]).resolve() for k in ("stdlib", "purelib", "platlib"))
    return [root for root in roots if root.is_dir()]


def _source_documents(root: Path, per: str) -> Iterator[bytes]:
    if per == "file":
        yield from (path.read_bytes() for path in _python_files(root))
        return
    for entry in sorted(root.iterdir()):
        if entry.is_dir() and entry.name not in _SKIPPED_DIRS:
            yield b"".join(path.read_bytes() for path in _python_files(entry))
        elif entry.suffix == ".py" and entry.is_file():
            yield entry.read_bytes()


def _python_files(directory: Path) -> list[Path]:
    """`.py` files under `directory`, sorted by relative path parts (a stable, platform-free order)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_DIRS]
        found.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    found = [p for p in found if p.is_file()]  # drops broken symlinks
    return sorted(found, key=lambda p: p.relative_to(directory).parts)


@dataclass(frozen=True)
class GlobalBatch:
    """One step's sequences: every rank holds the same object (lengths are cheap) and reads only
    the tokens of its own micro-batches."""

    dataset: TokenDataset
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
        dataset: TokenDataset,
        global_tokens: int,
        seed: int = 0,
        max_len: int | None = None,
        min_len: int = 2,
    ) -> None:
        if global_tokens < 1:
            raise ValueError(f"global_tokens must be >= 1, got {global_tokens}")
        if min_len < 1 or (max_len is not None and max_len < min_len):
            raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
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


def _frozen(values: np.ndarray) -> np.ndarray:
    """A read-only copy: a batch is shared by every consumer and must not drift."""
    values = values.astype(np.int64)
    values.flags.writeable = False
    return values
