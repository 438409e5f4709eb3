"""PP-balance that sees pipeline bubbles, stage-to-stage sends in the 1F1B simulator, and `auto` choosing
exactly the candidate a full search over `CANDIDATES` would."""

from __future__ import annotations

import hashlib
import json

import pytest

from bytescale_compile.planner import CostModel, Hardware, plan
from bytescale_compile.planner.auto import CANDIDATES
from bytescale_compile.sim.lengths import sample_global_batch
from bytescale_compile.sim.pipeline import one_f_one_b
from bytescale_compile.sim.simulator import boundary_bytes_per_token, bubble_rates, pipeline_sends, step_time

K = 1024
COST = CostModel.preset("llama-7b")
L20_COST = CostModel.preset("llama-7b", Hardware.preset("l20"))


def _digest(p) -> str:
    body = [(m.ranks, m.sequences, round(m.offload_ratio, 9)) for m in p.micro_batches]
    return hashlib.sha256(json.dumps([body, p.schedule]).encode()).hexdigest()[:16]


# balance plans at pp = 1 captured before PP-balance learned about bubbles (2M tokens, 128K context, 16 ranks),
# recaptured when a layer's launch constant gamma moved from each sequence to each micro-batch, and when balance
# learned to widen a sequence that would end past the balanced time onto ranks it waits for
PP1_PLANS = {
    ("byted", 0): "9c13db605309117d",
    ("byted", 1): "7ad33554b4a2a42a",
    ("github", 0): "020cc8b65e8285a7",
    ("github", 1): "6eac129ffad1d7d3",
}


@pytest.mark.parametrize("dataset,seed", list(PP1_PLANS))
def test_pp1_balance_plans_are_unchanged(dataset, seed):
    lens = sample_global_batch(dataset, 2 * 2**20, seed=seed, max_len=128 * K)
    assert (
        _digest(plan(lens, world_size=16, capacity=8 * K, cost_model=COST, strategy="balance"))
        == PP1_PLANS[dataset, seed]
    )


@pytest.mark.parametrize("dataset", ["github", "byted"])
def test_pp4_auto_is_never_slower_than_balance_or_static(dataset):
    lens = sample_global_batch(dataset, 2 * 2**20, seed=0, max_len=128 * K)
    steps = {
        s: step_time(
            plan(
                lens,
                world_size=16,
                capacity=32 * K,
                cost_model=COST,
                strategy=s,
                pp_size=4,
                context_length=128 * K,
                step_time=step_time,
            ),
            COST,
        )
        for s in ("balance", "static", "auto")
    }
    assert steps["auto"] <= min(steps["balance"], steps["static"]) * (1 + 1e-9)


def test_pp4_balance_caps_micro_batches_below_the_balanced_time():
    """No pipeline runs one micro-batch that alone would be most of its step (Insight 1)."""
    lens = sample_global_batch("github", 2 * 2**20, seed=0, max_len=128 * K)
    piped = plan(lens, world_size=16, capacity=32 * K, cost_model=COST, strategy="balance", pp_size=4)
    balanced = float(COST.seq_time(lens).sum()) / 16
    assert max(m.est_time for m in piped.micro_batches) <= balanced / 4


def test_sends_between_stages_are_charged_per_micro_batch_and_boundary():
    # micro-batch 0 pays 1 s on boundary 0 only: its forward and its backward each wait for it once
    base = one_f_one_b([6.0], 2).makespan
    assert one_f_one_b([6.0], 2, send=[[1.0]]).makespan == pytest.approx(base + 2.0)
    with pytest.raises(ValueError, match="one per stage boundary"):
        one_f_one_b([6.0, 6.0], 3, send=[[1.0]])


@pytest.mark.parametrize("cost", [COST, L20_COST], ids=["private-links", "l20"])
def test_simulator_charges_activation_sends_only_with_pipelines(cost):
    assert boundary_bytes_per_token(cost) == 2 * 4096  # LLaMA-7B's hidden size, bf16
    lens = sample_global_batch("github", 2**21, seed=2, max_len=64 * K)
    piped = plan(lens, world_size=8, capacity=32 * K, cost_model=cost, strategy="balance", pp_size=4)
    sends = pipeline_sends(piped, cost, 0)
    tokens = [m.tokens_per_rank for m in piped.micro_batches_of(0)]
    assert len(sends) == len(tokens) and all(len(row) == 3 for row in sends)
    # stage-major placement: stages 0 and 1 of rank 0 sit at positions 0 and 8, another switch of one L20 node
    bandwidth = cost.hardware.network_bandwidth if cost.hardware.topology is None else 32e9
    assert sends[0][0] == pytest.approx(tokens[0] * 8192 / bandwidth + cost.latency)
    assert step_time(piped, cost) > step_time(piped, cost, sends=False)
    assert bubble_rates(piped, cost)[0] > bubble_rates(piped, cost, sends=False)[0]
    flat = plan(lens, world_size=8, capacity=8 * K, cost_model=cost, strategy="balance")
    assert step_time(flat, cost) == step_time(flat, cost, sends=False)


@pytest.mark.parametrize("pp", [1, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_auto_picks_what_a_full_search_over_the_candidates_picks(seed, pp):
    lens = sample_global_batch("byted", 2 * 2**20, seed=seed, max_len=128 * K)
    chosen = plan(
        lens, world_size=16, capacity=8 * K * pp, cost_model=L20_COST, strategy="auto", pp_size=pp, step_time=step_time
    )
    steps = {
        c.name: step_time(c.build(lens, world_size=16, capacity=8 * K * pp, cost_model=L20_COST, pp_size=pp), L20_COST)
        for c in CANDIDATES
    }
    best = min(steps, key=steps.__getitem__)
    assert chosen.auto.chosen == best
    assert chosen.auto.step_time == pytest.approx(steps)
    assert _digest(chosen) == _digest(
        next(c for c in CANDIDATES if c.name == best).build(
            lens, world_size=16, capacity=8 * K * pp, cost_model=L20_COST, pp_size=pp
        )
    )
