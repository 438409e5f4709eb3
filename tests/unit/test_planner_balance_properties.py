"""Balance's invariants (the docstring of `planner/balance.py`) on random batches, with and without pipelines:
every plan validates, every sequence and token is in exactly one micro-batch, no rank holds more than the
capacity its offload ratio allows, and ranks that share micro-batches run them in one relative order."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from bytescale_compile.planner import CostModel, Plan
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
