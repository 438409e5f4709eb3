"""ZeRO-1 and the distributed optimizer under tensor parallelism, on TP 2 × HDP 2 (4 gloo ranks): the state sharded
over the HDP ranks of each TP index, parameters kept as DTensors, equal to one process's AdamW, and checkpoints
that resume bit for bit.

By default on a small eager model (a column- and a row-parallel linear, a replicated bias, a plain norm); the same
through `Runtime.step` on a tiny Hugging Face Llama is slow (it compiles).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor, Replicate, Shard

import bytescale_compile as bsc
from bytescale_compile.engine.collectives import local, sync_gradients
from bytescale_compile.engine.dist_optim import DistributedOptimizer
from bytescale_compile.engine.mesh import ReplicaGroupError, TrainMesh, hdp_group
from bytescale_compile.engine.optim import LocalZeroRedundancyOptimizer, StepGuard, build_optimizer
from bytescale_compile.planner import CostModel
from bytescale_compile.testing import run_distributed
from bytescale_compile.train.checkpoint import load_checkpoint, load_model_weights, save_checkpoint
from tests.helpers import hf_llama, reference_step, rel_err

LR, BETAS, DECAY = 3e-3, (0.9, 0.95), 0.1
MAX_NORM = 0.5  # below the gradients' norm: clipping acts
TP = 2
Optimizer = torch.optim.Optimizer | DistributedOptimizer


def _mlp() -> torch.nn.Module:
    """In fp64, the reference's precision."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 6), torch.nn.LayerNorm(6)
    ).double()


def _sharded_mlp() -> torch.nn.Module:
    """In fp32: column-parallel (Shard(0) weight and bias), row-parallel (Shard(1) weight, replicated DTensor bias),
    then a plain LayerNorm."""
    model = _mlp().float()
    bsc.tensor_parallel(model, TP, plan={"0": "colwise", "2": "rowwise"})
    return model


def _inputs(hdp_rank: int, step: int) -> torch.Tensor:
    return torch.randn(3, 6, generator=torch.Generator().manual_seed(10 * step + hdp_rank))


