"""The cost model's terms outside the decoder layers: E(n) per micro-batch (LM head, loss, embedding, every layer's
launches once, delta) and O per step (the optimizer over the rank's shard); their fit from timed steps; the
simulator charging them; old files without them."""

from __future__ import annotations

import dataclasses
import json
import logging
import warnings

import numpy as np
import pytest

from bytescale_compile.planner import CostModel, plan
from bytescale_compile.planner.builder import PlanBuilder
from bytescale_compile.planner.cost_model import STEP_TERMS, StepTerms
from bytescale_compile.planner.equations import EXPRS
from bytescale_compile.planner.hardware import Hardware
from bytescale_compile.planner.profiler import (
    OptimizerPoint,
    StepFit,
    StepPoint,
    fit_cost_model,
    fit_step_profile,
    fit_step_terms,
)
from bytescale_compile.sim.simulator import simulate, step_time
from bytescale_compile.train.profiling import step_shapes

COEFFS = dict(alpha1=1e-9, beta1=1e-6, gamma=1e-3, beta_head=2e-6, beta_embed=1e-7, delta=5e-3, omega=1e-12, sigma=2e-3)
MODEL = CostModel.from_terms(
    alpha2=10.0,
    beta2=0.0,
    layers=2,
    kv_bytes_per_token=4,
    param_bytes=1e9,
    hardware=Hardware(network_bandwidth=1e9, latency=1e-5),
    source="hand",
    **COEFFS,
)


def _by_hand(lengths: list[int]) -> float:
    """One micro-batch packing `lengths` on one rank, from the coefficients alone."""
    a1, b1, g = COEFFS["alpha1"], COEFFS["beta1"], COEFFS["gamma"]
    tokens = sum(lengths)
    layers = MODEL.layers * (sum(a1 * s * s + b1 * s for s in lengths) + g)
    return layers + (COEFFS["beta_head"] + COEFFS["beta_embed"]) * tokens + COEFFS["delta"]


def test_a_micro_batch_pays_every_layers_launches_once_however_many_sequences_it_packs():
    packed = MODEL.micro_batch_time([100, 200])
    assert packed == pytest.approx(_by_hand([100, 200]), rel=1e-12)
    apart = MODEL.micro_batch_time([100]) + MODEL.micro_batch_time([200])
    assert apart - packed == pytest.approx(MODEL.layers * COEFFS["gamma"] + COEFFS["delta"], rel=1e-9)
    # one sequence alone: the paper's layers x T(s), plus the head, loss and embedding and delta
    assert MODEL.micro_batch_time([300]) == pytest.approx(
        MODEL.layers * float(MODEL.layer_time(300)) + 2.1e-6 * 300 + 5e-3, rel=1e-12
    )


def test_the_optimizer_steps_the_ranks_shard():
    assert MODEL.optimizer_time(1) == pytest.approx(1e-12 * 1e9 + 2e-3)
    assert MODEL.optimizer_time(4) == pytest.approx(1e-12 * 1e9 / 4 + 2e-3)
    with pytest.raises(ValueError, match="shards"):
        MODEL.optimizer_time(0)


def test_the_new_terms_are_sympy_expressions_over_named_coefficients():
    assert {str(s) for s in EXPRS["E"].free_symbols} == {"n", "l", "gamma", "beta_head", "beta_embed", "delta"}
    assert {str(s) for s in EXPRS["O"].free_symbols} == {"omega", "P", "shards", "sigma"}
    assert set(STEP_TERMS) == {f.name for f in dataclasses.fields(StepTerms)}


def test_the_simulated_step_is_the_sum_of_its_terms():
    lens = np.array([100, 200, 300])
    builder = PlanBuilder("static", lens, 1, 400, MODEL)
    builder.add([0], [0, 1])
    builder.add([0], [2])
    plan = builder.build()
    optimizer = 1e-12 * 1e9 + 2e-3  # one rank steps every parameter
    expected = _by_hand([100, 200]) + _by_hand([300]) + optimizer
    assert step_time(plan, MODEL) == pytest.approx(expected, rel=1e-12)
    timeline = simulate(plan, MODEL)
    assert timeline.step_time == pytest.approx(expected, rel=1e-12)
    (opt,) = [s for s in timeline.spans if s.kind == "optimizer"]
    assert opt.end - opt.start == pytest.approx(optimizer)


def test_two_ranks_all_reduce_then_step_half_the_optimizer_state_each():
    lens = np.array([100, 200])
    builder = PlanBuilder("static", lens, 2, 400, MODEL)
    builder.add([0], [0])
    builder.add([1], [1])
    plan = builder.build()
    expected = _by_hand([200]) + MODEL.allreduce_time() + 1e-12 * 1e9 / 2 + 2e-3
    assert step_time(plan, MODEL) == pytest.approx(expected, rel=1e-12)


def test_analytic_models_leave_the_new_terms_at_zero():
    preset = CostModel.preset("llama-7b")
    assert all(getattr(preset, k) == 0.0 for k in STEP_TERMS)
    assert preset.micro_batch_overhead == pytest.approx(preset.layers * preset.gamma)


