"""The u × r split of a shared micro-batch (Ulysses degree u inside groups of u ranks, the zigzag ring among r
groups): measured on CPU ranks, then on the simulator.

Prints:
  1. `--part ranks`: one sequence of T tokens (`--tokens`) shared by 4 gloo ranks, fp32, Hq=4 Hkv=2 D=Dv=32
     (u = 4 > Hkv: every K/V head goes to two members), for (u, r) = (4, 1), (2, 2), (1, 4), full causal and
     with each window of `--windows`: forward+backward wall time (the slowest rank, median of `--repeats`
     after a warm-up) and the MiB each rank sent, ring P2P and the Ulysses all-to-all apart, forward and
     backward together, min-max over the ranks.
  2. `--part sim`: simulated steps of 32M tokens on 1024 H100 GPUs (`Hardware.preset("h100-nvlink")`, 8 GPUs
     per node on one NVSwitch), LLaMA-7B at TP 1 (8 HDP ranks per node: u up to 8) and LLaMA-70B at TP 4
     (2 per node: u up to 2; at TP 8 a rank is a whole node and only u = 1 is allowed), C = 8K tokens per
     HDP rank, Byted- and GitHub-like batches at 256K and 1M context, mean of `--seeds` batches: step time
     of static and of balance, each with sp="ring" and sp="auto"; balance auto's speedup over balance ring
     and over static (ring); and the share of each plan's shared micro-batches per Ulysses degree u.

Limits: on a 2-core machine the 4 ranks oversubscribe the cores, so part 1's times show the work each split
does (the all-to-all's copies against the ring's steps), not how communication overlaps compute on a GPU;
the default tokens are 16K and 32K because 64K full causal on 2 cores takes minutes per split (pass
`--tokens 65536`). Part 2 is the cost model's view (`planner/split.py`), not a measurement; the default seeds
(`--seeds`) are few only to keep the run short: each plan takes well under a second.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bytescale_compile.planner import CostModel, Hardware  # noqa: E402
from bytescale_compile.runtime.layout import ulysses_layout  # noqa: E402
from bytescale_compile.runtime.p2p import P2PStats  # noqa: E402
from bytescale_compile.runtime.ulysses import ulysses_attention_bwd, ulysses_attention_fwd  # noqa: E402
from bytescale_compile.sim.experiments import run_strategy  # noqa: E402
from bytescale_compile.sim.lengths import sample_global_batch  # noqa: E402
from bytescale_compile.testing import run_distributed  # noqa: E402

K, M = 2**10, 2**20
WORLD, HQ, HKV, D = 4, 4, 2, 32
SPLITS = [(4, 1), (2, 2), (1, 4)]
GPUS, TOKENS, CAPACITY, HARDWARE = 1024, 32 * M, 8 * K, "h100-nvlink"
MODELS = {"llama-7b": 1, "llama-70b": 4}
"""Model -> TP size of one HDP rank."""
CONTEXTS = [256 * K, M]


# --- 1. CPU ranks -----------------------------------------------------------------------------------


def _worker(rank: int, world: int, tokens: int, windows: list[int | None], repeats: int, result: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    group = list(range(world))
    rows = []
    for u, r in SPLITS:
        layout = ulysses_layout([tokens], u, r)
        t_local = layout.rank(rank).num_tokens
        q, k, v = (torch.randn(t_local, h, D) for h in (HQ, HKV, HKV))
        g = torch.randn_like(q)
        for window in windows:
            times = []
            for i in range(repeats + 1):
                stats = P2PStats()
                dist.barrier()
                start = time.perf_counter()
                out, lse = ulysses_attention_fwd(q, k, v, layout, group, stats=stats, check=i == 0, window=window)
                ulysses_attention_bwd(g, q, k, v, out, lse, layout, group, stats=stats, window=window)
                elapsed = torch.tensor(time.perf_counter() - start)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                times.append(elapsed.item())
            mine = torch.tensor(
                [stats.bytes_sent - stats.ulysses_bytes_sent, stats.ulysses_bytes_sent], dtype=torch.float64
            )
            every = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(every, mine)
            sent = torch.stack(every)
            rows.append(
                {
                    "u": u,
                    "r": r,
                    "window": window,
                    "seconds": statistics.median(times[1:]),
                    "ring": [sent[:, 0].min().item(), sent[:, 0].max().item()],
                    "a2a": [sent[:, 1].min().item(), sent[:, 1].max().item()],
                }
            )
    if rank == 0:
        Path(result).write_text(json.dumps(rows))


def ranks_part(tokens: list[int], windows: list[int | None], repeats: int) -> None:
    print(
        f"1. fp32 CPU, {WORLD} gloo ranks, Hq={HQ} Hkv={HKV} D=Dv={D}, one sequence, fwd+bwd, slowest rank, "
        f"median of {repeats} after a warm-up; MiB sent per rank (fwd+bwd), min-max over the ranks\n"
    )
    print("| tokens | window | u × r | time s | ring MiB/rank | all-to-all MiB/rank | total MiB/rank (max) |")
    print("|---:|---:|:---:|---:|---:|---:|---:|")
    mib = 2**-20
    with tempfile.TemporaryDirectory() as results:
        for t in tokens:
            path = str(Path(results, f"{t}.json"))
            start = time.perf_counter()
            run_distributed(_worker, WORLD, t, windows, repeats, path)
            for row in sorted(
                json.loads(Path(path).read_text()), key=lambda x: (x["window"] is not None, x["window"] or 0)
            ):
                ring, a2a = (f"{row[k][0] * mib:.1f}-{row[k][1] * mib:.1f}" for k in ("ring", "a2a"))
                total = (row["ring"][1] + row["a2a"][1]) * mib
                window = row["window"] or "causal"
                print(
                    f"| {t // K}K | {window} | {row['u']} × {row['r']} | {row['seconds']:.2f} | {ring} | {a2a} "
                    f"| {total:.1f} |",
                    flush=True,
                )
            print(f"<!-- {t // K}K: {time.perf_counter() - start:.0f} s wall including spawns -->", flush=True)


# --- 2. simulator -----------------------------------------------------------------------------------


def _shares(splits: Counter[tuple[int, int]]) -> str:
    """Share of the shared micro-batches per Ulysses degree u, with the ring degrees r they took."""
    total = sum(splits.values())
    parts = []
    for u in sorted({u for u, _ in splits}):
        rs = sorted(r for (v, r) in splits if v == u)
        span = f"{rs[0]}" if rs[0] == rs[-1] else f"{rs[0]}-{rs[-1]}"
        parts.append(f"{u}×{span}: {sum(n for (v, _), n in splits.items() if v == u) / total:.0%}")
    return ", ".join(parts) or "-"


def sim_part(seeds: int) -> None:
    print(
        f"\n2. simulated, {GPUS} H100 GPUs ({HARDWARE}), {TOKENS // M}M tokens per step, C = {CAPACITY // K}K per "
        f"HDP rank, mean of {seeds} seeds; step time s (static and balance, each with sp=ring and sp=auto); "
        "splits: share of the shared micro-batches per u (u × the r they took), over the seeds\n"
    )
    print(
        "| model (TP, ranks) | dataset | context | static ring | static auto | balance ring | balance auto "
        "| bal. auto vs ring | bal. auto vs static | balance auto's splits | static auto's splits | plan s |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|")
    for model, tp in MODELS.items():
        cost = CostModel.preset(model, Hardware.preset(HARDWARE, tp_size=tp))
        ranks = GPUS // tp
        for dataset in ("byted", "github"):
            for context in CONTEXTS:
                steps: dict[tuple[str, str], list[float]] = {}
                splits: dict[str, Counter[tuple[int, int]]] = {"balance": Counter(), "static": Counter()}
                plan_s = 0.0
                for seed in range(seeds):
                    lens = sample_global_batch(dataset, TOKENS, seed=seed, max_len=context)
                    for name in ("static", "balance"):
                        for sp in ("ring", "auto"):
                            out = run_strategy(name, lens, ranks, CAPACITY, cost, context, sp=sp)
                            steps.setdefault((name, sp), []).append(out.step_time)
                            plan_s = max(plan_s, out.plan_seconds)
                            if sp == "auto":
                                splits[name].update((m.ulysses, m.ring) for m in out.plan.micro_batches if m.shared)
                mean = {key: float(np.mean(v)) for key, v in steps.items()}
                auto, ring, static = mean["balance", "auto"], mean["balance", "ring"], mean["static", "ring"]
                print(
                    f"| {model} (TP {tp}, {ranks}) | {dataset} | {context // K}K | {static:.2f} "
                    f"| {mean['static', 'auto']:.2f} | {ring:.2f} | {auto:.2f} | {ring / auto:.3f}x "
                    f"| {static / auto:.2f}x | {_shares(splits['balance'])} | {_shares(splits['static'])} "
                    f"| {plan_s:.2f} |",
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("ranks", "sim", "both"), default="both")
    parser.add_argument("--tokens", default="16384,32768", help="comma-separated total token counts (part 1)")
    parser.add_argument("--windows", default="4096", help="comma-separated sliding windows beside causal (part 1)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seeds", type=int, default=3, help="global batches per row (part 2)")
    args = parser.parse_args()
    if args.part in ("ranks", "both"):
        windows = [None, *(int(w) for w in args.windows.split(",") if w)]
        ranks_part([int(t) for t in args.tokens.split(",")], windows, args.repeats)
    if args.part in ("sim", "both"):
        sim_part(args.seeds)


if __name__ == "__main__":
    main()
