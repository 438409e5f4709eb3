"""Train the example LLaMA with Hybrid Data Parallelism under torchrun.

    torchrun --nproc_per_node=4 examples/train.py --strategy all --steps 4

Every rank builds the same global batches (a token budget of real, skewed data: the Python sources
installed on this machine, one sample per file), plans each step identically and trains on its own
micro-batches. `--strategy all` runs balance, naive and static on the same batches, each from the
same initial weights, and prints a comparison next to the simulator's prediction for those plans.
gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bytescale_compile as bsc  # noqa: E402
from bytescale_compile.planner import CostModel  # noqa: E402
from bytescale_compile.runtime.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint  # noqa: E402
from bytescale_compile.runtime.data import GlobalBatchSampler, TokenDataset, build_from_python_sources  # noqa: E402
from bytescale_compile.runtime.engine import default_cost_model  # noqa: E402
from bytescale_compile.runtime.launch import init_distributed  # noqa: E402
from bytescale_compile.sim.experiments import parse_size  # noqa: E402
from bytescale_compile.sim.simulator import busy_times, p2p_bytes, simulate  # noqa: E402
from examples.models import llama  # noqa: E402

STRATEGIES = ("balance", "naive", "static")


@dataclass
class RunResult:
    strategy: str
    losses: list[float] = field(default_factory=list)
    tokens_per_second: list[float] = field(default_factory=list)
    spreads: list[float] = field(default_factory=list)
    p2p_bytes: list[int] = field(default_factory=list)
    predicted_step: list[float] = field(default_factory=list)
    predicted_spread: list[float] = field(default_factory=list)
    predicted_p2p_bytes: list[float] = field(default_factory=list)
    measured_step: list[float] = field(default_factory=list)


def log(*parts: object) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*parts, flush=True)


def open_dataset(args: argparse.Namespace) -> TokenDataset:
    """The dataset at --data, built from the installed Python sources on rank 0 if it does not exist."""
    prefix = Path(args.data)
    if not prefix.with_suffix(".json").exists() and args.data_source == "python":
        if dist.get_rank() == 0:
            prefix.parent.mkdir(parents=True, exist_ok=True)
            log(f"building the Python-sources dataset at {prefix} ...")
            build_from_python_sources(prefix, per="file")
        dist.barrier()
    return TokenDataset.open(prefix)


def make_model(name: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return getattr(llama, name)()


def train(strategy: str, args: argparse.Namespace, dataset: TokenDataset, cost: CostModel) -> RunResult:
    model = make_model(args.model, args.seed)
    if args.zero:  # ZeRO-1: optimizer state sharded over the ranks; checkpoints keep one shard per rank
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=args.lr)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    runtime = bsc.Runtime(model, optimizer, cost_model=cost, strategy=strategy, capacity=args.capacity,
                          context_length=args.max_len if strategy == "static" else None)
    sampler = GlobalBatchSampler(dataset, args.global_tokens, seed=args.seed, max_len=args.max_len)
    ckpt_dir = Path(args.checkpoint_dir) / strategy if args.checkpoint_dir else None
    first_step, result = 0, RunResult(strategy)
    if args.resume and ckpt_dir and (found := latest_checkpoint(ckpt_dir)):
        state = load_checkpoint(found, runtime.model, optimizer)
        sampler.load_state_dict(state["sampler"])
        first_step, result.losses = state["step"], state["losses"]
        log(f"[{strategy}] resumed from {found} at step {first_step}")
    batches = iter(sampler)
    progress = _progress(range(first_step, args.steps), strategy)
    for step in progress:
        batch = next(batches)
        stats = runtime.step(batch)
        timeline = simulate(stats.plan, cost)
        busy = busy_times(timeline)
        result.losses.append(stats.loss)
        result.tokens_per_second.append(stats.tokens_per_second)
        result.spreads.append(stats.busy_spread)
        result.p2p_bytes.append(stats.p2p_bytes)
        result.predicted_step.append(timeline.step_time)
        result.predicted_spread.append(float(busy.max() / busy[busy > 0].min()) if busy.any() else 1.0)
        result.predicted_p2p_bytes.append(p2p_bytes(stats.plan, cost))
        result.measured_step.append(stats.time)
        if hasattr(progress, "set_postfix"):
            progress.set_postfix(loss=f"{stats.loss:.3f}", tok_s=f"{stats.tokens_per_second:,.0f}", mbs=max(stats.micro_batches))
        log(f"[{strategy}] step {step + 1}: loss {stats.loss:.4f}, {stats.tokens} tokens, {stats.tokens_per_second:,.0f} tokens/s, "
            f"busy max/min {stats.busy_spread:.2f}, micro-batches per rank {stats.micro_batches}")
        if ckpt_dir and args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            save_checkpoint(ckpt_dir, step + 1, runtime.model, optimizer,
                            {"step": step + 1, "sampler": sampler.state_dict(), "strategy": strategy, "losses": result.losses})
    return result


def _progress(steps: range, strategy: str):
    if dist.get_rank() != 0:
        return steps
    try:
        from tqdm import tqdm
    except ImportError:
        return steps
    return tqdm(steps, desc=strategy, leave=False, file=sys.stderr)


def report(results: list[RunResult], skip: int) -> None:
    """Steady-state figures (the first `skip` steps compile), measured and as the simulator predicts them."""
    log("\n             ---------------- measured ----------------   ---------------- predicted ---------------")
    log("strategy     tokens/s  busy max/min  P2P MiB/step  step s    tokens/s  busy max/min  P2P MiB/step  step s"
        "   final loss")
    speed = {}
    for r in results:
        steady = slice(skip, None) if len(r.tokens_per_second) > skip else slice(None)
        tokens = statistics.mean(t * m for t, m in zip(r.tokens_per_second[steady], r.measured_step[steady]))
        measured, predicted = statistics.mean(r.measured_step[steady]), statistics.mean(r.predicted_step[steady])
        speed[r.strategy] = (tokens / measured, tokens / predicted)
        log(f"{r.strategy:<10} {speed[r.strategy][0]:>10,.0f} {statistics.mean(r.spreads[steady]):>13.2f} "
            f"{statistics.mean(r.p2p_bytes[steady]) / 2 ** 20:>13.1f} {measured:>7.2f}  "
            f"{speed[r.strategy][1]:>10,.0f} {statistics.mean(r.predicted_spread[steady]):>13.2f} "
            f"{statistics.mean(r.predicted_p2p_bytes[steady]) / 2 ** 20:>13.1f} {predicted:>7.2f} {r.losses[-1]:>12.4f}")
    if "static" in speed and len(speed) > 1:
        static = speed["static"]
        log("\nspeedup over static: " + ", ".join(
            f"{s} {v[0] / static[0]:.2f}x measured, {v[1] / static[1]:.2f}x predicted"
            for s, v in speed.items() if s != "static"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small", choices=["tiny", "small"])
    parser.add_argument("--data", default=".cache/data/python_files", help="dataset prefix (built if missing)")
    parser.add_argument("--data-source", default="python", choices=["python", "none"],
                        help="what to build --data from when it does not exist")
    parser.add_argument("--global-tokens", type=parse_size, default=parse_size("32K"))
    parser.add_argument("--capacity", type=parse_size, default=parse_size("2K"), help="tokens per rank, C")
    parser.add_argument("--max-len", type=parse_size, default=parse_size("8K"), help="context length")
    parser.add_argument("--strategy", default="all", choices=[*STRATEGIES, "all"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cost-model", default=None, help="profiled cost model JSON (default: analytic)")
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in --checkpoint-dir if there is one (so a "
                             "torchrun restart after a failure picks up where the run stopped)")
    parser.add_argument("--zero", action="store_true", help="ZeRO-1: shard the optimizer state over the ranks")
    parser.add_argument("--report-json", default=None, help="write the per-step figures here (rank 0)")
    args = parser.parse_args()

    backend = init_distributed()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    try:
        dataset = open_dataset(args)
        model_for_cost = make_model(args.model, args.seed)
        if (top := dataset.max_token()) >= model_for_cost.config.vocab_size:
            raise SystemExit(f"{args.data} has token ids up to {top}, but --model {args.model} has a vocabulary of "
                             f"{model_for_cost.config.vocab_size}: pick a model whose vocab_size exceeds {top}")
        cost = CostModel.load(args.cost_model) if args.cost_model else default_cost_model(model_for_cost)
        log(f"{dist.get_world_size()} ranks ({backend}), {len(dataset)} sequences in {args.data}, "
            f"global batch {args.global_tokens} tokens, C={args.capacity}, context {args.max_len}")
        strategies = STRATEGIES if args.strategy == "all" else (args.strategy,)
        start = time.perf_counter()
        results = [train(s, args, dataset, cost) for s in strategies]
        report(results, skip=1)
        log(f"\ntotal {time.perf_counter() - start:.1f} s")
        if args.report_json and dist.get_rank() == 0:
            Path(args.report_json).write_text(json.dumps([vars(r) for r in results], indent=1))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
