"""Which sequence lengths no plan of a strategy can hold, known before any step, and what would hold them.

The planners refuse a sequence too long for the cluster only when a step draws it. `length_limit` runs their
checks over a whole dataset's lengths at once, so a run can refuse before its first step, naming the
sequences and the settings that would hold them. The checks live here, once: `naive.ranks_needed`,
`static.plan_static` and `unsharded.plan_unsharded` refuse through `refuse` and the reasons below.

What holds a sequence, as `plan()` decides on a batch of it:
- a model that cannot be sharded (`shard_blockers`, any strategy): at most the capacity, on one rank;
- static: at most the context length, and a context-length row within the mesh (`mesh_row`);
- naive and balance: D(s) of Eq. 2, offloading allowed, at most the W ranks;
- auto: what balance with offloading or static holds. W ranks hold any s <= W x C without offloading
  (D(s, 0) = ceil(Act(s) / Act(C)) <= W), so static holds nothing balance does not: auto's limit is balance's.
A batch fails exactly when it holds a flagged sequence: each rule judges sequences one by one, static's row
included (a given context length fails every sequence or none; otherwise the row is the batch's longest).

D(s) is monotone in neither s nor C: offloading lowers D only where it frees a whole rank's worth (r* >= r_low,
`CostModel.ranks_and_ratio`), and whether it does turns on both. So the lengths and capacities that fit are
unions of intervals, found with the cost model's own D(s).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..strategies import STATIC
from .checks import check_arguments
from .plan import PlanError

if TYPE_CHECKING:
    from .cost_model import CostModel

__all__ = [
    "LengthLimit",
    "Reason",
    "eq2_reason",
    "layers_per_stage",
    "length_limit",
    "mesh_reason",
    "mesh_row",
    "refuse",
    "static_reason",
    "unsharded_reason",
]

Reason = Callable[[int], str]
"""Why a sequence of so many tokens is too long: a clause completing "sequence i has n tokens, ..."."""


@dataclass(frozen=True, eq=False)
class LengthLimit:
    """Which of a dataset's sequences no plan of a strategy can hold on a cluster, and what would hold them."""

    too_long: np.ndarray
    """Indices into the lengths of the sequences no plan can hold, ascending."""
    longest: int
    """The longest sequence a plan can hold (static: its row's, W x C or the shorter context length)."""
    max_len: int
    """The longest length to truncate to that leaves none of them too long: `longest`, unless a too-long
    sequence is shorter (D(s) is not monotone), then the longest length that fits below the shortest too-long
    one. A static context length beyond the mesh's row must come down to it too (the trainer's is its max_len)."""
    reason: str
    """Why they are too long, completing "positions ... have n tokens, ..."; empty when none is."""
    enough_capacity: int | None
    """The smallest capacity with which the same ranks hold every too-long sequence; None when none is too
    long, or no capacity would (longer than static's given context length). A larger capacity can hold less
    (where Eq. 2 stops offloading), but every one from the capacity that holds them without offloading holds."""
    enough_ranks: int | None
    """The fewest HDP ranks that hold every too-long sequence at this capacity (static: a mesh of them, CP the
    whole); None when none is too long, or no number of ranks would (one rank runs an unshardable sequence)."""
    pp_size: int

    @property
    def enough_processes(self) -> int | None:
        """The processes a job of `enough_ranks` HDP ranks needs: pp_size each."""
        return None if self.enough_ranks is None else self.enough_ranks * self.pp_size


def length_limit(
    lengths: Sequence[int] | np.ndarray,
    *,
    world_size: int,
    capacity: int,
    cost_model: CostModel,
    strategy: str,
    pp_size: int = 1,
    context_length: int | None = None,
    shard_blockers: Sequence[str] = (),
) -> LengthLimit:
    """The sequences among `lengths` that `plan()` with these arguments refuses in any batch, and the length,
    capacity and ranks that would hold them; vectorised over the lengths (a whole dataset's)."""
    lens = check_arguments(lengths, strategy, world_size, capacity, pp_size)
    if shard_blockers:
        too_long = lens > capacity
        need = int(lens[too_long].max(initial=0))
        why = unsharded_reason(capacity, tuple(shard_blockers))
        return _limit(lens, too_long, why, capacity, capacity, need, None, pp_size)
    if strategy == STATIC:
        return _static_limit(lens, world_size, capacity, context_length, pp_size)
    return _eq2_limit(lens, world_size, capacity, cost_model, layers_per_stage(cost_model, pp_size), pp_size)


