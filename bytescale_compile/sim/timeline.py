"""Per-rank timelines of a simulated step, and the two figures made from them.

``plot_timelines`` is the paper's case-study figure (per-rank timelines of static / naive / balance);
``plot_throughput`` is its tokens/s vs context-length figure. matplotlib is imported only inside the
plotting functions, so the simulator can use ``Span``/``Timeline`` where matplotlib is not installed.
Figures are built on ``matplotlib.figure.Figure`` (Agg canvas) rather than pyplot: no global backend
switch, and nothing is left open after saving.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..units import format_tokens

if TYPE_CHECKING:
    from matplotlib.artist import Artist
    from matplotlib.axes import Axes
    from matplotlib.colors import Colormap, Normalize


KIND_COLOURS = {"packed": "tab:orange", "allreduce": "0.45", "optimizer": "0.7", "idle": "0.92"}
SHARED_CMAP = "viridis"
STEP_COLOUR = "tab:red"


@dataclass(frozen=True)
class Span:
    """One micro-batch on one rank."""

    rank: int
    start: float
    end: float
    micro_batch: int
    kind: str  # "packed" (1 rank), "shared" (ring over several ranks), "idle", "allreduce", "optimizer"
    tokens: int = 0
    group_size: int = 1


@dataclass
class Timeline:
    """Every span of one simulated step under one strategy."""

    strategy: str
    world_size: int
    spans: list[Span]
    bubbles: list[float] | None = None
    """With pipelines (pp > 1): each rank's 1F1B bubble rate, stage by stage; None without."""

    @property
    def step_time(self) -> float:
        """The step ends when the last rank does."""
        return max((s.end for s in self.spans), default=0.0)


def shown_ranks(world_size: int, max_ranks: int) -> np.ndarray:
    """All ranks, or max_ranks of them evenly spaced (first and last included) when there are more."""
    if world_size <= max_ranks:
        return np.arange(world_size)
    return np.unique(np.linspace(0, world_size - 1, max_ranks).round().astype(np.int64))


def _group_norm(timelines: Sequence[Timeline]) -> Normalize:
    """Log colour scale over the group sizes of every shared span, one scale for all subplots."""
    from matplotlib.colors import LogNorm

    sizes = [s.group_size for t in timelines for s in t.spans if s.kind == "shared"] or [2]
    lo, hi = max(1, min(sizes)), max(sizes)
    return LogNorm(vmin=lo, vmax=max(hi, 2 * lo))


def _draw_timeline(ax: Axes, timeline: Timeline, max_ranks: int, cmap: Colormap, norm: Normalize) -> None:
    """One horizontal bar per shown rank, a rectangle per span, and the step-time line."""
    ranks = shown_ranks(timeline.world_size, max_ranks)
    row = {int(r): i for i, r in enumerate(ranks)}
    spans = [s for s in timeline.spans if s.rank in row]
    colours = [cmap(norm(s.group_size)) if s.kind == "shared" else KIND_COLOURS.get(s.kind, "black") for s in spans]
    ax.barh(
        [row[s.rank] for s in spans],
        [s.end - s.start for s in spans],
        left=[s.start for s in spans],
        height=0.8,
        color=colours,
        edgecolor="white",
        linewidth=0.3,
    )
    step = timeline.step_time
    ax.axvline(step, color=STEP_COLOUR, linestyle="--", linewidth=1.2)
    ax.annotate(
        f"step {step:.3g} s",
        xy=(step, 1.0),
        xycoords=("data", "axes fraction"),
        xytext=(0, 2),
        textcoords="offset points",
        ha="center",
        va="bottom",
        color=STEP_COLOUR,
        fontsize=8,
    )
    ticks = np.unique(np.linspace(0, len(ranks) - 1, min(len(ranks), 8)).round().astype(np.int64))
    ax.set_yticks(ticks, [str(ranks[t]) for t in ticks])
    ax.set_ylim(len(ranks) - 0.5, -0.5)  # rank 0 on top
    ax.set_ylabel("rank")
    subset = f", {len(ranks)} of {timeline.world_size} ranks shown" if len(ranks) < timeline.world_size else ""
    ax.set_title(f"{timeline.strategy}: step {step:.3g} s{subset}", fontsize=10, loc="left")


def plot_timelines(timelines: list[Timeline], path: str, max_ranks: int = 64, title: str | None = None) -> None:
    """Save the per-rank timelines of each strategy, stacked on one time axis, as an image at path.

    Shared micro-batches are coloured by their ring group's size, packed ones in one colour, gradient
    all-reduce in grey; more than max_ranks ranks are thinned to an evenly spaced subset."""
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import FixedLocator

    if not timelines:
        raise ValueError("plot_timelines needs at least one timeline")
    if max_ranks < 1:
        raise ValueError(f"max_ranks must be >= 1, got {max_ranks}")
    cmap, norm = colormaps[SHARED_CMAP], _group_norm(timelines)
    rows = max(min(t.world_size, max_ranks) for t in timelines)
    fig = Figure(figsize=(12, 1.0 + len(timelines) * min(1.2 + 0.06 * rows, 5.0)), layout="constrained")
    axes = fig.subplots(len(timelines), 1, sharex=True, squeeze=False)[:, 0]
    for ax, timeline in zip(axes, timelines):
        _draw_timeline(ax, timeline, max_ranks, cmap, norm)
    axes[-1].set_xlabel("time (s)")
    handles: list[Artist] = [Patch(color=c, label=k) for k, c in KIND_COLOURS.items()]
    handles.append(Line2D([], [], color=STEP_COLOUR, linestyle="--", label="step time"))
    fig.legend(handles=handles, loc="outside upper right", ncol=len(handles), fontsize=8, frameon=False)
    bar = fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=list(axes), pad=0.01, aspect=40)
    bar.set_label("shared: ring group size (ranks)")
    assert norm.vmin is not None and norm.vmax is not None  # `_group_norm` sets both
    powers = [2**i for i in range(int(np.log2(norm.vmax)) + 1) if norm.vmin <= 2**i <= norm.vmax]
    bar.ax.yaxis.set_major_locator(FixedLocator(powers))
    bar.ax.set_yticklabels([str(p) for p in powers])
    bar.ax.minorticks_off()
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=120)


def plot_throughput(
    contexts: list[int], throughput: dict[str, list[float]], path: str, title: str | None = None
) -> None:
    """Save tokens/s against context length (log2 axis), one line per strategy, as an image at path."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import EngFormatter

    if not contexts:
        raise ValueError("plot_throughput needs at least one context length")
    for strategy, values in throughput.items():
        if len(values) != len(contexts):
            raise ValueError(f"{strategy}: {len(values)} throughputs for {len(contexts)} context lengths")
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    for strategy, values in throughput.items():
        ax.plot(contexts, values, marker="o", label=strategy)
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts, [format_tokens(c) for c in contexts])
    ax.minorticks_off()
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("throughput (tokens/s)")
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_formatter(EngFormatter(sep=""))
    ax.grid(True, alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    fig.savefig(path, dpi=120)
