"""Gradient checkpointing against selective offload: the longest sequence one rank holds, and the step time.

Four variants of the demo LLaMA (`examples/models/hf.py:llama_demo`, 4 layers, hidden 256, vocab 4096, fp32):
neither, Hugging Face's `gradient_checkpointing_enable()` (non-reentrant), and offload at r = 0.5 and r = 1.
Each is built fresh, optimized and compiled in training mode at `--tokens`; one warm-up step compiles, then
`--repeats` measured forward + backward steps give the median step time on CPU.

The longest sequence is the memory model's (`train/memory.py:memory_model`, `planner/memory.py:MemoryModel`),
from each variant's compile report (its saved-activation table): the largest T with

    static + workspace + T · per_token <= budget

where per_token is `MemoryModel.activation_bytes(1, r)` (Eq. 2: the last 2 layers and what lies outside the
layers stay; (1 - r)(l - 2) layers' worth more). Checkpointing saves only each layer's input, but its backward
recomputes one layer at a time and holds that layer's activations while it runs: its per_token adds one
full layer, as the variant without checkpointing saves it. Figures are printed, never asserted.

    .venv/bin/python benchmarks/checkpointing.py [--budget 1GiB] [--layers 32] [--tokens 2048] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

import bytescale_compile as bsc  # noqa: E402
from bytescale_compile.engine.protocol import packed_row  # noqa: E402
from bytescale_compile.planner.memory import MemoryModel, format_bytes  # noqa: E402
from bytescale_compile.runtime.offload import get_act_ctx  # noqa: E402
from bytescale_compile.train.memory import memory_model, parse_memory  # noqa: E402
from examples.models.hf import llama_demo  # noqa: E402


@dataclass(frozen=True)
class Variant:
    name: str
    checkpointing: bool = False
    ratio: float | None = None
    """The offload ratio r; None: the offload pass off."""


VARIANTS = (
    Variant("neither"),
    Variant("checkpointing", checkpointing=True),
    Variant("offload r=0.5", ratio=0.5),
    Variant("offload r=1", ratio=1.0),
)


def batch(tokens: int, vocab: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, tokens + 1), generator=g)
    return {**packed_row(ids[:, :-1], [tokens]).kwargs(labels=True), "use_cache": False}


def step(model: torch.nn.Module, inputs: dict[str, Any], ratio: float | None) -> None:
    """One forward + backward, under an act_ctx at ratio r when the variant offloads."""
    model.zero_grad(set_to_none=True)
    if ratio is None:
        model(**inputs).loss.backward()
        return
    act_ctx = get_act_ctx(1, [ratio])
    act_ctx.update_micro_batch_id(0)
    with act_ctx:
        loss = model(**inputs).loss
    with act_ctx:
        loss.backward()


def run(variant: Variant, tokens: int, repeats: int, layers: int) -> tuple[MemoryModel, float]:
    """The variant's memory model (as a model of `layers` layers) and its median step time in seconds."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = llama_demo().train()
    if variant.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimized = bsc.optimize(model, offload="off" if variant.ratio is None else "auto")
    inputs = batch(tokens, model.config.vocab_size)
    step(optimized, inputs, variant.ratio)  # compiles
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step(optimized, inputs, variant.ratio)
        times.append(time.perf_counter() - start)
    return memory_model(optimized, total_layers=layers, hdp=1, dtype="fp32"), statistics.median(times)


def longest(memory: MemoryModel, budget: int, ratio: float, recompute_bytes_per_token: float) -> int:
    """The largest T whose predicted peak, plus the layer a checkpointed backward recomputes, fits `budget`."""
    per_token = memory.activation_bytes(1, ratio) + recompute_bytes_per_token
    return int((budget - memory.static.total - memory.workspace_bytes) // per_token)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", default="1GiB", help="one rank's memory budget (default 1GiB)")
    parser.add_argument(
        "--layers", type=int, default=32, help="layers the memory model scales the demo's to (default 32)"
    )
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of the timed step (default 2048)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    budget = parse_memory(args.budget)
    results = {v.name: run(v, args.tokens, args.repeats, args.layers) for v in VARIANTS}
    full_layer = results["neither"][0].layer_bytes_per_token
    base_time = results["neither"][1]
    print(
        f"demo LLaMA as {args.layers} layers, fp32, budget {format_bytes(budget)}; "
        f"step time at {args.tokens} tokens on CPU (median of {args.repeats})"
    )
    print(f"{'variant':<15} {'saved/token/layer':>18} {'longest T':>10} {'step (s)':>9} {'vs neither':>10}")
    for v in VARIANTS:
        memory, seconds = results[v.name]
        recompute = full_layer if v.checkpointing else 0.0
        tokens = longest(memory, budget, v.ratio or 0.0, recompute)
        print(
            f"{v.name:<15} {format_bytes(memory.layer_bytes_per_token):>18} {tokens:>10} "
            f"{seconds:>9.3f} {seconds / base_time:>9.2f}x"
        )


if __name__ == "__main__":
    main()
