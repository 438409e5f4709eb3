"""Global-batch sequence-length samplers: the data the planner and simulator are run on.

Two synthetic datasets match the statistics the paper gives in §3.1 and §6 (constants below), and one
real corpus is made on the spot from the Python sources installed on this machine (byte-level tokens,
nothing downloaded).

Every sampler is an inverse CDF (``ppf``) drawn with *stratified* uniforms: one draw per stratum
[k/n, (k+1)/n) of n strata. A 32M-token Byted batch holds only ~2,600 sequences of which ~1.3 are
>= 2M tokens; i.i.d. draws would leave a quarter of the batches with none (and the §3.1 token shares would swing
by tens of points from step to step), while stratified draws keep every batch representative, as the
paper's "randomly sampled global batch" statistics are, and still vary with the seed.
"""

from __future__ import annotations

import functools
import os
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

K = 1024
M = 1024 * K

Ppf = Callable[[np.ndarray], np.ndarray]

DATASETS = ("byted", "github", "python")


# --- the target statistics -----------------------------------------------------------------------

# Byted (§3.1): "nearly 80% of the samples are 4K tokens or shorter, while only 0.05% of the samples
# can reach 2M tokens ... (>=2M) contribute 12.1% of the tokens ..., and 1% of the samples (>=128K)
# contribute 44.3%"; §6.2: "37% of the tokens in a global batch are longer than 256K".
BYTED_SAMPLES_LE_4K = 0.80
BYTED_SAMPLES_GE_128K = 0.01
BYTED_SAMPLES_GE_2M = 0.0005
BYTED_TOKENS_GE_128K = 0.443
BYTED_TOKENS_GE_256K = 0.37
BYTED_TOKENS_GE_2M = 0.121
BYTED_MAX = 4 * M

# GitHub (§3.1): "16.2% of its tokens come from sequences exceeding 128K"; §6.2: "only 9.8% of the
# tokens in a global batch are longer than 256K". The paper gives no sample fractions for GitHub; the
# three below are our assumptions ("a lower proportion of long sequences" than Byted), needed to fix
# the mixture's weights.
GITHUB_TOKENS_GT_128K = 0.162
GITHUB_TOKENS_GT_256K = 0.098
GITHUB_SAMPLES_LE_4K = 0.80  # assumed
GITHUB_SAMPLES_GE_128K = 0.003  # assumed
GITHUB_SAMPLES_GE_1M = 0.0001  # assumed
GITHUB_MAX = 2 * M

SHORTEST = 32  # shortest synthetic sequence (tokens)


# --- log-uniform mixtures ------------------------------------------------------------------------


@dataclass(frozen=True)
class Mixture:
    """Lengths log-uniform on each segment [edges[i], edges[i+1]) with probability weights[i].

    Segment edges sit on the thresholds of the statistics, so each statistic is linear in the weights
    and they can be solved for exactly (see ``solve``)."""

    edges: tuple[int, ...]
    weights: tuple[float, ...]

    @staticmethod
    def segment_means(edges: np.ndarray) -> np.ndarray:
        """Mean of a log-uniform law on [a, b): (b - a) / ln(b / a)."""
        a, b = edges[:-1], edges[1:]
        return (b - a) / np.log(b / a)

    @classmethod
    def solve(cls, edges: tuple[int, ...], samples_below: dict[int, float], tokens_from: dict[int, float]) -> Mixture:
        """Weights with P(L < x) = samples_below[x] and token share of L >= x = tokens_from[x].

        One equation per statistic plus sum(w) = 1; there must be as many as segments."""
        e = np.asarray(edges, dtype=np.float64)
        means = cls.segment_means(e)
        rows, rhs = [np.ones_like(means)], [1.0]
        for x, p in samples_below.items():
            rows.append((e[1:] <= x).astype(np.float64))
            rhs.append(p)
        for x, share in tokens_from.items():  # sum_{seg >= x} w m = share * sum w m
            rows.append((e[:-1] >= x) * means - share * means)
            rhs.append(0.0)
        weights = np.linalg.solve(np.array(rows), np.array(rhs))
        if (weights < 0).any():
            raise ValueError(f"statistics not reachable with segments {edges}: weights {weights}")
        return cls(edges, tuple(float(w) for w in weights))

    def ppf(self, u: np.ndarray) -> np.ndarray:
        """Inverse CDF: uniforms in [0, 1) to integer lengths."""
        cum = np.cumsum(self.weights)
        seg = np.minimum(np.searchsorted(cum, u, side="right"), len(self.weights) - 1)
        lo = np.concatenate(([0.0], cum[:-1]))[seg]
        within = np.clip((u - lo) / np.asarray(self.weights)[seg], 0.0, 1.0)
        log_e = np.log(np.asarray(self.edges, dtype=np.float64))
        x = np.exp(log_e[seg] + within * (log_e[seg + 1] - log_e[seg]))
        return np.minimum(x.astype(np.int64), np.asarray(self.edges)[seg + 1] - 1)


