"""The capacity C `bytescale-compile memory` picks for LLaMA-3-8B and LLaMA-70B shapes, and bytes per parameter.

Prints:
  1. per model, tp (1, 2, 8; hdp = 64 / tp, pp 1, bf16) and device (80 GiB, 141 GiB): static GiB, bytes per
     parameter, workspace, C without and with offload, and the longest share of a sequence one rank can hold
     (offload r = 1); "-" where the static bytes alone do not fit;
  2. bytes per parameter of fp32 (plain and ZeRO-1) and bf16 (fp32 and bf16 gradient reduction) at N = 1, 4, 64;
  3. one H200 (139.8 GiB), 8 layers of the LLaMA-3-8B shape, bf16, one rank: the C `--capacity auto` picks and its
     predicted reserved peak part by part, with and without expandable segments, against the model before the
     transients (5% slack, allocated bytes), which picked the C at which the 128K-token batches ran out of memory.
Each model is a 2-layer copy compiled on the meta device (no weights, no device memory), as the command does.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import LlamaConfig  # noqa: E402

from bytescale_compile.engine.protocol import model_inputs  # noqa: E402
from bytescale_compile.planner.memory import MemoryBudgetError, MemoryModel, format_bytes  # noqa: E402
from bytescale_compile.train.memory import compile_on_meta, memory_model, meta_model  # noqa: E402

GiB = 2**30
WORLD = 64
"""Devices per model replica group: hdp = WORLD / tp."""
DEVICES = {"80G": 80 * GiB, "141G": 141 * GiB}
SHAPES: dict[str, dict[str, Any]] = {
    "LLaMA-3-8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32),
    "LLaMA-70B": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64),
}


def capacities() -> None:
    print(f"bf16, pp 1, hdp = {WORLD} / tp; C in tokens per rank")
    header = (
        f"{'model':<11} {'tp':>2} {'hdp':>3} {'device':>6} {'static':>10} {'B/param':>7} {'workspace':>9} "
        f"{'C no offload':>12} {'C offload':>9} {'longest/rank':>12}"
    )
    print(header)
    print("-" * len(header))
    for name, shape in SHAPES.items():
        config = LlamaConfig(**shape, num_key_value_heads=8, vocab_size=128256)
        model, layers = meta_model(config, "bf16")
        optimized = compile_on_meta(model, model_inputs(model, 32))
        for tp in (1, 2, 8):
            for device, budget in DEVICES.items():
                m = memory_model(optimized, total_layers=layers, hdp=WORLD // tp, dtype="bf16", tp=tp, budget=budget)
                row = (
                    f"{name:<11} {tp:>2} {WORLD // tp:>3} {device:>6} {m.static.total / GiB:>6.1f} GiB "
                    f"{m.bytes_per_param:>7.2f} {m.workspace_bytes / GiB:>5.1f} GiB"
                )
                try:
                    found = (m.capacity(budget, False), m.capacity(budget, True), m.longest_per_rank(budget))
                    print(row + f" {found[0]:>12,} {found[1]:>9,} {found[2]:>12,}")
                except MemoryBudgetError:
                    print(row + f" {'-':>12} {'-':>9} {'-':>12}")


def bytes_per_param() -> None:
    params = 8_030_261_248
    print(f"\nbytes per parameter ({params:,} parameters, 25 MiB buckets)")
    layouts = {
        "fp32": ("fp32", False, "fp32"),
        "fp32 ZeRO-1": ("fp32", True, "fp32"),
        "bf16": ("bf16", False, "fp32"),
        "bf16, bf16 reduction": ("bf16", False, "bf16"),
    }
    print(f"{'layout':<22} " + " ".join(f"{f'N = {n}':>8}" for n in (1, 4, 64)))
    for label, (dtype, zero, reduce) in layouts.items():
        values = [
            MemoryModel(
                params=params, hdp_size=n, dtype=dtype, zero=zero, grad_reduce_dtype=reduce, layers=32
            ).bytes_per_param
            for n in (1, 4, 64)
        ]
        print(f"{label:<22} " + " ".join(f"{v:>8.2f}" for v in values))


H200 = round(139.8 * GiB)
"""What torch reports as an H200's memory; the budget is the free memory, lower by the CUDA context."""
MEASURED_64K_ALLOCATED = 126.9
"""GiB: the allocated peak of one 64K-token micro-batch on that H200 (RESULTS, one H200)."""


