"""The setup probe (engine/probe.py): what planning reads of a compiled model, learnt once, without an optimizer,
and the same as the model's own report says."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import bytescale_compile as bsc
from bytescale_compile.engine import probe as probe_module
from bytescale_compile.engine import runtime as runtime_module
from bytescale_compile.engine.probe import default_cost_model, probe
from bytescale_compile.engine.runtime import ListBatch, NoOptimizerError
from bytescale_compile.models.llama import tiny
from bytescale_compile.passes.report import CompileReport
from bytescale_compile.planner import CostModel
from tests.hf_models import HYBRID_BY_NAME, VOCAB, build_hybrid

LENGTHS = [40, 24, 9]


def _batch(vocab: int = 128) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g) for n in LENGTHS]


def test_probe_compiles_an_uncompiled_model_once_and_reads_its_report():
    optimized = bsc.optimize(tiny())
    probed = probe(optimized)
    assert optimized.compilations > 0
    compiled = optimized.compilations
    assert probed.shard_blockers == tuple(optimized.shard_blockers()) == () and probed.shardable
    assert (probed.hdp, probed.pp_size, probed.tp_size) == (1, 1, 1)
    assert probed.cost_model == default_cost_model(optimized).replace(tp_size=1)
    assert probe(optimized) == probed and optimized.compilations == compiled, "a compiled model is only read"


def test_a_model_the_attention_pass_left_alone_is_not_shardable():
    optimized = bsc.optimize(tiny(), attention=False)
    probed = probe(optimized)
    assert probed.shard_blockers == tuple(optimized.shard_blockers()) and probed.shard_blockers
    assert not probed.shardable


def test_a_hybrid_is_charged_its_mixer_costs_from_the_compile_report():
    optimized = bsc.optimize(build_hybrid("lfm2"))
    cost = CostModel.preset("llama-7b")
    probed = probe(optimized, cost)
    layers, state_bytes = CompileReport(graphs=optimized.compiled_graphs).mixer_costs()
    assert layers == len(HYBRID_BY_NAME["lfm2"].mixers) and state_bytes > 0
    assert (probed.mixer_layers, probed.mixer_state_bytes) == (layers, float(state_bytes))
    assert probed.cost_model == cost.replace(tp_size=1, mixer_layers=layers, mixer_state_bytes=float(state_bytes))
    calibrated = cost.replace(alpha1=cost.alpha1 * 2)
    assert probed.charged(calibrated).mixer_layers == layers, "another cost model is charged alike"
    own = cost.replace(mixer_layers=1, mixer_state_bytes=5.0)
    assert probed.charged(own).mixer_layers == 1, "a cost model that holds mixer costs keeps its own"


def test_probe_refuses_a_module_that_is_not_optimized():
    with pytest.raises(TypeError, match=r"probe\(\) takes a model through bytescale_compile.optimize\(\)"):
        probe(tiny())


def test_the_runtime_probes_once_and_its_shard_blockers_change_nothing(monkeypatch):
    """The mixer costs are read from the report once, however many plans and steps follow."""
    reads = []
    real = probe_module._mixer_costs
    monkeypatch.setattr(probe_module, "_mixer_costs", lambda *a: reads.append(1) or real(*a))
    model = tiny()
    runtime = bsc.Runtime(model, torch.optim.SGD(model.parameters(), lr=0.1), capacity=64)
    for _ in range(2):
        runtime.step(_batch())
    cost_model = runtime.cost_model
    assert runtime.shard_blockers() == [] and runtime.plan(np.array(LENGTHS)) is not None
    assert runtime.cost_model is cost_model and len(reads) == 1


def test_a_given_probe_is_taken_without_compiling_again_and_must_match_the_mesh(monkeypatch):
    optimized = bsc.optimize(build_hybrid("lfm2"))
    cost = CostModel.preset("llama-7b")
    probed = probe(optimized, cost)
    monkeypatch.setattr(runtime_module, "probe_executor", lambda *a: pytest.fail("the Runtime probed again"))
    runtime = bsc.Runtime(optimized, None, cost_model=cost, capacity=64, probe=probed)
    assert runtime.probe is probed and runtime.cost_model == probed.cost_model
    runtime.cost_model = cost.replace(alpha1=cost.alpha1 * 2)  # e.g. calibrated in the job
    assert runtime.cost_model.mixer_layers == probed.mixer_layers > 0, "a cost model set later is charged alike"
    with pytest.raises(ValueError, match="the given probe is of 2 HDP ranks x pp 1 x tp 1, this Runtime runs 1"):
        bsc.Runtime(optimized, None, cost_model=cost, probe=dataclasses.replace(probed, hdp=2))


def test_a_runtime_without_optimizer_runs_forward_backward_and_refuses_a_step():
    torch.manual_seed(0)
    model = build_hybrid("lfm2")
    runtime = bsc.Runtime(model, None, cost_model=CostModel.preset("llama-7b"), capacity=64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = ListBatch(_batch(VOCAB), VOCAB)
    runtime.forward_backward(runtime.plan(np.array(LENGTHS)), batch)
    assert any(p.grad is not None and p.grad.any() for p in model.parameters())
    with pytest.raises(NoOptimizerError, match="built with optimizer=None"):
        runtime.step(_batch(VOCAB))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
