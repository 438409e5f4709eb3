"""CPU step time of an MoE model's experts under TP 2: expert-parallel inside the TP group against TP experts.

Both train the same seeded Hugging Face `Qwen3MoeForCausalLM` (hidden 256, 4 layers, 8 experts of intermediate
256, top 2, vocab 1024, fp32, SGD) through `bytescale_compile.Runtime` (strategy "balance") on one fixed batch
of varied lengths (`tp_throughput.py`'s), on 2 gloo ranks forming one TP group (`bsc.tensor_parallel(model, 2, expert_layout=...)`):
"ep" gives each rank 4 whole experts, "tp" a half of every expert; "tp 1" is the same 2 processes as 2 HDP
ranks with the experts whole. Prints the mean step time over `--steps` steps after `--warmup` (the first
compiles) and the tokens/s. Timings are printed, never asserted; the processes share the machine's cores.

    python benchmarks/moe_tp.py [--tokens 2048] [--capacity 1024] [--warmup 2] [--steps 3]
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
from benchmarks.tp_throughput import VOCAB, batch  # noqa: E402
from bytescale_compile.engine.runtime import CostModelWarning  # noqa: E402
from bytescale_compile.testing import run_distributed  # noqa: E402

LAYOUTS = {"tp 1 (2 HDP ranks)": (1, "auto"), "tp 2, ep": (2, "ep"), "tp 2, tp experts": (2, "tp")}


def qwen3_moe() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        use_cache=False,
    )
    return transformers.Qwen3MoeForCausalLM(config)


def worker(rank: int, world: int, name: str, args: argparse.Namespace) -> None:
    warnings.simplefilter("ignore", CostModelWarning)
    tp, layout = LAYOUTS[name]
    model = bsc.tensor_parallel(qwen3_moe(), tp, expert_layout=layout)
    runtime = bsc.Runtime(model, torch.optim.SGD(model.parameters(), lr=1e-3), capacity=args.capacity * tp)
    data = batch(args.tokens)
    times = []
    for step in range(args.warmup + args.steps):
        stats = runtime.step(data)
        if step >= args.warmup:
            times.append(stats.time)
    if rank == 0:
        mean = statistics.mean(times)
        print(f"| {name} | {mean * 1e3:.0f} ms | {args.tokens / mean:.0f} |", flush=True)
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--capacity", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    print("| layout (2 CPU ranks) | step | tokens/s |")
    print("|---|---|---|")
    for name in LAYOUTS:
        run_distributed(worker, 2, name, args)


if __name__ == "__main__":
    main()
