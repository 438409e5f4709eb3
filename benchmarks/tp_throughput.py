"""Tokens/s of TP 2 × HDP 2 against HDP 4 on 4 CPU ranks, each beside the Runtime's predicted step time.

Both train the same seeded Hugging Face `LlamaForCausalLM` (hidden 256, 4 layers, 8 heads / 4 KV heads,
intermediate 1024, vocab 1024) through `bytescale_compile.Runtime` (strategy "balance", fp32, SGD) on one
fixed batch of varied lengths (`--tokens` in all, drawn once from a seeded generator). With TP 2 an HDP
rank is a TP group of two processes, so the plan has two HDP ranks and the capacity is the group's:
`--capacity` for HDP 4, twice it for TP 2 (the same tokens per process).

Each layout first calibrates its cost model on the spot (`train/calibrate.py`, as the trainer does: T(s) of
an HDP rank, its TP collectives included, and the ring's bandwidth, timed on these processes). Prints per
layout the mean step time over `--steps` steps after `--warmup` (the first compiles), the tokens/s, and the
simulator's step time for the same plans (`Runtime.predict`). Timings are printed, never asserted;
the four processes share the machine's cores.

    python benchmarks/tp_throughput.py [--tokens 4096] [--capacity 1024] [--warmup 2] [--steps 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bytescale_compile as bsc  # noqa: E402
from bytescale_compile.engine.runtime import CostModelWarning  # noqa: E402
from bytescale_compile.testing import run_distributed  # noqa: E402
from bytescale_compile.train.calibrate import calibrate  # noqa: E402

VOCAB = 1024


def llama() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config)


def batch(tokens: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lengths, left = [], tokens
    while left > 0:
        n = min(left, int(torch.randint(16, tokens // 2, (1,), generator=g)))
        lengths.append(n)
        left -= n
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


def worker(rank: int, world: int, tp: int, args: argparse.Namespace) -> None:
    warnings.simplefilter("ignore", CostModelWarning)
    model = bsc.tensor_parallel(llama(), tp)
    runtime = bsc.Runtime(model, torch.optim.SGD(model.parameters(), lr=1e-3), capacity=args.capacity * tp)
    runtime.cost_model = calibrate(runtime).cost_model
    data = batch(args.tokens)
    times, predicted = [], []
    for step in range(args.warmup + args.steps):
        stats = runtime.step(data)
        if step >= args.warmup:
            times.append(stats.time)
            predicted.append(runtime.predict(stats).time)
    if rank == 0:
        mean = statistics.mean(times)
        layout = f"TP {tp} × HDP {world // tp}"
        print(
            f"| {layout} | {mean * 1e3:.0f} ms | {args.tokens / mean:.0f} | {statistics.mean(predicted) * 1e3:.1f} ms |",
            flush=True,
        )
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--capacity", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    print("| layout (4 CPU ranks) | step | tokens/s | predicted step |")
    print("|---|---|---|---|")
    for tp in (1, 2):
        run_distributed(worker, 4, tp, args)


if __name__ == "__main__":
    main()
