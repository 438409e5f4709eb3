"""An MoE model's load-balancing loss under every plan: a Runtime step against training each sequence alone.

A tiny Hugging Face Qwen3-MoE (4 experts, top 2, `output_router_logits=True`, `router_aux_loss_coef=0.5`) takes
one SGD step on 2 gloo ranks under balance, naive and static, and the same step trains each sequence alone
(`CE_mean_s + coef * LB_s`, weighted by n_s / N: `tests/moe.py`). "before" runs Hugging Face's own
`load_balancing_loss_func` (the loss of whatever each micro-batch holds, added once per forward call), "after" the
per-sequence one the Runtime swaps in (`capture/routers.py`). Printed: the step's loss and the largest difference
of an updated weight from the per-sequence step's.

    python benchmarks/moe_aux_loss.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bytescale_compile.testing import run_distributed  # noqa: E402
from tests.moe import batch, max_weight_error, per_sequence_step, qwen3_moe, runtime_step  # noqa: E402

LENGTHS = [40, 9, 12, 7, 20, 3, 15]
CAPACITY = 32
LR = 0.5
STRATEGIES = ("balance", "naive", "static")


def _worker(rank: int, world: int, out: str) -> None:
    import transformers.models.qwen3_moe.modeling_qwen3_moe as modeling

    ref = per_sequence_step(qwen3_moe(), batch(LENGTHS), LR)
    rows = [f"| per-sequence reference | {ref.loss:.4f} | 0 | aux {ref.aux_loss:.4f} |"]
    for mode in ("before", "after"):
        for strategy in STRATEGIES:
            model = qwen3_moe()
            if mode == "before":  # Hugging Face's own function, as it was before the Runtime swapped it
                runtime = _runtime_with_hf_loss(model, strategy, modeling)
                stats = runtime.step(batch(LENGTHS))
                weights = {n: p.detach().clone() for n, p in model.named_parameters()}
            else:
                stats, weights = runtime_step(model, batch(LENGTHS), strategy, CAPACITY, LR)
            shared = sum(len(mb.ranks) > 1 for mb in stats.plan.micro_batches)
            aux = f"; aux {stats.aux_loss:.4f}" if mode == "after" else ""
            rows.append(
                f"| {mode}: {strategy} | {stats.loss:.4f} | {max_weight_error(weights, ref.weights):.1e} | "
                f"{len(stats.plan.micro_batches)} micro-batches, {shared} shared{aux} |"
            )
    if rank == 0:
        Path(out).write_text("\n".join(rows) + "\n")


def _runtime_with_hf_loss(model: torch.nn.Module, strategy: str, modeling: object) -> object:
    import bytescale_compile as bsc

    runtime = bsc.Runtime(model, torch.optim.SGD(model.parameters(), lr=LR), strategy=strategy, capacity=CAPACITY)
    swapped = modeling.load_balancing_loss_func  # type: ignore[attr-defined]
    modeling.load_balancing_loss_func = swapped.__wrapped__  # type: ignore[attr-defined]
    return runtime


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "table.md")
        run_distributed(_worker, 2, out)
        print(f"lengths {LENGTHS}, capacity {CAPACITY}, 2 gloo ranks, SGD lr {LR}, aux coef 0.5")
        print("| run | step loss | max abs weight difference | plan, aux loss |")
        print("|---|---|---|---|")
        print(Path(out).read_text(), end="")


if __name__ == "__main__":
    main()
