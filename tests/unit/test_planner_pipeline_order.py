"""Pipelines that share micro-batches: every stage rank runs its ops in `stage_order` and a shared
micro-batch's forward or backward on a stage is one ring over all its pipelines. Plain 1F1B deadlocks
where pipelines hold two shared micro-batches different numbers of places apart; `stage_order` keeps
shared micro-batches apart, so only pipelines that disagree on their order deadlock, and
`Plan.validate()` rejects exactly those."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

import pytest

from bytescale_compile.planner import CostModel, plan
from bytescale_compile.planner.pipeline_order import Op, chained_micro_batches, stage_order
from bytescale_compile.planner.plan import MicroBatch, Plan, PlanError, local_tokens
from bytescale_compile.sim.lengths import sample_global_batch

COST = CostModel.preset("llama-7b")
CAPACITY = 8192
LENGTH = 100
"""Every hand-made micro-batch holds one sequence of this many tokens."""


def _plan(ranks_of: list[list[int]], schedule: list[list[int]], pp: int) -> Plan:
    """Micro-batch i runs on pipelines `ranks_of[i]`; `schedule[p]` is pipeline p's order of ids."""
    mbs = [MicroBatch(i, tuple(r), (i,), 0.0, local_tokens([LENGTH], len(r)), 1.0) for i, r in enumerate(ranks_of)]
    return Plan("balance", len(schedule), CAPACITY, pp, [LENGTH] * len(mbs), mbs, schedule)


def _plain_1f1b(stage: int, pp: int, shared: list[bool]) -> list[Op]:
    """1F1B by its definition, shared micro-batches or not: warm-up forwards, then one forward and one
    backward in turn, then the remaining backwards."""
    m = len(shared)
    warmup = min(pp - stage - 1, m)
    steady = [op for k in range(warmup, m) for op in (("F", k), ("B", k - warmup))]
    return [("F", k) for k in range(warmup)] + steady + [("B", j) for j in range(m - warmup, m)]


def _runs_to_completion(p: Plan, order: Callable[[int, int, list[bool]], list[Op]] = stage_order) -> bool:
    """Run the plan op by op, independently of `validate()`, each stage rank in `order`: its next op runs
    once its stage-to-stage dependency is done and, for a shared micro-batch, once every pipeline sharing
    it has that op next on the same stage. False: some stage ranks wait on each other forever."""
    by_id = {m.id: m for m in p.micro_batches}
    queues = {
        (i, s): [(kind, ids[j]) for kind, j in order(s, p.pp_size, [by_id[k].shared for k in ids])]
        for i, ids in enumerate(p.schedule)
        for s in range(p.pp_size)
    }
    heads = dict.fromkeys(queues, 0)
    done: set[tuple[str, int, int]] = set()
    progress = True
    while progress:
        progress = False
        for (i, s), queue in queues.items():
            if heads[i, s] == len(queue):
                continue
            kind, mb = queue[heads[i, s]]
            dep = ("F", mb, s - 1) if kind == "F" else ("B", mb, s + 1) if s < p.pp_size - 1 else ("F", mb, s)
            if not (0 <= dep[2] < p.pp_size) or dep in done:
                ranks = by_id[mb].ranks
                if all(heads[r, s] < len(queues[r, s]) and queues[r, s][heads[r, s]] == (kind, mb) for r in ranks):
                    done.add((kind, mb, s))
                    for r in ranks:
                        heads[r, s] += 1
                    progress = True
    return all(heads[k] == len(q) for k, q in queues.items())


def _valid(p: Plan) -> bool:
    try:
        p.validate()
    except PlanError:
        return False
    return True


# A and B (ids 0, 1) are shared by both pipelines; P (2) is pipeline 1's own, Q (3) pipeline 0's.
SHARED_PAIR = [[0, 1], [0, 1], [1], [0]]
APART = [[0, 1, 3], [0, 2, 1]]
"""P between A and B on pipeline 1 only. Under plain 1F1B (one warm-up forward on stage 0) pipeline 1's
stage 0 runs F(A) F(P) B(A) F(B), so it needs B(A) before F(B), while pipeline 0's runs F(A) F(B) B(A) and
needs F(B) before B(A): both stage-0 ranks wait at a ring the other never reaches, although both run A
before B."""


@pytest.mark.parametrize("pp", [1, 2, 3, 5])
def test_stage_order_without_shared_micro_batches_is_plain_1f1b(pp):
    for stage in range(pp):
        for m in range(8):
            assert stage_order(stage, pp, [False] * m) == _plain_1f1b(stage, pp, [False] * m)


def test_a_shared_forward_waits_for_the_previous_shared_backward():
    # stage 0 of 4 (3 warm-up forwards): B(0) moves before F(1); packed F(2) still overlaps B(1)
    assert stage_order(0, 4, [True, True, False]) == [("F", 0), ("B", 0), ("F", 1), ("F", 2), ("B", 1), ("B", 2)]
    assert stage_order(0, 4, [True, False, True]) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]


