"""Tensor parallelism: `optimize()` of a DTensor model equals the eager DTensor model, and one `Runtime.step` on
TP 2 × HDP 2 (4 gloo ranks) equals one single-process step, with a sequence shared by both HDP ranks; a user's plan
that leaves per-head norms' gradients partial is refused at the first step, before its update."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import bytescale_compile as bsc
from bytescale_compile import TensorParallelError
from bytescale_compile.capture.tp_plan import tp_plan_of
from bytescale_compile.engine.collectives import ReplicaGradientError
from bytescale_compile.engine.dist_optim import DistributedOptimizer
from bytescale_compile.models.llama import tiny
from bytescale_compile.passes.loss import NAME as FUSED_LOSS
from bytescale_compile.testing import run_distributed
from tests.helpers import hf_llama, reference_step, rel_err
from tests.hf_models import build

transformers = pytest.importorskip("transformers")

LENGTHS = [60, 10, 12, 7, 20, 3]  # with C = 32 the 60-token sequence is shared by both HDP ranks
CAPACITY = 32


def _batch(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g) for n in LENGTHS]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    return tiny()


MODELS = {  # hf_models' configs have 4 heads and 2 KV heads: the KV heads equal tp
    "ours": _tiny,
    "hf_llama": hf_llama,
    "qwen2_window": lambda: build("qwen2-sliding"),
    "gqa_kv_eq_tp": lambda: build("mistral"),
    "gemma2_softcaps": lambda: build("gemma2"),  # attention and final logit soft-caps, a window
    "qwen3_head_norms": lambda: build("qwen3"),  # q_norm / k_norm on local heads: gradients summed over TP
}


def _runtime_worker(rank: int, world: int, name: str, lm_head: str, sp: str) -> None:
    model = MODELS[name]()
    hf = name != "ours"
    reference = copy.deepcopy(model)
    plan = tp_plan_of(model)
    if lm_head == "replicated":
        plan.pop("lm_head", None)
    else:
        plan["lm_head"] = "colwise_gather_output"
    bsc.tensor_parallel(model, 2, plan=plan)
    runtime = bsc.Runtime(model, torch.optim.SGD(model.parameters(), lr=0.5), capacity=CAPACITY, sp=sp)
    assert (runtime.world_size, runtime.tp_size, runtime.rank) == (2, 2, rank // 2)
    step_plan = runtime.plan(torch.tensor(LENGTHS).numpy())
    shared = [mb for mb in step_plan.micro_batches if len(mb.ranks) == 2]
    # Ulysses splits each TP rank's 2 query heads (and copies its one K/V head) over the 2 HDP ranks
    assert shared and all(mb.ulysses == (2 if sp == "ulysses" else 1) for mb in shared), shared
    stats = runtime.step(_batch())
    ref_loss, ref_params = reference_step(reference, _batch(), lr=0.5, hf=hf)
    assert abs(stats.loss - ref_loss) <= 1e-5 * abs(ref_loss), (stats.loss, ref_loss)
    for pname, p in model.named_parameters():
        assert rel_err(_full(p.detach()), ref_params[pname]) <= 1e-5, f"{name} rank {rank} {pname}"
    assert len(stats.busy) == 2 and stats.tokens == sum(LENGTHS)
    report = runtime.model.report
    assert report.tensor_parallel and any("column-parallel" in v for v in report.tensor_parallel.values())


@pytest.mark.parametrize(
    "name,lm_head,sp",
    [
        ("hf_llama", "vocab_parallel", "ring"),
        pytest.param("hf_llama", "replicated", "ring", marks=pytest.mark.slow),
        pytest.param("ours", "vocab_parallel", "ring", marks=pytest.mark.slow),
        pytest.param("qwen2_window", "vocab_parallel", "ring", marks=pytest.mark.slow),
        pytest.param("qwen2_window", "vocab_parallel", "ulysses", marks=pytest.mark.slow),
        pytest.param("gqa_kv_eq_tp", "replicated", "ring", marks=pytest.mark.slow),
        pytest.param("gemma2_softcaps", "replicated", "ring", marks=pytest.mark.slow),  # tied embeddings: lm_head whole
        pytest.param("qwen3_head_norms", "vocab_parallel", "ring", marks=pytest.mark.slow),
    ],
)
def test_runtime_step_on_tp2_hdp2_equals_single_process(name, lm_head, sp):
    run_distributed(_runtime_worker, 4, name, lm_head, sp)


def _tp_pp_worker(rank: int, world: int) -> None:
    model = hf_llama()
    reference = copy.deepcopy(model)
    bsc.tensor_parallel(model, 2)
    names = {id(p): n for n, p in model.named_parameters()}
    stage = bsc.pipeline_stage(model, 2)
    runtime = bsc.Runtime(stage, torch.optim.SGD(stage.parameters(), lr=0.5), capacity=4 * CAPACITY)
    assert (runtime.world_size, runtime.tp_size, runtime.pp_size, runtime.rank) == (1, 2, 2, 0)
    stats = runtime.step(_batch())
    ref_loss, ref_params = reference_step(reference, _batch(), lr=0.5, hf=True)
    assert abs(stats.loss - ref_loss) <= 1e-5 * abs(ref_loss), (stats.loss, ref_loss)
    for p in stage.parameters():
        assert rel_err(_full(p.detach()), ref_params[names[id(p)]]) <= 1e-5, f"rank {rank}: {names[id(p)]}"
    assert stats.stage_bytes > 0 and stats.bubbles is not None and len(stats.bubbles) == 1


@pytest.mark.slow
def test_tp2_pp2_step_equals_single_process():
    run_distributed(_tp_pp_worker, 4)


def _user_plan(model: torch.nn.Module, mesh) -> None:
    """What a user writes with torch's API: Megatron's layout on every layer, a vocabulary-parallel embedding and
    lm_head."""
    plan: dict = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate())}
    plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    for i in range(len(model.model.layers)):
        for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{proj}"] = ColwiseParallel()
        for proj in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{proj}"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)


def _partial_norms_worker(rank: int, world: int, optimizers: tuple[str, ...], check_tensor_parallel: bool) -> None:
    """Qwen3 under the user's plan: q_norm / k_norm see each rank's own heads, and parallelize_module does not sum
    their gradients. Refused on every rank, before the update; the same model sharded by bsc.tensor_parallel (which
    marks them replicated_with_grad_allreduce) trains like one process."""
    reference = build("qwen3")
    for name in optimizers:
        model = copy.deepcopy(reference)
        _user_plan(model, init_device_mesh("cpu", (2,)))
        before = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
        optimizer = (
            torch.optim.SGD(model.parameters(), lr=0.5)
            if name == "sgd"
            else DistributedOptimizer(model, 0.1, 0.0, (0.9, 0.95), dtype=torch.float32)
        )
        runtime = bsc.Runtime(model, optimizer, capacity=4 * CAPACITY)
        with pytest.raises(ReplicaGradientError, match="different gradients on the 2 ranks") as refused:
            runtime.step(_batch())
        named = re.findall(r"model\.layers\.\d\.\S+weight", str(refused.value))
        assert named == [f"model.layers.{i}.self_attn.{n}.weight" for i in (0, 1) for n in ("k_norm", "q_norm")]
        assert "bsc.tensor_parallel(model, 2)" in str(refused.value)
        for n, p in model.named_parameters():
            assert torch.equal(_full(p.detach()), before[n]), n  # no update
    if not check_tensor_parallel:
        return
    model = copy.deepcopy(reference)
    bsc.tensor_parallel(model, 2)
    stats = bsc.Runtime(model, torch.optim.SGD(model.parameters(), lr=0.5), capacity=4 * CAPACITY).step(_batch())
    ref_loss, ref_params = reference_step(reference, _batch(), lr=0.5, hf=True)
    assert abs(stats.loss - ref_loss) <= 1e-5 * abs(ref_loss), (stats.loss, ref_loss)
    for n, p in model.named_parameters():
        assert rel_err(_full(p.detach()), ref_params[n]) <= 1e-5, f"rank {rank} {n}"


@pytest.mark.parametrize(
    "optimizers,check_tensor_parallel",
    [
        (("sgd",), False),
        pytest.param(("distributed",), True, marks=pytest.mark.slow),
    ],
)
def test_partial_replica_gradients_are_refused_and_tensor_parallel_sums_them(optimizers, check_tensor_parallel):
    run_distributed(_partial_norms_worker, 2, optimizers, check_tensor_parallel)


def _optimize_worker(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (2,))
    model = hf_llama()
    _user_plan(model, mesh)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    eager = model(input_ids=ids, labels=ids).loss
    eager.backward()
    expected = {n: _full(p.grad).clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    optimized = bsc.optimize(model)
    loss = optimized(input_ids=ids, labels=ids).loss
    loss.backward()
    assert abs(loss.item() - eager.item()) <= 1e-6 * abs(eager.item())
    for n, p in model.named_parameters():
        assert isinstance(p, DTensor) or "norm" in n, n  # the user's parameters stay theirs
        assert rel_err(_full(p.grad), expected[n]) <= 1e-5, n
    layouts = optimized.report.tensor_parallel
    assert layouts["model.embed_tokens"].startswith("vocabulary-parallel")
    assert layouts["model.layers.1.self_attn.o_proj"].startswith("row-parallel")
    assert "Tensor parallelism per layer" in optimized.report.to_markdown()
    fused = optimized.report.rewrites(FUSED_LOSS)
    assert fused and fused[0].detail.startswith("vocabulary-parallel over TP 2"), fused  # no rank gathers logits
    compiled = optimized.compilations
    other = torch.randint(0, 128, (1, 57))
    optimized(input_ids=other, labels=other).loss.backward()  # another length: the same graphs
    assert optimized.compilations == compiled
    _refusals()


def _refusals() -> None:
    """Bad tensor-parallel input, each refused before anything is sharded or compiled."""
    few_kv = hf_llama()
    few_kv.config.num_key_value_heads = 1
    with pytest.raises(
        TensorParallelError, match=re.escape("`model.layers.0.self_attn`: 1 KV heads are not divisible by tp 2")
    ):
        bsc.tensor_parallel(few_kv, 2)
    four_kv = hf_llama()
    four_kv.config.num_key_value_heads = 4  # heads that tp 4 divides: the world size is what refuses
    with pytest.raises(TensorParallelError, match="world size 2 is not divisible by tp × pp = 4 × 1"):
        bsc.tensor_parallel(four_kv, 4)
    with pytest.raises(TensorParallelError, match="Sequential has no known tensor-parallel plan"):
        bsc.tensor_parallel(torch.nn.Sequential(torch.nn.Linear(4, 4)), 2)
    with pytest.raises(TensorParallelError, match="style 'packed_colwise' is not supported"):
        bsc.tensor_parallel(hf_llama(), 2, plan={"model.layers.*.mlp.up_proj": "packed_colwise"})
    reversed_mesh = DeviceMesh("cpu", torch.tensor([1, 0]))  # TP index 0 on global rank 1: not (hdp, tp) order
    model = hf_llama()
    parallelize_module(model, reversed_mesh, {"model.layers.0.mlp.up_proj": ColwiseParallel()})
    with pytest.raises(TensorParallelError, match=r"tensor parallelism must be the innermost mesh dimension"):
        bsc.optimize(model)


def test_optimize_of_a_user_parallelized_model_equals_eager_and_bad_input_is_refused():
    run_distributed(_optimize_worker, 2)
