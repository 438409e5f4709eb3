"""Every attention site of 33 more Hugging Face architectures is accounted for.

Each layer's attention is either rewritten into `bytescale::attention` (with its sliding window, where the
model has one) or left alone with a reason that names what the model does (attention sinks, ALiBi, chunked
attention, a mask read from a buffer...); optimized == eager, loss and every gradient. Single process, tiny
configs from `tests/hf_models.py`; the architectures quickest to compile run by default, the rest are slow.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

import bytescale_compile as bsc
from tests.helpers import eager_copy, loss_and_grads, protocol_batch, rel_err
from tests.hf_models import BY_NAME, MORE_ARCHS, VOCAB, WINDOW, build


@dataclass(frozen=True)
class Site:
    """What the compile report must say about one layer's attention."""

    pattern: str | None = None
    """None: rewritten. Otherwise left alone, and the reason must contain this name of the pattern."""
    window: int | None = None
    """The sliding window a rewritten site must report; None: a rewritten site must report none."""


REWRITTEN = Site()
SLIDING = Site(window=WINDOW)


def left_alone(pattern: str) -> Site:
    return Site(pattern=pattern)


SITES: dict[str, tuple[Site, ...]] = {
    "gpt-oss": (left_alone("attention sinks"),) * 2,
    "bloom": (left_alone("ALiBi"),) * 2,
    "phimoe": (SLIDING, SLIDING),
    "ministral": (SLIDING, REWRITTEN),
    "exaone4": (SLIDING, REWRITTEN),
    "gpt-j": (REWRITTEN, REWRITTEN),
    "codegen": (REWRITTEN, REWRITTEN),
    "gpt-neo": (left_alone("buffer"),) * 2,
    "opt": (REWRITTEN, REWRITTEN),
    "falcon": (REWRITTEN, REWRITTEN),
    "gpt2": (REWRITTEN, REWRITTEN),
    "granite": (REWRITTEN, REWRITTEN),
    "cohere": (REWRITTEN, REWRITTEN),
    "stablelm": (REWRITTEN, REWRITTEN),
    "starcoder2": (SLIDING, SLIDING),
    "olmo2": (REWRITTEN, REWRITTEN),
    "phi": (REWRITTEN, REWRITTEN),
    "gemma": (REWRITTEN, REWRITTEN),
    "qwen3-moe": (REWRITTEN, REWRITTEN),
    "gpt-bigcode": (REWRITTEN, REWRITTEN),
    "cohere2": (SLIDING, REWRITTEN),
    "olmo3": (SLIDING, REWRITTEN),
    "smollm3": (REWRITTEN, REWRITTEN),
    "granite-moe": (REWRITTEN, REWRITTEN),
    "llama4": (left_alone("chunked"), REWRITTEN),
    "mpt": (left_alone("ALiBi"),) * 2,
    "persimmon": (REWRITTEN, REWRITTEN),
    "biogpt": (REWRITTEN, REWRITTEN),
    "xglm": (left_alone("layout"),) * 2,
    "glm4": (REWRITTEN, REWRITTEN),
    "nemotron": (REWRITTEN, REWRITTEN),
    "olmoe": (REWRITTEN, REWRITTEN),
    "deepseek-v2": (REWRITTEN, REWRITTEN),
}
DEFAULT = ("gpt-oss", "mpt", "gpt-neo", "llama4", "ministral", "biogpt")
"""One of each kind of site (sinks, ALiBi, a mask buffer, chunked, sliding, rewritten) at its quickest; the others
are @slow."""
NO_POSITION_IDS = ("bloom", "mpt")
"""ALiBi models: their forward takes no position_ids, so they are called without."""
ZERO_GRAD = 1e-6
"""A reference gradient below this fraction of the largest one is zero up to fp32 rounding."""


def test_every_new_architecture_has_its_sites_listed():
    assert set(SITES) == {a.name for a in MORE_ARCHS}
    assert all(len(SITES[a.name]) == a.layers for a in MORE_ARCHS)


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in DEFAULT else pytest.mark.slow) for n in SITES])
def test_each_attention_site_is_rewritten_or_left_alone_with_its_pattern_named(name):
    arch = BY_NAME[name]
    model = build(name)
    eager = eager_copy(model)
    optimized = bsc.optimize(model)
    _assert_matches_eager_seeded(optimized, eager, _batch(name))
    report = optimized.report
    assert len(report.rewrites("attention")) + len(report.skipped("attention")) == arch.layers
    lines = report.mixer_layers()
    assert len(lines) == arch.layers, lines
    for layer, (line, site) in enumerate(zip(lines, SITES[name])):
        assert line.startswith(f"layer {layer} "), lines
        _check_site(line, site)
    assert bool(optimized.shard_blockers()) == any(s.pattern for s in SITES[name])
    assert len(report.rewrites("fused_loss")) == int(arch.fused_loss), report.skipped("fused_loss")


def _check_site(line: str, site: Site) -> None:
    if site.pattern is not None:
        assert "left alone: " in line and site.pattern in line, f"expected left alone for {site.pattern!r}: {line}"
        return
    assert line.endswith("rewritten"), line
    assert re.findall(r"sliding window (\d+)", line) == ([str(site.window)] if site.window else []), line


def _batch(name: str) -> dict[str, Any]:
    batch = protocol_batch([21, 7, 30], VOCAB, hf=True)
    if name in NO_POSITION_IDS:
        del batch["position_ids"]
    return batch


def _assert_matches_eager_seeded(
    optimized: nn.Module, eager: nn.Module, batch: dict[str, Any], tol: float = 1e-5
) -> None:
    """Loss and every gradient of `optimized` equal eager's to `tol`, both run from one RNG state.

    One RNG state because PhiMoE samples its experts while training. A gradient that is zero in exact
    arithmetic — the key bias of a model without RoPE (OPT, XGLM, BioGPT), since softmax ignores a constant
    added to one query's scores — holds only fp32 rounding, so it is compared against the largest gradient.
    """
    torch.manual_seed(0)
    loss, grads = loss_and_grads(optimized, batch)
    torch.manual_seed(0)
    ref_loss, ref_grads = loss_and_grads(eager, batch)
    assert rel_err(loss, ref_loss) <= tol, (loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    scale = max(g.abs().max().item() for g in ref_grads.values())
    errors = {n: _grad_err(grads[n], ref, scale) for n, ref in ref_grads.items()}
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] <= tol, (worst, errors[worst])


def _grad_err(grad: torch.Tensor, ref: torch.Tensor, scale: float) -> float:
    """Relative to `ref`, or to the largest gradient `scale` where `ref` is zero in exact arithmetic."""
    zero_in_exact_arithmetic = ref.abs().max().item() <= ZERO_GRAD * scale
    return rel_err(grad, ref, floor=scale) if zero_in_exact_arithmetic else rel_err(grad, ref)
