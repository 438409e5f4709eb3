"""On a CUDA GPU (skipped elsewhere): the compiled path against eager, under bf16 autocast, and a training run on
NCCL against the same run on the CPU. Run on a lent GPU with `pytest tests/e2e/test_gpu.py`."""

from __future__ import annotations

import copy

import pytest
import torch

import bytescale_compile as bsc
from bytescale_compile.models.llama import tiny
from tests.helpers import assert_matches_eager, hf_llama, loss_and_grads, protocol_batch, rel_err
from tests.trainer_runs import run_losses, run_trainer, torchrun_command, train_args

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def exact_fp32():
    """fp32 matmuls in full precision (no tf32), so fp32 results compare to 1e-4."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


def _on_cuda(batch: dict) -> dict:
    return {k: v.cuda() for k, v in batch.items()}


@pytest.mark.parametrize("build,hf", [(tiny, False), (hf_llama, True)], ids=["llama", "hf-llama"])
@pytest.mark.parametrize("partitioner", ["default", "min_cut"])
def test_optimized_matches_eager_fp32(build, hf, partitioner):
    """Triton attention and loss kernels, Inductor code generation: loss and every gradient equal eager."""
    torch.manual_seed(0)
    model = build().cuda()
    eager = copy.deepcopy(model)
    optimized = bsc.optimize(model, partitioner=partitioner)
    assert_matches_eager(optimized, eager, _on_cuda(protocol_batch([100, 37, 200, 5], 128, hf=hf)), tol=1e-4)


def test_bf16_autocast_matches_eager():
    """Under bf16 autocast the compiled model runs (autocast rules of our ops) and lands near eager's bf16."""
    torch.manual_seed(0)
    model = hf_llama().cuda()
    eager = copy.deepcopy(model)
    optimized = bsc.optimize(model)
    batch = _on_cuda(protocol_batch([300, 64, 9], 128, hf=True))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss, grads = loss_and_grads(optimized, batch)
        ref_loss, ref_grads = loss_and_grads(eager, batch)
    assert rel_err(loss, ref_loss) <= 1e-2
    assert max(rel_err(grads[n], ref_grads[n]) for n in grads) <= 5e-2


def test_training_on_nccl_matches_the_cpu(workspace, tmp_path):  # noqa: F811
    """The trainer on one GPU rank (NCCL, model and batches on cuda:0) gives the losses of the CPU run (gloo)."""
    gpu, cpu = tmp_path / "gpu", tmp_path / "cpu"
    run_trainer(torchrun_command(1, train_args(workspace, gpu)))
    run_trainer(torchrun_command(1, train_args(workspace, cpu)), CUDA_VISIBLE_DEVICES="")
    torch.testing.assert_close(run_losses(gpu), run_losses(cpu), rtol=1e-3, atol=0)
