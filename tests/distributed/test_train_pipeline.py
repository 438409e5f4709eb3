"""Pipelines through the Runtime: one step of hdp x pp stage ranks (each stage through optimize(), run by the
1F1B executor) equals the single-process step of the whole model over the whole batch, with micro-batches
shared by pipelines and pipelines running different numbers of micro-batches, and so does evaluation; plans
that cannot run fail before any communication."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

import bytescale_compile as bsc
from bytescale_compile.engine import pipeline
from bytescale_compile.engine.pipeline import (
    PipelineExecutor,
    PipelineSetupError,
    StageTransferError,
    check_stage_plan,
    pipeline_stage,
)
from bytescale_compile.engine.stages import StageSpec, split_stages
from bytescale_compile.models.llama import LlamaConfig, LlamaForCausalLM, tiny
from bytescale_compile.planner.plan import MicroBatch, Plan, PlanError, local_tokens, split_tokens
from bytescale_compile.testing import run_distributed
from tests.helpers import hf_llama, reference_step, rel_err

LR = 0.5


def ours(num_layers: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=num_layers, num_heads=2, num_kv_heads=1
        )
    )


def ours_tiny() -> nn.Module:
    torch.manual_seed(0)
    return tiny()


MODELS: dict[str, tuple[Callable[[], nn.Module], bool]] = {
    "tiny": (ours_tiny, False),
    "ours": (ours, False),
    "ours-6": (lambda: ours(6), False),
    "hf-llama": (lambda: hf_llama(4).train(), True),
}
"""Our LLaMA's 2-layer preset (one layer a stage at PP 2), 4- and 6-layer ones (a stage keeps its last two
layers' activations resident, so offloading needs three a stage), and Hugging Face's LLaMA."""


def _plan(
    lengths: list[int], micro_batches: list[tuple[tuple[int, ...], tuple[int, ...]]], schedule: list[list[int]], pp: int
) -> Plan:
    """Micro-batch i holds sequences `micro_batches[i][1]` on pipelines `micro_batches[i][0]`."""
    mbs = [
        MicroBatch(i, ranks, seqs, 0.0, local_tokens([lengths[s] for s in seqs], len(ranks)), 1.0)
        for i, (ranks, seqs) in enumerate(micro_batches)
    ]
    return Plan("balance", len(schedule), 64, pp, lengths, mbs, schedule)


SMALL = _plan([16, 7, 5], [((0, 1), (0,)), ((1,), (1, 2))], [[0], [0, 1]], 2)
"""PP 2 x HDP 2 at its smallest: sequence 0 shared by both pipelines (a ring on each stage), pipeline 1 runs a
second micro-batch packing two sequences."""
SHARED = _plan([24, 9, 12, 7, 5], [((0, 1), (0,)), ((0,), (1,)), ((1,), (2,)), ((1,), (3, 4))], [[1, 0], [0, 2, 3]], 2)
"""PP 2 x HDP 2: the shared sequence is pipeline 0's second micro-batch and pipeline 1's first; pipeline 1 runs
3 micro-batches, pipeline 0 runs 2."""
SPLIT = dataclasses.replace(
    SHARED,
    micro_batches=[
        dataclasses.replace(SHARED.micro_batches[0], ulysses=2, tokens_per_rank=split_tokens(np.array([24]), 2, 2)),
        *SHARED.micro_batches[1:],
    ],
)
"""SHARED with its shared sequence split 2 × 1: Ulysses over heads between the pipelines' stages, no ring."""
DEEP = _plan([13, 9, 20, 6], [((0,), (0, 1)), ((0,), (2,)), ((0,), (3,))], [[0, 1, 2]], 4)
"""PP 4 x HDP 1: fewer micro-batches than stages."""
CROSSED = _plan([8, 8], [((0, 1), (0,)), ((0, 1), (1,))], [[0, 1], [1, 0]], 2)
"""Two shared micro-batches the pipelines run in opposite orders: a deadlock under 1F1B."""


def _batch(lengths: list[int]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 128, (n,), generator=g) for n in lengths]


