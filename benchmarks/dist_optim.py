"""The distributed optimizer against plain fp32 AdamW: bytes per parameter held, and the step on CPU ranks.

Two paths train the same seeded Hugging Face `LlamaForCausalLM` (hidden 256, 4 layers, 4 heads / 2 KV heads,
intermediate 512, vocab 1024, untied embeddings) on `--ranks` gloo ranks, through `bytescale_compile.Runtime`
(strategy "balance", autocast bf16 forward, gradient clipping at 1):

  before  fp32 weights, `torch.optim.AdamW` (`train.optim.build_optimizer`, no ZeRO), every rank's gradients
          all-reduced after the backward (in `collectives.BUCKET_BYTES` buckets);
  after   `DistributedOptimizer`: bf16 weights, an fp32 gradient buffer reduce-scattered in buckets of
          `--bucket-bytes` while the backward still runs, fp32 main weights and AdamW moments sharded.

Prints:
  1. bytes per parameter of weights + gradients + master + optimizer state counted from the live tensors (each
     distinct storage once) on every rank after the measured steps, beside the `MemoryModel` formula at N =
     `--ranks`; then the formula's bytes per parameter at N = 1, 4, 64 for fp32, fp32 ZeRO-1 and bf16 for this
     model's parameter count. The formula's `buckets` part (fp32: the flat copy of one all-reduce bucket) is
     transient, so it is not among the live tensors;
  2. per path, over `--steps` steps after `--warmup` warm-up steps (the first compiles), on one fixed batch of
     varied sequence lengths (drawn once from a seeded generator, `--tokens` in all, capacity `--capacity`):
     the mean step time, the mean reduction time left exposed after the backward (`StepStats.reduce_time`),
     the share of buckets reduce-scattered during the backward (`reduce_overlap`), the gradient bytes each rank
     reduced per step, and the loss of the last step of each (close, not equal: bf16 weights).
Rank 0's figures; timings are printed, never asserted. The ranks share the machine's cores, so the overlap
shows the schedule of the reductions, not the speedup a GPU (compute beside communication) would give.

    python benchmarks/dist_optim.py [--ranks 4] [--tokens 4096] [--capacity 1024] [--warmup 2] [--steps 4]
                                    [--bucket-bytes 1M]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bytescale_compile as bsc  # noqa: E402
from bytescale_compile.engine.collectives import BUCKET_BYTES  # noqa: E402
from bytescale_compile.engine.dist_optim import DistributedOptimizer  # noqa: E402
from bytescale_compile.engine.optim import build_optimizer  # noqa: E402
from bytescale_compile.engine.runtime import CostModelWarning  # noqa: E402
from bytescale_compile.planner.memory import MemoryModel  # noqa: E402
from bytescale_compile.testing import run_distributed  # noqa: E402
from bytescale_compile.units import parse_size  # noqa: E402

VOCAB = 1024
LR, BETAS, DECAY = 1e-3, (0.9, 0.95), 0.1
PARTS = ("weights", "gradients", "master", "optimizer")
MIB = 2**20


def llama() -> torch.nn.Module:
    """The model under test, fp32, from a fixed seed (both paths start from the same weights)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config).float().train()


def lengths(tokens: int, capacity: int, seed: int) -> list[int]:
    """Sequence lengths drawn once from a seeded generator (log-normal around `capacity` / 4, at most 2 x
    `capacity`) until they add up to `tokens`."""
    rng = np.random.default_rng(seed)
    drawn: list[int] = []
    while sum(drawn) < tokens:
        drawn.append(int(min(rng.lognormal(np.log(capacity / 4), 1.0), 2 * capacity)) + 8)
    drawn[-1] -= sum(drawn) - tokens
    if drawn[-1] < 8:
        drawn[-2] += drawn.pop()
    return drawn


def batch(seq_lengths: list[int], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in seq_lengths]