BYTED = Mixture.solve(
    edges=(SHORTEST, 4 * K, 32 * K, 128 * K, 256 * K, M, 2 * M, BYTED_MAX),
    samples_below={
        4 * K: BYTED_SAMPLES_LE_4K,
        128 * K: 1 - BYTED_SAMPLES_GE_128K,
        2 * M: 1 - BYTED_SAMPLES_GE_2M,
    },
    tokens_from={128 * K: BYTED_TOKENS_GE_128K, 256 * K: BYTED_TOKENS_GE_256K, 2 * M: BYTED_TOKENS_GE_2M},
)

GITHUB = Mixture.solve(
    edges=(SHORTEST, 4 * K, 32 * K, 128 * K, 256 * K, M, GITHUB_MAX),
    samples_below={
        4 * K: GITHUB_SAMPLES_LE_4K,
        128 * K: 1 - GITHUB_SAMPLES_GE_128K,
        M: 1 - GITHUB_SAMPLES_GE_1M,
    },
    tokens_from={128 * K: GITHUB_TOKENS_GT_128K, 256 * K: GITHUB_TOKENS_GT_256K},
)


# --- the real corpus: installed Python sources ---------------------------------------------------


def _source_roots() -> list[str]:
    """The stdlib and the interpreter's site-packages, each once."""
    paths = sysconfig.get_paths()
    roots = (paths["stdlib"], paths["purelib"], paths["platlib"])
    return list(dict.fromkeys(os.path.realpath(r) for r in roots if os.path.isdir(r)))


def _py_sizes(path: str, skip: frozenset[str]) -> Iterator[int]:
    """Byte sizes of the .py files under path (recursively), not entering directories named in skip."""
    with os.scandir(path) as it:
        for entry in it:
            if entry.is_dir(follow_symlinks=False) and entry.name not in skip:
                yield from _py_sizes(entry.path, skip)
            elif entry.name.endswith(".py") and entry.is_file(follow_symlinks=False):
                yield entry.stat(follow_symlinks=False).st_size


@functools.cache
def python_corpus_lengths(per: str = "package") -> np.ndarray:
    """Sorted byte lengths of the installed Python sources, one per file or per top-level package.

    per="package" concatenates every file of a top-level directory of the stdlib or site-packages (a
    top-level module file is its own package): repository-level concatenation gives the long tail.
    Empty files and packages are dropped (a sequence has at least one token). Read-only, cached."""
    if per not in ("file", "package"):
        raise ValueError(f"per must be 'file' or 'package', got {per!r}")
    roots = _source_roots()
    skip = frozenset({"__pycache__", "site-packages", "dist-packages"})
    lengths: list[int] = []
    for root in roots:
        with os.scandir(root) as it:
            for entry in it:
                if entry.is_dir(follow_symlinks=False) and entry.name not in skip:
                    sizes = list(_py_sizes(entry.path, skip))
                    lengths.extend(sizes if per == "file" else [sum(sizes)])
                elif entry.name.endswith(".py") and entry.is_file(follow_symlinks=False):
                    lengths.append(entry.stat(follow_symlinks=False).st_size)
    out = np.sort(np.array([n for n in lengths if n > 0], dtype=np.int64))
    if out.size == 0:
        raise RuntimeError(f"no Python sources found under {roots}")
    out.setflags(write=False)
    return out


