"""Tiny Hugging Face MoE models with their router losses on, and the per-sequence training a Runtime step must equal.

The reference trains each sequence alone, with Hugging Face's own loss: `CE_mean_s + coef * LB_s`, weighted by
the sequence's share n_s / N of the global batch's targets (what its token-level cross-entropy weighs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

import bytescale_compile as bsc
from bytescale_compile.capture.routers import bias_routers, expert_bias
from bytescale_compile.engine.protocol import packed_row
from tests.hf_models import VOCAB, _common, build

AUX_COEF = 0.5


def qwen3_moe(seed: int = 0, aux_coef: float = AUX_COEF) -> nn.Module:
    """A 2-layer Qwen3-MoE (4 experts, top 2) that adds its load-balancing loss (`output_router_logits`)."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = tf.Qwen3MoeConfig(
        **_common(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
        output_router_logits=True,
        router_aux_loss_coef=aux_coef,
    )
    return tf.Qwen3MoeForCausalLM(config).float().train()


def deepseek_v3(seed: int = 0) -> nn.Module:
    """The matrix's 2-layer DeepSeek-V3: its second layer routes over 4 experts with an expert bias (no aux loss)."""
    return build("deepseek-v3", seed)


AUX_LOSS_ARCHS = ("qwen3-moe", "mixtral", "olmoe", "gpt-oss")
"""tests/hf_models.py's MoE causal LMs that add Hugging Face's load-balancing loss (DeepSeek-V3 has none: its
routers balance with an expert bias instead)."""


def moe_model(name: str, *, aux: bool, seed: int = 0) -> nn.Module:
    """tests/hf_models.py's MoE `name`, with its load-balancing loss on (coefficient AUX_COEF) or off."""
    if aux and name not in AUX_LOSS_ARCHS:
        raise ValueError(f"{name} has no load-balancing loss (those with one: {AUX_LOSS_ARCHS})")
    model = build(name, seed)
    model.config.output_router_logits = aux
    if aux:  # the causal LM copies the coefficient at construction
        model.config.router_aux_loss_coef = model.router_aux_loss_coef = AUX_COEF
    return model


@contextmanager
def routed_counts(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Per expert-bias router (DeepSeek-V3's), the tokens it routes to each expert over the calls made inside."""
    routers = bias_routers(model)
    counts = [torch.zeros_like(expert_bias(r)) for r in routers]

    def count(i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, out: tuple[torch.Tensor, ...]) -> None:
            counts[i] += torch.bincount(out[-1].reshape(-1), minlength=counts[i].numel()).to(counts[i].dtype)

        return hook

    handles = [r.register_forward_hook(count(i)) for i, r in enumerate(routers)]
    try:
        yield counts
    finally:
        for h in handles:
            h.remove()


def batch(lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


@dataclass(frozen=True)
class Step:
    """A step's loss, its load-balancing part (with its coefficient) and the updated weights."""

    loss: float
    aux_loss: float
    weights: dict[str, torch.Tensor]


def per_sequence_step(model: nn.Module, sequences: list[torch.Tensor], lr: float, max_grad_norm: float = 1.0) -> Step:
    """One SGD step of `model` trained on each sequence alone (its own forward, Hugging Face's loss), weighted by
    n_s / N."""
    total_items = sum(len(s) - 1 for s in sequences)
    coef = getattr(model.config, "router_aux_loss_coef", 0.0)
    loss_sum, aux_sum = 0.0, 0.0
    for seq in sequences:
        share = (len(seq) - 1) / total_items
        out = model(**packed_row(seq, [len(seq)]).kwargs(labels=True))
        (out.loss * share).backward()
        loss_sum += float(out.loss.detach()) * share
        aux = getattr(out, "aux_loss", None)  # None without the load-balancing loss
        aux_sum += float(aux.detach()) * coef * share if aux is not None else 0.0
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    torch.optim.SGD(model.parameters(), lr=lr).step()
    return Step(loss_sum, aux_sum, weights_of(model))


def runtime_step(
    model: nn.Module, sequences: list[torch.Tensor], strategy: str, capacity: int, lr: float, **runtime: Any
) -> tuple[bsc.StepStats, dict[str, torch.Tensor]]:
    """One Runtime step of `model` (trained in place): its stats and updated weights."""
    rt = bsc.Runtime(model, torch.optim.SGD(model.parameters(), lr=lr), strategy=strategy, capacity=capacity, **runtime)
    stats = rt.step(sequences)
    return stats, weights_of(model)


def weights_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def max_weight_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max(float((got[n] - want[n]).abs().max()) for n in want)
