"""Packed ring attention on CPU ranks (gloo): a sliding window against full causal attention.

For each total token count (one sequence of that length, zigzag over N ranks) and each window (none
= full causal, then `--windows`), this prints the forward+backward wall time of the ring (the slowest
rank, median over `--repeats` after a warm-up) and the bytes each rank sent, forward and backward
(min and max over the ranks), next to what the previous ring design moved (every rank's whole K/V
to every other rank, (N-1) × T_local × Hkv × (D + Dv) × 4 bytes forward). It also prints the
transfers each rank skipped because the layout left it nothing to send, and the blocks computed
and skipped.

On a 2-core machine N ranks oversubscribe the cores: times show the work the window saves and the
cost of the ring machinery, not the overlap of communication with compute, which needs a GPU.
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

from bytescale_compile.runtime.layout import zigzag_layout  # noqa: E402
from bytescale_compile.runtime.p2p import P2PStats  # noqa: E402
from bytescale_compile.runtime.ring_attention import ring_attention_bwd, ring_attention_fwd  # noqa: E402
from bytescale_compile.testing import run_distributed  # noqa: E402

HQ, HKV, D = 2, 1, 32
_FIELDS = ("bytes_sent", "sends_skipped", "blocks_computed", "blocks_skipped")


def _ring_worker(rank: int, world: int, tokens: int, window: int | None, repeats: int, result: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    layout = zigzag_layout([tokens], world)
    t_local = layout.rank(rank).num_tokens
    q, k, v = (torch.randn(t_local, h, D) for h in (HQ, HKV, HKV))
    g = torch.randn_like(q)
    group = list(range(world))
    times = []
    for i in range(repeats + 1):
        fwd, bwd = P2PStats(), P2PStats()
        dist.barrier()
        start = time.perf_counter()
        out, lse = ring_attention_fwd(q, k, v, layout, group, stats=fwd, check=i == 0, window=window)
        ring_attention_bwd(g, q, k, v, out, lse, layout, group, stats=bwd, window=window)
        elapsed = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    mine = torch.tensor([getattr(s, f) for s in (fwd, bwd) for f in _FIELDS], dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    if rank == 0:
        rows = torch.stack(every)
        Path(result).write_text(
            " ".join(
                map(str, [statistics.median(times[1:]), *rows.min(0).values.tolist(), *rows.max(0).values.tolist()])
            )
        )


def _row(tokens: int, world: int, window: int | None, repeats: int, results: str) -> str:
    path = str(Path(results, f"{tokens}_{world}_{window}"))
    run_distributed(_ring_worker, world, tokens, window, repeats, path)
    t, *values = (float(x) for x in Path(path).read_text().split())
    n = 2 * len(_FIELDS)
    low = dict(zip([f"fwd_{f}" for f in _FIELDS] + [f"bwd_{f}" for f in _FIELDS], values[:n]))
    high = dict(zip(low, values[n:]))
    t_local = tokens // world
    old = (world - 1) * t_local * HKV * (D + D) * 4
    mib = 2**-20

    def span(key: str, scale: float = 1.0) -> str:
        return f"{low[key] * scale:.1f}-{high[key] * scale:.1f}" if scale != 1.0 else f"{low[key]:.0f}-{high[key]:.0f}"

    return (
        f"{tokens:>7} {window or 'causal':>7} {t:>8.2f} {span('fwd_bytes_sent', mib):>13} "
        f"{span('bwd_bytes_sent', mib):>13} {old * mib:>12.1f} {span('fwd_sends_skipped'):>13} "
        f"{int(high['fwd_blocks_computed'])}/{int(high['fwd_blocks_skipped'])}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="32768,65536", help="comma-separated total token counts")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--windows", default="4096", help="comma-separated sliding windows to compare with causal")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    windows = [None, *(int(w) for w in args.windows.split(","))]
    print(
        f"fp32 CPU, {args.ranks} gloo ranks, Hq={HQ} Hkv={HKV} D=Dv={D}, one sequence, fwd+bwd, "
        f"median of {args.repeats} after a warm-up; MiB sent per rank as min-max over the ranks"
    )
    print(
        f"{'tokens':>7} {'window':>7} {'time s':>8} {'fwd MiB/rank':>13} {'bwd MiB/rank':>13} "
        f"{'old ring fwd':>12} {'sends skipped':>13} {'blocks run/skipped (max rank)'}"
    )
    with tempfile.TemporaryDirectory() as results:
        for tokens in (int(t) for t in args.tokens.split(",")):
            for window in windows:
                print(_row(tokens, args.ranks, window, args.repeats, results), flush=True)


if __name__ == "__main__":
    main()
