"""The end-of-run table: per strategy, steady-state throughput, busy-time spread and ring bytes, measured and as the
simulator predicts them for the same plans, with the final training and held-out losses. Strategy "auto" is
labelled with how many steps ran each candidate, e.g. "auto (balance 3/static 0)". The trainer prints its one
strategy's line; the comparison (`compare.py`) every strategy's."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..strategies import STATIC

if TYPE_CHECKING:
    from .metrics import StepRecord

__all__ = ["StrategySummary", "comparison", "summarize"]

_MIB = 2**20


@dataclass(frozen=True)
class StrategySummary:
    """Means over the steady steps of one strategy's run (the first steps compile and are left out)."""

    strategy: str
    first_step: int
    last_step: int
    """The steps the means cover."""
    tokens_per_second: float
    busy_spread: float
    p2p_mib: float
    step_time: float
    predicted_tokens_per_second: float
    predicted_busy_spread: float
    predicted_p2p_mib: float
    predicted_step_time: float
    final_loss: float
    eval_loss: float | None
    auto_choices: dict[str, int] = field(default_factory=dict)
    """Strategy "auto": how many of the run's steps (all of them, not only the steady ones) ran each candidate."""

    @property
    def label(self) -> str:
        """The strategy, for auto with the candidates it chose (and static, to show when it never was)."""
        if not self.auto_choices:
            return self.strategy
        from ..planner.auto import CANDIDATES  # torch: not for --help

        shown = [c.name for c in CANDIDATES if self.auto_choices.get(c.name) or c.name == STATIC]
        return f"{self.strategy} ({'/'.join(f'{name} {self.auto_choices.get(name, 0)}' for name in shown)})"


def summarize(records: Sequence[StepRecord], eval_loss: float | None, skip: int = 1) -> StrategySummary:
    """Tokens/s as total tokens over total time (not a mean of ratios) over the records after the first `skip`
    (all of them when there are no more)."""
    if not records:
        raise ValueError("no steps to summarize")
    steady = list(records[skip:]) or list(records)
    tokens = sum(r.tokens for r in steady)
    measured, predicted = sum(r.time for r in steady), sum(r.predicted_time for r in steady)
    return StrategySummary(
        strategy=steady[0].strategy,
        first_step=steady[0].step,
        last_step=steady[-1].step,
        tokens_per_second=tokens / measured,
        busy_spread=statistics.mean(r.busy_spread for r in steady),
        p2p_mib=statistics.mean(r.p2p_bytes for r in steady) / _MIB,
        step_time=measured / len(steady),
        predicted_tokens_per_second=tokens / predicted,
        predicted_busy_spread=statistics.mean(r.predicted_busy_spread for r in steady),
        predicted_p2p_mib=statistics.mean(r.predicted_p2p_bytes for r in steady) / _MIB,
        predicted_step_time=predicted / len(steady),
        final_loss=records[-1].loss,
        eval_loss=eval_loss,
        auto_choices=dict(Counter(r.auto_choice for r in records if r.auto_choice is not None)),
    )


def comparison(summaries: Sequence[StrategySummary], unpredicted: str | None = None) -> str:
    """The table, plus each strategy's speedup over static when static ran too. With `unpredicted` (why the cost
    model's predictions are not of this device) the predicted columns are left out and the reason printed: a
    prediction of another device beside these measurements would compare nothing."""
    width = max([10, *(len(s.label) for s in summaries)])
    predicted = unpredicted is None
    header = " " * width + "   ---------------- measured ----------------"
    columns = f"{'strategy':<{width}}   tokens/s  busy max/min  P2P MiB/step  step s"
    if predicted:
        header += "   ---------------- predicted ---------------"
        columns += "    tokens/s  busy max/min  P2P MiB/step  step s"
    lines = [header, columns + "   final loss   eval loss"]
    for s in summaries:
        held_out = f"{s.eval_loss:>11.4f}" if s.eval_loss is not None else f"{'-':>11}"
        row = f"{s.label:<{width}} {s.tokens_per_second:>10,.0f} {s.busy_spread:>13.2f} {s.p2p_mib:>13.1f} {s.step_time:>7.2f}"
        if predicted:
            row += (
                f"  {s.predicted_tokens_per_second:>10,.0f} {s.predicted_busy_spread:>13.2f} "
                f"{s.predicted_p2p_mib:>13.1f} {s.predicted_step_time:>7.2f}"
            )
        lines.append(f"{row} {s.final_loss:>12.4f} {held_out}")
    if summaries:
        lines.append(
            f"(means over steps {summaries[0].first_step}..{summaries[0].last_step}; the first step of a run compiles)"
        )
    if not predicted:
        lines.append(f"no predicted figures: {unpredicted}")
    static = next((s for s in summaries if s.strategy == STATIC), None)
    others = [s for s in summaries if s.strategy != STATIC]
    if static is not None and others:
        lines.append("speedup over static: " + ", ".join(_speedup(s, static, predicted=predicted) for s in others))
    return "\n".join(lines)


def _speedup(s: StrategySummary, static: StrategySummary, *, predicted: bool) -> str:
    measured = f"{s.strategy} {s.tokens_per_second / static.tokens_per_second:.2f}x measured"
    if not predicted:
        return measured
    return f"{measured}, {s.predicted_tokens_per_second / static.predicted_tokens_per_second:.2f}x predicted"
