"""Training on several prepared datasets at once, each given a share of the tokens (`--data a:0.7,b:0.3`).

`MixedDataset` reads the datasets as one: global sequence ids run through the parts in order, so a
`GlobalBatch`, the planners and the evaluation read a mixture like a single `TokenDataset`.
`MixtureSampler` decides what each step trains on: every part is visited in its own seeded order, and
the next sequence always comes from the part furthest behind its share of the tokens taken so far
(stride scheduling), so that each part's token share converges to its weight whatever its sequence
lengths, deterministically on every rank.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from numpy.typing import ArrayLike

from .dataset import (
    _BYTE_VOCAB_SIZE,
    DatasetError,
    GlobalBatch,
    TokenDataset,
    TokenizerInfo,
    _frozen,
    check_sampling,
)
from .formats import held_out_path, open_dataset
from .spec import DataItem, format_data_spec, parse_data_spec

__all__ = [
    "MixedDataset",
    "MixtureSampler",
    "batch_sources",
    "eval_spec",
    "open_data",
]


class MixedDataset:
    """Several `TokenDataset`s read as one, sequence ids running through the parts in order.

    The parts must share a tokenizer: one model reads all their ids. Pickles as the parts' prefixes,
    so a worker reopens the maps instead of receiving the tokens."""

    def __init__(self, parts: Sequence[TokenDataset]) -> None:
        if not parts:
            raise ValueError("a mixture needs at least one dataset")
        first = parts[0]
        for part in parts[1:]:
            if _tokenizer_identity(part) != _tokenizer_identity(first):
                raise DatasetError(
                    f"{part.prefix} (tokenizer {_describe(part)}) was not tokenized like "
                    f"{first.prefix} (tokenizer {_describe(first)}): a mixture's datasets "
                    f"must be prepared with the same tokenizer"
                )
        self.parts = tuple(parts)
        self.names = _unique_names([Path(part.prefix).name for part in parts])
        """A short name per part (its prefix's file name, numbered where two agree): metrics' keys."""
        self.prefix = ",".join(part.spec for part in parts)
        """The parts' `--data` items, comma-separated: `open_data` reopens the same datasets from it."""
        self._starts = [0, *np.cumsum([len(part) for part in parts]).tolist()]
        self._lengths = np.concatenate([part.lengths for part in parts])
        self._lengths.flags.writeable = False

    @classmethod
    def open(cls, prefixes: Iterable[str | Path]) -> MixedDataset:
        return cls([open_dataset(str(prefix)) for prefix in prefixes])

    def __reduce__(self):
        return (MixedDataset.open, ([part.spec for part in self.parts],))

    def __repr__(self) -> str:
        return f"MixedDataset({self.prefix!r})"

    def __len__(self) -> int:
        return self._starts[-1]

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per sequence (int64, read-only), the parts' one after the other."""
        return self._lengths

    @property
    def starts(self) -> list[int]:
        """The global id of each part's first sequence, then the total: part i holds [starts[i], starts[i + 1])."""
        return list(self._starts)

    @property
    def vocab_size(self) -> int:
        return max(part.vocab_size for part in self.parts)

    @property
    def tokenizer(self) -> TokenizerInfo | None:
        return self.parts[0].tokenizer

    @property
    def source(self) -> str:
        return "; ".join(f"{name}: {part.source}" for name, part in zip(self.names, self.parts))

    def max_token(self) -> int:
        return max(part.max_token() for part in self.parts)

    def part_of(self, indices: ArrayLike) -> np.ndarray:
        """Which part each global sequence id belongs to (int64, the shape of `indices`)."""
        ids = np.asarray(indices, dtype=np.int64)
        if ids.size and not (0 <= ids.min() and ids.max() < len(self)):
            raise IndexError(f"sequence ids {ids.min()}..{ids.max()} outside a dataset of {len(self)} sequences")
        return np.searchsorted(self._starts, ids, side="right").astype(np.int64) - 1

    def tokens(self, index: int, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Tokens [start, end) of global sequence `index` as int64, read from its part."""
        if not 0 <= index < len(self):
            raise IndexError(f"sequence {index} outside a dataset of {len(self)} sequences")
        part = bisect.bisect_right(self._starts, index) - 1
        return self.parts[part].tokens(index - self._starts[part], start, end)


def _tokenizer_identity(part: TokenDataset) -> tuple[str, int]:
    """What makes two datasets' ids mean the same: the tokenizer's files and EOS, not where it was loaded from;
    without a tokenizer (bytes, or data given a vocabulary size alone), the vocabulary size."""
    info = part.tokenizer
    return ("no tokenizer", part.vocab_size) if info is None else (info.sha256, info.eos_token_id)


def _describe(part: TokenDataset) -> str:
    info = part.tokenizer
    if info is None:
        return "bytes" if part.vocab_size == _BYTE_VOCAB_SIZE else f"unknown, vocab_size {part.vocab_size}"
    return f"{info.name_or_path}, sha256 {info.sha256[:12]}..."


def _unique_names(names: list[str]) -> list[str]:
    unique: list[str] = []
    for name in names:
        candidate, k = name, 2
        while candidate in unique:
            candidate, k = f"{name}_{k}", k + 1
        unique.append(candidate)
    return unique


class MixtureSampler:
    """Global batches by token budget from a `MixedDataset`, each part getting its weight's share of the tokens.

    Each part visits its sequences of at least `min_len` tokens in a random order seeded by (seed, part,
    epoch), reshuffled whenever it runs out. The next sequence comes from the part whose tokens taken so
    far divided by its weight is smallest (the first on a tie), so every part stays within one sequence
    of its share. A batch takes sequences until the budget is reached (the last may overshoot: sequences
    are never split), each truncated to `max_len`. Every rank constructs it with the same arguments and
    gets the same batches; iteration continues from the current state.
    """

    def __init__(
        self,
        dataset: MixedDataset,
        weights: Sequence[float],
        global_tokens: int,
        seed: int = 0,
        max_len: int | None = None,
        min_len: int = 2,
    ) -> None:
        check_sampling(global_tokens, min_len, max_len)
        if len(weights) != len(dataset.parts):
            raise ValueError(f"{len(weights)} weights for the {len(dataset.parts)} datasets of {dataset.prefix}")
        if not all(math.isfinite(w) and w > 0 for w in weights):
            raise ValueError(f"mixture weights must be numbers > 0, got {list(weights)}")
        total = math.fsum(weights)
        self.dataset = dataset
        self.weights = [w / total for w in weights]
        self.global_tokens = global_tokens
        self.seed = seed
        self._starts = dataset.starts
        self._used = [part.lengths if max_len is None else np.minimum(part.lengths, max_len) for part in dataset.parts]
        self._eligible = [np.flatnonzero(part.lengths >= min_len) for part in dataset.parts]
        for part, used, eligible, weight in zip(dataset.parts, self._used, self._eligible, self.weights):
            usable = int(used[eligible].sum())
            if usable < weight * global_tokens:
                raise ValueError(
                    f"{part.prefix}: only {usable} tokens in sequences of >= {min_len} tokens, fewer than "
                    f"its share of a batch ({weight:.3g} x global_tokens={global_tokens})"
                )
        parts = len(dataset.parts)
        self._taken, self._epochs, self._positions = [0] * parts, [0] * parts, [0] * parts
        self._orders: dict[int, tuple[int, np.ndarray]] = {}
        """Per part, its current epoch and that epoch's order: drawn once, not once a sequence."""

    def _order(self, part: int) -> np.ndarray:
        epoch = self._epochs[part]
        cached = self._orders.get(part)
        if cached is None or cached[0] != epoch:
            order = np.random.default_rng([self.seed, part, epoch]).permutation(self._eligible[part])
            self._orders[part] = cached = (epoch, order)
        return cached[1]

    def _next_sequence(self) -> tuple[int, int]:
        """Global id and tokens used of the next sequence of the part furthest behind its share."""
        part = min(range(len(self.weights)), key=lambda i: self._taken[i] / self.weights[i])
        if self._positions[part] == len(self._eligible[part]):
            self._epochs[part], self._positions[part] = self._epochs[part] + 1, 0
        local = int(self._order(part)[self._positions[part]])
        used = int(self._used[part][local])
        self._positions[part] += 1
        self._taken[part] += used
        return self._starts[part] + local, used

    def __iter__(self) -> Iterator[GlobalBatch]:
        """Infinite: each part's epochs repeat, each reshuffled."""
        while True:
            indices: list[int] = []
            lengths: list[int] = []
            total = 0
            while total < self.global_tokens:
                index, used = self._next_sequence()
                indices.append(index)
                lengths.append(used)
                total += used
            yield GlobalBatch(self.dataset, _frozen(np.array(indices)), _frozen(np.array(lengths)))

    def state_dict(self) -> dict:
        """Per part: tokens taken, epoch and position after the last batch handed out; enough to resume exactly."""
        return {"taken": list(self._taken), "epochs": list(self._epochs), "positions": list(self._positions)}

    def load_state_dict(self, state: dict) -> None:
        taken, epochs, positions = ([int(v) for v in state[key]] for key in ("taken", "epochs", "positions"))
        sizes = [len(eligible) for eligible in self._eligible]
        if not (
            len(taken) == len(epochs) == len(positions) == len(sizes)
            and min(taken + epochs) >= 0
            and all(0 <= p <= n for p, n in zip(positions, sizes))
        ):
            raise ValueError(f"sampler state {state} does not fit {len(sizes)} datasets of {sizes} sequences per epoch")
        self._taken, self._epochs, self._positions = taken, epochs, positions


def batch_sources(batch: GlobalBatch) -> dict[str, int]:
    """Tokens of `batch` per dataset name (every part of a mixture, zeros included, so metrics keep their keys)."""
    data = batch.dataset
    if not isinstance(data, MixedDataset):
        return {Path(data.prefix).name: batch.num_tokens}
    tokens = np.zeros(len(data.parts), dtype=np.int64)
    np.add.at(tokens, data.part_of(batch.indices), batch.lengths)
    return dict(zip(data.names, tokens.tolist()))


def open_data(spec: str) -> tuple[TokenDataset | MixedDataset, list[float] | None]:
    """The dataset of a `--data` spec: one item opens as a `TokenDataset` of its format (`formats.open_dataset`;
    no weights); several as a `MixedDataset` with their normalised weights, for `MixtureSampler`."""
    items = parse_data_spec(spec)
    if len(items) == 1:
        return open_dataset(items[0][0]), None
    return MixedDataset.open(prefix for prefix, _ in items), [weight for _, weight in items]


def eval_spec(spec: str) -> str:
    """`spec` with each dataset replaced by its held-out split (`formats.held_out_path`: `data prepare`'s
    `eval_prefix` for our own format), with the same options and weights."""
    return format_data_spec([(_held_out(item), weight) for item, weight in parse_data_spec(spec)])


def _held_out(item: str) -> str:
    parsed = DataItem.parse(item)
    return str(dataclasses.replace(parsed, path=held_out_path(parsed.path)))
