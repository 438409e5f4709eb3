"""Balance's invariants (the docstring of `planner/balance.py`) on random batches, with and without pipelines:
every plan validates, every sequence and token is in exactly one micro-batch, no rank holds more than the
capacity its offload ratio allows, and ranks that share micro-batches run them in one relative order. The malleable
placement keeps them on long-dominated and heavy-short batches, and widens a short sequence only within its area."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from bytescale_compile.planner import CostModel, Hardware, Plan, placers
from bytescale_compile.planner.balance import plan_balance
from bytescale_compile.planner.plan import capacity_for_ratio, local_tokens
from bytescale_compile.sim.lengths import sample_global_batch

COST = CostModel.preset("llama-7b")
K = 1024


@st.composite
def _batches(draw: st.DrawFn) -> tuple[list[int], int, int, int]:
    """Lengths, world size, capacity and pp: mostly short sequences, some up to the whole cluster's capacity
    (so every batch fits without offloading too)."""
    world = draw(st.integers(1, 20))
    capacity = draw(st.sampled_from([256, 2 * K, 8 * K]))
    short = st.integers(1, capacity)
    long = st.integers(capacity, world * capacity)
    lengths = draw(st.lists(st.one_of(short, short, short, long), max_size=100))
    return lengths, world, capacity, draw(st.sampled_from([1, 2, 3, 4]))


def _check_invariants(plan: Plan, lengths: list[int]) -> None:
    plan.validate()
    assert plan.sequences == list(lengths)
    placed = sorted(s for m in plan.micro_batches for s in m.sequences)
    assert placed == list(range(len(lengths)))  # every sequence exactly once
    assert sum(plan.sequences[s] for m in plan.micro_batches for s in m.sequences) == sum(lengths)
    for m in plan.micro_batches:
        held = local_tokens([plan.sequences[s] for s in m.sequences], len(m.ranks))
        limit = capacity_for_ratio(plan.capacity, m.offload_ratio, plan.layers_per_rank)
        assert m.tokens_per_rank == held
        assert held <= (limit + 2 * len(m.sequences) if m.shared else limit)  # zigzag rounds up per sequence
        if not m.shared and m.offload_ratio == 0:
            assert held <= plan.capacity
    scheduled = sorted((i, r) for r, ids in enumerate(plan.schedule) for i in ids)
    assert scheduled == sorted((m.id, r) for m in plan.micro_batches for r in m.ranks)  # each once, on its ranks
    _check_shared_order(plan)


def _check_shared_order(plan: Plan) -> None:
    """Any two ranks run the shared micro-batches they both hold in the same order."""
    shared = {m.id for m in plan.micro_batches if m.shared}
    runs = [[i for i in ids if i in shared] for ids in plan.schedule]
    for a, b in itertools.combinations(runs, 2):
        both = set(a) & set(b)
        assert [i for i in a if i in both] == [i for i in b if i in both]


@settings(max_examples=150)
@given(batch=_batches(), offload=st.booleans(), delta=st.sampled_from([None, 0.0, 1.0]))
def test_balance_keeps_its_invariants(batch, offload, delta):
    lengths, world, capacity, pp = batch
    plan = plan_balance(
        np.array(lengths, dtype=np.int64),
        world_size=world,
        capacity=capacity,
        cost_model=COST,
        pp_size=pp,
        delta=delta,
        offload=offload,
    )
    assert plan.balance.mode == ("pp" if pp > 1 else "dp")
    _check_invariants(plan, lengths)


@settings(max_examples=80)
@given(
    dataset=st.sampled_from(["byted", "github"]),
    seed=st.integers(0, 2**16),
    world=st.sampled_from([4, 8, 16]),
    capacity=st.sampled_from([4 * K, 8 * K, 16 * K]),
    pp=st.sampled_from([1, 2, 4]),
)
@example(dataset="github", seed=0, world=16, capacity=4 * K, pp=2)  # packs past a gap's tokens (`split_gap`)
def test_balance_keeps_its_invariants_on_skewed_batches(dataset, seed, world, capacity, pp):
    """Byted-like and GitHub-like batches: a few sequences over many ranks, offloaded, chained, and gaps
    before chains with time left for more than one packed micro-batch."""
    lengths = sample_global_batch(dataset, 512 * K, seed=seed, max_len=min(world * capacity, 256 * K))
    plan = plan_balance(lengths, world_size=world, capacity=capacity, cost_model=COST, pp_size=pp)
    _check_invariants(plan, lengths.tolist())


# --- malleable placement: long sequences widened to end together, heavy short ones widened too ------------------------

MALLEABLE_COSTS = {
    "none": COST,
    "h100": CostModel.preset("llama-7b", Hardware.preset("h100-nvlink", 1)),
    "l20": CostModel.preset("llama-7b", Hardware.preset("l20", tp_size=2)),
}


@st.composite
def _long_dominated(draw: st.DrawFn) -> tuple[list[int], int, int]:
    """Byted-like: a few sequences longer than C carry at least 98% of the work, short ones the rest."""
    world = draw(st.integers(4, 32))
    capacity = draw(st.sampled_from([2 * K, 8 * K]))
    long = draw(st.lists(st.integers(capacity + 1, world * capacity), min_size=1, max_size=6))
    short = draw(st.lists(st.integers(1, capacity), max_size=60))
    work = COST.seq_time(np.array(long + short, dtype=np.int64))
    kept = np.cumsum(work[len(long) :]) <= 0.02 / 0.98 * work[: len(long)].sum()
    lengths = long + [n for n, keep in zip(short, kept.tolist()) if keep]
    order = draw(st.permutations(range(len(lengths))))
    return [lengths[i] for i in order], world, capacity


@st.composite
def _heavy_short(draw: st.DrawFn) -> tuple[list[int], int, int]:
    """Many sequences of half to all of C, each a sizeable share of a rank's balanced time, and some tiny ones."""
    world = draw(st.integers(4, 32))
    capacity = draw(st.sampled_from([2 * K, 8 * K]))
    heavy = draw(st.lists(st.integers(capacity // 2, capacity), min_size=1, max_size=3 * world))
    tiny = draw(st.lists(st.integers(1, capacity // 16), max_size=60))
    long = draw(st.lists(st.integers(capacity + 1, world * capacity), max_size=1))
    return heavy + tiny + long, world, capacity


def _check_malleable(plan: Plan, lengths: list[int], cost: CostModel) -> None:
    """Balance's invariants, and no short sequence (<= C) that balance widens over several ranks costs more
    rank-seconds than `placers._WIDEN_AREA` over its work and one micro-batch's fixed cost, by the planner's own
    estimate. Sequences heavier than the balanced time are spread to end within it whatever the area
    (`balance._spread_heavy`), so they are not malleable ones."""
    _check_invariants(plan, lengths)
    work = cost.seq_time(np.array(lengths, dtype=np.float64))
    balanced = float(work.sum()) / plan.world_size
    overhead = cost.micro_batch_overhead
    for m in plan.micro_batches:
        if not m.shared or len(m.sequences) != 1:
            continue
        (s,) = m.sequences
        if lengths[s] > plan.capacity or work[s] > balanced:
            continue
        area = len(m.ranks) * (m.est_time + overhead)
        assert area <= (1 + placers._WIDEN_AREA) * (work[s] + overhead) * (1 + 1e-9), (s, len(m.ranks), area)


@settings(max_examples=60)
@given(batch=_long_dominated(), cost=st.sampled_from(sorted(MALLEABLE_COSTS)), sp=st.sampled_from(["ring", "auto"]))
def test_malleable_waves_keep_every_token_once_and_ranks_within_capacity(batch, cost, sp):
    """Long sequences widened so a wave ends together (`DPPlacer._widen`) still place every sequence once, on no
    rank over C (or the capacity its offload allows), on every cluster and split."""
    lengths, world, capacity = batch
    cm = MALLEABLE_COSTS[cost]
    plan = plan_balance(np.array(lengths, dtype=np.int64), world_size=world, capacity=capacity, cost_model=cm, sp=sp)
    _check_malleable(plan, lengths, cm)


@settings(max_examples=60)
@given(batch=_heavy_short(), cost=st.sampled_from(sorted(MALLEABLE_COSTS)), sp=st.sampled_from(["ring", "auto"]))
def test_widened_short_sequences_stay_within_their_area(batch, cost, sp):
    """Heavy short sequences that would end past the balanced time are widened (`placers.MALLEABLE_SHORT`): each
    still appears once, no rank goes over C, and widening never costs more than `_WIDEN_AREA` extra rank-seconds."""
    lengths, world, capacity = batch
    cm = MALLEABLE_COSTS[cost]
    plan = plan_balance(np.array(lengths, dtype=np.int64), world_size=world, capacity=capacity, cost_model=cm, sp=sp)
    _check_malleable(plan, lengths, cm)


def test_heavy_short_sequences_are_widened_within_their_area():
    """The area check above is not vacuous: on a batch of sequences just under C on 16 ranks, balance widens some
    short ones over several ranks, each within its area."""
    rng = np.random.default_rng(0)
    lengths = np.concatenate([rng.integers(6 * K, 8 * K, 20), rng.integers(100, 1000, 50)]).tolist()
    cm = MALLEABLE_COSTS["h100"]
    plan = plan_balance(np.array(lengths, dtype=np.int64), world_size=16, capacity=8 * K, cost_model=cm, sp="auto")
    _check_malleable(plan, lengths, cm)
    widened = [m for m in plan.micro_batches if m.shared and lengths[m.sequences[0]] <= 8 * K]
    assert widened and all(len(m.ranks) > 1 for m in widened)