def test_plain_1f1b_deadlocks_where_stage_order_does_not():
    p = _plan(SHARED_PAIR, APART, pp=2)
    assert not _runs_to_completion(p, _plain_1f1b)
    assert _runs_to_completion(p)
    p.validate()


def test_pipelines_of_different_micro_batch_counts_validate():
    # pp = 4: pipeline 0 runs 5 micro-batches (3 warm-up forwards on stage 0), pipeline 1 runs 3 (all
    # warm-up); A and B are two places apart on one and one on the other
    ranks_of = [[0, 1], [0, 1], [0], [0], [0]]
    uneven = _plan(ranks_of, [[0, 2, 1, 3, 4], [0, 1]], pp=4)
    assert not _runs_to_completion(uneven, _plain_1f1b)
    assert _runs_to_completion(uneven)
    uneven.validate()


def test_inconsistent_order_of_shared_micro_batches_is_rejected_naming_each_pipelines_order():
    p = _plan(SHARED_PAIR, [[0, 1, 3], [1, 0, 2]], pp=2)
    assert not _runs_to_completion(p)
    with pytest.raises(PlanError, match=r"deadlock under 1F1B: .* wait on each other in a cycle") as caught:
        p.validate()
    assert "pipelines [0] run" in str(caught.value) and "pipelines [1] run" in str(caught.value)


def _random_plan(rng: random.Random) -> Plan:
    """2-4 pipelines of 2-4 stages; shared micro-batches in one global order (or, one time in four, each
    pipeline's own shuffle) with each pipeline's own micro-batches at random places among them."""
    world, pp = rng.randint(2, 4), rng.randint(2, 4)
    ranks_of = [sorted(rng.sample(range(world), rng.randint(2, world))) for _ in range(rng.randint(1, 3))]
    ranks_of += [[rng.randrange(world)] for _ in range(rng.randint(0, 6))]
    schedule = []
    for i in range(world):
        shared = [m for m, r in enumerate(ranks_of) if len(r) > 1 and i in r]
        if rng.random() < 0.25:
            rng.shuffle(shared)
        for m, r in enumerate(ranks_of):
            if r == [i]:
                shared.insert(rng.randint(0, len(shared)), m)
        schedule.append(shared)
    return _plan(ranks_of, schedule, pp)


def test_validate_rejects_exactly_the_plans_that_deadlock_and_those_disagree_on_the_shared_order():
    """Against the op-by-op run above, on random small plans (both outcomes must occur): a plan deadlocks
    exactly when its pipelines order their shared micro-batches differently (what `validate` checks at
    pp_size 1), whatever their own micro-batches between them."""
    rng = random.Random(0)
    outcomes = []
    for _ in range(400):
        p = _random_plan(rng)
        outcomes.append(_runs_to_completion(p))
        assert _valid(p) == outcomes[-1], (p.pp_size, [m.ranks for m in p.micro_batches], p.schedule)
        assert _valid(dataclasses.replace(p, pp_size=1)) == outcomes[-1]
    assert 50 < sum(outcomes) < 350


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("strategy", ["balance", "naive", "static"])
@pytest.mark.parametrize("seed,world", [(2, 16), (0, 4)])
def test_planner_pipeline_plans_validate_and_run(strategy, pp, seed, world):
    lens = sample_global_batch("github", 2**18 if world == 4 else 1_000_000, seed=seed, max_len=64 * 1024)
    piped = plan(lens, world_size=world, capacity=CAPACITY * pp, cost_model=COST, strategy=strategy, pp_size=pp)
    piped.validate()
    assert _runs_to_completion(piped)


def test_static_rows_are_chained_so_its_pipelines_run_plain_1f1b():
    """A CP group's pipelines run the same rows in the same order: every row but the first follows the same
    row of the same ranks on all of them, so none waits for the previous one's backward."""
    lens = sample_global_batch("github", 2**20, seed=0, max_len=64 * 1024)
    static = plan(
        lens, world_size=8, capacity=CAPACITY, cost_model=COST, strategy="static", pp_size=4, context_length=64 * 1024
    )
    shared = [m.id for m in static.micro_batches if m.shared]
    firsts = {ids[0] for ids in static.schedule if ids}
    assert shared and chained_micro_batches(static) == set(shared) - firsts
    # a packed micro-batch between two shared ones of the same ranks on one pipeline breaks the chain
    assert chained_micro_batches(_plan(SHARED_PAIR, APART, pp=2)) == set()
    assert chained_micro_batches(_plan(SHARED_PAIR, [[0, 1, 3], [0, 1, 2]], pp=2)) == {1}
