"""Timeline dataclasses and the two figures (written as PNGs into tmp_path)."""

import numpy as np
import pytest

from bytescale_compile.sim.timeline import Span, Timeline, format_tokens, shown_ranks

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def fake_timeline(strategy: str, world_size: int, seed: int = 0) -> Timeline:
    """Rings of 2..world_size ranks, packed micro-batches, idle tails and a closing all-reduce."""
    rng = np.random.default_rng(seed)
    spans, t = [], 0.0
    group = world_size
    while group >= 2:  # shared micro-batches over halving groups, ranks 0..group-1
        dur = float(rng.uniform(0.5, 1.0)) * group / world_size
        spans += [
            Span(r, t, t + dur, len(spans), "shared", tokens=8192 * group, group_size=group) for r in range(group)
        ]
        t += dur
        group //= 2
    compute_end = []
    for r in range(world_size):  # packed micro-batches, unequal per rank
        start = t
        for mb in range(int(rng.integers(1, 4))):
            dur = float(rng.uniform(0.05, 0.3))
            spans.append(Span(r, start, start + dur, 100 + mb, "packed", tokens=8192))
            start += dur
        compute_end.append(start)
    done = max(compute_end)
    for r, end in enumerate(compute_end):
        if end < done:
            spans.append(Span(r, end, done, -1, "idle"))
        spans.append(Span(r, done, done + 0.1, -1, "allreduce"))
    return Timeline(strategy, world_size, spans)


def test_step_time_is_last_end():
    spans = [Span(0, 0.0, 1.5, 0, "packed"), Span(1, 0.2, 2.5, 0, "shared", group_size=2), Span(0, 1.5, 2.0, 1, "idle")]
    assert Timeline("naive", 2, spans).step_time == 2.5
    assert Timeline("static", 4, []).step_time == 0.0


def test_span_defaults_and_frozen():
    s = Span(3, 0.0, 1.0, 7, "packed")
    assert (s.tokens, s.group_size) == (0, 1)
    with pytest.raises(AttributeError):
        s.rank = 4  # type: ignore[misc]


def test_shown_ranks():
    assert list(shown_ranks(8, 64)) == list(range(8))
    sub = shown_ranks(1024, 64)
    assert len(sub) == 64 and sub[0] == 0 and sub[-1] == 1023 and np.all(np.diff(sub) > 0)


def test_format_tokens():
    assert [format_tokens(n) for n in (256 * 1024, 1 << 20, 2 << 20, 8192, 1000)] == ["256K", "1M", "2M", "8K", "1000"]


def _is_png(path) -> bool:
    data = path.read_bytes()
    return len(data) > 1000 and data.startswith(PNG_MAGIC)


def test_plot_timelines_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    from bytescale_compile.sim.timeline import plot_timelines

    path = tmp_path / "timelines.png"
    timelines = [fake_timeline(s, 16, seed=i) for i, s in enumerate(("static", "naive", "balance"))]
    plot_timelines(timelines, str(path), title="case study")
    assert _is_png(path)


def test_plot_timelines_rank_subset(tmp_path):
    pytest.importorskip("matplotlib")
    from bytescale_compile.sim.timeline import plot_timelines

    path = tmp_path / "subset.png"
    plot_timelines([fake_timeline("balance", 256), Timeline("empty", 4, [])], str(path), max_ranks=32)
    assert _is_png(path)
    with pytest.raises(ValueError):
        plot_timelines([], str(path))


def test_plot_throughput_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    from bytescale_compile.sim.timeline import plot_throughput

    path = tmp_path / "throughput.png"
    contexts = [256 << 10, 512 << 10, 1 << 20, 2 << 20]
    plot_throughput(
        contexts, {"static": [8e5, 4e5, 2e5, 1e5], "balance": [9e5, 8.3e5, 7.7e5, 7.1e5]}, str(path), title="GitHub"
    )
    assert _is_png(path)
    with pytest.raises(ValueError, match="static"):
        plot_throughput(contexts, {"static": [1.0]}, str(path))
