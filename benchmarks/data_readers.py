"""Read throughput of the dataset readers on the same synthetic tokens: our own format (`data prepare`),
Megatron-LM's indexed `.bin`/`.idx` (`MegatronDataset`), a Hugging Face `save_to_disk` folder (`HFDataset`)
and Parquet converted once into our format (`token_files.py`).

`--sequences` (default 200,000) sequences of heavy-tailed lengths (Pareto 1.2, 1..16K tokens), ids below a
50,304 vocabulary: uint16 in ours and Megatron's, int32 in the Hugging Face folder (as tokenizers' ids usually
are) and in Parquet. Everything is written to a temporary directory, then read from the page cache (just
written: warm). Per reader:

- open: open the dataset up to its lengths (what planning needs), median of 5; sequences/s = sequences / open;
- random reads: `tokens(i)` of whole sequences at `--reads` random ids, sequences/s and tokens/s;
- batches/s: `GlobalBatchSampler` (1M tokens a batch, max_len 16K) drawing `--batches` batches, first without
  reading a token (what every rank does), then reading every token of each batch (more than one rank reads).

The one-off conversion of the Parquet file (its first open) is timed on its own. Each figure is the median of
`--repeat` rounds, each round measuring every reader in turn (the machine may be shared).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import datasets  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from bytescale_compile.data import GlobalBatchSampler, TokenDataset, open_dataset  # noqa: E402
from bytescale_compile.data.dataset import DatasetWriter  # noqa: E402
from bytescale_compile.data.token_files import CACHE_ENV  # noqa: E402

VOCAB = 50_304
MAX_LEN = 16_384
GLOBAL_TOKENS = 1 << 20


def synthetic(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """All ids back to back (uint16) and the n + 1 offsets of the sequences."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.pareto(1.2, n) * 60 + 1, MAX_LEN).astype(np.int64)
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    return rng.integers(0, VOCAB, int(offsets[-1]), dtype=np.uint16), offsets


def write_ours(prefix: Path, ids: np.ndarray, offsets: np.ndarray) -> str:
    with DatasetWriter(prefix, VOCAB) as writer:
        writer.extend(ids, offsets)
        writer.finish("synthetic")
    return str(prefix)


def write_megatron(prefix: Path, ids: np.ndarray, offsets: np.ndarray) -> str:
    """Megatron's layout (megatron/core/datasets/indexed_dataset.py): one document per sequence."""
    n = len(offsets) - 1
    Path(f"{prefix}.bin").write_bytes(ids.tobytes())
    header = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, n, n + 1)  # dtype code 8: uint16
    lengths = np.diff(offsets).astype(np.int32)
    pointers = (offsets[:-1] * ids.itemsize).astype(np.int64)
    documents = np.arange(n + 1, dtype=np.int64)
    Path(f"{prefix}.idx").write_bytes(header + lengths.tobytes() + pointers.tobytes() + documents.tobytes())
    return f"{prefix}?vocab_size={VOCAB}"


def token_table(ids: np.ndarray, offsets: np.ndarray) -> pa.Table:
    lists = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(ids.astype(np.int32)))
    return pa.table({"input_ids": lists})


def write_hf(path: Path, ids: np.ndarray, offsets: np.ndarray) -> str:
    datasets.disable_progress_bars()
    datasets.Dataset(datasets.table.InMemoryTable(token_table(ids, offsets))).save_to_disk(path)
    return f"{path}?vocab_size={VOCAB}"


def write_parquet(path: Path, ids: np.ndarray, offsets: np.ndarray) -> str:
    pq.write_table(token_table(ids, offsets), path, row_group_size=10_000)
    return f"{path}?vocab_size={VOCAB}"


def seconds(fn: Callable[[], object]) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def measure(spec: str, args: argparse.Namespace) -> dict[str, float]:
    """One round of every figure for the dataset at `spec`."""
    data = open_dataset(spec)
    picks = np.random.default_rng(1).integers(0, len(data), args.reads)

    def reads() -> None:
        for i in picks:
            data.tokens(int(i))

    def draw(read: bool) -> Callable[[], None]:
        def run() -> None:
            sampler = GlobalBatchSampler(data, GLOBAL_TOKENS, seed=0, max_len=MAX_LEN)
            for batch in itertools.islice(sampler, args.batches):
                if read:
                    for seq in range(len(batch.indices)):
                        batch.tokens(seq)

        return run

    opened = statistics.median(seconds(lambda: open_dataset(spec).lengths) for _ in range(5))
    read = seconds(reads)
    return {
        "open_ms": opened * 1e3,
        "lengths_seq_s": len(data) / opened,
        "read_seq_s": args.reads / read,
        "read_tok_s": int(data.lengths[picks].sum()) / read / 1e6,
        "batches_s": args.batches / seconds(draw(False)),
        "batches_read_s": args.batches / seconds(draw(True)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=200_000)
    parser.add_argument("--reads", type=int, default=20_000, help="random whole-sequence reads (default 20,000)")
    parser.add_argument("--batches", type=int, default=20, help="global batches drawn (default 20)")
    parser.add_argument("--repeat", type=int, default=5, help="rounds over the readers, medians printed (default 5)")
    args = parser.parse_args()
    ids, offsets = synthetic(args.sequences)
    print(
        f"{args.sequences:,} sequences, {ids.size:,} tokens (mean {ids.size / args.sequences:.0f}, "
        f"max {int(np.diff(offsets).max()):,}), vocab {VOCAB:,}; {os.cpu_count()} CPU cores, warm page cache"
    )
    with tempfile.TemporaryDirectory() as tmp:
        os.environ[CACHE_ENV] = str(Path(tmp, "cache"))
        specs = {
            "ours": write_ours(Path(tmp, "ours"), ids, offsets),
            "megatron": write_megatron(Path(tmp, "megatron"), ids, offsets),
            "hf save_to_disk": write_hf(Path(tmp, "hf"), ids, offsets),
            "parquet": write_parquet(Path(tmp, "tokens.parquet"), ids, offsets),
        }
        began = time.perf_counter()
        converted = open_dataset(specs["parquet"])
        seconds = time.perf_counter() - began
        assert isinstance(converted, TokenDataset) and np.array_equal(converted.lengths, np.diff(offsets))
        print(f"parquet: converted once in {seconds:.2f} s ({ids.size / seconds / 1e6:.1f} M tokens/s)\n")
        print(
            f"{'reader':>16} {'open ms':>8} {'lengths seq/s':>14} {'read seq/s':>11} {'read tok/s':>11} "
            f"{'batches/s':>10} {'+tokens b/s':>12}"
        )
        rounds: dict[str, list[dict[str, float]]] = {name: [] for name in specs}
        for _ in range(args.repeat):  # alternating, so that other jobs' load falls on every reader alike
            for name, spec in specs.items():
                rounds[name].append(measure(spec, args))
        for name, runs in rounds.items():
            m = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
            print(
                f"{name:>16} {m['open_ms']:>8.1f} {m['lengths_seq_s']:>14,.0f} {m['read_seq_s']:>11,.0f} "
                f"{m['read_tok_s']:>10.1f}M {m['batches_s']:>10.0f} {m['batches_read_s']:>12.1f}"
            )


if __name__ == "__main__":
    main()
