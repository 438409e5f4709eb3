"""Balance scheduler (paper Algorithm 2): balance time, not tokens.

Sequences are sorted longest first and cut into buckets of about equal FLOPs. Each sequence then goes
to the ranks that have the least work so far: a long one to its D(s) least-loaded ranks together,
a short one into the open packed micro-batch of the least-loaded rank. Ranks that drew short work get
more micro-batches, so all finish together (§5 "Redefine micro-batch"). Buckets are taken in order, so
ranks run sequences of the same length level at the same time (DP-Balance), and with pipelines each
pipeline takes micro-batches of one or two adjacent length levels, the ones with shorter micro-batches
more of them (PP-Balance, Insight 1): a 1F1B pipeline's fill and drain are set by its longest
micro-batches, so mixing levels in one pipeline costs bubble time (`sim/pipeline.py`). PP-balance
also counts each pipeline's fill and drain in its load, and caps a micro-batch at 1/(4 pp) of the
balanced time, spreading long sequences over more ranks (`_longest_micro_batch`), in groups that tile
the ranks (`_tile_heavy`).

PP-balance keeps a group of pipelines together for consecutive shared sequences, a chain
(`placers.ChainPlacer`), as static's CP rows are: in the executable 1F1B order
(`pipeline_order.stage_order`) only chained shared micro-batches overlap in a pipeline, the others wait
for the previous shared one's backward. Packed micro-batches go after the chains, and each pipeline runs
its micro-batches from short to long and back (`ChainPlacer.schedule`), so that 1F1B fills and drains on
short ones: at pp = 2 and 4 it took balance's step in benchmarks/planner.py section 5 from well behind
static's to ahead of it.

D(s) is the fewest ranks that can *hold* a sequence; a sequence whose work on D(s) ranks exceeds the
balanced per-rank time (total work / ranks) would alone set the step time, so it gets the fewest ranks on
which some u × r split ends it within that time (with r = 0 once its tokens fit), or else its fastest
group: group size and split are chosen together (`group_size.py`), since a split sends 1/u of the ring's
bytes and so stays fast on groups far wider than a plain ring's. When a sequence would still end past the
balanced time on its least-loaded ranks (a wave of long ones ending unevenly; few long sequences, three on
four ranks, say), it widens onto the next least-loaded ranks, waiting for them if need be, to the size that
ends it soonest (`DPPlacer`'s malleable placement); heavy short sequences at the end of the step likewise.

`delta` is the paper's threshold δ: a short sequence may go to a rank up to δ seconds busier than
the least-loaded one when that rank's open micro-batch still has room, so balance within δ buys
fewer, fuller micro-batches.

Placement is two placers (`placers.py`), `DPPlacer` without pipelines and `ChainPlacer` with them, each
over one `rank_load.RankLoads`: every rank's load, its entries in order, the packed micro-batches being
filled and the idle gaps. Every balance plan keeps these invariants (`Plan.validate` checks them, and
tests/test_balance_properties.py on random batches):

1. Every sequence, so every token, is in exactly one micro-batch: `schedule_balance` visits each
   sequence once and a placer puts it either in a micro-batch of its own (a long one, or a short one it
   widened) or in one packed entry (a short one), which `RankLoads.schedule` makes one micro-batch.
2. No rank holds more than its capacity C at once, or with offload ratio r the capacity Eq. 2 allows
   (`plan.capacity_for_ratio`): a long sequence runs on at least D(s) ranks at its r, a wider group drops
   r to 0 only once the sequence fits C on it (zigzag rounding adds up to two tokens a sequence), and
   a packed entry takes a short sequence (at most C tokens) only while it stays within C.
3. Ranks that share micro-batches run them in the same relative order, so none waits on another
   forever: each rank lists its shared micro-batches in the order they were placed, and `ChainPlacer`
   reorders only within a chain, whose micro-batches are consecutive on every member and one entry
   object on all of them, so the same way everywhere. With pipelines the 1F1B order of every stage then
   agrees too (`pipeline_order.stage_order`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..strategies import BALANCE
from .builder import PlanBuilder
from .group_size import GroupChoice, fastest_groups, least_groups
from .naive import ranks_needed
from .placers import ChainPlacer, Demands, DPPlacer, Placer
from .plan import BalanceSettings, Plan
from .split import DEFAULT_SP

if TYPE_CHECKING:
    from .cost_model import CostModel

__all__ = [
    "DEFAULT_DELTA",
    "BalanceInputs",
    "balance_inputs",
    "balance_ranks",
    "plan_balance",
    "schedule_balance",
    "flop_buckets",
]

DEFAULT_DELTA = 0.01
"""δ as a fraction of the balanced per-rank time (total work / ranks)."""
MICRO_BATCHES_PER_STAGE = 4
"""With pipelines, sequences are spread until each pipeline has at least this many micro-batches per stage."""


def flop_buckets(flops: np.ndarray, order: np.ndarray, num_buckets: int) -> list[np.ndarray]:
    """Split `order` (longest first) into contiguous buckets of about equal total FLOPs."""
    if order.size == 0:
        return []
    cumulative = np.cumsum(flops[order])
    edges = np.searchsorted(cumulative, cumulative[-1] * np.arange(1, num_buckets) / num_buckets, side="right")
    return [b for b in np.split(order, edges) if b.size]


def _spread_heavy(
    inputs: BalanceInputs, ranks: np.ndarray, ratio: np.ndarray, longest: float
) -> tuple[np.ndarray, np.ndarray]:
    """Give sequences heavier than `longest` (the longest micro-batch a rank should run) the fewest ranks on
    which some u × r split ends them within it (`group_size.least_groups`), or, where none does, the group
    of their least time (`BalanceInputs.groups`)."""
    i = inputs
    if i.lens.size == 0 or longest <= 0:  # no sequence costs time (a cost model of fixed costs only): none is heavy
        return ranks, ratio
    over = np.flatnonzero(i.seq_time > longest * np.maximum(ranks, 1))
    if over.size == 0:
        return ranks, ratio
    fastest = GroupChoice(i.groups.ranks[over], i.groups.ulysses[over], i.groups.seconds[over])
    wanted = least_groups(
        i.cost_model, i.lens[over], i.seq_time[over], ranks[over], longest, fastest, world_size=i.world_size, sp=i.sp
    )
    ranks, ratio = ranks.copy(), ratio.copy()
    heavy = wanted > np.maximum(ranks[over], 1)
    ranks[over] = np.where(heavy, wanted, ranks[over])
    ratio[over] = np.where(heavy & (i.lens[over] <= ranks[over] * i.capacity), 0.0, ratio[over])
    return ranks, ratio


def _longest_micro_batch(balanced: float, pp_size: int) -> float:
    """The longest micro-batch a rank should run: the balanced per-rank time without pipelines. A
    pipeline's fill and drain last (pp - 1)/pp of its longest micro-batch, so with pp > 1 the cap is
    1/(MICRO_BATCHES_PER_STAGE x pp) of it: at most (pp - 1)/(4 pp + pp - 1) of the step is bubble
    (Insight 1: more, shorter micro-batches per pipeline)."""
    return balanced if pp_size == 1 else balanced / (MICRO_BATCHES_PER_STAGE * pp_size)


@dataclass(frozen=True)
class BalanceInputs:
    """What balance derives from the batch before deciding any offload: the order it visits sequences
    in (FLOP buckets, longest first), their work, the balanced per-rank time, the ring's useful widths.
    `auto`'s candidates with and without offloading differ only in D(s) and r, so they share these."""

    lens: np.ndarray
    world_size: int
    capacity: int
    cost_model: CostModel
    pp_size: int
    layers: int
    seq_time: np.ndarray
    total_work: float
    sequence: np.ndarray
    buckets: int
    groups: GroupChoice
    """Each sequence's group of least time, size and split together (`group_size.fastest_groups`); one rank
    for those too light ever to be spread."""
    sp: str = DEFAULT_SP
    """How shared micro-batches split their ranks u × r (`split.choose_split`)."""

    @property
    def balanced(self) -> float:
        """The balanced per-rank time: total work / ranks."""
        return self.total_work / self.world_size

    @property
    def fastest(self) -> np.ndarray:
        """The group size past which each sequence gets no faster."""
        return self.groups.ranks


