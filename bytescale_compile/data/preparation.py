"""`data prepare`: users' text into the memory-mapped token dataset the sampler reads (data/dataset.py).

Documents (formats in `sources`) are tokenized in worker processes without the tokenizer's own special
tokens; its EOS is appended to each, and ids are stored in the smallest dtype holding the vocabulary.
Each document goes to the held-out eval split with probability `eval_fraction`, drawn from `seed` in
document order, so the split is the same for any number of workers; a long document's pieces stay in
one split. The training dataset is written at PREFIX, the eval split at PREFIX + "_eval".
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from multiprocessing.pool import Pool
from pathlib import Path
from typing import Any, cast

import numpy as np

from .dataset import DatasetWriter, TokenDataset, TokenizerInfo, token_dtype
from .sources import SourceStats, read_documents, resolve_inputs
from .spec import DatasetError, dataset_files
from .tokenizer import LoadedTokenizer, load_tokenizer

__all__ = ["LONG_DOC_POLICIES", "PrepareReport", "eval_prefix", "prepare"]

LONG_DOC_POLICIES = ("split", "drop")
_CHUNK_CHARS = 1 << 20
"""Text per worker task: enough to amortize the pickling, small enough for a steady progress bar."""
_START_METHOD = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
"""Fork: workers inherit the loaded tokenizer instead of importing transformers again."""


def eval_prefix(prefix: str | Path) -> Path:
    """Where `prepare` writes the held-out split of the dataset at `prefix`."""
    prefix = Path(prefix)
    return prefix.with_name(f"{prefix.name}_eval")


@dataclass(frozen=True)
class PrepareReport:
    train: TokenDataset
    eval: TokenDataset | None
    sources: SourceStats
    long_documents: int
    """Documents longer than max_len tokens (EOS included): split or dropped as `long_docs` says."""
    long_docs: str
    max_len: int | None
    text_bytes: int
    """UTF-8 bytes of the documents tokenized."""
    seconds: float

    @property
    def mb_per_second(self) -> float:
        return self.text_bytes / 1e6 / self.seconds

    def summary(self) -> str:
        lines = [self.sources.summary()]
        if self.max_len is not None:
            done = f"split into pieces of <= {self.max_len}" if self.long_docs == "split" else "dropped"
            lines.append(f"{self.long_documents} documents longer than {self.max_len} tokens {done}")
        for name, ds in (("train", self.train), ("eval", self.eval)):
            if ds is not None:
                lines.append(
                    f"{name}: {ds.prefix}: {len(ds)} sequences, {int(ds.lengths.sum())} tokens "
                    f"({ds.dtype}, vocab {ds.vocab_size})"
                )
        lines.append(f"{self.text_bytes / 1e6:.2f} MB of text in {self.seconds:.1f} s ({self.mb_per_second:.2f} MB/s)")
        return "\n".join(lines)


def prepare(
    inputs: Sequence[str | Path],
    tokenizer: str | Path,
    out: str | Path,
    *,
    text_field: str = "text",
    workers: int = 1,
    max_len: int | None = None,
    long_docs: str = "split",
    eval_fraction: float = 0.01,
    seed: int = 0,
    overwrite: bool = False,
    progress: bool = False,
) -> PrepareReport:
    """Tokenize the documents of `inputs` with the tokenizer directory `tokenizer` into datasets at `out`
    and `eval_prefix(out)`. Inputs, tokenizer and outputs are all checked before any work starts. `progress`: a
    bar on stderr, drawn only when stderr is a terminal."""
    _check_options(workers, max_len, long_docs, eval_fraction)
    sources = resolve_inputs(inputs)
    loaded = load_tokenizer(tokenizer)
    train_prefix, held_out_prefix = Path(out), eval_prefix(out)
    _claim_outputs([train_prefix, held_out_prefix], overwrite)
    stats = SourceStats()
    chunks = _chunks(read_documents(sources, text_field, stats))
    rng = np.random.default_rng(seed)
    long_documents = text_bytes = 0
    start = time.perf_counter()
    with ExitStack() as stack:
        from tqdm import tqdm

        encoded = stack.enter_context(_encoded(chunks, loaded, workers))
        shown = progress and sys.stderr.isatty()  # without a terminal the bar prints its every redraw
        bar = stack.enter_context(tqdm(desc="tokenizing", unit="B", unit_scale=True, disable=not shown))
        train = stack.enter_context(DatasetWriter(train_prefix, loaded.vocab_size, loaded.info))
        held_out = (
            stack.enter_context(DatasetWriter(held_out_prefix, loaded.vocab_size, loaded.info))
            if eval_fraction
            else None
        )
        for docs, nbytes in encoded:
            for doc, is_eval in zip(docs, rng.random(len(docs)) < eval_fraction):
                long_documents += max_len is not None and len(doc) > max_len
                for piece in _pieces(doc, max_len, long_docs):
                    (cast(DatasetWriter, held_out) if is_eval else train).append(piece)  # is_eval: a fraction > 0
            text_bytes += nbytes
            bar.update(nbytes)
        _check_filled(train, held_out, stats, eval_fraction)
        source = _describe(inputs, text_field, loaded.info, eval_fraction, seed)
        train_ds = train.finish(source)
        eval_ds = held_out.finish(f"held-out split of {train_prefix}: {source}") if held_out else None
    return PrepareReport(
        train_ds, eval_ds, stats, long_documents, long_docs, max_len, text_bytes, time.perf_counter() - start
    )


def _check_options(workers: int, max_len: int | None, long_docs: str, eval_fraction: float) -> None:
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if max_len is not None and max_len < 2:
        raise ValueError(f"max_len must be >= 2 (a token and its target), got {max_len}")
    if long_docs not in LONG_DOC_POLICIES:
        raise ValueError(f"long_docs must be one of {LONG_DOC_POLICIES}, got {long_docs!r}")
    if not 0 <= eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")


def _claim_outputs(prefixes: list[Path], overwrite: bool) -> None:
    """Refuse to replace existing datasets unless asked; when asked, remove them all first, so a stale
    eval split never sits beside a new training set."""
    existing = [path for prefix in prefixes for path in dataset_files(prefix) if path.exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{existing[0]} exists: pass overwrite (--overwrite) to replace the dataset")
    for path in existing:
        path.unlink()


def _chunks(documents: Iterable[str]) -> Iterator[list[str]]:
    chunk: list[str] = []
    size = 0
    for text in documents:
        chunk.append(text)
        size += len(text)
        if size >= _CHUNK_CHARS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _pieces(doc: np.ndarray, max_len: int | None, long_docs: str) -> list[np.ndarray]:
    if max_len is None or len(doc) <= max_len:
        return [doc]
    if long_docs == "drop":
        return []
    return [doc[i : i + max_len] for i in range(0, len(doc), max_len)]


def _check_filled(
    train: DatasetWriter, held_out: DatasetWriter | None, stats: SourceStats, eval_fraction: float
) -> None:
    """An empty split is an error that says why, before either dataset is finished."""
    if train.num_sequences == 0:
        raise DatasetError(f"no documents to write to {train.prefix}:\n{stats.summary()}")
    if held_out is not None and held_out.num_sequences == 0:
        raise DatasetError(
            f"no document of {stats.documents} fell into the eval split {held_out.prefix} at "
            f"eval_fraction {eval_fraction}: raise it (--eval-fraction), or pass 0 for no eval split"
        )


def _describe(
    inputs: Sequence[str | Path], text_field: str, info: TokenizerInfo, eval_fraction: float, seed: int
) -> str:
    shown = ", ".join(map(str, inputs[:5])) + (f" and {len(inputs) - 5} more" if len(inputs) > 5 else "")
    return (
        f"{shown} (field {text_field!r}), tokenized by {info.name_or_path} with EOS appended; "
        f"eval fraction {eval_fraction}, seed {seed}"
    )


@dataclass(frozen=True)
class _Encoder:
    """Texts to id arrays, EOS appended, in the dataset's dtype (less to pickle back from a worker)."""

    tokenizer: Any
    eos_token_id: int
    dtype: np.dtype

    def __call__(self, texts: list[str]) -> tuple[list[np.ndarray], int]:
        rows = self.tokenizer(
            texts, add_special_tokens=False, return_attention_mask=False, return_token_type_ids=False, verbose=False
        )["input_ids"]
        docs = []
        for row in rows:
            doc = np.empty(len(row) + 1, dtype=self.dtype)
            doc[:-1] = row
            doc[-1] = self.eos_token_id
            docs.append(doc)
        return docs, sum(len(text.encode("utf-8")) for text in texts)


