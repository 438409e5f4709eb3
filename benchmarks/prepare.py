"""Data-preparation throughput: MB of text per second through `bytescale_compile.data.prepare`.

The corpus is the running interpreter's `.py` files (`data.python_source_files`: stdlib first, sorted;
`--mb` MB of them, one document per file). A byte-level BPE (`--vocab-size`) is first trained on the same files with
`train_tokenizer`, and its time printed. Then `prepare` runs with 1 and 2 workers (or `--workers`); the
time is the whole call: reading, tokenizing, splitting off 1% for eval and writing both datasets.
TOKENIZERS_PARALLELISM is switched off, so one worker is one core and the worker count is the
parallelism. Everything is written to a temporary directory and removed afterwards.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["TOKENIZERS_PARALLELISM"] = "false"

from bytescale_compile.data import prepare, train_tokenizer  # noqa: E402
from bytescale_compile.data.dataset import python_source_files  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=30.0, help="MB of Python sources (default 30)")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--workers", default="1,2", help="worker counts to measure (default 1,2)")
    args = parser.parse_args()
    files = python_source_files(int(args.mb * 1e6))
    size = sum(p.stat().st_size for p in files) / 1e6
    print(
        f"corpus: {len(files)} .py files of this interpreter (stdlib first), {size:.1f} MB; {os.cpu_count()} CPU cores"
    )
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        trained = train_tokenizer(files, args.vocab_size, Path(tmp, "tok"))
        print(f"tokenizer train: vocab {trained.vocab_size} in {time.perf_counter() - start:.1f} s")
        print(f"{'workers':>7} {'MB/s':>7} {'seconds':>8} {'tokens':>11} {'bytes/token':>11}")
        for workers in map(int, args.workers.split(",")):
            report = prepare(files, trained.path, Path(tmp, f"ds{workers}"), workers=workers)
            tokens = int(report.train.lengths.sum() + report.eval.lengths.sum())
            print(
                f"{workers:>7} {report.mb_per_second:>7.2f} {report.seconds:>8.1f} {tokens:>11,} "
                f"{report.text_bytes / tokens:>11.2f}"
            )


if __name__ == "__main__":
    main()
