"""The vocabulary-parallel fused loss: the op on 2 gloo ranks equals linear + cross-entropy over the whole
vocabulary with one collective per chunk, and `optimize()` of a tensor-parallel HF Llama with a gathered lm_head uses it and equals the eager
DTensor model (a replicated lm_head keeps the unsplit fused op)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

import bytescale_compile as bsc
from bytescale_compile.kernels import cross_entropy_ref
from bytescale_compile.ops.loss import vocab_parallel_linear_cross_entropy_op
from bytescale_compile.testing import run_distributed
from tests.helpers import hf_llama, protocol_batch, rel_err

WORLD = 2
H, V = 16, 38
TOKENS = 13
TOL = 1e-5
CHUNK = 4
"""Tokens per chunk: 4 chunks of the 13 tokens."""


@dataclass(frozen=True)
class Case:
    reduction: str
    bias: bool
    scale: float = 1.0
    softcap: float | None = None
    ignore_index: int = -100
    shape: tuple[int, ...] = (TOKENS,)


CASES = [
    Case("sum", bias=False),
    Case("mean", bias=True, shape=(1, TOKENS)),
    Case("mean", bias=True, scale=0.5, softcap=3.0),
    Case("sum", bias=True, scale=-1.5, ignore_index=0),  # an ignored id inside rank 0's shard
]


def _inputs(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The same hidden, whole weight, bias and targets on every rank; every 3rd target ignored, the others on
    both shards."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(*case.shape, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) * 0.5
    bias = torch.randn(V, generator=gen) if case.bias else None
    target = torch.randint(0, V, case.shape, generator=gen)
    target.view(-1)[::3] = case.ignore_index
    kept = target[target != case.ignore_index]
    assert (kept < V // WORLD).any() and (kept >= V // WORLD).any()
    return hidden, weight, bias, target


def _reference(
    case: Case, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor
) -> torch.Tensor:
    z = F.linear(hidden, weight, bias).float()
    logits = case.scale * z if case.softcap is None else case.softcap * torch.tanh(case.scale * z / case.softcap)
    return F.cross_entropy(
        logits.view(-1, V), target.view(-1), ignore_index=case.ignore_index, reduction=case.reduction
    )


def _leaves(*tensors: torch.Tensor | None) -> list[Any]:
    return [None if t is None else t.detach().clone().requires_grad_() for t in tensors]


def _shard(rank: int) -> slice:
    return slice(rank * V // WORLD, (rank + 1) * V // WORLD)


def _op_args(rank: int, case: Case, group_name: str) -> tuple:
    """The op's arguments on `rank`: leaf hidden, weight and bias shards, a workspace of CHUNK tokens per chunk."""
    hidden, weight, bias, target = _inputs(case)
    rows = _shard(rank)
    leaves = _leaves(hidden, weight[rows], None if bias is None else bias[rows])
    cap = CHUNK * (V // WORLD) * cross_entropy_ref.logit_bytes(torch.float32, True, case.softcap)
    options = (case.ignore_index, case.reduction, True, cap, case.scale, case.softcap)
    return (*leaves, target, *options, group_name, rows.start)


@contextlib.contextmanager
def _counted_collectives() -> Iterator[list[str]]:
    """The names of the collectives called inside the block, in order."""
    calls: list[str] = []
    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather_into_tensor", "all_gather")}

    def counting(name: str, fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return fn(*args, **kwargs)

        return run

    for name, fn in originals.items():
        setattr(dist, name, counting(name, fn))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _check_case(rank: int, case: Case, group_name: str) -> None:
    hidden, weight, bias, target = _inputs(case)
    ref = _leaves(hidden, weight, bias)
    ref_loss = _reference(case, ref[0], ref[1], ref[2], target)
    ref_loss.backward()

    args = _op_args(rank, case, group_name)
    with _counted_collectives() as calls:
        loss = vocab_parallel_linear_cross_entropy_op(*args)[0]
    assert calls == ["all_gather"] * -(-TOKENS // CHUNK), calls  # one small collective per chunk
    loss.backward()
    grad_hidden = args[0].grad.clone()
    dist.all_reduce(grad_hidden)  # the shards' partial gradients: copy_to_tp's job in a model

    rows = _shard(rank)
    assert rel_err(loss, ref_loss) <= TOL, (case, loss, ref_loss)
    assert rel_err(grad_hidden, ref[0].grad) <= TOL, case
    assert rel_err(args[1].grad, ref[1].grad[rows]) <= TOL, case
    if bias is not None:
        assert rel_err(args[2].grad, ref[2].grad[rows]) <= TOL, case


def _op_worker(rank: int, world: int) -> None:
    group_name = dist.distributed_c10d._get_default_group().group_name
    for case in CASES:
        _check_case(rank, case, group_name)
    torch.library.opcheck(vocab_parallel_linear_cross_entropy_op, _op_args(rank, CASES[2], group_name))
    args = list(_op_args(rank, CASES[0], group_name))
    args[3].view(-1)[1] = V  # past the last shard: every rank refuses it before any collective
    with pytest.raises(ValueError, match=f"{V}.*V={V}"):
        vocab_parallel_linear_cross_entropy_op(*args)
    args[3].view(-1)[1], args[-1] = 0, 1
    with pytest.raises(ValueError, match="vocab_start"):
        vocab_parallel_linear_cross_entropy_op(*args)


def test_op_matches_linear_cross_entropy_over_whole_vocabulary() -> None:
    run_distributed(_op_worker, WORLD)


# --- a tensor-parallel Hugging Face Llama ------------------------------------------------------------------


def _tp_llama(mesh: DeviceMesh, lm_head: str) -> torch.nn.Module:
    """`hf_llama` with attention and MLP split over the mesh; the lm_head gathered or replicated."""
    model: Any = hf_llama()
    plan: dict[str, ParallelStyle] = {}
    for i in range(len(model.model.layers)):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    if lm_head == "gathered":
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    return parallelize_module(model, mesh, plan)


def _loss_and_grads(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, Any]]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads


def _check_model(mesh: DeviceMesh, lm_head: str, protocol: bool) -> None:
    """`optimize()` equals the eager DTensor model, and its loss rewrite splits the vocabulary iff the lm_head is."""
    model = _tp_llama(mesh, lm_head)
    batch = protocol_batch([17, 9], vocab=128, hf=True, seed=1)
    if not protocol:  # labels only: HF shifts them itself and averages (reduction "mean")
        batch = {"input_ids": batch["input_ids"], "labels": batch["input_ids"]}
    ref_loss, ref_grads = _loss_and_grads(model, batch)
    optimized = bsc.optimize(model)
    loss, grads = _loss_and_grads(optimized, batch)

    assert rel_err(loss, ref_loss) <= TOL, (lm_head, loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert rel_err(grad, ref_grads[name]) <= TOL, (lm_head, name)
    (rewrite,) = optimized.report.rewrites("fused_loss")
    split = lm_head == "gathered"
    op = "vocab_parallel_linear_cross_entropy" if split else "fused_linear_cross_entropy"
    assert rewrite.target == f"bytescale.{op}"
    assert ("vocabulary-parallel over TP 2" in rewrite.detail) == split, rewrite.detail
    assert f"reduction={'sum' if protocol else 'mean'}" in rewrite.detail


def _model_worker(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    _check_model(mesh, "gathered", protocol=True)  # the runtime's model protocol: reduction "sum"
    _check_model(mesh, "replicated", protocol=False)  # HF's own shift and mean (the op test has both reductions)


@pytest.mark.slow  # the vocabulary-parallel lm_head also runs by default in tests/distributed/test_tensor_parallel.py
def test_optimized_tp_llama_matches_eager_with_split_and_whole_lm_head() -> None:
    pytest.importorskip("transformers")
    run_distributed(_model_worker, WORLD)