_worker_encoder: _Encoder | None = None


def _start_worker(encoder: _Encoder) -> None:
    global _worker_encoder
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the workers already use the cores
    _worker_encoder = encoder


def _encode_in_worker(texts: list[str]) -> tuple[list[np.ndarray], int]:
    assert _worker_encoder is not None  # the pool's initializer set it
    return _worker_encoder(texts)


@contextmanager
def _encoded(
    chunks: Iterable[list[str]], loaded: LoadedTokenizer, workers: int
) -> Iterator[Iterator[tuple[list[np.ndarray], int]]]:
    """The chunks' encodings in order: in this process for one worker, else from a pool."""
    encoder = _Encoder(loaded.tokenizer, loaded.info.eos_token_id, token_dtype(loaded.vocab_size))
    if workers == 1:
        yield map(encoder, chunks)
        return
    with multiprocessing.get_context(_START_METHOD).Pool(workers, _start_worker, (encoder,)) as pool:
        yield _in_order(pool, chunks, depth=2 * workers)


def _in_order(pool: Pool, chunks: Iterable[list[str]], depth: int) -> Iterator[tuple[list[np.ndarray], int]]:
    """Like `pool.imap`, but reads at most `depth` chunks ahead (imap would read the whole corpus into memory)."""
    pending: deque = deque()
    for chunk in chunks:
        pending.append(pool.apply_async(_encode_in_worker, (chunk,)))
        if len(pending) >= depth:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()
