"""`length_limit` flags exactly the lengths `plan()` refuses, with the reason its PlanError gives, and the
length, capacity and ranks it suggests make them plan while one less does not."""

from __future__ import annotations

import numpy as np
import pytest

from bytescale_compile.planner import CostModel, ModelShape, PlanError, length_limit, plan
from bytescale_compile.sim.simulator import step_time

COST = CostModel.preset("llama-7b")
TINY = CostModel.analytic(ModelShape("tiny", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=128))
"""Two layers: nothing to offload, D(s) = ceil(s / C)."""

CASES = [
    # strategy, cost model, world, capacity, pp, context length, shard blocker
    ("balance", TINY, 2, 1024, 1, None, None),
    ("balance", COST, 2, 1024, 1, None, None),
    ("balance", COST, 2, 1024, 4, None, None),  # a gap: 2049 fails, 3499 fits
    ("naive", COST, 3, 1024, 1, None, None),
    ("naive", COST, 1, 1024, 2, None, None),
    ("auto", COST, 2, 1024, 4, 4096, None),
    ("auto", COST, 2, 1024, 1, 1500, None),
    ("static", COST, 2, 1024, 1, None, None),
    ("static", COST, 3, 1024, 2, 1500, None),
    ("static", COST, 2, 1024, 1, 4096, None),  # the row does not fit the mesh: every sequence fails
    ("balance", COST, 2, 1024, 2, None, "attention pass disabled"),
    ("auto", COST, 4, 512, 1, 4096, "attention pass disabled"),
]


def _plan(lens, case, **changes):
    strategy, cost, world, capacity, pp, context, blocker = case
    settings = {"world_size": world, "capacity": capacity, "context_length": context, **changes}
    return plan(
        lens,
        cost_model=cost,
        strategy=strategy,
        pp_size=pp,
        shard_blockers=(blocker,) if blocker else (),
        step_time=step_time,
        **settings,
    )


def _limit(lens, case, **changes):
    strategy, cost, world, capacity, pp, context, blocker = case
    settings = {"world_size": world, "capacity": capacity, "context_length": context, **changes}
    return length_limit(
        lens, cost_model=cost, strategy=strategy, pp_size=pp, shard_blockers=(blocker,) if blocker else (), **settings
    )


def _lengths(case) -> np.ndarray:
    """A coarse grid to past every limit, and every length within 3 of each limit, of C and of W x C."""
    _, _, world, capacity, _, context, _ = case
    grid = np.arange(1, 6 * world * capacity, 127)
    coarse = _limit(grid, case)
    marks = [capacity, world * capacity, context or 1, coarse.longest, coarse.max_len]
    if coarse.too_long.size:
        marks.append(int(grid[coarse.too_long[0]]))
    lens = np.unique(np.concatenate([grid, *(np.arange(m - 3, m + 4) for m in marks)]))
    return lens[lens > 0]


def _refuses(lens, case, **changes) -> str | None:
    try:
        _plan(lens, case, **changes)
    except PlanError as e:
        return str(e)
    return None


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-W{c[2]}-C{c[3]}-pp{c[4]}-ctx{c[5]}-{bool(c[6])}")
def test_flags_exactly_what_plan_refuses(case):
    lens = _lengths(case)
    limit = _limit(lens, case)
    flagged = np.zeros(lens.size, bool)
    flagged[limit.too_long] = True
    for n, too_long in zip(lens.tolist(), flagged.tolist()):
        error = _refuses([n], case)
        assert (error is not None) == too_long, (n, error)
    assert flagged.any() and limit.reason
    if not flagged.all():  # a batch fails only through a flagged sequence
        _plan(lens[~flagged], case).validate()
        assert _refuses([int(lens[~flagged].max()), int(lens[flagged][0])], case) is not None


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-W{c[2]}-C{c[3]}-pp{c[4]}-ctx{c[5]}-{bool(c[6])}")
def test_suggested_settings_hold_what_is_too_long_and_one_less_does_not(case):
    strategy, _, world, capacity, pp, context, blocker = case
    lens = _lengths(case)
    limit = _limit(lens, case)
    over = lens[limit.too_long]
    if limit.enough_capacity is None:
        assert strategy == "static" and context is not None and over.max() > context
    else:
        _plan(over, case, capacity=limit.enough_capacity).validate()
        assert _refuses(over, case, capacity=limit.enough_capacity - 1) is not None
    if limit.enough_ranks is None:
        assert blocker is not None or (strategy == "static" and over.max() > context)
    else:
        _plan(over, case, world_size=limit.enough_ranks).validate()
        assert _refuses(over, case, world_size=limit.enough_ranks - 1) is not None
        assert limit.enough_processes == limit.enough_ranks * pp
    # truncating to max_len holds them all, a static context length beyond the mesh coming down to it too
    for cut, too_long in ((limit.max_len, False), (limit.max_len + 1, True)):
        row = {"context_length": cut} if context and context > world * capacity else {}
        assert (_limit(np.minimum(lens, cut), case, **row).too_long.size > 0) == too_long