# --- the checks the planners share ----------------------------------------------------------------


def layers_per_stage(cost_model: CostModel, pp_size: int) -> int:
    """l of Eq. 2: the layers one pipeline stage holds, whose activations its ranks keep."""
    return max(1, cost_model.model.layers // pp_size)


def mesh_row(world_size: int, capacity: int) -> int:
    """The longest row a static mesh holds: CP = W, a divisor of W, holds W x C tokens."""
    return world_size * capacity


def refuse(lens: np.ndarray, too_long: np.ndarray, why: Reason) -> None:
    """Raise PlanError naming the longest sequence `too_long` (a mask over `lens`) flags, if any; `why` runs
    only then (Eq. 2's bound costs a root solve)."""
    if too_long.any():
        over = np.flatnonzero(too_long)
        i = int(over[lens[over].argmax()])
        raise PlanError(f"sequence {i} has {int(lens[i])} tokens, {why(int(lens[i]))}")


def unsharded_reason(capacity: int, shard_blockers: Sequence[str]) -> Reason:
    blockers = "; ".join(shard_blockers)
    return lambda _: (
        f"more than the capacity {capacity} of one rank, and the model cannot be sharded over ranks: {blockers}"
    )


def static_reason(context: int) -> Reason:
    return lambda _: f"more than the static mesh's context length {context}"


def mesh_reason(world_size: int, capacity: int, context: int | None = None) -> Reason:
    """Why a static mesh holds no row of `context` tokens (None: each batch's row is its longest sequence)."""
    row = f"more than the {mesh_row(world_size, capacity)} tokens a row of {_ranks(world_size)} of capacity {capacity}"
    return lambda _: f"{row} holds" if context is None else f"in rows of the context length {context}, {row} holds"


def eq2_reason(
    world_size: int, capacity: int, cost_model: CostModel, layers_per_rank: int, offload: bool = True
) -> Reason:
    """Why D(s) > W: more than the longest sequence that fits, or, below it, a length whose offloading would not
    hide under its compute (D is not monotone in s)."""

    def why(tokens: int) -> str:
        longest = cost_model.max_sequence(world_size, capacity, layers_per_rank, offload=offload)
        how = "with the offload ratios Eq. 2 allows" if offload else "without offloading"
        held = f"{_ranks(world_size)} of capacity {capacity} can hold {how} ({layers_per_rank} layer{'s' if layers_per_rank > 1 else ''} per pipeline stage)"
        if tokens > longest:
            return f"more than the {longest} that {held}"
        return (
            f"more than {held}: they hold at most {longest} tokens, and not every shorter sequence (offloading "
            f"pays only where it hides under the compute)"
        )

    return why


# --- the limits ------------------------------------------------------------------------------------


def _ranks(count: int) -> str:
    return f"{count} rank" if count == 1 else f"{count} ranks"


def _limit(
    lens: np.ndarray,
    too_long: np.ndarray,
    why: Reason,
    longest: int,
    max_len: int,
    capacity: int,
    ranks: int | None,
    pp_size: int,
) -> LengthLimit:
    """The limit, fixes kept only where something is too long (`capacity` 0: none helps)."""
    flagged = np.flatnonzero(too_long)
    if not flagged.size:
        return LengthLimit(flagged, longest, max_len, "", None, None, pp_size)
    reason = why(int(lens[flagged].min()))
    return LengthLimit(flagged, longest, max_len, reason, capacity or None, ranks, pp_size)


def _static_limit(
    lens: np.ndarray, world_size: int, capacity: int, context_length: int | None, pp_size: int
) -> LengthLimit:
    """Without a context length each batch's row is its longest sequence, so one beyond the mesh's row fails;
    a given context length beyond it fails them all, and a sequence beyond a given one fails whatever the
    cluster (only truncating helps). A mesh of `need` tokens per row takes ceil(need / C) ranks, CP the whole."""
    row = mesh_row(world_size, capacity)
    longest = min(context_length or row, row)
    if not context_length:
        too_long, why = lens > row, mesh_reason(world_size, capacity)
        need = int(lens[too_long].max(initial=0))
    elif context_length > row:
        too_long, why = np.ones(lens.shape, bool), mesh_reason(world_size, capacity, context_length)
        need = 0 if (lens > context_length).any() else context_length
    else:
        too_long, why, need = lens > context_length, static_reason(context_length), 0
    ranks = -(-need // capacity) or None
    return _limit(lens, too_long, why, longest, longest, -(-need // world_size), ranks, pp_size)


def _eq2_limit(
    lens: np.ndarray, world_size: int, capacity: int, cost_model: CostModel, layers: int, pp_size: int
) -> LengthLimit:
    """D(s) > W, as `naive.ranks_needed` refuses. D does not depend on W: the fewest ranks are the largest D."""
    ranks = cost_model.ranks_and_ratio(lens, capacity, layers)[0]
    too_long = ranks > world_size
    why = eq2_reason(world_size, capacity, cost_model, layers)
    longest = cost_model.max_sequence(world_size, capacity, layers)
    if not too_long.any():
        return _limit(lens, too_long, why, longest, longest, 0, None, pp_size)
    over = np.sort(lens[too_long])  # distinct by hand: np.unique hashes, far slower on many lengths
    over = over[np.r_[True, over[1:] != over[:-1]]]

    def fits(s: np.ndarray) -> np.ndarray:
        return cost_model.ranks_and_ratio(s, capacity, layers)[0] <= world_size

    max_len = longest if over[0] > longest else _longest_fitting_below(int(over[0]), fits)
    enough = _enough_capacity(over, world_size, capacity, cost_model, layers)
    return _limit(lens, too_long, why, longest, max_len, enough, int(ranks.max()), pp_size)


def _longest_fitting_below(tokens: int, fits: Callable[[np.ndarray], np.ndarray]) -> int:
    """The longest length below `tokens` that fits, scanning down in doubling windows. It ends, at C at the
    latest (D = 0), and soon: such gaps lie where offloading hides only partly under compute (r* < 1); above,
    D(s, 1) grows with s."""
    top, width = tokens - 1, 1024
    while True:
        window = np.arange(max(1, top - width + 1), top + 1)
        ok = np.flatnonzero(fits(window))
        if ok.size:
            return int(window[ok[-1]])
        top, width = int(window[0]) - 1, 2 * width


def _enough_capacity(over: np.ndarray, world_size: int, capacity: int, cost_model: CostModel, layers: int) -> int:
    """The smallest capacity above `capacity` at which `world_size` ranks hold every length in `over`.

    The capacities that do are no upper interval: each length's are two (`_capacities_holding`). So this keeps
    the capacities left, tries the least (D(s) of every length, as the planners judge it), and where a length
    fails there, keeps only those holding it too. Each round drops a capacity, and the longest length in
    `over` is one that holds them all (D = 0), so it ends; a dataset takes a round or two."""
    top = int(over[-1])
    left = [(capacity + 1, top)]
    while True:
        least = min(lo for lo, _ in left)
        failing = over[cost_model.ranks_and_ratio(over, least, layers)[0] > world_size]
        if not failing.size:
            return least
        left = [
            (max(lo, a, least + 1), min(hi, b))
            for lo, hi in left
            for a, b in _capacities_holding(int(failing[-1]), top, world_size, cost_model, layers)
            if max(lo, a, least + 1) <= min(hi, b)
        ]


def _capacities_holding(
    tokens: int, top: int, world_size: int, cost_model: CostModel, layers: int
) -> list[tuple[int, int]]:
    """The capacities up to `top` at which `world_size` ranks hold `tokens`, as two intervals: [C0, top], where
    D(s, 0) <= W (it falls as C grows), and [C1, C2], where offloading is on (r* does not depend on C, r_low
    grows with it: up to C2) and D(s, r*) <= W (falling: from C1). Between C2 and C0 offloading would free
    less than a rank, Eq. 2 keeps r = 0 and D(s, 0) > W: a larger capacity holding less."""

    def at(c: int, offload: bool = True) -> tuple[int, float]:
        ranks, ratio = cost_model.ranks_and_ratio(np.array([tokens]), c, layers, offload)
        return int(ranks[0]), float(ratio[0])

    c0 = _first(lambda c: at(c, offload=False)[0] <= world_size, 1, tokens)
    c2 = _first(lambda c: at(c)[1] == 0, 1, tokens) - 1
    c1 = _first(lambda c: at(c)[0] <= world_size, 1, c2)
    return [(c1, c2), (c0, top)]


def _first(holds: Callable[[int], bool], lo: int, hi: int) -> int:
    """The least c in [lo, hi] where `holds`, false below it and true from it on; hi + 1 if none."""
    while lo <= hi:
        mid = (lo + hi) // 2
        if holds(mid):
            hi = mid - 1
        else:
            lo = mid + 1
    return lo
