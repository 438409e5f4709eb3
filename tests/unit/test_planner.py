"""Plans of every strategy are valid; bad input fails with the limit; validation names what broke."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bytescale_compile.planner import CostModel, Hardware, MicroBatch, Plan, PlanError, plan
from bytescale_compile.planner.auto import SharedWork
from bytescale_compile.planner.balance import plan_balance
from bytescale_compile.planner.builder import best_fit_pack
from bytescale_compile.planner.plan import local_tokens
from bytescale_compile.planner.static import plan_static
from bytescale_compile.runtime.layout import zigzag_layout
from bytescale_compile.sim.lengths import sample_global_batch
from bytescale_compile.sim.simulator import lower_bound, simulate, step_time

COST = CostModel.preset("llama-7b")
CAPACITY = 1024


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 12_000), max_size=60),
    world=st.integers(1, 24),
    strategy=st.sampled_from(["balance", "naive", "static", "naive-no-offload"]),
)
def test_every_plan_is_valid(lengths, world, strategy):
    name, offload = ("naive", False) if strategy == "naive-no-offload" else (strategy, True)
    try:
        result = plan(lengths, world_size=world, capacity=CAPACITY, cost_model=COST, strategy=name, offload=offload)
    except PlanError as e:  # only "too long for this cluster" may refuse a batch
        assert "more than" in str(e) or "needs more than" in str(e)
        return
    result.validate()
    assert sorted(s for m in result.micro_batches for s in m.sequences) == list(range(len(lengths)))
    timeline = simulate(result, COST)
    assert timeline.step_time >= 0


def test_world_size_one_and_empty_batch():
    for strategy in ("balance", "naive", "static"):
        empty = plan([], world_size=4, capacity=CAPACITY, cost_model=COST, strategy=strategy)
        empty.validate()
        assert empty.micro_batches == [] and empty.schedule == [[], [], [], []]
        single = plan([100, 900, 1000], world_size=1, capacity=CAPACITY, cost_model=COST, strategy=strategy)
        single.validate()
        assert all(m.ranks == (0,) for m in single.micro_batches)


def test_sequence_too_long_for_the_cluster_names_it_and_the_limit():
    limit = COST.max_sequence(8, CAPACITY)
    with pytest.raises(
        PlanError, match=rf"sequence 1 has {limit + 1} tokens, more than the {limit} .*8 ranks.*offload"
    ):
        plan([10, limit + 1], world_size=8, capacity=CAPACITY, cost_model=COST)
    plan([10, limit], world_size=8, capacity=CAPACITY, cost_model=COST).validate()


@pytest.mark.parametrize(
    "bad,message", [([5, 0], "positive"), ([5, -3], "positive"), ([5, 2.5], "integers"), (["x"], "integers")]
)
def test_bad_lengths_raise_value_error(bad, message):
    with pytest.raises(ValueError, match=message):
        plan(bad, world_size=4, capacity=CAPACITY, cost_model=COST)


def test_bad_arguments():
    with pytest.raises(ValueError, match="strategy must be one of"):
        plan([5], world_size=4, capacity=CAPACITY, cost_model=COST, strategy="fastest")
    with pytest.raises(ValueError, match="world_size"):
        plan([5], world_size=0, capacity=CAPACITY, cost_model=COST)


def test_json_round_trip():
    result = plan([3000, 200, 700, 5000, 90], world_size=6, capacity=CAPACITY, cost_model=COST)
    again = Plan.from_json(result.to_json())
    assert again == result
    data = json.loads(result.to_json())
    assert set(data) >= {"strategy", "world_size", "capacity", "pp_size", "sequences", "micro_batches", "schedule"}
    with pytest.raises(PlanError, match="malformed plan JSON"):
        Plan.from_json('{"strategy": "balance"}')


def _plan(micro_batches, schedule, lens=(100, 100, 100), world=3):
    return Plan("balance", world, CAPACITY, 1, list(lens), micro_batches, schedule)


def _mb(i, ranks, seqs, lens=(100, 100, 100)):
    from bytescale_compile.planner.plan import local_tokens

    return MicroBatch(i, tuple(ranks), tuple(seqs), 0.0, local_tokens([lens[s] for s in seqs], len(ranks)), 1.0)


def test_validation_rejects_a_schedule_that_would_deadlock():
    mbs = [_mb(0, [0, 1], [0]), _mb(1, [1, 2], [1]), _mb(2, [2, 0], [2])]
    cyclic = _plan(mbs, [[2, 0], [0, 1], [1, 2]])
    with pytest.raises(PlanError, match="deadlock.*cycle"):
        cyclic.validate()
    _plan(mbs, [[0, 2], [0, 1], [1, 2]]).validate()


@pytest.mark.parametrize(
    "broken,message",
    [
        (lambda: _plan([_mb(0, [0], [0, 1])], [[0], [], []]), "sequence 2 .* in 0 micro-batches"),
        (lambda: _plan([_mb(0, [0], [0, 1, 2])], [[0], [0], []]), "scheduled on"),
        (lambda: _plan([_mb(0, [0, 5], [0, 1, 2])], [[0], [], []]), "distinct ranks"),
        (lambda: _plan([_mb(0, [0], [0], lens=(5000,))], [[0]], lens=(5000,), world=1), "exceed the capacity"),
    ],
)
def test_validation_names_the_broken_invariant(broken, message):
    with pytest.raises(PlanError, match=message):
        broken().validate()


def test_balance_gives_ranks_different_numbers_of_micro_batches_and_beats_naive():
    lens = sample_global_batch("byted", 2_000_000, seed=1, max_len=256 * 1024)
    world, capacity = 64, 8192
    balanced = plan(lens, world_size=world, capacity=capacity, cost_model=COST, strategy="balance")
    balanced.validate()
    assert len({len(ids) for ids in balanced.schedule}) > 1
    naive = plan(lens, world_size=world, capacity=capacity, cost_model=COST, strategy="naive")
    assert simulate(balanced, COST).step_time < simulate(naive, COST).step_time


def test_balance_widens_a_sequence_that_would_overrun_onto_idle_ranks():
    """Three long sequences on 4 ranks: two run on 2 ranks each, the third would then run on 2 ranks
    while 2 idle; balance spreads it over all 4 and ends with the static mesh, not 18% after it."""
    capacity = 4096
    lens = np.array([4 * capacity, 4 * capacity, int(3.7 * capacity)])
    balanced = plan(lens, world_size=4, capacity=capacity, cost_model=COST, strategy="balance")
    static = plan(
        lens, world_size=4, capacity=capacity, cost_model=COST, strategy="static", context_length=4 * capacity
    )
    assert sorted(len(m.ranks) for m in balanced.micro_batches) == [2, 2, 4]
    assert simulate(balanced, COST).step_time <= simulate(static, COST).step_time * 1.001


@pytest.mark.parametrize("dataset", ["byted", "github"])
def test_balance_is_within_five_percent_of_the_lower_bound_at_scale(dataset):
    """32M tokens, 1024 ranks, 2M context: the paper's setting."""
    lens = sample_global_batch(dataset, 32 * 2**20, seed=0, max_len=2**21)
    balanced = plan(lens, world_size=1024, capacity=8192, cost_model=COST, strategy="balance")
    balanced.validate()
    bound = lower_bound(lens, 1024, 8192, COST)
    assert simulate(balanced, COST).step_time / bound <= 1.05