def test_a_gap_below_the_longest_shows_in_max_len_and_the_reason():
    case = CASES[2]
    limit = _limit(np.array([3499, 2049, 100, 3500]), case)
    assert limit.too_long.tolist() == [1, 3] and limit.longest == 3499 and limit.max_len == 2048
    assert "at most 3499 tokens, and not every shorter sequence" in limit.reason
    assert limit.reason in _refuses([2049], case)
    assert _limit(np.array([3500]), case).reason in _refuses([3500], case)


def test_enough_capacity_is_the_least_though_a_larger_one_can_hold_less():
    """Eq. 2 offloads only where that frees a whole rank, which a larger capacity can undo."""
    limit = length_limit(
        np.array([3000, 4800, 5000]), world_size=2, capacity=1024, cost_model=COST, strategy="balance", pp_size=4
    )
    assert limit.too_long.tolist() == [1, 2]
    over = np.array([4800, 5000])
    holds = [(COST.ranks_and_ratio(over, c, 8)[0] <= 2).all() for c in range(1025, 5001)]
    assert holds.index(True) + 1025 == limit.enough_capacity
    assert not all(holds[limit.enough_capacity - 1025 :])


def test_two_tiny_ranks_and_one_long_sequence():
    limit = length_limit(np.array([8192]), world_size=2, capacity=1024, cost_model=TINY, strategy="balance")
    assert limit.too_long.tolist() == [0]
    assert (limit.longest, limit.max_len, limit.enough_capacity, limit.enough_ranks) == (2048, 2048, 4096, 8)
    assert limit.reason == (
        "more than the 2048 that 2 ranks of capacity 1024 can hold with the offload ratios Eq. 2 allows "
        "(2 layers per pipeline stage)"
    )


def test_nothing_too_long_suggests_nothing():
    limit = length_limit(np.array([10, 2048]), world_size=2, capacity=1024, cost_model=TINY, strategy="balance")
    assert limit.too_long.size == 0 and limit.reason == "" and limit.enough_capacity is limit.enough_ranks is None


def test_a_million_lengths():
    lens = np.random.default_rng(0).integers(1, 2_000_000, 10**6)
    limits = {
        s: length_limit(lens, world_size=2, capacity=1024, cost_model=COST, strategy=s, pp_size=4)
        for s in ("balance", "static", "auto")
    }
    for limit in limits.values():
        assert lens[limit.too_long].min() > limit.max_len
    assert np.array_equal(limits["auto"].too_long, limits["balance"].too_long)


def test_bad_arguments():
    with pytest.raises(ValueError, match="strategy must be one of"):
        length_limit([5], world_size=4, capacity=1024, cost_model=COST, strategy="fastest")
    with pytest.raises(ValueError, match="pp_size"):
        length_limit([5], world_size=4, capacity=1024, cost_model=COST, strategy="balance", pp_size=0)
    with pytest.raises(ValueError, match="positive"):
        length_limit([5, 0], world_size=4, capacity=1024, cost_model=COST, strategy="balance")
