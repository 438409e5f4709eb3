"""One model of a group's time (`split.group_seconds`), the joint choice of group size and Ulysses x ring split
(`planner/group_size.py`), and the lower bound built on it:

1. every estimate of a micro-batch of one sequence (`PlanBuilder.time_of`, `ring_time`, `_one_time`,
   `group_size.sequence_times`) and the simulator's duration of a lone shared micro-batch are `split_time`'s;
2. `fastest_groups` picks u > 1 exactly where the arithmetic says (a brute force over every group size and every
   split adjacent ranks allow), with cases where each side wins, and balance's plans follow it;
3. no plan simulates below `lower_bound`: every strategy's, and a Megatron-like one of power-of-two groups.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bytescale_compile.planner import CostModel, Hardware, Plan, plan
from bytescale_compile.planner.builder import PlanBuilder
from bytescale_compile.planner.group_size import fastest_groups, sequence_times
from bytescale_compile.planner.split import allowed_ulysses, split_time
from bytescale_compile.sim.simulator import lower_bound, simulate, step_time

K = 1024
M = 1024 * K
REL = 1e-12


@functools.cache
def _hardware(name: str) -> Hardware:
    """The clusters the tests run on: one NVLink node of 8 ("h100"), the paper's L20 servers at TP 2 ("l20"), and
    the default rank without a topology ("none")."""
    if name == "h100":
        return Hardware.preset("h100-nvlink", 1)
    if name == "l20":
        return Hardware.preset("l20", tp_size=2)
    return Hardware()


@functools.cache
def _cost(hardware: str, variant: str = "plain") -> CostModel:
    """llama-7b on `hardware`, as is, with activation recompute, or as a hybrid of 1 attention : 3 mixer layers."""
    base = CostModel.preset("llama-7b", _hardware(hardware))
    if variant == "recompute":
        return base.replace(recompute=True)
    if variant == "hybrid":
        return base.replace(mixer_layers=3 * base.layers // 4, mixer_state_bytes=1e6)
    return base


def _slow_all_to_all(hardware: str) -> CostModel:
    """llama-7b on `hardware` with all-to-alls at 10 MB/s per device: moving 1/u of the K/V around the ring then
    never pays for the queries, keys, values and outputs an all-to-all moves."""
    hw = _hardware(hardware)
    assert hw.topology is not None
    topology = dataclasses.replace(hw.topology, all_to_all_link=1e7)
    return CostModel.preset("llama-7b", dataclasses.replace(hw, topology=topology))


COSTS = [(h, v) for h in ("h100", "l20", "none") for v in ("plain", "recompute", "hybrid")]
LENS = np.array([3 * K + 5, 64 * K + 1, 300 * K + 7, 2 * M])
GROUPS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 64)


# --- 1. one model ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("hardware", "variant"), COSTS)
def test_every_estimate_of_one_sequence_is_split_time(hardware, variant):
    """The planner's float fast path, its ring-only estimate, its vectorised group search and `split_time` are one
    expression: a divergence (a relay factor, a dtype, the attention layers) would let a plan beat the bound or the
    planner pick groups the simulator times otherwise."""
    cm = _cost(hardware, variant)
    work = cm.seq_time(LENS)
    for sp in ("ring", "auto"):
        builder = PlanBuilder("balance", LENS, 64, 8 * K, cm, sp=sp)
        for d in GROUPS:
            ranks = tuple(range(d))
            degrees = allowed_ulysses(cm, ranks) if sp == "auto" else [1]
            for ratio in (0.0, 0.3):
                for i in range(LENS.size):
                    expected = {u: split_time(cm, LENS[[i]], ranks, ratio, u) for u in degrees}
                    for u in degrees:
                        fast = builder._one_time(i, d, ratio, u, builder._aligned(d, u))
                        assert math.isclose(fast, expected[u], rel_tol=REL), (sp, d, u, ratio, int(LENS[i]))
                    assert math.isclose(builder.time_of([i], d, ratio), min(expected.values()), rel_tol=REL)
                    ring = split_time(cm, LENS[[i]], ranks, ratio, 1)
                    assert math.isclose(builder.ring_time(i, d, ratio), ring, rel_tol=REL)
                for u in degrees:  # vectorised over lengths, broadcast against the group size
                    times = sequence_times(cm, LENS, work, np.full(LENS.size, d), u, ratio)
                    expected_u = [split_time(cm, LENS[[i]], ranks, ratio, u) for i in range(LENS.size)]
                    np.testing.assert_allclose(times, expected_u, rtol=REL)


@pytest.mark.parametrize("hardware", ["h100", "l20", "none"])
@pytest.mark.parametrize("sp", ["ring", "auto"])
def test_the_simulator_times_a_lone_shared_micro_batch_by_split_time(hardware, sp):
    """With nothing else running (no link shared), the simulator's duration of a shared micro-batch on adjacent
    ranks is the planner's `split_time` at its split plus the micro-batch's fixed cost: the planner, the bound and
    the simulator agree."""
    cm = _cost(hardware)
    topology = _hardware(hardware).topology
    per_node = topology.ranks_per_node if topology else 8
    splits = set()
    for length in (32 * K, 256 * K):
        lens = np.array([length])
        for first, d, ratio in ((0, 2, 0.0), (0, 8, 0.0), (0, 24, 0.3), (per_node, 16, 0.0), (0, 64, 0.0)):
            builder = PlanBuilder("balance", lens, 64, 8 * K, cm, sp=sp)
            ranks = range(first, first + d)
            mb = builder.add(ranks, [0], ratio)
            timeline = simulate(builder.build(), cm)
            spans = [s for s in timeline.spans if s.micro_batch == mb.id and s.kind == "shared"]
            assert sorted(s.rank for s in spans) == list(ranks)
            expected = split_time(cm, lens, ranks, ratio, mb.ulysses) + cm.micro_batch_overhead
            for s in spans:
                assert math.isclose(s.end - s.start, expected, rel_tol=REL), (length, first, d, ratio, mb.ulysses)
            splits.add(mb.ulysses)
    assert (splits == {1}) == (sp == "ring"), "under auto the checks cover a split (u > 1) as well"


# --- 2. the joint choice ---------------------------------------------------------------------------------------------


def _brute_force(cm: CostModel, lens: np.ndarray, min_ranks: np.ndarray, world: int, sp: str) -> np.ndarray:
    """Per sequence, the least `sequence_times` over every group size D >= max(min_ranks, 1) of adjacent ranks, at
    most `world` and one token per rank, and every u the ranks allow (`allowed_ulysses`, the planner's rule for a
    micro-batch on given ranks)."""
    work = cm.seq_time(lens)
    lo = np.maximum(min_ranks, 1)
    best = np.full(lens.shape, np.inf)
    for d in range(1, world + 1):
        fits = (d >= lo) & (d <= lens)
        if not fits.any():
            continue
        degrees = allowed_ulysses(cm, range(d)) if sp == "auto" else [1]
        for u in degrees:
            seconds = sequence_times(cm, lens, work, np.full(lens.shape, d), u)
            best = np.where(fits, np.minimum(best, seconds), best)
    return best


def _check_against_brute_force(cm: CostModel, lens: np.ndarray, min_ranks: np.ndarray, world: int, sp: str):
    """`fastest_groups` exhaustive equals the brute force exactly, its chosen (D, u) takes those seconds, and the
    planners' search of turning points is within 2% of it. Returns the exhaustive choice."""
    work = cm.seq_time(lens)
    exact = fastest_groups(cm, lens, work, world, min_ranks, sp=sp, exhaustive=True)
    np.testing.assert_array_equal(exact.seconds, _brute_force(cm, lens, min_ranks, world, sp))
    for choice in (exact, fastest_groups(cm, lens, work, world, min_ranks, sp=sp)):
        assert (choice.ranks >= np.maximum(min_ranks, 1)).all() and (choice.ranks <= world).all()
        assert (choice.ranks % choice.ulysses == 0).all()
        for u in np.unique(choice.ulysses).tolist():
            rows = choice.ulysses == u
            own = sequence_times(cm, lens[rows], work[rows], choice.ranks[rows], u)
            np.testing.assert_array_equal(choice.seconds[rows], own)
        assert (choice.seconds <= exact.seconds * 1.02).all(), (lens, choice.seconds / exact.seconds)
    return exact


