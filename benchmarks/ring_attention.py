"""Packed ring attention on CPU ranks (gloo) against the same attention work on one rank.

For each total token count (one causal sequence of that length) this prints the forward+backward
wall time of:
  - one rank running segment-causal attention over all tokens (all cores, torch's threads), and
  - the zigzag ring over N ranks (N processes, cores split between them), the time of the slowest
    rank, median over `--repeats` after a warm-up;
plus the K/V bytes each rank sent in the forward and the backward, next to the analytic forward
count (N-1) × T_local × 2 × Hkv × D × element size. On a 2-core machine 4 ranks oversubscribe the
cores: the 4-rank row shows overhead, not speed-up; the point of this CPU run is correctness of the
volumes and the cost of the ring machinery, the overlap itself only shows on a GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bytescale_compile.kernels.attention_ref import causal_attention_bwd, causal_attention_fwd  # noqa: E402
from bytescale_compile.runtime.dist_attn import RingStats, ring_attention_bwd, ring_attention_fwd  # noqa: E402
from bytescale_compile.runtime.layout import zigzag_layout  # noqa: E402
from bytescale_compile.runtime.spawn import run_distributed  # noqa: E402

HQ, HKV, D = 8, 2, 64


def one_rank(tokens: int, repeats: int) -> float:
    q, k, v = (torch.randn(1, h, tokens, D) for h in (HQ, HKV, HKV))
    g = torch.randn_like(q)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        out, lse = causal_attention_fwd(q, k, v, D ** -0.5)
        causal_attention_bwd(g, q, k, v, out, lse, D ** -0.5)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _ring_worker(rank: int, world: int, tokens: int, repeats: int, result_dir: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    layout = zigzag_layout([tokens], world)
    t_local = layout.rank(rank).num_tokens
    q, k, v = (torch.randn(t_local, h, D) for h in (HQ, HKV, HKV))
    g = torch.randn_like(q)
    group = list(range(world))
    times, fwd, bwd = [], RingStats(), RingStats()
    for i in range(repeats + 1):
        fwd_i, bwd_i = RingStats(), RingStats()
        dist.barrier()
        start = time.perf_counter()
        out, lse = ring_attention_fwd(q, k, v, layout, group, stats=fwd_i, check=i == 0)
        ring_attention_bwd(g, q, k, v, out, lse, layout, group, stats=bwd_i)
        elapsed = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
        fwd, bwd = fwd_i, bwd_i
    if rank == 0:
        analytic = (world - 1) * t_local * 2 * HKV * D * 4
        Path(result_dir, f"{tokens}_{world}").write_text(
            f"{statistics.median(times[1:])} {fwd.bytes_sent} {bwd.bytes_sent} {analytic} {fwd.blocks_computed} {fwd.blocks_skipped}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="8192,32768", help="comma-separated total token counts")
    parser.add_argument("--ranks", default="2,4", help="comma-separated ring sizes")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(f"fp32 CPU, Hq={HQ} Hkv={HKV} D={D}, one causal sequence, fwd+bwd, median of {args.repeats}")
    print(f"{'tokens':>7} {'ranks':>5} {'time s':>8} {'vs 1 rank':>9} {'fwd MiB/rank':>12} {'analytic':>9} "
          f"{'bwd MiB/rank':>12} {'blocks run/skipped':>18}")
    with tempfile.TemporaryDirectory() as results:
        for tokens in (int(t) for t in args.tokens.split(",")):
            base = one_rank(tokens, args.repeats)
            print(f"{tokens:>7} {1:>5} {base:>8.2f} {1.0:>9.2f} {0:>12.2f} {0:>9.2f} {0:>12.2f} {'-':>18}", flush=True)
            for world in (int(n) for n in args.ranks.split(",")):
                run_distributed(_ring_worker, world, tokens, args.repeats, results)
                t, fwd, bwd, analytic, run, skipped = Path(results, f"{tokens}_{world}").read_text().split()
                mib = 1 / 2 ** 20
                print(f"{tokens:>7} {world:>5} {float(t):>8.2f} {float(t) / base:>9.2f} {int(fwd) * mib:>12.2f} "
                      f"{int(analytic) * mib:>9.2f} {int(bwd) * mib:>12.2f} {run + '/' + skipped:>18}", flush=True)


if __name__ == "__main__":
    main()
