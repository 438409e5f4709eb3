"""PP-balance keeps a group of pipelines together for consecutive shared sequences (chains), so its plans run
in plain 1F1B where static's do; and benchmarks/pp_balance.py's unbalanced deal of its micro-batches."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.pp_balance import deal_unbalanced
from bytescale_compile.planner import CostModel, plan
from bytescale_compile.planner.pipeline_order import chained_micro_batches
from bytescale_compile.sim.lengths import sample_global_batch
from bytescale_compile.sim.simulator import step_time

K = 1024
COST = CostModel.preset("llama-7b")


def _github(seed: int = 0) -> np.ndarray:
    return sample_global_batch("github", 2**20, seed=seed, max_len=64 * K)


def test_shared_micro_batches_chain_at_pp2():
    """Most shared micro-batches follow one of the same ranks on all their pipelines (before chains: 13 of 93
    in benchmarks/planner.py section 5)."""
    piped = plan(_github(), world_size=16, capacity=16 * K, cost_model=COST, strategy="balance", pp_size=2)
    shared = [m.id for m in piped.micro_batches if m.shared]
    chained = chained_micro_batches(piped)
    assert len(shared) >= 8 and len(chained) >= len(shared) // 2


@pytest.mark.parametrize("dataset", ["github", "byted"])
@pytest.mark.parametrize("pp", [2, 4])
def test_balance_is_no_slower_than_static(dataset, pp):
    """Static's CP rows chain; balance's chains let it keep its lead (it was 1.5-2.7x slower without them)."""
    lens = sample_global_batch(dataset, 2 * 2**20, seed=0, max_len=128 * K)
    steps = {
        s: step_time(
            plan(
                lens,
                world_size=16,
                capacity=8 * K * pp,
                cost_model=COST,
                strategy=s,
                pp_size=pp,
                context_length=128 * K,
            ),
            COST,
        )
        for s in ("balance", "static")
    }
    assert steps["balance"] <= steps["static"]


def _random_batch(rng: np.random.Generator, capacity: int) -> np.ndarray:
    """Short sequences with a few up to 6 x capacity (offloaded or shared over several ranks)."""
    short = rng.integers(64, capacity // 2, rng.integers(5, 60))
    long = rng.integers(capacity // 2, 6 * capacity, rng.integers(0, 8))
    return rng.permutation(np.concatenate([short, long]))


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("world", [3, 6, 8, 16])
def test_random_batches_give_valid_plans_that_simulate(pp, world):
    rng = np.random.default_rng(world * 10 + pp)
    capacity = 4 * K * pp
    for _ in range(6):
        piped = plan(
            _random_batch(rng, capacity),
            world_size=world,
            capacity=capacity,
            cost_model=COST,
            strategy="balance",
            pp_size=pp,
        )
        piped.validate()  # every pipeline runs the shared micro-batches in one order: no deadlock
        assert step_time(piped, COST) > 0  # the simulator runs the same 1F1B order to the end


def test_spread_groups_tile_the_ranks():
    """Sequences spread past the ranks that hold them get a divisor of the world size: no ranks left over."""
    lens = sample_global_batch("github", 8 * 2**20, seed=0, max_len=128 * K)
    piped = plan(lens, world_size=32, capacity=32 * K, cost_model=COST, strategy="balance", pp_size=4)
    widths = {len(m.ranks) for m in piped.micro_batches if max(piped.sequences[s] for s in m.sequences) == 128 * K}
    assert widths and all(32 % w == 0 for w in widths)


def test_pipelines_with_shorter_micro_batches_get_more():
    """Insight 1: pipelines of short (spread) micro-batches run more of them than those of full packed ones. As
    plain rings the four long sequences spread over 11 of the 16 pipelines; a u × r split would take all 16, and
    no pipeline would run shorter micro-batches than another."""
    rng = np.random.default_rng(0)
    lens = np.concatenate([[64 * K] * 4, rng.integers(K, 8 * K, 600)])
    piped = plan(lens, world_size=16, capacity=32 * K, cost_model=COST, strategy="balance", pp_size=4, sp="ring")
    by_id = {m.id: m for m in piped.micro_batches}
    mean = [np.mean([by_id[i].est_time for i in ids]) for ids in piped.schedule]
    count = [len(ids) for ids in piped.schedule]
    assert count[int(np.argmin(mean))] > count[int(np.argmax(mean))]


@pytest.mark.parametrize("pp", [2, 4])
def test_unbalanced_deal_keeps_the_micro_batches_and_is_valid(pp):
    balanced = plan(_github(1), world_size=16, capacity=8 * K * pp, cost_model=COST, strategy="balance", pp_size=pp)
    dealt = deal_unbalanced(balanced)
    dealt.validate()
    before = {m.id: m for m in balanced.micro_batches}
    after = {m.id: m for m in dealt.micro_batches}
    assert before.keys() == after.keys()
    for i, m in after.items():
        assert (m.sequences, m.offload_ratio, m.tokens_per_rank, m.est_time) == (
            before[i].sequences,
            before[i].offload_ratio,
            before[i].tokens_per_rank,
            before[i].est_time,
        )
        if m.shared:
            assert m.ranks == before[i].ranks
    one_rank = sorted(i for i, m in after.items() if not m.shared)
    assert [after[i].ranks[0] for i in one_rank] == [k % 16 for k in range(len(one_rank))]
    assert all(ids == sorted(ids) for ids in dealt.schedule)
    assert dealt.schedule != balanced.schedule