@pytest.mark.parametrize(
    ("cost", "world", "length", "ulysses"),
    [
        pytest.param(lambda: _cost("h100"), 1024, 1 * M, 8, id="nvlink-node-slow-rails-1M-ring-bound"),
        pytest.param(lambda: _cost("l20"), 1024, 512 * K, 8, id="l20-512K-ring-bound"),
        pytest.param(lambda: _cost("h100"), 64, 512 * K, 1, id="nvlink-512K-on-64-ring-hides"),
        pytest.param(lambda: _slow_all_to_all("h100"), 1024, 1 * M, 1, id="slow-all-to-all"),
    ],
)
def test_the_joint_choice_takes_ulysses_exactly_where_it_is_faster(cost, world, length, ulysses):
    """u > 1 where the ring's P2P bounds a long sequence and the node's all-to-all is fast; u = 1 where the ring
    hides behind the compute or the all-to-all is slow. Either way the choice is the brute force's minimum, and
    with u > 1 the sequence ends sooner (and on more ranks) than any ring can end it."""
    cm = cost()
    lens = np.array([length])
    min_ranks = cm.ranks_and_ratio(lens, 8 * K)[0]
    choice = _check_against_brute_force(cm, lens, min_ranks, world, "auto")
    ring = fastest_groups(cm, lens, cm.seq_time(lens), world, min_ranks, sp="ring", exhaustive=True)
    assert choice.ulysses.tolist() == [ulysses]
    if ulysses > 1:
        assert choice.seconds[0] < ring.seconds[0] and choice.ranks[0] > ring.ranks[0]
    else:
        assert choice.seconds[0] == ring.seconds[0] and choice.ranks[0] == ring.ranks[0]