def _storages(tensors: list[torch.Tensor]) -> dict[int, int]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def held_bytes(model: torch.nn.Module, optimizer) -> dict[str, int]:
    """Bytes of the distinct storages behind the weights, gradients, master weights and optimizer state, by part
    (a storage counted once, under the first part that holds it), and their total."""
    params = list(model.parameters())
    groups: dict[str, list[torch.Tensor]] = {
        "weights": params,
        "gradients": [p.grad for p in params if p.grad is not None],
        "master": [],
        "optimizer": [],
    }
    if isinstance(optimizer, DistributedOptimizer):
        groups["gradients"].append(optimizer.grads.data)
        groups["master"].append(optimizer.main)
        groups["optimizer"] += list(optimizer.moments.values())
        states = optimizer.inner.state.values()
    else:
        states = optimizer.state.values()
    for state in states:
        groups["optimizer"] += [t for t in state.values() if isinstance(t, torch.Tensor)]
    seen: set[int] = set()
    held = {}
    for part in PARTS:
        storages = {k: v for k, v in _storages(groups[part]).items() if k not in seen}
        seen |= storages.keys()
        held[part] = sum(storages.values())
    held["total"] = sum(held[p] for p in PARTS)
    return held


def run_path(name: str, rank: int, world: int, args: argparse.Namespace, seq_lengths: list[int]) -> dict:
    """Build the model and the path's optimizer, warm up, measure; the figures and the held bytes."""
    model = llama()
    numel = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())
    if name == "after":
        optimizer = DistributedOptimizer(model, LR, DECAY, BETAS, bucket_bytes=args.bucket_bytes)
        buckets = len(optimizer.buckets)
    else:
        optimizer = build_optimizer(model, LR, DECAY, BETAS)
        buckets = 0
    runtime = bsc.Runtime(model, optimizer, strategy="balance", capacity=args.capacity, mixed_precision=torch.bfloat16)
    data = batch(seq_lengths, args.seed)
    for _ in range(args.warmup):
        runtime.step(data)
    measured = [runtime.step(data) for _ in range(args.steps)]
    held = held_bytes(model, optimizer)
    everyone = [None] * world
    dist.all_gather_object(everyone, held["total"])
    return {
        "numel": numel,
        "largest": largest,
        "buckets": buckets,
        "held": held,
        "held_max": max(everyone),
        "time": statistics.mean(s.time for s in measured),
        "reduce_time": statistics.mean(s.reduce_time for s in measured),
        "overlap": statistics.mean(s.reduce_overlap for s in measured),
        "reduced": statistics.mean(s.allreduce_bytes for s in measured),
        "loss": measured[-1].loss,
        "micro_batches": measured[-1].micro_batches,
        "compilations": runtime.model.compilations,
    }


def formula(numel: int, largest: int, n: int, dtype: str, zero: bool, bucket_bytes: int) -> MemoryModel:
    return MemoryModel(
        params=numel,
        hdp_size=n,
        dtype=dtype,
        zero=zero,
        bucket_bytes=bucket_bytes,
        largest_param=largest,
        layers=4,
    )