def llama3_8b_on_one_h200() -> None:
    """The run whose 128K-token batches ran out of memory: what the model picks now, and what it picked then."""
    config = LlamaConfig(**SHAPES["LLaMA-3-8B"], num_key_value_heads=8, vocab_size=128256)
    model, _ = meta_model(config, "bf16")
    optimized = compile_on_meta(model, model_inputs(model, 32))
    print(f"\nLLaMA-3-8B shape, 8 layers, bf16, 1 rank, budget {format_bytes(H200)} (offload auto: C with offload)")
    for expandable in (True, False):
        m = memory_model(optimized, total_layers=8, hdp=1, dtype="bf16", budget=H200, expandable=expandable)
        before = _before_transients(m, config)
        print(f"expandable segments {'on' if expandable else 'off'}:")
        for label, model_ in (("now", m), ("before", before)):
            c_plain, c_off = model_.capacity(H200, offload=False), model_.capacity(H200, offload=True)
            print(
                f"  {label:<6} C = {c_off:,} with offload ({c_plain:,} without); peak at C "
                f"{model_.peak(c_off) / GiB:.1f} GiB, at 65,536 {model_.peak(65_536) / GiB:.1f} GiB, at 67,552 "
                f"{model_.peak(67_552) / GiB:.1f} GiB"
            )
        c = m.capacity(H200, offload=True)
        activations, transients = m.activation_bytes(c), m.transient_bytes(c)
        loss = m.loss.bytes(c) if m.loss is not None else 0.0
        print(
            f"  at C = {c:,}: static {m.static.total / GiB:.1f} + activations {activations / GiB:.1f} + transients "
            f"{transients / GiB:.2f} (backward {m.backward_bytes_per_token * c / GiB:.2f}, loss {loss / GiB:.2f}, chunk "
            f"{m.loss.chunk(c) if m.loss else 0:,}) + fragmentation {m.fragmentation * (activations + transients) / GiB:.2f}"
            f" + workspace {m.workspace_bytes / GiB:.2f} = {m.peak(c) / GiB:.1f} GiB of {H200 / GiB:.1f}"
        )
        terms = m.static.total + m.activation_bytes(65_536) + m.transient_bytes(65_536)
        print(
            f"  at 65,536 tokens before fragmentation and workspace: {terms / GiB:.1f} GiB; measured allocated "
            f"{MEASURED_64K_ALLOCATED} GiB, {MEASURED_64K_ALLOCATED - terms / GiB:.1f} GiB above them "
            f"({(MEASURED_64K_ALLOCATED * GiB - terms) / (terms - m.static.total):.1%} of activations and transients)"
        )


def _before_transients(m: MemoryModel, config: LlamaConfig) -> MemoryModel:
    """The model as it was: no transients, no fragmentation, the loss's fixed workspace (an fp32 [V, H] accumulator,
    its bf16 copy and two fp32 [1024, V] buffers) plus 5% of the budget."""
    vocab, hidden = config.vocab_size, config.hidden_size
    workspace = vocab * hidden * (4 + 2) + 2 * 1024 * vocab * 4 + round(0.05 * H200)
    return dataclasses.replace(m, backward_bytes_per_token=0.0, loss=None, fragmentation=0.0, workspace_bytes=workspace)


if __name__ == "__main__":
    if "--h200" not in sys.argv:
        capacities()
        bytes_per_param()
    llama3_8b_on_one_h200()
