"""Hugging Face MoE models under tensor parallelism: one `Runtime.step` on TP 2 × HDP 2 (4 gloo ranks) equals training
each sequence alone in one process (loss, load-balancing loss and every updated weight), with the experts
expert-parallel inside the TP group ("ep") or split like a dense MLP ("tp"), a sequence shared by both HDP ranks,
and the load-balancing loss on and off; DeepSeek-V3 with its aux-loss-free expert bias instead; PP 2 × TP 2."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import bytescale_compile as bsc
from bytescale_compile.capture.routers import bias_routers, expert_bias
from bytescale_compile.planner.plan import PlanError
from bytescale_compile.testing import run_distributed
from tests.moe import batch, moe_model, per_sequence_step, routed_counts

transformers = pytest.importorskip("transformers")

LENGTHS = [40, 9, 12, 7, 20, 3, 15]
"""With capacity 32 on 2 HDP ranks the 40-token sequence is shared by both, the short ones are packed."""
CAPACITY = 32
SINKS_CAPACITY = 48
"""gpt-oss: its attention sinks are left alone by the attention pass, so no sequence is shared nor packed and each
must fit one rank."""
LR = 0.5
TOLERANCE = 1e-5
BIAS_STEP = 0.01


@dataclass(frozen=True)
class Case:
    """One model of the matrix under one expert layout."""

    model: str
    layout: str
    aux: bool
    """The load-balancing loss on."""
    bias_update: bool = False
    """DeepSeek-V3's aux-loss-free balancing (`expert_bias_update`)."""

    @property
    def sinks(self) -> bool:
        return self.model == "gpt-oss"


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def _check_experts_sharded(model: torch.nn.Module, layout: str) -> None:
    """Every experts parameter is a DTensor of `layout`: E/tp whole experts (Shard(0)), or split like an MLP."""
    experts = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
    assert experts
    for module in experts:
        for name, p in module.named_parameters():
            assert isinstance(p, DTensor), name
            (placement,) = p.placements
            if layout == "ep":
                assert placement == Shard(0) and p.to_local().shape[0] == p.shape[0] // 2, (name, placement)
            elif name == "gate_up_proj":
                assert isinstance(placement, _StridedShard) and placement.dim == 1, placement
            else:
                assert placement == Shard(2), (name, placement)


def _check_plan(runtime: bsc.Runtime, case: Case) -> None:
    plan = runtime.plan(np.array(LENGTHS))
    shared = [mb for mb in plan.micro_batches if len(mb.ranks) == 2]
    if not case.sinks:
        assert shared, plan.micro_batches
        return
    assert not shared and all(len(mb.sequences) == 1 for mb in plan.micro_batches), plan.micro_batches
    with pytest.raises(PlanError, match="40 tokens, more than the capacity 32.*attention sinks"):
        dataclasses.replace(runtime.plan_request(), capacity=CAPACITY).plan(np.array(LENGTHS))


