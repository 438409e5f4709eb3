"""The order in which one stage of a pipeline runs its micro-batches' forwards (F) and backwards (B): 1F1B,
with shared micro-batches kept apart.

Plain 1F1B runs min(pp - stage - 1, m) warm-up forwards, then one forward and one backward in turn, then
drains the backwards: F(k) runs once B(k - warm-up - 1) is done. Pipelines that share micro-batches
(a ring over their stage ranks) must meet at each shared F and B in the same order, and plain 1F1B
cannot promise that: on stage s, F(k) comes before B(j) iff k <= j + warm-up, so two pipelines that hold
two shared micro-batches different numbers of places apart order their ops differently and wait on each
other forever. So here a shared micro-batch's forward also waits for the backward of the pipeline's
previous shared micro-batch, unless it is chained to it: on every pipeline holding it, it comes right
after that same micro-batch, shared by the same ranks (a static row after a static row). Every pipeline
then runs the ops of the shared micro-batches it holds in one order: within a chain, plain 1F1B with the
same places everywhere; between chains, each chain done before the next starts. No schedule whose
pipelines agree on the order of shared micro-batches can deadlock (`Plan.validate` checks it). The price:
two unchained shared micro-batches in a row do not overlap in the pipeline; a packed one between does.

The simulator (`sim/pipeline.py`), the plan check and the pipeline executor use this one definition.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["Op", "Scheduled", "chained_micro_batches", "stage_order"]

Op = tuple[str, int]
"""("F" or "B", index of the micro-batch in the pipeline's schedule)."""


class _ScheduledMicroBatch(Protocol):
    @property
    def id(self) -> int: ...
    @property
    def ranks(self) -> tuple[int, ...]: ...
    @property
    def shared(self) -> bool: ...


class Scheduled(Protocol):
    """What `chained_micro_batches` reads of a plan (`plan.Plan` is one): described here rather than imported,
    as the plan's deadlock check imports this module."""

    @property
    def micro_batches(self) -> Sequence[_ScheduledMicroBatch]: ...
    @property
    def schedule(self) -> Sequence[Sequence[int]]: ...


def stage_order(stage: int, pp: int, shared: Sequence[bool], chained: Sequence[bool] | None = None) -> list[Op]:
    """The ops stage `stage` of a `pp`-stage pipeline runs, in order, for micro-batches whose flags are given
    in schedule order: `shared` (a ring with other pipelines) and `chained` (`chained_micro_batches`)."""
    m = len(shared)
    chained = chained or [False] * m
    warmup = min(pp - stage - 1, m)
    order: list[Op] = []
    backwards_done, waits_for, last_shared = -1, -1, -1
    for k in range(m):
        waits = shared[k] and not chained[k]
        waits_for = max(waits_for, k - warmup - 1, last_shared if waits else -1)
        while backwards_done < waits_for:
            backwards_done += 1
            order.append(("B", backwards_done))
        order.append(("F", k))
        if shared[k]:
            last_shared = k
    order.extend(("B", j) for j in range(backwards_done + 1, m))
    return order


def chained_micro_batches(plan: Scheduled) -> set[int]:
    """Ids of the shared micro-batches that, on every pipeline holding them, come right after one same
    shared micro-batch of the same ranks."""
    by_id = {m.id: m for m in plan.micro_batches}
    before: dict[int, set[int | None]] = {}
    for ids in plan.schedule:
        for k, i in enumerate(ids):
            if by_id[i].shared:
                before.setdefault(i, set()).add(ids[k - 1] if k else None)
    return {
        i
        for i, prev in before.items()
        if len(prev) == 1 and (p := next(iter(prev))) is not None and by_id[p].ranks == by_id[i].ranks
    }