def balance_inputs(
    lens: np.ndarray,
    world_size: int,
    capacity: int,
    cost_model: CostModel,
    pp_size: int = 1,
    num_buckets: int = 16,
    sp: str = DEFAULT_SP,
) -> BalanceInputs:
    """The offload-independent part of `plan_balance`, computed once for every offload setting."""
    seq_time = cost_model.seq_time(lens) if lens.size else np.zeros(0)
    total = float(seq_time.sum())
    flops = cost_model.flops(lens) if lens.size else np.zeros(0)
    order = np.argsort(-lens, kind="stable")
    buckets = flop_buckets(flops, order, num_buckets)
    return BalanceInputs(
        lens,
        world_size,
        capacity,
        cost_model,
        pp_size,
        max(1, cost_model.model.layers // pp_size),
        seq_time,
        total,
        np.concatenate(buckets) if buckets else order,
        len(buckets),
        _groups(
            lens, capacity, cost_model, seq_time, world_size, _longest_micro_batch(total / world_size, pp_size), sp
        ),
        sp,
    )


def _groups(
    lens: np.ndarray,
    capacity: int,
    cost_model: CostModel,
    seq_time: np.ndarray,
    world_size: int,
    longest: float,
    sp: str,
) -> GroupChoice:
    """`fastest_groups` of the sequences that may be shared: longer than C, or heavier than the longest
    micro-batch (`_longest_micro_batch`), so that balance spreads them; one rank for the rest."""
    groups = GroupChoice(np.ones(lens.shape, np.int64), np.ones(lens.shape, np.int64), seq_time.copy())
    may_share = np.flatnonzero((lens > capacity) | (seq_time > longest))
    if may_share.size:
        found = fastest_groups(
            cost_model, lens[may_share], seq_time[may_share], world_size, np.ones(may_share.size, np.int64), sp=sp
        )
        groups.ranks[may_share], groups.ulysses[may_share], groups.seconds[may_share] = (
            found.ranks,
            found.ulysses,
            found.seconds,
        )
    return groups


def balance_ranks(inputs: BalanceInputs, offload: bool) -> tuple[np.ndarray, np.ndarray]:
    """Each sequence's ranks and offload ratio: D(s) and r of Eq. 2, then heavy sequences spread
    (`_spread_heavy`), with pipelines onto groups that tile the ranks (`_tile_heavy`). Raises PlanError
    when a sequence does not fit the cluster."""
    i = inputs
    needed, ratio = ranks_needed(i.lens, i.world_size, i.capacity, i.cost_model, i.layers, offload=offload)
    ranks, ratio = _spread_heavy(i, needed, ratio, _longest_micro_batch(i.balanced, i.pp_size))
    if i.pp_size == 1:
        return ranks, ratio
    return _tile_heavy(i.lens, needed, ranks, ratio, i.world_size, i.capacity, i.fastest)


def _tile_heavy(
    lens: np.ndarray,
    needed: np.ndarray,
    ranks: np.ndarray,
    ratio: np.ndarray,
    world_size: int,
    capacity: int,
    fastest: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """With pipelines, widen each spread sequence's group to the next divisor of the world size, where it
    is no slower there (`fastest`): chains of equal groups then tile the ranks, as a static mesh's rows
    do, instead of leaving a few ranks to join a chain late (2 of 32 with groups of 15: a longer step at
    pp = 4 on GitHub-like data in benchmarks/planner.py section 5)."""
    spread = ranks > np.maximum(needed, 1)
    if not spread.any():
        return ranks, ratio
    divisors = np.array([d for d in range(1, world_size + 1) if world_size % d == 0])
    tiled = divisors[np.searchsorted(divisors, ranks)]
    widen = spread & (tiled <= fastest)
    ranks = np.where(widen, tiled, ranks)
    return ranks, np.where(widen & (lens <= ranks * capacity), 0.0, ratio)


def schedule_balance(
    inputs: BalanceInputs, ranks: np.ndarray, ratio: np.ndarray, offload: bool, delta: float | None = None
) -> Plan:
    """Place every sequence, in bucket order, on its `ranks` with offload `ratio` (`balance_ranks`)."""
    i = inputs
    builder = PlanBuilder(
        BALANCE, i.lens, i.world_size, i.capacity, i.cost_model, i.pp_size, i.layers, i.seq_time, sp=i.sp
    )
    if delta is None:
        delta = DEFAULT_DELTA * i.total_work / i.world_size
    demands = Demands(
        i.sequence.tolist(),
        ranks.tolist(),
        ratio.tolist(),
        np.maximum(i.fastest, ranks).tolist(),
        i.lens.tolist(),
        i.seq_time.tolist(),
    )
    placer: Placer
    if i.pp_size > 1:
        placer, balance = ChainPlacer(builder, i.world_size, i.capacity, i.pp_size), "pp"
    else:
        placer, balance = DPPlacer(builder, i.world_size, i.capacity, i.balanced), "dp"
    placer.place(demands, delta)
    return builder.build(
        placer.schedule(), offload=offload, balance=BalanceSettings(delta=delta, buckets=i.buckets, mode=balance)
    )


def plan_balance(
    lens: np.ndarray,
    *,
    world_size: int,
    capacity: int,
    cost_model: CostModel,
    pp_size: int = 1,
    delta: float | None = None,
    num_buckets: int = 16,
    offload: bool = True,
    sp: str = DEFAULT_SP,
) -> Plan:
    """`delta` defaults to 1% of the balanced per-rank time (`DEFAULT_DELTA`); `offload=False` is the
    ablation that gives every long sequence its D(s, 0) ranks; `sp` how shared micro-batches split u × r."""
    inputs = balance_inputs(lens, world_size, capacity, cost_model, pp_size, num_buckets, sp)
    return schedule_balance(inputs, *balance_ranks(inputs, offload), offload, delta)
