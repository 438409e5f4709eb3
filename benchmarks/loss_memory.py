"""Peak memory and time of the fused linear cross-entropy vs eager linear -> float -> cross_entropy.

Each variant runs in its own fresh subprocess (this script with ``--variant``), on CPU, fp32, one
forward + backward of ``cross_entropy(linear(hidden, weight).float(), target, reduction="sum") /
num_items`` with hidden and weight requiring grad (the lm_head of a causal LM).

Memory: the subprocess allocates its inputs, then reads ``ru_maxrss`` (the process's peak resident
set size) as the baseline, then runs ONE forward + backward with no warm-up before it and reads
``ru_maxrss`` again. The figure is the difference: how far one step's peak rises above the inputs,
weight gradient included. The parent never imports torch, so the child does not inherit a large
peak from it (a child's ``ru_maxrss`` starts at its parent's at exec time).

Time: in the same subprocess, after the memory phase (which doubles as the warm-up), the median
wall time of ``--repeats`` further forward + backward runs, gradients reset between runs.

Goals (paper: the fused loss never holds the full fp32 logits): fused peak extra <= 25% of
eager's, fused time <= 1.2x eager's. Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

VARIANTS = ("eager", "fused")
MEMORY_GOAL = 0.25
TIME_GOAL = 1.2
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _maxrss_mib() -> float:
    """Peak resident set size of this process so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _loss_fn(variant: str):
    """The loss under test, imported here so the parent process never loads torch."""
    import torch.nn.functional as F

    from bytescale_compile.ops.loss import fused_linear_cross_entropy

    def eager(hidden, weight, target):
        logits = F.linear(hidden, weight).float()
        return F.cross_entropy(logits, target, reduction="sum")

    def fused(hidden, weight, target):
        return fused_linear_cross_entropy(hidden, weight, target, reduction="sum")

    return {"eager": eager, "fused": fused}[variant]


def run_variant(variant: str, tokens: int, hidden_size: int, vocab: int, repeats: int) -> dict:
    """Measure one variant in this process; return its figures."""
    import torch

    loss_fn = _loss_fn(variant)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=gen).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=gen) * 0.02).requires_grad_()
    target = torch.randint(0, vocab, (tokens,), generator=gen)
    num_items = torch.tensor(float(tokens))

    def step() -> float:
        hidden.grad = weight.grad = None
        loss = loss_fn(hidden, weight, target) / num_items
        loss.backward()
        return loss.item()

    baseline = _maxrss_mib()
    loss = step()
    peak_extra = _maxrss_mib() - baseline

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"variant": variant, "peak_extra_mib": peak_extra, "time_s": statistics.median(times), "loss": loss}


def measure_in_subprocess(variant: str, args: argparse.Namespace) -> dict:
    """Run this script with --variant in a fresh interpreter and parse its JSON line."""
    cmd = [
        sys.executable,
        __file__,
        "--variant",
        variant,
        "--tokens",
        str(args.tokens),
        "--hidden",
        str(args.hidden),
        "--vocab",
        str(args.vocab),
        "--repeats",
        str(args.repeats),
    ]
    python_path = os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": python_path}
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _verdict(ratio: float, goal: float) -> str:
    return "met" if ratio <= goal else "NOT met"


def report(results: dict[str, dict]) -> None:
    """Print the table and the fused/eager ratios against the goals."""
    print(f"{'variant':<8} {'peak extra MiB':>15} {'time s':>8} {'loss':>10}")
    for r in results.values():
        print(f"{r['variant']:<8} {r['peak_extra_mib']:>15.1f} {r['time_s']:>8.3f} {r['loss']:>10.5f}")
    eager, fused = results["eager"], results["fused"]
    mem = fused["peak_extra_mib"] / eager["peak_extra_mib"]
    speed = fused["time_s"] / eager["time_s"]
    print(f"memory fused/eager: {mem:.1%} (goal <= {MEMORY_GOAL:.0%}): {_verdict(mem, MEMORY_GOAL)}")
    print(f"time   fused/eager: {speed:.2f}x (goal <= {TIME_GOAL}x): {_verdict(speed, TIME_GOAL)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variant", choices=VARIANTS, help="internal: measure one variant here")
    args = parser.parse_args()
    if args.variant:
        figures = run_variant(args.variant, args.tokens, args.hidden, args.vocab, args.repeats)
        print(json.dumps(figures))
        return
    print(f"T={args.tokens} H={args.hidden} V={args.vocab} fp32 CPU, forward+backward, median of {args.repeats}")
    report({v: measure_in_subprocess(v, args) for v in VARIANTS})


if __name__ == "__main__":
    main()