def report(results: dict[str, dict], world: int, args: argparse.Namespace, seq_lengths: list[int]) -> None:
    before, after = results["before"], results["after"]
    numel, largest = before["numel"], before["largest"]
    print(
        f"\nLlamaForCausalLM (hidden 256, 4 layers, 4/2 heads, intermediate 512, vocab {VOCAB}): {numel:,} "
        f"parameters (largest {largest:,}); {world} gloo ranks; DistributedOptimizer buckets of "
        f"{args.bucket_bytes / MIB:g} MiB ({after['buckets']} buckets)"
    )

    print(
        f"\n1. bytes per parameter held on rank 0 (live tensors, distinct storages) vs the MemoryModel at N = {world}"
    )
    header = f"{'path':<34} {'source':<8} " + " ".join(f"{p:>9}" for p in PARTS) + f" {'total':>7} {'max rank':>8}"
    print(header)
    print("-" * len(header))
    layouts = {
        "before: fp32 AdamW (no ZeRO)": (before, "fp32", BUCKET_BYTES),
        "after: bf16 DistributedOptimizer": (after, "bf16", args.bucket_bytes),
    }
    for label, (result, dtype, bucket_bytes) in layouts.items():
        held = result["held"]
        print(
            f"{label:<34} {'live':<8} "
            + " ".join(f"{held[p] / numel:>9.3f}" for p in PARTS)
            + f" {held['total'] / numel:>7.3f} {result['held_max'] / numel:>8.3f}"
        )
        static = formula(numel, largest, world, dtype, False, bucket_bytes).static
        parts = static.parts()
        print(
            f"{'':<34} {'formula':<8} "
            + " ".join(f"{parts[p] / numel:>9.3f}" for p in PARTS)
            + f" {(static.total - static.buckets) / numel:>7.3f}"
            + (f"   (+ {static.buckets / numel:.3f} transient bucket copy)" if static.buckets else "")
        )
    print(
        f"\nMemoryModel bytes per parameter ({numel:,} parameters; buckets as the paths use them: fp32 all-reduces "
        f"{BUCKET_BYTES / MIB:g} MiB, bf16 reduce-scatters {args.bucket_bytes / MIB:g} MiB)"
    )
    print(f"{'layout':<12} " + " ".join(f"{f'N = {n}':>8}" for n in (1, 4, 64)))
    table = {
        "fp32": ("fp32", False, BUCKET_BYTES),
        "fp32 ZeRO-1": ("fp32", True, BUCKET_BYTES),
        "bf16": ("bf16", False, args.bucket_bytes),
    }
    for label, (dtype, zero, bucket_bytes) in table.items():
        values = [formula(numel, largest, n, dtype, zero, bucket_bytes).bytes_per_param for n in (1, 4, 64)]
        print(f"{label:<12} " + " ".join(f"{v:>8.2f}" for v in values))
    print(
        "(fp32 at N > 1 counts the flat copy of one all-reduce bucket, here the whole model; bf16 at N = 1 holds "
        "an unsharded fp32 master copy beside the bf16 weights: 2 + 4 + 4 + 8)"
    )

    total = sum(seq_lengths)
    print(
        f"\n2. step on {world} CPU ranks (gloo), strategy balance, capacity {args.capacity}: one fixed batch of "
        f"{len(seq_lengths)} sequences, {total:,} tokens (lengths {seq_lengths}); {args.warmup} warm-up + "
        f"{args.steps} measured steps, means over the measured ones (rank 0)"
    )
    header = (
        f"{'path':<34} {'step s':>7} {'exposed reduce s':>16} {'overlap':>7} {'MiB reduced/rank':>16} "
        f"{'last loss':>10} {'micro-batches':>13} {'compiles':>8}"
    )
    print(header)
    print("-" * len(header))
    for label, result in zip(layouts, (before, after)):
        print(
            f"{label:<34} {result['time']:>7.3f} {result['reduce_time']:>16.4f} {result['overlap']:>7.0%} "
            f"{result['reduced'] / MIB:>16.2f} {result['loss']:>10.5f} {str(result['micro_batches']):>13} "
            f"{result['compilations']:>8}"
        )
    print(
        f"\nlast loss: before {before['loss']:.6f}, after {after['loss']:.6f} (relative difference "
        f"{abs(after['loss'] - before['loss']) / abs(before['loss']):.2e}; bf16 weights, same batch and seed)"
    )
    print(
        f"note: {world} ranks share {os.cpu_count()} cores (1 thread each), so compute and communication compete "
        f"for the same cores: the overlap column shows the schedule (buckets reduce-scattered while the backward "
        f"still runs), the exposed time what was left to wait for after it; not the speedup a GPU would show. "
        f"Before all-reduces {BUCKET_BYTES / MIB:g} MiB buckets after the backward; after reduce-scatters "
        f"{args.bucket_bytes / MIB:g} MiB buckets (fp32, padded to a multiple of {world})."
    )


def _worker(rank: int, world: int, args: argparse.Namespace, seq_lengths: list[int]) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", CostModelWarning)
    results = {name: run_path(name, rank, world, args, seq_lengths) for name in ("before", "after")}
    if rank == 0:
        report(results, world, args, seq_lengths)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens in the batch (default 4096)")
    parser.add_argument("--capacity", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps, not measured (default 2)")
    parser.add_argument("--steps", type=int, default=4, help="measured steps (default 4)")
    parser.add_argument(
        "--bucket-bytes",
        type=parse_size,
        default=MIB,
        help="DistributedOptimizer bucket size, e.g. 1M or 256K (default 1M)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the lengths and the tokens")
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    run_distributed(_worker, args.ranks, args, lengths(args.tokens, args.capacity, args.seed))


if __name__ == "__main__":
    main()
