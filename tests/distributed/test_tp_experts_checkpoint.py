"""Hugging Face MoE experts under tensor parallelism with every optimizer, and their checkpoints: AdamW, ZeRO-1 and
the distributed optimizer update a Qwen3-MoE in either expert layout ("ep": whole experts per rank, "tp": every
expert split, its fused gate/up a strided shard) as one process does, and a checkpoint of either layout loads into
the other and into one whole model, by name and global shape. By default AdamW on TP 2 (2 gloo ranks); every
optimizer on TP 2 × HDP 2 (4 ranks) is slow.

The gradients are given (random, per HDP rank, summed over the HDP ranks as the Runtime sums them), so no forward
runs: what is checked is where every element of a shard lives in the global tensor.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

import bytescale_compile as bsc
from bytescale_compile.engine.collectives import local, sync_gradients
from bytescale_compile.engine.dist_optim import DistributedOptimizer, TPSplit
from bytescale_compile.engine.mesh import TrainMesh, hdp_group
from bytescale_compile.engine.optim import build_optimizer
from bytescale_compile.testing import run_distributed
from bytescale_compile.train.checkpoint import load_checkpoint, load_model_weights, save_checkpoint
from tests.helpers import rel_err
from tests.moe import qwen3_moe

LR, BETAS, DECAY = 1e-2, (0.9, 0.95), 0.1
TP = 2
KINDS = ("adamw", "zero", "bf16")
GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"


def _model(layout: str | None) -> torch.nn.Module:
    """The tiny Qwen3-MoE (4 experts of intermediate size 32), sharded over TP 2 in `layout` (None: whole)."""
    model = qwen3_moe()
    if layout is not None:
        bsc.tensor_parallel(model, TP, expert_layout=layout)  # type: ignore[arg-type]
    return model


def _optimizer(model: torch.nn.Module, kind: str) -> torch.optim.Optimizer | DistributedOptimizer:
    if kind == "bf16":
        return DistributedOptimizer(model, LR, DECAY, BETAS, bucket_bytes=4096)  # fragments end mid-expert
    return build_optimizer(model, LR, DECAY, BETAS, zero=kind == "zero")


def _grad(shape: torch.Size, step: int, hdp_rank: int, index: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 100 * hdp_rank + index)
    return torch.randn(shape, generator=g)


def _local_grad(p: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """`whole` as `p` holds it: torch's own placement of a DTensor, the reference for where a shard lives."""
    return distribute_tensor(whole, p.device_mesh, p.placements).to_local() if isinstance(p, DTensor) else whole


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer | DistributedOptimizer, step: int) -> None:
    """One step of this HDP rank's gradients, summed over the HDP ranks (the distributed optimizer's
    reduce-scatter, else an all-reduce), not clipped."""
    mesh = TrainMesh.of_world(tp=TP)
    params = list(model.parameters())
    grads = [_local_grad(p, _grad(p.shape, step, mesh.hdp_rank, i)) for i, p in enumerate(params)]
    if isinstance(optimizer, DistributedOptimizer):
        optimizer.start(1)
        sum((local(p).float() * g).sum() for p, g in zip(params, grads)).backward()
        optimizer.finish()
        optimizer.step()
        return
    optimizer.zero_grad()
    for p, g in zip(params, grads):
        p.grad = DTensor.from_local(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g.clone()
    sync_gradients(params, mesh.hdp, hdp_group(mesh))
    optimizer.step()


def _reference(steps: int, hdp: int) -> dict[str, torch.Tensor]:
    """One process's AdamW on the whole model, with the `hdp` HDP ranks' gradients summed."""
    model = _model(None)
    optimizer = build_optimizer(model, LR, DECAY, BETAS)
    for step in range(steps):
        for i, p in enumerate(model.parameters()):
            p.grad = sum(_grad(p.shape, step, h, i) for h in range(hdp))
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _whole(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()
        for name, p in model.named_parameters()
    }


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), (name, rel_err(a[name], b[name]))


def _assert_trained_like(model: torch.nn.Module, reference: dict[str, torch.Tensor], kind: str) -> None:
    """fp32: one process's weights to rounding; bf16 rounds weights and gradients: the tensors agree in norm."""
    for name, whole in _whole(model).items():
        if kind == "bf16":
            err = float((whole.double() - reference[name]).norm() / reference[name].double().norm())
            assert err <= 5e-2, (name, err)
        else:
            assert rel_err(whole, reference[name]) <= 1e-5, (name, rel_err(whole, reference[name]))


def _worker(rank: int, world: int, root: str, kinds: tuple[str, ...], layouts: tuple[str, ...]) -> None:
    reference = _reference(2, world // TP)
    for layout in ("ep", "tp"):
        model = _model(layout)
        placements = str(model.get_parameter(GATE_UP).placements)
        assert ("_StridedShard" in placements) == (layout == "tp"), placements
        _check_boxes(model.get_parameter(GATE_UP))
    for kind in kinds:
        for saved_in in layouts:
            loaded_in = {"ep": "tp", "tp": "ep"}[saved_in]
            path = Path(root, kind, saved_in)
            model = _model(saved_in)
            optimizer = _optimizer(model, kind)
            for step in range(2):
                _step(model, optimizer, step)
            _assert_trained_like(model, reference, kind)
            save_checkpoint(path, 2, model, optimizer, {"step": 2})
            _step(model, optimizer, 2)

            other = _model(loaded_in)  # the other layout: resharded by name and global shape
            other_optimizer = _optimizer(other, kind)
            assert load_checkpoint(path / "step_00000002", other, other_optimizer) == {"step": 2}
            _step(other, other_optimizer, 2)  # the moments came along too: the same next step
            _assert_equal(_whole(other), _whole(model))

            whole = _model(None)  # what an export reads: the fp32 weights, whole, in one model
            load_model_weights(path / "step_00000002", whole)
            if kind != "bf16":
                _assert_trained_like(whole, reference, kind)
        dist.barrier()


def _check_boxes(p: DTensor) -> None:
    """`TPSplit`'s boxes of this rank's shard are where torch puts those elements in the global tensor."""
    split = TPSplit.of(p, GATE_UP)
    assert split is not None
    numbered = torch.arange(p.numel(), dtype=torch.float32).view(p.shape)
    mine = _local_grad(p, numbered)
    rank = p.device_mesh.get_local_rank()
    for lo, hi in ((0, mine.numel()), (5, mine.numel() - 7), (100, 3000)):
        covered = 0
        for at, sizes, start in split.boxes(tuple(mine.shape), rank, lo, hi):
            piece = mine.reshape(-1)[start : start + math.prod(sizes)].view(sizes)
            assert torch.equal(piece, numbered[tuple(slice(o, o + n) for o, n in zip(at, sizes))]), (at, sizes)
            covered += piece.numel()
        assert covered == hi - lo


def test_strided_experts_train_and_checkpoint_into_the_other_layout_and_one_model(tmp_path):
    run_distributed(_worker, 2, str(tmp_path), ("adamw",), ("tp",))


@pytest.mark.slow  # four ranks, each optimizer in both layouts
def test_experts_train_and_checkpoint_in_either_layout_with_every_optimizer(tmp_path):
    run_distributed(_worker, 4, str(tmp_path), KINDS, ("tp", "ep"))
