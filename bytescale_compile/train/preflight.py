"""The checks before step 1 that every sequence the run can draw fits the cluster, and that the data's token ids
fit the model's vocabulary.

The planner refuses a sequence too long for `ranks x C` (with the offload Eq. 2 allows, per pipeline stage)
only when a step draws it, which can be hours into a run. Every length is known from the datasets' index, so
each rank runs the planner's own rule (`planner/limits.py`) over all of them, the training and the held-out
split, before the first step and without communicating; the step's check stays as the last line of defence.

Formats that do not record their vocabulary (Megatron's, Hugging Face `datasets`, token files) take it as an
option, which can be wrong: an id past the model's vocabulary would otherwise surface as an `IndexError` deep in
the embedding's forward. `check_token_ids` reads a sample of every dataset's sequences (the same on every rank)
and names the first such id; the micro-batch build checks every id it reads (`ids_checked`), and
`bytescale-compile data check --vocab-size N` scans them all.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..data import GlobalBatch, MixedDataset, TokenDataset
from ..data.spec import format_data_spec
from ..planner import AUTO, STATIC, CostModel
from ..planner.limits import LengthLimit, length_limit
from .config import ConfigError, TrainConfig

__all__ = ["PreflightError", "TokenIdError", "check_token_ids", "preflight"]

MIN_LEN = 2
"""Sequences shorter than this have no target and are never drawn (the samplers' `min_len`)."""
_SHOWN = 8
"""Dataset positions named in the message; the count says how many more."""
ID_SAMPLE = 256
"""Sequences of each dataset whose ids are checked before step 1, spread evenly over it."""


class PreflightError(ConfigError):
    """Sequences of the data that no plan of this run can hold; names them and the settings that would."""


class TokenIdError(ConfigError):
    """A token id of the data outside the model's vocabulary: names the dataset, the sequence, the id and the fix."""


def check_token_ids(data: TokenDataset | MixedDataset, vocab_size: int, model: str, sample: int = ID_SAMPLE) -> None:
    """Raise `TokenIdError` at the first id outside 0..vocab_size-1 (the rows of `model`'s embedding) in `sample`
    sequences spread evenly over each dataset of `data`."""
    for part in data.parts if isinstance(data, MixedDataset) else (data,):
        indices = np.unique(np.linspace(0, len(part) - 1, min(sample, len(part))).round().astype(np.int64))
        found = part.first_outside(vocab_size, indices)
        if found is not None:
            raise TokenIdError(
                f"dataset {part.spec} ({part.source}): sequence {found.sequence} holds token id {found.token} at "
                f"position {found.position}, outside model {model}'s vocabulary of {vocab_size} (ids 0 to "
                f"{vocab_size - 1}; the dataset declares vocab_size {part.vocab_size}). Give the vocabulary the data "
                f"was tokenized with (PATH?vocab_size=N or PATH?tokenizer=DIR) and a model whose vocab_size covers "
                f"it; `bytescale-compile data check --data {format_data_spec([(part.spec, 1.0)])} --vocab-size "
                f"{vocab_size}` scans every id"
            )


def preflight(
    config: TrainConfig,
    train_data: TokenDataset | MixedDataset,
    held_out: Sequence[GlobalBatch],
    hdp_ranks: int,
    pp_size: int,
    strategy: str,
    cost_model: CostModel,
    blockers: Sequence[str],
) -> None:
    """Raise `PreflightError` when a sequence the run can draw from `train_data` (truncated to --max-len), or one
    it evaluates on (`held_out`), is longer than the run's `hdp_ranks` ranks of capacity C hold under `strategy`."""
    drawn = np.flatnonzero(train_data.lengths >= MIN_LEN)
    sources = [
        (
            f"--data {train_data.prefix}",
            np.minimum(train_data.lengths[drawn], config.max_len),
            lambda i: _position(train_data, int(drawn[i])),
        )
    ]
    if held_out:
        index = [(batch, int(seq)) for batch in held_out for seq in batch.indices]
        names = {Path(str(batch.dataset.prefix)).name for batch in held_out}
        sources.append(
            (
                "the held-out split",
                np.concatenate([batch.lengths for batch in held_out]),
                lambda i: _held_out_position(index[i][0], index[i][1], len(names) > 1),
            )
        )
    for what, used, position in sources:
        limit = length_limit(
            used,
            world_size=hdp_ranks,
            capacity=config.capacity_tokens,
            cost_model=cost_model,
            strategy=strategy,
            pp_size=pp_size,
            context_length=config.max_len if strategy in (STATIC, AUTO) else None,
            shard_blockers=tuple(blockers),
        )
        if limit.too_long.size:
            raise PreflightError(
                _message(what, [position(int(i)) for i in limit.too_long], used[limit.too_long], limit, config.tp)
            )


def _message(what: str, positions: list[str], lengths: np.ndarray, limit: LengthLimit, tp: int) -> str:
    shown = ", ".join(positions[:_SHOWN])
    more = f" and {len(positions) - _SHOWN} more" if len(positions) > _SHOWN else ""
    plural = "s" if len(positions) > 1 else ""
    ways = [f"--max-len {limit.max_len} (truncates them)"]
    if limit.enough_capacity is not None:
        ways.append(f"--capacity {limit.enough_capacity}")
    if limit.enough_ranks is not None and limit.enough_processes is not None:
        processes = limit.enough_processes * tp  # each HDP rank a TP group
        ways.append(f"{limit.enough_ranks} HDP ranks (torchrun --nproc_per_node={processes} in all)")
    ways.append(f"data prepared with --long-docs split --max-len {limit.max_len} (pieces instead of truncation)")
    return (
        f"{len(positions)} sequence{plural} of {what}, at dataset position{plural} {shown}{more}, cannot be "
        f"planned: up to {int(lengths.max())} tokens (after --max-len), {limit.reason}. Any of these holds "
        f"them: {'; '.join(ways)}"
    )


def _position(data: TokenDataset | MixedDataset, index: int) -> str:
    """`index` itself, or in a mixture `name:index` within its part."""
    if not isinstance(data, MixedDataset):
        return str(index)
    part = int(data.part_of([index])[0])
    return f"{data.names[part]}:{index - data.starts[part]}"


def _held_out_position(batch: GlobalBatch, index: int, named: bool) -> str:
    """A held-out sequence's index in its split, with the split's name when they come from several."""
    return f"{Path(str(batch.dataset.prefix)).name}:{index}" if named else str(index)
