"""The optimized example model over a 3-rank ring equals the single-process model on that sequence."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import bytescale_compile as bsc
from bytescale_compile.models.llama import tiny
from bytescale_compile.runtime.context import micro_batch
from bytescale_compile.runtime.layout import zigzag_layout
from bytescale_compile.testing import run_distributed
from tests.helpers import loss_and_grads, protocol_batch, rel_err


def _model_worker(rank: int, world: int, length: int) -> None:
    torch.manual_seed(0)
    model = tiny()
    full = protocol_batch([length], vocab=128, seed=3)
    ref_loss, ref_grads = loss_and_grads(model, full)

    group = list(range(world))
    layout = zigzag_layout([length], world)
    mine = layout.rank(rank)
    local = {
        "input_ids": full["input_ids"][:, mine.token_index],
        "position_ids": mine.position_ids[None],
        "shift_labels": full["shift_labels"][:, mine.token_index],
        "num_items_in_batch": full["num_items_in_batch"],
    }
    optimized = bsc.optimize(model)
    with micro_batch(group=group, layout=layout) as ctx:
        loss, grads = loss_and_grads(optimized, local)
    assert ctx.ring_stats.calls == 2  # one ring forward per layer of the tiny model
    dist.all_reduce(loss)
    for g in grads.values():
        dist.all_reduce(g)
    assert rel_err(loss, ref_loss) <= 1e-5
    for name, g in grads.items():
        err = rel_err(g, ref_grads[name])
        assert err <= 1e-5, f"rank {rank} {name}: {err:.2e}"
    assert len(optimized.report.rewrites("attention")) == 2


@pytest.mark.slow  # by default the Runtime runs an optimized HF model over rings in tests/distributed/test_train_ulysses.py
def test_optimized_model_over_three_rank_ring_matches_single_process():
    run_distributed(_model_worker, 3, 301)