def test_pipeline_plans_are_valid_and_pay_a_bubble():
    lens = sample_global_batch("github", 1_000_000, seed=2, max_len=64 * 1024)
    for strategy in ("balance", "naive", "static"):
        piped = plan(lens, world_size=16, capacity=CAPACITY * 8, cost_model=COST, strategy=strategy, pp_size=4)
        piped.validate()
        assert piped.balance is None or piped.balance.mode == "pp"
        flat_stages = sum(m.est_time for m in piped.micro_batches if 0 in m.ranks) / 4
        assert simulate(piped, COST).step_time > flat_stages  # the 1F1B bubble is paid


L20_COST = CostModel.preset("llama-7b", Hardware.preset("l20", tp_size=2))


def test_ratio_for_ranks_is_the_least_ratio_that_fits():
    lens = np.array([300_000, 2**21, 9000, 100_000])
    ranks = np.array([10, 64, 2, 13])
    ratio = COST.ratio_for_ranks(lens, ranks, 8192)
    assert (COST.ranks_needed(lens, ratio, 8192) <= ranks).all()
    offloaded = ratio > 0
    assert offloaded.tolist() == [True, True, False, False]
    assert (COST.ranks_needed(lens, ratio - 1e-6, 8192)[offloaded] > ranks[offloaded]).all()


