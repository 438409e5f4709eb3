"""An MoE model's router losses on 2 gloo ranks: a Runtime step equals training each sequence alone, under every
plan; aux-loss-free balancing moves the expert bias alike on 1 and 2 ranks."""

from __future__ import annotations

import pytest
import torch

import bytescale_compile as bsc
from bytescale_compile.capture.routers import bias_routers
from bytescale_compile.testing import run_distributed
from tests.moe import batch, deepseek_v3, max_weight_error, per_sequence_step, qwen3_moe, runtime_step

LENGTHS = [40, 9, 12, 7, 20, 3, 15]
"""With capacity 32 on 2 ranks: the 40-token sequence is shared by both ranks, the short ones are packed."""
LR = 0.5
TOLERANCE = 1e-5


def _aux_loss_worker(rank: int, world: int, strategy: str, capacity: int, sp: str, checkpointed: bool) -> None:
    ref = per_sequence_step(qwen3_moe(), batch(LENGTHS), LR)
    model = qwen3_moe()
    if checkpointed:  # the router logits leave each checkpointed layer through Hugging Face's recording hook
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    stats, weights = runtime_step(model, batch(LENGTHS), strategy, capacity, LR, sp=sp)
    assert any(len(mb.ranks) > 1 for mb in stats.plan.micro_batches), stats.plan.micro_batches
    if sp == "ulysses":
        assert any(mb.ulysses > 1 for mb in stats.plan.micro_batches), stats.plan.micro_batches
    assert abs(stats.loss - ref.loss) <= TOLERANCE, (strategy, stats.loss, ref.loss)
    assert abs(stats.aux_loss - ref.aux_loss) <= TOLERANCE, (strategy, stats.aux_loss, ref.aux_loss)
    assert ref.aux_loss > 0.1  # the load-balancing loss weighs in the step
    assert max_weight_error(weights, ref.weights) <= TOLERANCE, strategy
    assert stats.expert_load is not None and len(stats.expert_load) == 2
    assert all(1.0 <= load <= 2.0 for load in stats.expert_load), stats.expert_load  # 4 experts, top 2


@pytest.mark.parametrize(
    "strategy,capacity,sp,checkpointed",
    [
        pytest.param("balance", 32, "ring", False),
        # gradient checkpointing: the layers compiled, not run eagerly (the default set checks that in
        # tests/unit/test_capture_checkpointing.py)
        pytest.param("balance", 32, "ring", True, marks=pytest.mark.slow),
        pytest.param("naive", 32, "ring", False, marks=pytest.mark.slow),
        pytest.param("static", 32, "ring", False, marks=pytest.mark.slow),
        # more micro-batches, the long one over both
        pytest.param("balance", 24, "ring", False, marks=pytest.mark.slow),
        pytest.param("naive", 32, "ulysses", False, marks=pytest.mark.slow),  # the shared sequence split by heads
        pytest.param("naive", 32, "ulysses", True, marks=pytest.mark.slow),
    ],
)
def test_step_with_aux_loss_equals_per_sequence_training(strategy, capacity, sp, checkpointed):
    run_distributed(_aux_loss_worker, 2, strategy, capacity, sp, checkpointed)


BIAS_STEP = 0.01
BIAS_LENGTHS = [30, 9, 12, 7, 20]


def _biases_after_steps(steps: int) -> list[torch.Tensor]:
    model = deepseek_v3()
    runtime = bsc.Runtime(model, torch.optim.SGD(model.parameters(), lr=LR), capacity=32, expert_bias_update=BIAS_STEP)
    for _ in range(steps):  # one batch: one plan, so nothing recompiles
        stats = runtime.step(batch(BIAS_LENGTHS))
        assert stats.expert_load is not None and len(stats.expert_load) == 1  # layer 0 is dense
    return [r.e_score_correction_bias.detach().clone() for r in bias_routers(model)]


def _bias_worker(rank: int, world: int, expected: list[torch.Tensor]) -> None:
    got = _biases_after_steps(3)
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e), (rank, g, e)


@pytest.mark.slow
def test_aux_loss_free_bias_after_three_steps_equal_on_one_and_two_ranks():
    expected = _biases_after_steps(3)
    assert any(bool(b.abs().sum() > 0) for b in expected)  # the bias moved
    run_distributed(_bias_worker, 2, expected)
