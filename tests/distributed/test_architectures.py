"""The Hugging Face architecture matrix: every attention rewritten, optimized == eager, and HDP == one process.

The single-process check runs by default for Llama and Gemma 2 (sliding window and soft-capping), and for every
architecture under `make test-all` (Inductor's code for Qwen2 with a sliding window: test_capture_codegen.py); the
2-rank `Runtime.step` with a sequence shared by both ranks runs for one sliding-window model by default and for
every architecture under `make test-all`. Gradient checkpointing (`gradient_checkpointing_enable()`, reentrant and
not) is a case of both: for Llama by default, for every architecture under `make test-all`.
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
DEFAULT_NAMES = ("llama", "gemma2")
CHECKPOINTING = ("non-reentrant", "reentrant")


def _checkpointed(*default: str) -> list:
    """(name, checkpointing mode) of every architecture; Llama's `default` modes run by default, the rest are slow."""
    return [
        pytest.param(name, mode, marks=() if name == "llama" and mode in default else pytest.mark.slow)
        for name in NAMES
        for mode in CHECKPOINTING
    ]


LENGTHS = [50, 9, 14]  # with C = 32 the 50-token sequence is shared by both ranks
CAPACITY = 32


def _build(name: str, checkpointing: str | None) -> torch.nn.Module:
    """The architecture, with Hugging Face's gradient checkpointing on its layers when `checkpointing` names a mode."""
    model = build(name)
    if checkpointing is not None:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"}
        )
    return model


@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=() if name in DEFAULT_NAMES else pytest.mark.slow) for name in NAMES]
)
def test_optimized_matches_eager_and_rewrites_every_attention(name):
    _check_optimized(name, None)


@pytest.mark.parametrize(("name", "checkpointing"), _checkpointed(*CHECKPOINTING))
def test_checkpointed_layers_are_rewritten_and_match_eager(name, checkpointing):
    _check_optimized(name, checkpointing)


def _check_optimized(name: str, checkpointing: str | None) -> None:
    model = _build(name, checkpointing)
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


def _shared_step_worker(rank: int, world: int, name: str, checkpointing: str | None = None) -> None:
    model = _build(name, checkpointing)
    reference = copy.deepcopy(model)
    runtime = bsc.Runtime(model, torch.optim.SGD(model.parameters(), lr=0.5), capacity=CAPACITY)
    step_plan = runtime.plan(torch.tensor(LENGTHS).numpy())
    assert any(len(mb.ranks) == world for mb in step_plan.micro_batches), step_plan.micro_batches
    stats = runtime.step(_batch())
    if checkpointing is not None:
        assert stats.p2p_bytes > 0, "the shared sequence ran without the ring"
    ref_loss, ref_params = reference_step(reference, _batch(), lr=0.5, hf=True)
    assert abs(stats.loss - ref_loss) <= 1e-5 * abs(ref_loss), (stats.loss, ref_loss)
    worst = max(ref_params, key=lambda n: rel_err(dict(model.named_parameters())[n], ref_params[n]))
    assert rel_err(dict(model.named_parameters())[worst], ref_params[worst]) <= 1e-5, f"rank {rank}: {worst}"


@pytest.mark.slow  # by default tests/distributed/test_train_ulysses.py runs qwen2-sliding's shared step, ring included
@pytest.mark.parametrize("name", NAMES)
def test_two_rank_step_with_a_shared_sequence_equals_one_process(name):
    run_distributed(_shared_step_worker, 2, name)


@pytest.mark.parametrize(("name", "checkpointing"), _checkpointed(CHECKPOINTING[0]))
def test_two_rank_step_of_checkpointed_layers_equals_one_process(name, checkpointing):
    """The shared sequence runs the ring inside the checkpointed layers, forward and recomputed backward."""
    run_distributed(_shared_step_worker, 2, name, checkpointing)
