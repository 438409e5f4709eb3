"""The Hugging Face architecture matrix: every attention rewritten, optimized == eager, and HDP == one process.

Single-process checks run by default; the 2-rank `Runtime.step` with a sequence shared by both ranks runs
for one sliding-window model by default and for every architecture under `make test-all`.
"""

from __future__ import annotations

import copy

import pytest
import torch

import bytescale_compile as bsc
from bytescale_compile.testing import run_distributed
from tests.helpers import assert_matches_eager, eager_copy, protocol_batch, reference_step, rel_err
from tests.hf_models import ARCHS, BY_NAME, VOCAB, build

NAMES = [a.name for a in ARCHS]
LENGTHS = [50, 9, 14]  # with C = 32 the 50-token sequence is shared by both ranks
CAPACITY = 32


@pytest.mark.parametrize("name", NAMES)
def test_optimized_matches_eager_and_rewrites_every_attention(name):
    model = build(name)
    eager = eager_copy(model)
    optimized = bsc.optimize(model)
    assert_matches_eager(optimized, eager, protocol_batch([21, 7, 30], VOCAB, hf=True))
    report = optimized.report
    arch = BY_NAME[name]
    assert [s.reason for s in report.skipped("attention")] == []
    assert len(report.rewrites("attention")) == arch.layers
    assert len(report.mixer_layers()) == arch.layers and all("rewritten" in line for line in report.mixer_layers())
    assert optimized.shard_blockers() == []
    assert len(report.rewrites("fused_loss")) == int(arch.fused_loss), report.skipped("fused_loss")


def _batch() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]


def _shared_step_worker(rank: int, world: int, name: str) -> None:
    model = build(name)
    reference = copy.deepcopy(model)
    runtime = bsc.Runtime(model, torch.optim.SGD(model.parameters(), lr=0.5), capacity=CAPACITY)
    step_plan = runtime.plan(torch.tensor(LENGTHS).numpy())
    assert any(len(mb.ranks) == world for mb in step_plan.micro_batches), step_plan.micro_batches
    stats = runtime.step(_batch())
    ref_loss, ref_params = reference_step(reference, _batch(), lr=0.5, hf=True)
    assert abs(stats.loss - ref_loss) <= 1e-5 * abs(ref_loss), (stats.loss, ref_loss)
    worst = max(ref_params, key=lambda n: rel_err(dict(model.named_parameters())[n], ref_params[n]))
    assert rel_err(dict(model.named_parameters())[worst], ref_params[worst]) <= 1e-5, f"rank {rank}: {worst}"


@pytest.mark.slow  # by default tests/distributed/test_train_ulysses.py runs qwen2-sliding's shared step, ring included
@pytest.mark.parametrize("name", NAMES)
def test_two_rank_step_with_a_shared_sequence_equals_one_process(name):
    run_distributed(_shared_step_worker, 2, name)