@pytest.mark.parametrize("cost", [COST, L20_COST], ids=["private-links", "l20"])
@pytest.mark.parametrize("dataset,seed", [("byted", 0), ("byted", 1), ("github", 2)])
def test_naive_offloading_is_never_slower_than_without(cost, dataset, seed):
    """Eq. 2's D(s, r*) alone packs a 256K sequence onto a handful of ranks that then compute long after
    the rest; naive with offloading sheds only ranks whose compute the ring hides."""
    lens = sample_global_batch(dataset, 4 * 2**20, seed=seed, max_len=256 * 1024)
    with_offload = plan(lens, world_size=64, capacity=8192, cost_model=cost, strategy="naive")
    without = plan(lens, world_size=64, capacity=8192, cost_model=cost, strategy="naive", offload=False)
    with_offload.validate()
    assert simulate(with_offload, cost).step_time <= simulate(without, cost).step_time * (1 + 1e-9)
    by_sequence = {m.sequences: m.est_time for m in without.micro_batches if m.shared}
    for m in with_offload.micro_batches:
        if m.shared:
            assert m.est_time <= by_sequence[m.sequences] * (1 + 1e-9)


def test_naive_offload_lowers_ranks_of_ring_bound_sequences():
    """A sequence whose ring P2P outlasts its compute on D(s, 0) ranks gets fewer ranks and an offload
    ratio, and its micro-batch takes no longer."""
    slow_ring = dataclasses.replace(
        L20_COST.hardware,
        topology=dataclasses.replace(L20_COST.hardware.topology, switch_uplink=1e9, nic_bandwidth=1e9),
    )
    cost = L20_COST.replace(hardware=slow_ring)
    lens = np.array([200_000] + [4096] * 200)
    naive, without = (
        plan(lens, world_size=64, capacity=8192, cost_model=cost, strategy="naive", offload=o) for o in (True, False)
    )
    long_with = next(m for m in naive.micro_batches if 0 in m.sequences)
    long_without = next(m for m in without.micro_batches if 0 in m.sequences)
    assert len(long_with.ranks) < len(long_without.ranks) and long_with.offload_ratio > 0
    assert long_with.est_time <= long_without.est_time * (1 + 1e-9)


@pytest.mark.parametrize("cost", [COST, L20_COST], ids=["private-links", "l20"])
def test_auto_keeps_the_fastest_candidate_and_never_loses_to_static(cost):
    lens = sample_global_batch("byted", 4 * 2**20, seed=3, max_len=512 * 1024)
    chosen = plan(lens, world_size=64, capacity=8192, cost_model=cost, strategy="auto", step_time=step_time)
    chosen.validate()
    report = chosen.auto
    step = simulate(chosen, cost).step_time
    assert step == pytest.approx(min(report.step_time.values()))
    assert report.step_time[report.chosen] == pytest.approx(step)
    for strategy in ("static", "balance"):
        assert step <= simulate(
            plan(lens, world_size=64, capacity=8192, cost_model=cost, strategy=strategy), cost
        ).step_time * (1 + 1e-9)
    assert report.speedup_over_static == pytest.approx(report.step_time["static"] / step)
    json.loads(chosen.to_json())


@settings(max_examples=25, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 40_000), min_size=1, max_size=40), world=st.integers(2, 16))
def test_auto_is_never_slower_than_static(lengths, world):
    try:
        static = plan(lengths, world_size=world, capacity=CAPACITY * 8, cost_model=L20_COST, strategy="static")
    except PlanError:
        return
    chosen = plan(
        lengths, world_size=world, capacity=CAPACITY * 8, cost_model=L20_COST, strategy="auto", step_time=step_time
    )
    chosen.validate()
    assert simulate(chosen, L20_COST).step_time <= simulate(static, L20_COST).step_time * (1 + 1e-9)
    assert chosen.auto.speedup_over_static >= 1 - 1e-9


@pytest.mark.parametrize("group_size", [2, 3, 4, 6])
def test_predicted_p2p_bytes_are_the_rows_the_direct_exchange_moves(group_size):
    """The simulator's P2P count equals what the ring's layout sends: every rank's K/V rows that each other
    rank's causal blocks read (`ZigzagLayout.transfer`), summed over all pairs, against the relay ring's
    (N - 1) full shards per rank."""
    from bytescale_compile.runtime.layout import zigzag_layout
    from bytescale_compile.sim.simulator import DIRECT_EXCHANGE_SHARE

    layout = zigzag_layout([2 * group_size * 8, 2 * group_size * 5], group_size)
    sent = sum(layout.transfer(q, kv).num_rows for q in range(group_size) for kv in range(group_size) if q != kv)
    relay = group_size * (group_size - 1) * layout.rank(0).num_tokens
    assert sent == DIRECT_EXCHANGE_SHARE * relay