def _loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Half of the outputs' squares: the LayerNorm holds their sum over all outputs fixed, whose gradient would be
    rounding noise."""
    return model(x)[:, :3].pow(2).sum()


def _reference(steps: int, max_norm: float | None) -> tuple[list[float], torch.nn.Module]:
    """One process in fp64: both HDP ranks' inputs each step, clipped to `max_norm` (None: not clipped), torch's
    AdamW. The gradient norms before clipping, and the model."""
    model = _mlp()
    optimizer = build_optimizer(model, LR, DECAY, BETAS)
    norms = []
    for step in range(steps):
        optimizer.zero_grad()
        sum(_loss(model, _inputs(h, step).double()) for h in range(2)).backward()
        norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
    return norms, model


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _assert_close(model: torch.nn.Module, reference: torch.nn.Module, tol: float) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        err = rel_err(_full(p.detach()), _full(q.detach()))
        assert err <= tol, (name, err)


def _assert_close_in_norm(model: torch.nn.Module, reference: dict[str, torch.Tensor]) -> None:
    """bf16 rounds the weights and gradients, and Adam turns a near-zero gradient's rounding into a whole step of
    either sign: single elements differ, the tensors agree in norm."""
    for name, p in model.named_parameters():
        full, expected = _full(p.detach()).double(), reference[name].double()
        err = float((full - expected).norm() / expected.norm())
        assert err <= 5e-2, (name, err)


def _zero_step(model: torch.nn.Module, optimizer: Optimizer, step: int) -> None:
    """A step as the Runtime takes it with a torch optimizer, not clipped."""
    assert isinstance(optimizer, torch.optim.Optimizer)
    optimizer.zero_grad()
    mesh = TrainMesh.of_world(tp=TP)
    _loss(model, _inputs(mesh.hdp_rank, step)).backward()
    sync_gradients(list(model.parameters()), mesh.hdp, hdp_group(mesh))
    optimizer.step()


def _sharded_step(model: torch.nn.Module, optimizer: Optimizer, step: int) -> float:
    """A step as the Runtime takes it with the distributed optimizer, clipped to `MAX_NORM`; the norm before."""
    assert isinstance(optimizer, DistributedOptimizer)
    optimizer.start(1)
    x = _inputs(TrainMesh.of_world(tp=TP).hdp_rank, step)
    _loss(model, x.to(optimizer.dtype)).float().backward()
    optimizer.finish()
    norm = optimizer.grad_norm()
    optimizer.step(StepGuard.of(norm, MAX_NORM))
    return float(norm)


def _resumes(
    root: Path, make: Callable[[torch.nn.Module], Optimizer], step: Callable[[torch.nn.Module, Optimizer, int], object]
) -> tuple[torch.nn.Module, Optimizer]:
    """Train 2 steps, save, train 2 more; a fresh model and optimizer loaded from the checkpoint train the same 2 to
    the same bits. The trained model and its optimizer."""
    model = _sharded_mlp()
    optimizer = make(model)
    for i in range(2):
        step(model, optimizer, i)
    path = save_checkpoint(root, 2, model, optimizer, {"step": 2})
    for i in range(2, 4):
        step(model, optimizer, i)
    resumed = _sharded_mlp()
    resumed_optimizer = make(resumed)
    assert load_checkpoint(path, resumed, resumed_optimizer) == {"step": 2}
    for i in range(2, 4):
        step(resumed, resumed_optimizer, i)
    for (name, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert type(p) is type(q) and torch.equal(local(p), local(q)), name
    return model, optimizer


def _hdp_ranks(rank: int) -> list[int]:
    return [rank % TP, rank % TP + TP]


def _zero_worker(rank: int, world: int, root: str) -> None:
    model = _sharded_mlp()
    optimizer = build_optimizer(model, LR, DECAY, BETAS, zero=True)
    assert isinstance(optimizer, LocalZeroRedundancyOptimizer)
    assert dist.get_process_group_ranks(optimizer.process_group) == _hdp_ranks(rank)
    for i in range(2):
        _zero_step(model, optimizer, i)
    _assert_close(model, _reference(2, max_norm=None)[1], 1e-5)
    mine = {id(p) for group in optimizer.optim.param_groups for p in group["params"]}
    assert 0 < len(mine) < len(list(model.parameters()))  # each HDP rank holds the state of its share only
    assert all(
        isinstance(optimizer.optim.state[p]["exp_avg"], DTensor)
        for p in model.parameters()
        if id(p) in mine and isinstance(p, DTensor)
    )
    _resumes(Path(root), lambda m: build_optimizer(m, LR, DECAY, BETAS, zero=True), _zero_step)
    everyone = r"global ranks \[0, 1, 2, 3\] mixes TP indices"
    with pytest.raises(ReplicaGroupError, match=everyone):
        build_optimizer(model, LR, DECAY, BETAS, zero=True, process_group=dist.group.WORLD)
    with pytest.raises(ReplicaGroupError, match=everyone):
        DistributedOptimizer(model, LR, DECAY, BETAS, group=dist.group.WORLD)
    with pytest.raises(ValueError, match="torch's ZeroRedundancyOptimizer broadcasts whole parameters"):
        zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, process_group=optimizer.process_group)
        bsc.Runtime(model, zero, cost_model=CostModel.preset("llama-7b"))


def _distributed_worker(rank: int, world: int, root: str) -> None:
    model = _sharded_mlp()
    placements = {n: getattr(p, "placements", None) for n, p in model.named_parameters()}
    optimizer = DistributedOptimizer(model, LR, DECAY, BETAS, dtype=torch.float32, bucket_bytes=64)
    assert dist.get_process_group_ranks(optimizer.group) == _hdp_ranks(rank)
    assert len(optimizer.buckets) > 2
    storage = optimizer.weights.untyped_storage().data_ptr()
    for name, p in model.named_parameters():  # DTensors still, their local tensors views of the flat buffer
        assert getattr(p, "placements", None) == placements[name], name
        assert local(p).untyped_storage().data_ptr() == storage, name
    norms = [_sharded_step(model, optimizer, i) for i in range(2)]
    ref_norms, reference = _reference(2, MAX_NORM)
    assert max(abs(a - b) / b for a, b in zip(norms, ref_norms)) <= 1e-5, (norms, ref_norms)
    assert min(ref_norms) > MAX_NORM
    _assert_close(model, reference, 1e-5)

    bf16, bf16_optimizer = _resumes(
        Path(root, "resume"), lambda m: DistributedOptimizer(m, LR, DECAY, BETAS, bucket_bytes=64), _sharded_step
    )
    assert {local(p).dtype for p in bf16.parameters()} == {torch.bfloat16}
    assert isinstance(bf16[0].weight, DTensor) and bf16[0].weight.placements == (Shard(0),)
    assert isinstance(bf16[2].bias, DTensor) and bf16[2].bias.placements == (Replicate(),)
    _assert_close_in_norm(bf16, dict(_reference(4, MAX_NORM)[1].named_parameters()))
    path = save_checkpoint(Path(root, "final"), 4, bf16, bf16_optimizer, {})
    whole = _mlp().float()
    load_model_weights(path, whole)  # the fp32 main weights, put together from every TP and HDP rank's pieces
    for (name, p), q in zip(bf16.named_parameters(), whole.parameters()):
        assert torch.equal(_full(p.detach()), q.to(torch.bfloat16)), name
        assert not torch.equal(q.to(torch.bfloat16).float(), q), name


def _optimizers_worker(rank: int, world: int, root: str) -> None:
    _zero_worker(rank, world, str(Path(root, "zero")))
    _distributed_worker(rank, world, str(Path(root, "distributed")))


def test_zero1_and_the_distributed_optimizer_on_tp2_hdp2_equal_adamw_and_resume(tmp_path):
    """Both in one set of processes: starting four ranks costs as much as either check."""
    run_distributed(_optimizers_worker, 4, str(tmp_path))


LENGTHS = [60, 10, 12, 7, 20, 3]  # with C = 32 the 60-token sequence is shared by both HDP ranks
CAPACITY = 32


def _batch(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return [torch.randint(0, 128, (n,), generator=g) for n in LENGTHS]


def _runtime_worker(rank: int, world: int, root: str, kind: str) -> None:
    """One `Runtime.step` of a tiny Hugging Face Llama: its loss is one process's; with ZeRO-1 the update is torch's
    AdamW on the same TP layout and gradients, with the distributed optimizer one process's fp32 AdamW step to
    bf16's precision; a checkpoint loaded back repeats the next step bit for bit."""
    model = hf_llama()
    reference = copy.deepcopy(model)
    bsc.tensor_parallel(model, TP)
    twin = copy.deepcopy(model)
    bf16 = kind == "bf16"
    optimizer: Optimizer = (
        DistributedOptimizer(model, LR, DECAY, BETAS) if bf16 else build_optimizer(model, LR, DECAY, BETAS, zero=True)
    )
    runtime = bsc.Runtime(model, optimizer, capacity=CAPACITY, mixed_precision=torch.bfloat16 if bf16 else None)
    assert (runtime.world_size, runtime.tp_size) == (2, TP)
    loss = runtime.step(_batch(0)).loss
    ref_loss, ref_params = reference_step(
        reference, _batch(0), LR, hf=True, optimizer=build_optimizer(reference, LR, DECAY, BETAS)
    )
    assert abs(loss - ref_loss) <= (1e-2 if bf16 else 1e-5) * abs(ref_loss), (loss, ref_loss)
    if bf16:
        _assert_close_in_norm(model, ref_params)
    else:  # Adam's step on a gradient near its eps amplifies rounding: compare on the run's own gradients
        for p, q in zip(model.parameters(), twin.parameters()):
            q.grad = p.grad
        build_optimizer(twin, LR, DECAY, BETAS).step()
        _assert_close(model, twin, 1e-5)

    path = save_checkpoint(root, 1, runtime.model, optimizer, {"step": 1})
    first = runtime.step(_batch(1)).loss
    after = {name: local(p).detach().clone() for name, p in model.named_parameters()}
    load_checkpoint(path, runtime.model, optimizer)
    assert runtime.step(_batch(1)).loss == first
    for name, p in model.named_parameters():
        assert torch.equal(local(p), after[name]), name


@pytest.mark.slow  # compiles a model on 4 ranks; the default tests run both optimizers on an eager model
@pytest.mark.parametrize("kind", ["zero", "bf16"])
def test_runtime_step_on_tp2_hdp2_equals_single_process_and_resumes(tmp_path, kind):
    run_distributed(_runtime_worker, 4, str(tmp_path), kind)
