"""`bytescale-compile profile`'s step profile (`train/profiling.py`) end to end on a tiny Hugging Face LLaMA on the
CPU: the compiled model at 1 and 2 layers, packed micro-batches, the optimizer timed apart, and a file the planner
and the simulator load."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bytescale_compile.planner import CostModel, plan
from bytescale_compile.planner.cost_model import STEP_TERMS
from bytescale_compile.planner.profiler import build_model
from bytescale_compile.sim.simulator import simulate, step_time
from bytescale_compile.train.profiling import DEPTHS, _cut, profile_steps, step_shapes

pytest.importorskip("transformers")
SPEC = "tests.unit.test_planner_cost_model:hf_tiny"


def test_a_cut_copies_the_first_layers_and_leaves_the_model_whole():
    torch.manual_seed(0)
    model = build_model(SPEC)
    cut = _cut(model, 1)
    assert (len(cut.model.layers), cut.config.num_hidden_layers) == (1, 1)
    assert (len(model.model.layers), model.config.num_hidden_layers) == (2, 2)
    for (name, a), (_, b) in zip(cut.model.layers[0].named_parameters(), model.model.layers[0].named_parameters()):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr(), name
    ids = torch.randint(model.config.vocab_size, (1, 8))
    expected = torch.nn.functional.embedding(ids, model.model.embed_tokens.weight)
    assert torch.equal(cut.model.embed_tokens(ids), expected)
    with pytest.raises(ValueError, match="2 decoder layer"):
        _cut(model, 3)


@pytest.mark.slow  # by default test_faults.py profiles a Hugging Face config directory
def test_profile_times_compiled_steps_and_writes_a_cost_model_the_planner_loads(tmp_path):
    out = tmp_path / "cost.json"
    lengths = [16, 32, 64]
    profile = profile_steps(SPEC, lengths, out, device="cpu", min_time=0.0)
    shapes = step_shapes(lengths)
    assert [(p.layers, p.seq_len, p.sequences, p.micro_batches) for p in profile.points] == [
        (d, s.seq_len, s.sequences, s.micro_batches) for d in DEPTHS for s in shapes
    ]
    assert all(p.seconds > 0 for p in profile.points)
    sizes = [o.param_bytes for o in profile.optimizer]
    model = build_model(SPEC)
    layer = sum(p.numel() * 4 for p in model.model.layers[0].parameters())
    assert sizes[1] - sizes[0] == layer  # the cuts differ by one fp32 layer
    assert profile.act_lengths == (16, 32, 64) and profile.alpha2 > 0

    cost = CostModel.load(out)
    assert (cost.source, cost.layers, cost.kv_bytes_per_token, cost.device) == ("profiled", 2, 256, "cpu")
    assert cost.param_bytes == sum(p.numel() * 4 for p in model.parameters())
    assert set(STEP_TERMS) <= set(json.loads(out.read_text())["coefficients"])
    assert (cost.alpha1, cost.beta1, cost.gamma) == (profile.fit.alpha1, profile.fit.beta1, profile.fit.gamma)
    assert (cost.delta, cost.omega, cost.sigma) == (profile.fit.delta, profile.fit.omega, profile.fit.sigma)

    lens = np.array([64, 32, 16, 16])
    step = plan(lens, world_size=1, capacity=64, cost_model=cost, strategy="balance")
    expected = sum(cost.micro_batch_time(lens[list(m.sequences)]) for m in step.micro_batches)
    assert step_time(step, cost) == pytest.approx(expected + cost.optimizer_time(1), rel=1e-9)
    assert simulate(step, cost).step_time == pytest.approx(step_time(step, cost), rel=1e-12)