@pytest.mark.parametrize("pp", [1, 4])
@pytest.mark.parametrize("cost", [COST, L20_COST], ids=["private-links", "l20"])
@pytest.mark.parametrize("dataset,seed", [("byted", 0), ("byted", 1), ("github", 2)])
def test_auto_returns_exactly_what_its_candidates_plan_and_simulate_apart(dataset, seed, cost, pp):
    """auto computes balance's sort, buckets and work once for both offload settings, and simulates each
    plan once: every step time it reports and the plan it returns equal those planned from scratch."""
    lens = sample_global_batch(dataset, 2 * 2**20, seed=seed, max_len=256 * 1024)
    capacity = 8192 * pp
    apart = {
        "balance": plan_balance(lens, world_size=32, capacity=capacity, cost_model=cost, pp_size=pp),
        "balance-nooffload": plan_balance(
            lens, world_size=32, capacity=capacity, cost_model=cost, pp_size=pp, offload=False
        ),
        "static": plan_static(lens, world_size=32, capacity=capacity, cost_model=cost, pp_size=pp),
    }
    assert apart["balance"].to_json() != apart["balance-nooffload"].to_json()
    chosen = plan(
        lens, world_size=32, capacity=capacity, cost_model=cost, strategy="auto", pp_size=pp, step_time=step_time
    )
    report, chosen.auto = chosen.auto, None
    assert report.step_time == {name: step_time(p, cost) for name, p in apart.items()}
    assert chosen.to_json() == apart[report.chosen].to_json()


def test_auto_needs_the_callers_step_time():
    """The planner sits below the simulator: "auto" ranks its candidates by a step time passed in."""
    with pytest.raises(ValueError, match="step_time"):
        plan([100, 200], world_size=2, capacity=CAPACITY, cost_model=COST, strategy="auto")


def test_auto_plans_and_simulates_balance_once_when_offloading_changes_no_sequence():
    """No sequence longer than C: D(s) and r are the same with and without offloading, so are the plans
    (but for their `offload`), and auto builds and simulates one for both candidates."""
    lens = np.array([900, 1000, 300, 1024, 50, 700, 640, 2, 1000])
    with_offload, without = (
        plan_balance(lens, world_size=4, capacity=CAPACITY, cost_model=COST, offload=o) for o in (True, False)
    )
    assert with_offload.offload and without.offload is False
    assert dataclasses.replace(with_offload, offload=False).to_json() == without.to_json()
    shared = SharedWork(lens, 4, CAPACITY, COST, 1)
    assert shared.balance(True) is shared.balance(False)
    simulated = []
    chosen = plan(
        lens,
        world_size=4,
        capacity=CAPACITY,
        cost_model=COST,
        strategy="auto",
        step_time=lambda p, cost: simulated.append(p) or step_time(p, cost),
    )
    assert [p.strategy for p in simulated] == ["balance", "static"]
    steps = chosen.auto.step_time
    assert chosen.auto.chosen == "balance" and steps["balance"] == steps["balance-nooffload"]


@settings(max_examples=200)
@given(lengths=st.lists(st.integers(1, 100_000), min_size=1, max_size=50), group_size=st.integers(1, 64))
def test_local_tokens_is_the_zigzag_layouts_fullest_rank(lengths, group_size):
    assert local_tokens(np.array(lengths), group_size) == max(zigzag_layout(lengths, group_size).rank_tokens())


def _best_fit_by_definition(lens: list[int], capacity: int) -> list[list[int]]:
    """Longest first (stable); each into the bin with the least room that still holds it, the first on ties."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lens)), key=lambda i: -lens[i]):
        fits = [b for b in range(len(bins)) if room[b] >= lens[i]]
        if fits:
            b = min(fits, key=lambda b: room[b])
            bins[b].append(i)
            room[b] -= lens[i]
        else:
            bins.append([i])
            room.append(capacity - lens[i])
    return bins


@settings(max_examples=200)
@given(lengths=st.lists(st.integers(1, 5000), max_size=80), capacity=st.integers(1, 6000))
def test_best_fit_pack_puts_each_sequence_in_the_fullest_bin_it_fits(lengths, capacity):
    lens = np.array(lengths, dtype=np.int64)
    assert best_fit_pack(lens, np.arange(lens.size), capacity) == _best_fit_by_definition(lengths, capacity)
