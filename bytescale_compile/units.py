"""Sizes written as people write them ("32M", "8K"): read (and written back) by the CLI, the training config and the benchmarks.

A module of its own at the bottom of the layers, beside `config`, so that the command line and the
training config read sizes alike without importing the simulator or the planner."""

from __future__ import annotations

__all__ = ["format_tokens", "parse_size"]

_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


def parse_size(text: str) -> int:
    """'32M' -> 33554432, '8K' -> 8192, '1000' -> 1000 (binary K/M/G, as context lengths are)."""
    text = text.strip().upper()
    try:
        if text and text[-1] in _UNITS:
            return int(float(text[:-1]) * _UNITS[text[-1]])
        return int(text)
    except ValueError as e:
        raise ValueError(f"expected a size like 8K, 32M or 1000, got {text!r}") from e


def format_tokens(n: int) -> str:
    """A token count as the paper writes it: 262144 -> '256K', 2097152 -> '2M' (exact multiples only)."""
    if n >= _UNITS["M"] and n % _UNITS["M"] == 0:
        return f"{n // _UNITS['M']}M"
    if n >= _UNITS["K"] and n % _UNITS["K"] == 0:
        return f"{n // _UNITS['K']}K"
    return str(n)
