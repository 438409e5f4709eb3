"""The check before step 1 that every sequence the run can draw fits the cluster.

The planner refuses a sequence too long for `ranks x C` (with the offload Eq. 2 allows, per pipeline stage)
only when a step draws it, which can be hours into a run. Every length is known from the datasets' index, so
each rank runs the planner's own rule (`planner/limits.py`) over all of them, the training and the held-out
split, before the first step and without communicating; the step's check stays as the last line of defence.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..data import MixedDataset, TokenDataset
from ..planner import AUTO, STATIC, CostModel
from ..planner.limits import LengthLimit, length_limit
from .config import ConfigError, TrainConfig

__all__ = ["PreflightError", "preflight"]

MIN_LEN = 2
"""Sequences shorter than this have no target and are never drawn (the samplers' `min_len`)."""
_SHOWN = 8
"""Dataset positions named in the message; the count says how many more."""


class PreflightError(ConfigError):
    """Sequences of the data that no plan of this run can hold; names them and the settings that would."""


def preflight(
    config: TrainConfig,
    datasets: Sequence[tuple[str, TokenDataset | MixedDataset | None]],
    hdp_ranks: int,
    pp_size: int,
    strategy: str,
    cost_model: CostModel,
    blockers: Sequence[str],
) -> None:
    """Raise `PreflightError` when a sequence of one of the `(what, dataset)` (truncated to --max-len) is longer
    than the run's `hdp_ranks` ranks of capacity C hold under `strategy`."""
    for what, data in datasets:
        if data is None:
            continue
        drawn = np.flatnonzero(data.lengths >= MIN_LEN)
        used = np.minimum(data.lengths[drawn], config.max_len)
        limit = length_limit(
            used,
            hdp_ranks,
            config.capacity,
            cost_model,
            strategy,
            pp_size,
            context_length=config.max_len if strategy in (STATIC, AUTO) else None,
            shard_blocker="; ".join(blockers) or None,
        )
        if limit.too_long.size:
            raise PreflightError(_message(what, data, drawn[limit.too_long], used[limit.too_long], limit))


def _message(
    what: str, data: TokenDataset | MixedDataset, positions: np.ndarray, lengths: np.ndarray, limit: LengthLimit
) -> str:
    shown = ", ".join(_position(data, int(p)) for p in positions[:_SHOWN])
    more = f" and {positions.size - _SHOWN} more" if positions.size > _SHOWN else ""
    plural = "s" if positions.size > 1 else ""
    ways = [f"--max-len {limit.max_len} (truncates them)"]
    if limit.enough_capacity is not None:
        ways.append(f"--capacity {limit.enough_capacity}")
    if limit.enough_ranks is not None:
        ways.append(f"{limit.enough_ranks} HDP ranks (torchrun --nproc_per_node={limit.enough_processes} in all)")
    ways.append(f"data prepared with --long-docs split --max-len {limit.max_len} (pieces instead of truncation)")
    return (
        f"{positions.size} sequence{plural} of {what} {data.prefix}, at dataset position{plural} {shown}{more}, "
        f"cannot be planned: up to {int(lengths.max())} tokens (after --max-len), {limit.reason}. Any of these "
        f"holds them: {'; '.join(ways)}"
    )


def _position(data: TokenDataset | MixedDataset, index: int) -> str:
    """`index` itself, or in a mixture `name:index` within its part."""
    if not isinstance(data, MixedDataset):
        return str(index)
    part = int(data.part_of([index])[0])
    return f"{data.names[part]}:{index - data.starts[part]}"
