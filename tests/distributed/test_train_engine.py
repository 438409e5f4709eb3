"""The HDP engine on 4 gloo ranks equals one single-process step over the whole batch (Eq. 2 = Eq. 1)."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

import bytescale_compile as bsc
from bytescale_compile.engine.runtime import BatchError, SkippedStepsError
from bytescale_compile.models.llama import tiny
from bytescale_compile.planner import PlanError
from bytescale_compile.testing import run_distributed
from tests.helpers import reference_step, rel_err

LENGTHS = [90, 60, 10, 12, 7, 20, 3]  # with C = 32: one sequence over 3 ranks, one over 2, packed short ones
CAPACITY = 32


def _batch(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g) for n in LENGTHS]


def _equivalence_worker(rank: int, world: int, strategy: str, zero: bool) -> None:
    torch.manual_seed(0)
    model = tiny()
    reference = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    if zero:  # ZeRO-1: each rank updates its shard of the parameters, then broadcasts it
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.5)
        assert len(optimizer.optim.param_groups[0]["params"]) < len(list(model.parameters()))
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    runtime = bsc.Runtime(model, optimizer, strategy=strategy, capacity=CAPACITY)
    step_plan = runtime.plan(torch.tensor(LENGTHS).numpy())
    if strategy != "static":
        groups = sorted(len(m.ranks) for m in step_plan.micro_batches if m.shared)
        assert groups and max(groups) >= 2, groups
    stats = runtime.step(_batch())
    ref_loss, ref_params = reference_step(reference, _batch(), lr=0.5)
    assert abs(stats.loss - ref_loss) / abs(ref_loss) <= 1e-5, (stats.loss, ref_loss)
    for name, p in model.named_parameters():
        assert rel_err(p, ref_params[name]) <= 1e-5, f"{strategy} rank {rank} {name}"
        # the update itself, looser: fp32 sums in another order (ranks, ring merges) move it by ~1e-5
        moved, ref_moved = p.detach() - before[name], ref_params[name] - before[name]
        assert rel_err(moved, ref_moved) <= 1e-4, f"{strategy} rank {rank} {name}: {rel_err(moved, ref_moved):.2e}"
    assert stats.tokens == sum(LENGTHS) and len(stats.busy) == world
    assert stats.micro_batches[rank] == len(step_plan.schedule[rank])


@pytest.mark.parametrize(
    "strategy,zero",
    [
        pytest.param("balance", False, marks=pytest.mark.slow),  # the plain optimizer: every other runtime test
        pytest.param("balance", True, marks=pytest.mark.slow),  # ZeRO-1 runs by default in test_train_checkpoint
        pytest.param("naive", False, marks=pytest.mark.slow),
        pytest.param("static", False, marks=pytest.mark.slow),
    ],
)
def test_one_step_equals_single_process_step(strategy, zero):
    run_distributed(_equivalence_worker, 4, strategy, zero)


def _too_long_worker(rank: int, world: int) -> None:
    runtime = bsc.Runtime(tiny(), torch.optim.SGD(tiny().parameters(), lr=0.1), capacity=8)
    with pytest.raises(PlanError, match="sequence 1 has 400 tokens, more than the"):
        runtime.step([torch.zeros(5, dtype=torch.long), torch.zeros(400, dtype=torch.long)])


@pytest.mark.slow  # the refusal runs by default in the trainer's pre-flight tests and tests/unit/test_planner_limits.py
def test_sequence_too_long_fails_on_every_rank_before_any_compute():
    run_distributed(_too_long_worker, 2)


def test_single_process_runtime_matches_reference():
    torch.manual_seed(0)
    model = tiny()
    reference = copy.deepcopy(model)
    runtime = bsc.Runtime(model, torch.optim.SGD(model.parameters(), lr=0.5), capacity=128)
    stats = runtime.step(_batch())
    ref_loss, ref_params = reference_step(reference, _batch(), lr=0.5)
    assert abs(stats.loss - ref_loss) / ref_loss <= 1e-5
    assert max(rel_err(p, ref_params[n]) for n, p in model.named_parameters()) <= 1e-5
    assert stats.micro_batches == [len(runtime.plan(torch.tensor(LENGTHS).numpy()).micro_batches)]


def _unshardable_worker(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = tiny()
    reference = copy.deepcopy(model)
    runtime = bsc.Runtime(
        bsc.optimize(model, attention=False), torch.optim.SGD(model.parameters(), lr=0.5), capacity=CAPACITY
    )
    with pytest.raises(
        PlanError, match=r"sequence 0 has 90 tokens, more than the capacity 32 .*attention pass disabled"
    ):
        runtime.plan(torch.tensor(LENGTHS).numpy())
    short = [s for s in _batch() if len(s) <= CAPACITY]
    step_plan = runtime.plan(torch.tensor([len(s) for s in short]).numpy())
    assert all(len(mb.ranks) == 1 and len(mb.sequences) == 1 for mb in step_plan.micro_batches)
    assert any("attention pass disabled" in b for b in step_plan.shard_blockers)
    stats = runtime.step(short)
    ref_loss, ref_params = reference_step(reference, short, lr=0.5)
    assert abs(stats.loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert max(rel_err(p, ref_params[n]) for n, p in model.named_parameters()) <= 1e-5


@pytest.mark.slow  # the same refusal path runs by default for mixers left alone (test_hybrid)
def test_model_with_attention_left_alone_is_never_sharded_nor_packed():
    run_distributed(_unshardable_worker, 2)


def test_runtime_refuses_unknown_strategy_at_construction():
    with pytest.raises(ValueError, match="strategy must be one of"):
        bsc.Runtime(tiny(), torch.optim.SGD(tiny().parameters(), lr=0.1), strategy="fast")


def test_evaluate_changes_nothing_and_non_finite_steps_are_skipped():
    torch.manual_seed(0)
    model = tiny()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    runtime = bsc.Runtime(model, optimizer, capacity=128)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = runtime.evaluate(_batch())
    ref_loss, _ = reference_step(reference, _batch(), lr=0.0)
    assert abs(loss - ref_loss) <= 1e-5 * ref_loss
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()) and not optimizer.state
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    stats = runtime.step(_batch())
    assert stats.skipped and not optimizer.state, "a non-finite step reached the optimizer"
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if n != "lm_head.weight")
    with torch.no_grad():
        model.lm_head.weight[0, 0] = before["lm_head.weight"][0, 0]
    stats = runtime.step(_batch())
    assert not stats.skipped and stats.grad_norm > 0 and optimizer.state


@pytest.mark.parametrize(
    "bad,message",
    [
        (torch.zeros(2, 3, dtype=torch.long), "sequence 1 has shape (2, 3)"),
        (torch.zeros(4), "sequence 1 holds torch.float32 values"),
        (torch.tensor([3, 500]), "sequence 1 holds token id 500, outside the model's vocabulary of 128"),
        (torch.tensor([3, -1]), "sequence 1 holds token id -1"),
    ],
)
def test_step_refuses_malformed_sequences_naming_them(bad, message):
    model = tiny()
    runtime = bsc.Runtime(model, torch.optim.SGD(model.parameters(), lr=0.1), capacity=128)
    with pytest.raises(BatchError, match=re.escape(message)):
        runtime.step([torch.tensor([1, 2, 3]), bad])


def test_batch_without_targets_is_skipped_and_repeated_skips_stop_training():
    torch.manual_seed(0)
    model = tiny()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    runtime = bsc.Runtime(model, optimizer, capacity=128, max_skipped_steps=2)
    no_targets = [torch.tensor([5]), torch.tensor([7])]  # one token each: nothing to predict, loss 0/0
    assert runtime.step(no_targets).skipped
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()) and not optimizer.state
    with pytest.raises(SkippedStepsError, match=r"steps \[1, 2\] were all skipped"):
        runtime.step(no_targets)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
