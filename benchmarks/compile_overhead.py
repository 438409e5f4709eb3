"""Compile cost and speed of the optimized example model against eager, on CPU.

Prints:
  1. compilations (Dynamo's unique_graphs counter and our backend's count) and compile time over 20
     calls whose lengths vary between 17 and 4096 tokens; compile time is the first call's wall time
     minus a steady-state call of the same length;
  2. forward+backward time of optimized vs eager at one length (default T=2048): median of
     `--repeats` runs after a warm-up, the two alternating so machine drift hits both alike.
Goal for 2: optimized <= 1.1x eager.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bytescale_compile as bsc  # noqa: E402
from bytescale_compile.engine.protocol import ProtocolInputs, next_token_labels, restarting_positions  # noqa: E402
from bytescale_compile.models.llama import small  # noqa: E402


def batch(n: int, vocab: int) -> dict[str, torch.Tensor]:
    """`n` tokens of a longer sequence: every token has its target, the last one read one token past the row."""
    ids = torch.randint(0, vocab, (1, n + 1))
    return ProtocolInputs(
        input_ids=ids[:, :-1],
        position_ids=restarting_positions([n])[None],
        shift_labels=next_token_labels(ids, ends_sequence=False),
        num_items_in_batch=torch.tensor(n),
    ).kwargs()


def fwd_bwd(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> float:
    start = time.perf_counter()
    model(**inputs).loss.backward()
    return time.perf_counter() - start


def compile_figures(lengths: list[int]) -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = bsc.optimize(small())
    vocab = model.config.vocab_size
    first = fwd_bwd(model, batch(lengths[0], vocab))
    steady = fwd_bwd(model, batch(lengths[0], vocab))
    total = time.perf_counter()
    for n in lengths[1:]:
        fwd_bwd(model, batch(n, vocab))
    total = time.perf_counter() - total
    unique = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    print(f"lengths: {len(lengths)} calls, {min(lengths)}..{max(lengths)} tokens")
    print(f"compilations: dynamo unique_graphs={unique}, bytescale backend={model.compilations}")
    print(
        f"first call {first:.2f} s, steady call at the same length {steady:.3f} s -> compile time ~{first - steady:.2f} s"
    )
    print(f"the other {len(lengths) - 1} calls (fwd+bwd, no recompilation expected): {total:.2f} s")


def speed_figures(tokens: int, repeats: int) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = small()
    optimized = bsc.optimize(copy.deepcopy(eager))
    inputs = batch(tokens, eager.config.vocab_size)
    for model in (eager, optimized, eager, optimized):
        fwd_bwd(model, inputs)
    times: dict[str, list[float]] = {"eager": [], "optimized": []}
    for _ in range(repeats):
        times["eager"].append(fwd_bwd(eager, inputs))
        times["optimized"].append(fwd_bwd(optimized, inputs))
    e, o = statistics.median(times["eager"]), statistics.median(times["optimized"])
    print(f"fwd+bwd at T={tokens}: eager {e * 1e3:.1f} ms, optimized {o * 1e3:.1f} ms (median of {repeats})")
    print(f"optimized / eager = {o / e:.3f}  (goal <= 1.1: {'met' if o / e <= 1.1 else 'NOT met'})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    lengths = [17, 4096] + [rng.randint(17, 4096) for _ in range(18)]
    rng.shuffle(lengths)
    compile_figures(lengths)
    speed_figures(args.tokens, args.repeats)


if __name__ == "__main__":
    main()
