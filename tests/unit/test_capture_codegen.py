"""`CompileConfig(codegen="inductor")`: Inductor compiles the graphs our passes produce, our ops stay opaque calls.

Equality with eager to 1e-5 in fp32, offload bit-identical to the same codegen without it, varying
lengths without recompiling, and the report listing what Inductor generated.
"""

from __future__ import annotations

import copy

import pytest
import torch

import bytescale_compile as bsc
from bytescale_compile.engine.protocol import packed_row
from bytescale_compile.models.llama import LlamaConfig, LlamaForCausalLM
from bytescale_compile.runtime.offload import get_act_ctx
from tests.helpers import assert_matches_eager, eager_copy, loss_and_grads, protocol_batch
from tests.hf_models import ARCHS, VOCAB, build

INDUCTOR = bsc.CompileConfig(codegen="inductor")
DEFAULT_SUITE_ARCHS = ("qwen2-sliding",)
"""The HF architectures the default suite runs with Inductor; the rest of the matrix is marked slow."""


def _llama(num_layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=num_layers, num_heads=4, num_kv_heads=2
        )
    )


def _generated(opt: torch.nn.Module) -> list:
    return [code for g in opt.report.graphs for code in g.generated]


def test_our_llama_matches_eager_and_report_lists_the_kernels():
    model = _llama()
    opt = bsc.optimize(eager_copy(model), INDUCTOR)
    assert_matches_eager(opt, model, protocol_batch([21, 7, 30], VOCAB))
    generated = _generated(opt)
    assert {code.graph for code in generated} == {"forward", "backward"}
    for code in generated:
        assert code.kernels and all(k.fused_nodes for k in code.kernels), code
        assert any(call.startswith("torch.ops.bytescale.") for call in code.extern_calls), code.extern_calls
    assert max(len(k.fused_nodes) for code in generated for k in code.kernels) > 1  # something was fused
    assert "Inductor, forward graph:" in opt.report.to_markdown()


@pytest.mark.parametrize(
    "name", [pytest.param(a.name, marks=[] if a.name in DEFAULT_SUITE_ARCHS else pytest.mark.slow) for a in ARCHS]
)
def test_hugging_face_matrix_matches_eager(name):
    model = build(name)
    opt = bsc.optimize(eager_copy(model), INDUCTOR)
    assert_matches_eager(opt, model, protocol_batch([21, 7, 30], VOCAB, hf=True))
    assert _generated(opt)


def _offload_run(opt: torch.nn.Module, batch: dict, ratio: float | None):
    if ratio is None:
        return loss_and_grads(opt, batch)
    act_ctx = get_act_ctx(1, [ratio])
    with act_ctx:
        result = loss_and_grads(opt, batch)
    assert act_ctx.stats[0].offloaded_bytes > 0 and act_ctx.waiting(0) == 0
    return result


@pytest.mark.slow  # 33 s; the default run checks offloading exactly with the eager backend (test_offload.py)
@torch._inductor.config.patch(fx_graph_cache=False)
def test_offload_is_bit_identical_under_inductor():
    """r = 0.5 through the act_ctx against the same Inductor code without offloading (pass off). Both compile
    here: a graph from the FX graph cache, written by another test process, need not reduce in the same order.
    Every token id occurs once: Inductor's CPU scatter-add for the embedding's gradient adds a repeated id's
    rows in an order that varies between two runs of the very same code (3.6e-8 relative, one run in three)."""
    model = _llama(num_layers=4)
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:64]
    batch = packed_row(ids, [40, 24]).kwargs(labels=False)
    ref_loss, ref_grads = _offload_run(
        bsc.optimize(copy.deepcopy(model), INDUCTOR.with_overrides(offload="off")), batch, None
    )
    opt = bsc.optimize(model, INDUCTOR)
    loss, grads = _offload_run(opt, batch, 0.5)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)
    calls = [c for code in _generated(opt) for c in code.extern_calls]
    assert "torch.ops.bytescale.offload_saved.default" in calls and "torch.ops.bytescale.reload_saved.default" in calls


def test_twenty_lengths_compile_at_most_twice():
    opt = bsc.optimize(_llama(), INDUCTOR)
    for i, n in enumerate(torch.randint(5, 200, (20,), generator=torch.Generator().manual_seed(0)).tolist()):
        opt(**protocol_batch([n], VOCAB, seed=i)).loss.backward()
    assert opt.compilations <= 2


def test_codegen_auto_picks_by_device_and_bad_values_raise():
    assert bsc.CompileConfig().resolve_codegen("cpu") == "none"
    assert bsc.CompileConfig().resolve_codegen("cuda") == "inductor"
    assert bsc.CompileConfig(codegen="inductor").resolve_codegen("cpu") == "inductor"
    with pytest.raises(ValueError, match="CompileConfig.codegen"):
        bsc.CompileConfig(codegen="triton")