def _forbid_communication(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("communicated before rejecting the plan")

    for name in ("isend", "irecv", "send", "recv", "all_reduce", "batch_isend_irecv"):
        monkeypatch.setattr(pipeline.dist, name, refuse)


def _step_worker(rank: int, world: int, name: str, plan: Plan, offload: float = 0.0) -> None:
    """One Runtime step (each stage offloading `offload` of its saved activations) against the whole model's."""
    torch.set_num_threads(1)  # four processes on a few cores
    factory, hf = MODELS[name]
    model = factory()
    reference = copy.deepcopy(model)
    names = {id(p): n for n, p in model.named_parameters()}
    stage = bsc.pipeline_stage(model, plan.pp_size)
    runtime = bsc.Runtime(stage, torch.optim.SGD(stage.parameters(), lr=LR), bsc.CompileConfig(offload=offload))
    assert (runtime.rank, runtime.world_size, runtime.pp_size) == (
        rank % plan.world_size,
        plan.world_size,
        plan.pp_size,
    )
    evaluated = runtime.evaluate(_batch(plan.sequences))
    stats = runtime.step(_batch(plan.sequences), plan=plan)
    ref_loss, ref_params = reference_step(reference, _batch(plan.sequences), lr=LR, hf=hf)
    assert rel_err(torch.tensor(stats.loss), torch.tensor(ref_loss)) <= 1e-5, (stats.loss, ref_loss)
    assert rel_err(torch.tensor(evaluated), torch.tensor(ref_loss)) <= 1e-5, (evaluated, ref_loss)
    for p in stage.parameters():
        assert rel_err(p, ref_params[names[id(p)]]) <= 1e-5, f"rank {rank}: {names[id(p)]}"
    counts = [len(ids) for ids in plan.schedule]
    assert stats.micro_batches == counts * plan.pp_size
    assert min(stats.busy) > 0 and stats.stage_bytes > 0 and not stats.skipped
    assert (stats.p2p_bytes > 0) == any(mb.shared for mb in plan.micro_batches)
    assert (stats.offloaded_bytes > 0) == (offload > 0)
    assert stats.bubbles is not None and len(stats.bubbles) == plan.world_size
    assert all(0.0 <= b < 1.0 for b in stats.bubbles), stats.bubbles
    with pytest.MonkeyPatch.context() as patch:
        _forbid_communication(patch)
        with pytest.raises(PlanError, match="deadlock under 1F1B"):
            runtime.step(_batch(CROSSED.sequences), plan=CROSSED)


def test_pp2_hdp2_step_with_a_shared_sequence_and_offloading_equals_the_single_process_step():
    run_distributed(_step_worker, 4, "ours-6", SMALL, 0.5)


@pytest.mark.slow
@pytest.mark.parametrize("plan", [SHARED, SPLIT], ids=["ring", "ulysses"])
def test_pp2_hdp2_step_of_a_hugging_face_model_equals_the_single_process_step(plan):
    run_distributed(_step_worker, 4, "hf-llama", plan)


@pytest.mark.slow
def test_pp4_step_equals_the_single_process_step():
    run_distributed(_step_worker, 4, "ours", DEEP)


def _bf16_worker(rank: int, world: int) -> None:
    """Autocast on every stage: the step runs (no skip), in bf16 (not fp32's loss), close to fp32's."""
    torch.set_num_threads(1)
    model = hf_llama(4).train()
    reference = copy.deepcopy(model)
    stage = pipeline_stage(model, SHARED.pp_size)
    runtime = bsc.Runtime(stage, torch.optim.SGD(stage.parameters(), lr=LR), mixed_precision=torch.bfloat16)
    stats = runtime.step(_batch(SHARED.sequences), plan=SHARED)
    ref_loss, _ = reference_step(reference, _batch(SHARED.sequences), lr=LR, hf=True)
    assert not stats.skipped and math.isfinite(stats.grad_norm)
    assert stats.loss != ref_loss and abs(stats.loss - ref_loss) <= 2e-2 * abs(ref_loss), (stats.loss, ref_loss)


@pytest.mark.slow
def test_pp2_hdp2_bf16_step_is_close_to_the_fp32_step():
    run_distributed(_bf16_worker, 4)


def _mismatch_worker(rank: int, world: int) -> None:
    """Stage 1 runs the plan's two micro-batches in the other order than stage 0."""
    torch.set_num_threads(1)
    plan = _plan([10, 6], [((0,), (0,)), ((0,), (1,))], [[0, 1] if rank == 0 else [1, 0]], 2)
    stage = pipeline_stage(ours(), 2)
    runtime = bsc.Runtime(stage, torch.optim.SGD(stage.parameters(), lr=LR))
    if rank == 1:
        with pytest.raises(
            StageTransferError,
            match="expected the hidden states of micro-batch 1 with shape "
            r"\[1, 6, 32\] from rank 0, got micro-batch 0 with shape "
            r"\[1, 10, 32\]",
        ):
            runtime.step(_batch(plan.sequences), plan=plan)
        return
    with pytest.raises(RuntimeError):  # stage 1 has left: its gradient never comes
        runtime.step(_batch(plan.sequences), plan=plan)


@pytest.mark.slow
def test_stages_running_different_plans_fail_with_both_micro_batches_named():
    run_distributed(_mismatch_worker, 2, meet_at_exit=False)  # stage 0 must see stage 1 gone


def test_inconsistent_shared_order_is_rejected_by_the_plan_check():
    with pytest.raises(PlanError, match="deadlock under 1F1B"):
        check_stage_plan(CROSSED, StageSpec(0, 2, range(2)), world_size=4, rank=0)


@pytest.mark.parametrize(
    ("spec", "world", "rank", "message"),
    [
        (StageSpec(0, 2, range(2)), 6, 0, "need 4 processes, but the job has 6"),
        (StageSpec(0, 2, range(2)), 4, 2, "global rank 2 runs stage 1 .* holds stage module 0"),
        (StageSpec(0, 4, range(1)), 4, 0, "pp_size 2 but the stage module is stage 0 of 4"),
    ],
)
def test_plan_and_processes_that_do_not_fit_are_named(spec, world, rank, message):
    with pytest.raises(PipelineSetupError, match=message):
        check_stage_plan(SHARED, spec, world, rank)


def test_executor_needs_a_stage_and_a_process_group():
    model = ours()
    with pytest.raises(PipelineSetupError, match="has no StageSpec"):
        PipelineExecutor(model)
    stage = split_stages(model, 2)[0]
    assert not dist.is_initialized()
    with pytest.raises(PipelineSetupError, match="needs torch.distributed initialised"):
        bsc.Runtime(stage, torch.optim.SGD(stage.parameters(), lr=LR))
    with pytest.raises(PipelineSetupError, match="pp_size 2 needs torch.distributed initialised"):
        pipeline_stage(model, 2)