def _check_case(rank: int, case: Case) -> None:
    sequences = batch(LENGTHS)
    reference = moe_model(case.model, aux=case.aux)
    model = copy.deepcopy(reference)
    biases = [expert_bias(r).clone() for r in bias_routers(reference)]
    with routed_counts(reference) as counts:
        ref = per_sequence_step(reference, sequences, LR)
    bsc.tensor_parallel(model, 2, expert_layout=case.layout)
    _check_experts_sharded(model, case.layout)
    runtime = bsc.Runtime(
        model,
        torch.optim.SGD(model.parameters(), lr=LR),
        capacity=SINKS_CAPACITY if case.sinks else CAPACITY,
        expert_bias_update=BIAS_STEP if case.bias_update else None,
    )
    assert (runtime.world_size, runtime.tp_size, runtime.rank) == (2, 2, rank // 2)
    _check_plan(runtime, case)
    stats = runtime.step(sequences)
    where = f"{case} rank {rank}"
    assert abs(stats.loss - ref.loss) <= TOLERANCE, (where, stats.loss, ref.loss)
    assert abs(stats.aux_loss - ref.aux_loss) <= TOLERANCE, (where, stats.aux_loss, ref.aux_loss)
    assert (ref.aux_loss > 0.1) == case.aux, (where, ref.aux_loss)
    for name, p in model.named_parameters():
        err = float((_full(p) - ref.weights[name]).abs().max())
        assert err <= TOLERANCE, (where, name, err)
    if case.bias_update:
        loads = [float(c.max() / c.mean()) for c in counts]
        assert stats.expert_load == pytest.approx(loads), (where, stats.expert_load, loads)
        for router, before, c in zip(bias_routers(model), biases, counts, strict=True):
            expected = before + BIAS_STEP * torch.sign(c.mean() - c)
            assert torch.equal(expert_bias(router), expected), (where, expert_bias(router), expected)
    layouts = runtime.model.report.tensor_parallel
    kind = "whole experts" if case.layout == "ep" else "split like an MLP"
    assert any(path.endswith("mlp.experts") and kind in v for path, v in layouts.items()), layouts


def _matrix_worker(rank: int, world: int, cases: list[Case]) -> None:
    for case in cases:  # several models per process group: the spawn and the gloo setup once
        _check_case(rank, case)


def _both_ways(model: str, layouts: tuple[str, ...] = ("ep", "tp")) -> list[Case]:
    return [Case(model, layout, aux) for aux in (True, False) for layout in layouts]


@pytest.mark.parametrize(
    "cases",
    [
        pytest.param([Case("qwen3-moe", "ep", aux=True)], id="qwen3-moe-ep-aux"),
        pytest.param(
            [Case("qwen3-moe", "tp", aux=True), Case("qwen3-moe", "ep", aux=False), Case("qwen3-moe", "tp", aux=False)],
            id="qwen3-moe",
            marks=pytest.mark.slow,
        ),
        pytest.param(_both_ways("mixtral"), id="mixtral", marks=pytest.mark.slow),
        pytest.param(_both_ways("olmoe"), id="olmoe", marks=pytest.mark.slow),
        pytest.param(
            # no load-balancing loss: the expert bias, moved from the step's counts over every rank
            [Case("deepseek-v3", layout, aux=False, bias_update=True) for layout in ("ep", "tp")]
            + [Case("deepseek-v3", "ep", aux=False)],
            id="deepseek-v3",
            marks=pytest.mark.slow,
        ),
        # biased, transposed experts: expert-parallel only (TP experts are refused, tests/unit/test_tp_experts.py)
        pytest.param(_both_ways("gpt-oss", ("ep",)), id="gpt-oss", marks=pytest.mark.slow),
    ],
)
def test_runtime_step_on_tp2_hdp2_equals_per_sequence_training(cases):
    run_distributed(_matrix_worker, 4, cases)


def _tp_pp_worker(rank: int, world: int, layout: str) -> None:
    sequences = batch(LENGTHS)
    reference = moe_model("mixtral", aux=False)  # the aux loss spans every layer, which stages split: refused
    model = copy.deepcopy(reference)
    ref = per_sequence_step(reference, sequences, LR)
    bsc.tensor_parallel(model, 2, expert_layout=layout)
    names = {id(p): n for n, p in model.named_parameters()}
    stage = bsc.pipeline_stage(model, 2)
    runtime = bsc.Runtime(stage, torch.optim.SGD(stage.parameters(), lr=LR), capacity=4 * CAPACITY)
    assert (runtime.world_size, runtime.tp_size, runtime.pp_size, runtime.rank) == (1, 2, 2, 0)
    stats = runtime.step(sequences)
    assert abs(stats.loss - ref.loss) <= TOLERANCE, (stats.loss, ref.loss)
    for p in stage.parameters():
        err = float((_full(p) - ref.weights[names[id(p)]]).abs().max())
        assert err <= TOLERANCE, (rank, names[id(p)], err)
    assert stats.bubbles is not None and len(stats.bubbles) == 1


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ep", "tp"])
def test_pp2_tp2_step_equals_per_sequence_training(layout):
    run_distributed(_tp_pp_worker, 4, layout)
