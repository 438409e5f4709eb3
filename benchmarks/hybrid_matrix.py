"""The hybrid matrix: every token mixer of the tiny hybrids of `tests/hf_models.py` (`HYBRIDS`), packed and shared.

For LFM2 (short convolutions), Bamba, GraniteMoeHybrid, Nemotron-H and Zamba2 (Mamba2), Qwen3-Next (gated delta
rule), Jamba (Mamba) and Mamba2, beside attention where they have it, this prints one markdown table: per layer,
the compile report's token-mixer line (`report.mixer_layers()`: rewritten, or left alone and why), and per model
- packed: `optimize()` on one packed row of sequences [50, 9, 1, 14] against each sequence alone, eager: the
  max relative error of the loss and of the worst parameter gradient, in fp64 (fp32 for Jamba and Qwen3-Next,
  whose grouped-mm experts take no fp64; gradients compared against a floor of 0.1 x the largest for
  Qwen3-Next, as `tests/distributed/test_hybrid.py` does);
- shared: one 2-rank `Runtime.step` (gloo, fp32) of sequences [50, 9, 14, 30] with the 50-token one shared by
  both ranks (capacity 32, naive plan without offloading, the llama-7b cost model) against a single-process SGD
  step (`tests.helpers.reference_step`): the max relative error of the updated weights, and of the loss.

Figures are printed, never asserted.

    python benchmarks/hybrid_matrix.py [--models lfm2,bamba,qwen3-next,jamba,mamba2,nemotron-h,...]
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/

import bytescale_compile as bsc  # noqa: E402
from bytescale_compile.planner import CostModel, plan  # noqa: E402
from bytescale_compile.testing import run_distributed  # noqa: E402
from tests.distributed.test_hybrid import CAPACITY, LENGTHS, PACKED, PRECISION, _each_sequence_alone  # noqa: E402
from tests.helpers import loss_and_grads, protocol_batch, reference_step, rel_err  # noqa: E402
from tests.hf_models import HYBRIDS, VOCAB, build_hybrid  # noqa: E402

log = logging.getLogger("hybrid_matrix")
LR = 0.5


def packed(name: str) -> tuple[list[str], float, str]:
    """(the report's token-mixer lines, loss error, "worst gradient error (parameter)") of one packed row."""
    dtype, floor_of_largest = PRECISION.get(name, (torch.float64, 0.0))
    model = build_hybrid(name).to(dtype)
    eager = copy.deepcopy(model)
    optimized = bsc.optimize(model)
    loss, grads = loss_and_grads(optimized, protocol_batch(PACKED, VOCAB, hf=True))
    ref_loss, ref_grads = _each_sequence_alone(eager, PACKED)
    floor = max(1e-6, floor_of_largest * max(g.abs().max().item() for g in ref_grads.values()))
    errors = {n: rel_err(grads[n], ref_grads[n], floor=floor) for n in ref_grads}
    worst = max(errors, key=errors.__getitem__)
    return optimized.report.mixer_layers(), rel_err(loss, ref_loss), f"{errors[worst]:.1e} (`{worst}`, {dtype})"


def _batch() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]


def _shared_worker(rank: int, world: int, names: list[str], results: str) -> None:
    """One shared step per model; rank 0 writes each model's "weight error (parameter) | loss error"."""
    torch.set_num_threads(1)
    for name in names:
        model = build_hybrid(name)
        reference = copy.deepcopy(model)
        cost = CostModel.preset("llama-7b")  # Mamba2's config has no MLP width for the analytic cost model
        runtime = bsc.Runtime(model, torch.optim.SGD(model.parameters(), lr=LR), cost_model=cost, capacity=CAPACITY)
        stats = runtime.step(
            _batch(),
            plan=plan(LENGTHS, world_size=world, capacity=CAPACITY, cost_model=cost, strategy="naive", offload=False),
        )
        ref_loss, ref_params = reference_step(reference, _batch(), lr=LR, hf=True)
        params = dict(model.named_parameters())
        errors = {n: rel_err(params[n], ref_params[n]) for n in ref_params}
        worst = max(errors, key=errors.__getitem__)
        loss_error = rel_err(torch.tensor(stats.loss), torch.tensor(ref_loss))
        if rank == 0:
            Path(results, name).write_text(f"{errors[worst]:.1e} (`{worst}`) | {loss_error:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(h.name for h in HYBRIDS), help="comma-separated hybrids")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    log.setLevel(logging.INFO)
    names = args.models.split(",")
    with tempfile.TemporaryDirectory() as results:
        log.info("shared steps on 2 ranks: %s", ", ".join(names))
        run_distributed(_shared_worker, 2, names, results)
        shared = {name: Path(results, name).read_text() for name in names}
    print(
        "\n| model | layer | token mixer (compile report) | packed: loss err | packed: worst grad err "
        "| shared 2 ranks: worst weight err | shared: loss err |"
    )
    print("|---|---|---|---:|---|---|---:|")
    for name in names:
        log.info("packed row: %s", name)
        lines, loss_error, grad_error = packed(name)
        for i, line in enumerate(lines):
            layer, what = line.split(": ", 1)
            errors = f"{loss_error:.1e} | {grad_error} | {shared[name]}" if i == 0 else "| | |"
            print(f"| {name if i == 0 else ''} | {layer} | {what} | {errors} |", flush=True)


if __name__ == "__main__":
    main()