def test_json_keeps_the_new_terms_and_old_files_load_without_them(tmp_path, caplog):
    path = tmp_path / "cm.json"
    MODEL.save(path)
    assert CostModel.load(path) == MODEL
    data = json.loads(path.read_text())
    for key in ("delta", "omega"):
        del data["coefficients"][key]
    path.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="bytescale_compile.planner.cost_model"):
        old = CostModel.load(path)
    assert (old.delta, old.omega, old.beta_head) == (0.0, 0.0, COEFFS["beta_head"])
    assert "delta, omega" in caplog.text and "bytescale-compile profile" in caplog.text


def test_negative_terms_are_refused():
    with pytest.raises(ValueError, match="omega"):
        MODEL.replace(omega=-1.0)


TRUE = StepFit(
    alpha1=3e-11, beta1=2e-6, gamma=4e-4, beta_out=5e-6, delta=2e-3, omega=2e-12, step_constant=1e-3,
    optimizer_constant=5e-4,
)  # fmt: skip


def _synthetic(fit: StepFit) -> tuple[list[StepPoint], list[OptimizerPoint]]:
    shapes = step_shapes([1024, 4096, 16384, 32768])
    points = [StepPoint(depth, s.seq_len, s.sequences, s.micro_batches, 0.0) for depth in (1, 2) for s in shapes]
    points = [dataclasses.replace(p, seconds=fit.step_seconds(p)) for p in points]
    optimizer = [OptimizerPoint(b, fit.optimizer_seconds(b)) for b in (2.5e9, 2.9e9)]
    return points, optimizer


def test_the_fit_recovers_known_coefficients_from_synthetic_steps():
    got = fit_step_terms(*_synthetic(TRUE))
    for field in dataclasses.fields(StepFit):
        assert getattr(got, field.name) == pytest.approx(getattr(TRUE, field.name), rel=1e-6), field.name
    assert got.sigma == pytest.approx(1.5e-3)


def test_the_fit_needs_two_depths_and_two_micro_batch_counts():
    points, optimizer = _synthetic(TRUE)
    with pytest.raises(ValueError, match="2 model depths"):
        fit_step_terms([p for p in points if p.layers == 1], optimizer)
    with pytest.raises(ValueError, match="2 micro-batch counts"):
        fit_step_terms([p for p in points if p.micro_batches == 1], optimizer)
    with pytest.raises(ValueError, match="2 parameter sizes"):
        fit_step_terms(points, optimizer[:1])


def test_the_profile_splits_the_embedding_from_the_head_and_builds_the_cost_model():
    points, optimizer = _synthetic(TRUE)
    tokens = [1024, 4096, 32768]
    embed = (tokens, [1e-6 * n + 3e-4 for n in tokens])
    act = ([1024, 4096, 32768], [100 * n + 7 for n in (1024, 4096, 32768)])
    profile = fit_step_profile(points, optimizer, embed, act, "cpu")
    assert profile.beta_embed == pytest.approx(1e-6) and profile.beta_head == pytest.approx(4e-6)
    assert (profile.alpha2, profile.beta2) == (pytest.approx(100.0), pytest.approx(7.0))
    model = fit_cost_model(profile, layers=8, kv_bytes_per_token=4096, param_bytes=5.6e9)
    fitted = profile.fit
    assert (model.alpha1, model.gamma, model.delta) == (fitted.alpha1, fitted.gamma, fitted.delta)
    assert (model.beta_head, model.beta_embed) == (profile.beta_head, profile.beta_embed)
    assert model.optimizer_time(1) == pytest.approx(2e-12 * 5.6e9 + 1.5e-3)
    assert "E(n)" in profile.summary() and "O " in profile.summary()


def test_step_shapes_pack_the_shorter_lengths_into_the_longest_row():
    shapes = step_shapes([1024, 4096, 32768])
    assert [(s.seq_len, s.sequences, s.micro_batches) for s in shapes] == [
        (1024, 1, 1),
        (4096, 1, 1),
        (32768, 1, 1),
        (1024, 32, 1),
        (4096, 8, 1),
        (1024, 1, 2),
        (32768, 1, 2),
    ]
    with pytest.raises(ValueError, match="3 distinct"):
        step_shapes([64, 64, 128])


def test_a_cost_model_of_fixed_costs_only_still_plans():
    """A profile on a loaded CPU may find no time that grows with tokens: every sequence's work is then 0."""
    flat = CostModel.from_terms(
        alpha1=0.0,
        beta1=0.0,
        gamma=1e-3,
        alpha2=10.0,
        beta2=0.0,
        layers=2,
        kv_bytes_per_token=4,
        param_bytes=1e6,
        hardware=Hardware(),
        source="flat",
        delta=1e-3,
    )
    lens = np.array([300, 200, 100, 50])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step = plan(lens, world_size=2, capacity=400, cost_model=flat, strategy="balance")
    step.validate()
    assert sorted(i for m in step.micro_batches for i in m.sequences) == [0, 1, 2, 3]


def test_the_models_expressions_carry_its_numbers():
    e, o = MODEL.exprs["E"], MODEL.exprs["O"]
    symbols = {str(s): s for s in (*e.free_symbols, *o.free_symbols)}
    assert set(symbols) == {"n", "l", "P", "shards"}
    per_micro_batch = MODEL.micro_batch_overhead + (COEFFS["beta_head"] + COEFFS["beta_embed"]) * 300
    assert float(e.subs({symbols["n"]: 300, symbols["l"]: 2})) == pytest.approx(per_micro_batch)
    assert float(o.subs({symbols["P"]: MODEL.param_bytes, symbols["shards"]: 2})) == pytest.approx(
        MODEL.optimizer_time(2)
    )