GRID = np.array([8 * K, 12 * K, 32 * K, 50 * K, 128 * K, 200 * K, 512 * K, 777 * K, 1 * M, 1536 * K, 2 * M])


@pytest.mark.parametrize("hardware", ["h100", "l20"])
@pytest.mark.parametrize("world", [64, pytest.param(1024, marks=pytest.mark.slow)])
def test_the_planners_search_is_within_two_percent_of_every_group_size(hardware, world):
    """The lower bound's exhaustive search is the brute force's minimum exactly, and the planners' search of
    turning points (`exhaustive=False`) stays within 2% of it from 8K to 2M tokens, ring-only and joint."""
    cm = _cost(hardware)
    min_ranks = np.minimum(-(-GRID // (32 * K)), world)
    for sp in ("ring", "auto"):
        _check_against_brute_force(cm, GRID, min_ranks, world, sp)
        _check_against_brute_force(cm, GRID, np.ones_like(GRID), world, sp)


@pytest.mark.parametrize(("hardware", "length"), [("h100", 128 * K), ("l20", 32 * K)])
def test_balance_splits_a_ring_bound_sequence_only_when_allowed(hardware, length):
    """A batch whose one long sequence sets the step: under sp="auto" balance runs it split u x r (the joint
    choice), under sp="ring" never; the split plan simulates faster."""
    cm = _cost(hardware)
    lens = np.array([length] + [2 * K] * 4)
    plans = {
        sp: plan(lens, world_size=64, capacity=8 * K, cost_model=cm, strategy="balance", sp=sp)
        for sp in ("ring", "auto")
    }
    for p in plans.values():
        p.validate()
    assert all(m.ulysses == 1 for m in plans["ring"].micro_batches)
    long = [m for m in plans["auto"].micro_batches if 0 in m.sequences]
    assert len(long) == 1 and long[0].ulysses > 1
    assert step_time(plans["auto"], cm) < step_time(plans["ring"], cm)


# --- 3. the bound is a bound -----------------------------------------------------------------------------------------


def _megatron_like(lens: np.ndarray, world: int, capacity: int, cm: CostModel) -> Plan:
    """Megatron-Core's hybrid-CP shape: each sequence, longest first, alone on the least power of two >= s / C
    adjacent ranks (at most the world), groups aligned to their size and placed in waves that each rank runs one
    after another, a plain ring."""
    builder = PlanBuilder("naive", lens, world, capacity, cm, sp="ring")
    cursor = 0
    for seq in np.argsort(-lens, kind="stable").tolist():
        size = min(1 << max(0, math.ceil(lens[seq] / capacity) - 1).bit_length(), world)
        cursor = -(-cursor // size) * size
        if cursor + size > world:
            cursor = 0
        builder.add(range(cursor, cursor + size), [seq])
        cursor += size
    return builder.build()


@st.composite
def _batches(draw: st.DrawFn) -> tuple[list[int], int, int, str]:
    """Lengths, world size, capacity and cluster: short sequences and long ones up to the whole cluster's
    capacity."""
    world = draw(st.integers(4, 32))
    capacity = draw(st.sampled_from([2 * K, 8 * K]))
    short = st.integers(1, capacity)
    long = st.integers(capacity + 1, world * capacity)
    lengths = draw(st.lists(st.one_of(short, short, long), min_size=1, max_size=40))
    return lengths, world, capacity, draw(st.sampled_from(["h100", "l20", "none"]))


@settings(max_examples=150)
@given(batch=_batches())
def test_no_plan_simulates_below_the_lower_bound(batch):
    """Every strategy's plan, ring-only and joint, and a Megatron-like plan of power-of-two groups simulate at or
    above `lower_bound`: the bound searches every group size and split by the simulator's own arithmetic."""
    lengths, world, capacity, hardware = batch
    cm = _cost(hardware)
    lens = np.array(lengths, dtype=np.int64)
    bound = lower_bound(lens, world, capacity, cm)
    plans = {
        (strategy, sp): plan(lens, world_size=world, capacity=capacity, cost_model=cm, strategy=strategy, sp=sp)
        for strategy in ("balance", "naive", "static")
        for sp in ("ring", "auto")
    }
    plans["megatron", "ring"] = _megatron_like(lens, world, capacity, cm)
    for name, p in plans.items():
        p.validate()
        assert simulate(p, cm).step_time >= bound * (1 - 1e-9), name
