"""The planner's input checks, shared by `plan()` and `length_limit`: each names the first bad argument."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..strategies import RUNTIME_STRATEGIES

__all__ = ["check_arguments", "check_lengths"]


def check_arguments(
    lengths: Sequence[int] | np.ndarray, strategy: str, world_size: int, capacity: int, pp_size: int
) -> np.ndarray:
    """What `plan()` and `length_limit` are given, checked; the lengths as int64 (`check_lengths`)."""
    if strategy not in RUNTIME_STRATEGIES:
        raise ValueError(f"strategy must be one of {RUNTIME_STRATEGIES}, got {strategy!r}")
    for name, value in (("world_size", world_size), ("capacity", capacity), ("pp_size", pp_size)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return check_lengths(lengths)


def check_lengths(lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    """Lengths as int64; non-integers or lengths <= 0 raise ValueError naming the first offender."""
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"lengths must be a flat list of sequence lengths, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        as_int = arr.astype(np.int64) if np.issubdtype(arr.dtype, np.floating) else None
        if as_int is None or (as_int != arr).any():
            i = 0 if as_int is None else int(np.flatnonzero(as_int != arr)[0])
            raise ValueError(f"sequence lengths must be integers; sequence {i} has {arr[i]!r}")
        arr = as_int
    arr = arr.astype(np.int64)
    if (arr <= 0).any():
        i = int(np.flatnonzero(arr <= 0)[0])
        raise ValueError(f"sequence lengths must be positive; sequence {i} has {int(arr[i])}")
    return arr