def _empirical_ppf(sorted_lengths: np.ndarray) -> Ppf:
    """Inverse CDF of drawing uniformly, with replacement, from a sorted sample."""
    n = len(sorted_lengths)
    return lambda u: sorted_lengths[np.minimum((u * n).astype(np.int64), n - 1)]


# --- global batches ------------------------------------------------------------------------------


def _dataset_ppf(dataset: str) -> Ppf:
    if dataset == "byted":
        return BYTED.ppf
    if dataset == "github":
        return GITHUB.ppf
    if dataset == "python":
        return _empirical_ppf(python_corpus_lengths("package"))
    raise ValueError(f"unknown dataset {dataset!r}; choose one of {', '.join(DATASETS)}")


def _stratified(ppf: Ppf, n: int, rng: np.random.Generator) -> np.ndarray:
    """n lengths, one from each probability stratum [k/n, (k+1)/n), in random order."""
    u = (np.arange(n) + rng.random(n)) / n
    return rng.permutation(ppf(u))


@functools.lru_cache(maxsize=64)
def _mean_length(dataset: str, cap: int) -> float:
    """Mean capped length, from the inverse CDF at the midpoints of 2^16 strata."""
    grid = (np.arange(1 << 16) + 0.5) / (1 << 16)
    return float(np.minimum(_dataset_ppf(dataset)(grid), cap).mean())


def sample_global_batch(dataset: str, global_tokens: int, seed: int = 0, max_len: int | None = None) -> np.ndarray:
    """Sequence lengths (int64, each >= 1) of one global batch summing to exactly global_tokens.

    Lengths over max_len (the context length) are truncated to it, as training pipelines do; the last
    sequence is truncated so the batch holds exactly global_tokens. A first stratified block has the
    expected size; a short fall is topped up with further blocks rather than redrawn, since redrawing
    until the sum suffices would favour batches with large samples."""
    if global_tokens <= 0:
        raise ValueError(f"global_tokens must be positive, got {global_tokens}")
    if max_len is not None and max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    ppf = _dataset_ppf(dataset)
    cap = max_len if max_len is not None else int(np.iinfo(np.int64).max)
    mean = _mean_length(dataset, cap)
    rng = np.random.default_rng(seed)
    blocks, total = [], 0
    while total < global_tokens:
        n = max(1, round((global_tokens - total) / mean))
        blocks.append(np.minimum(_stratified(ppf, n, rng), cap))
        total += int(blocks[-1].sum())
    lengths = np.concatenate(blocks)
    cum = np.cumsum(lengths)
    last = int(np.searchsorted(cum, global_tokens))
    out = lengths[: last + 1].copy()
    out[-1] -= int(cum[last]) - global_tokens
    return out


def length_stats(lengths: np.ndarray) -> dict[str, float]:
    """The §3.1 statistics of a batch: sample fractions and token shares at the paper's thresholds."""
    x = np.asarray(lengths, dtype=np.int64)
    if x.size == 0:
        raise ValueError("length_stats of an empty batch")
    tokens = float(x.sum())

    def share(mask: np.ndarray) -> float:
        return float(x[mask].sum()) / tokens

    return {
        "n_samples": int(x.size),
        "tokens": int(tokens),
        "max": int(x.max()),
        "median": float(np.median(x)),
        "samples_le_4k": float((x <= 4 * K).mean()),
        "samples_ge_128k": float((x >= 128 * K).mean()),
        "tokens_ge_128k": share(x >= 128 * K),
        "samples_ge_2m": float((x >= 2 * M).mean()),
        "tokens_ge_2m": share(x >= 2 * M),
        "tokens_gt_128k": share(x > 128 * K),
        "tokens_gt_256k": share(x > 256 * K),
    }
