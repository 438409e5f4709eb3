"""Inputs of the model protocol and an eager-vs-optimized comparison used across the tests."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from bytescale_compile.engine.protocol import num_targets, packed_row


def rel_err(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-6) -> float:
    """max |a - b| / max(max |b|, floor) in fp64: relative where b has a scale, absolute below `floor`.

    Every numerical comparison of the suite goes through here. Where b can be 0 in exact arithmetic (the
    dq of a lone token, a window of one), pass the problem's scale as `floor`: b then holds only rounding
    noise, 1.7e-16 on one CPU and 9e-17 on another, and must not be divided by.
    """
    a, b = a.detach().double(), b.detach().double()
    if not b.numel():
        return 0.0
    diff, scale = (a - b).abs().max().item(), b.abs().max().item()
    return diff / max(scale, floor)


def protocol_batch(seq_lens: list[int], vocab: int, hf: bool = False, seed: int = 0) -> dict[str, Any]:
    """One row packing `seq_lens` random sequences (`packed_row`: restarting position_ids, -100 at each sequence's
    last token); each sequence is drawn one token longer than it is kept, as the suite's cases were written."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.randint(0, vocab, (n + 1,), generator=g)[:-1] for n in seq_lens])
    return packed_row(ids, seq_lens).kwargs(labels=hf)


def loss_and_grads(model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    for p in model.parameters():
        p.grad = None
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_matches_eager(
    optimized: nn.Module, eager: nn.Module, batch: dict[str, Any], tol: float = 1e-5, floor_of_largest: float = 0.0
) -> None:
    """Loss and every parameter gradient of `optimized` equal those of `eager` (a deep copy) to `tol`.

    A gradient smaller than `floor_of_largest` times the model's largest is compared against that floor:
    for a sum of cancelling terms far below the rest, which holds only their fp32 rounding.
    """
    loss, grads = loss_and_grads(optimized, batch)
    ref_loss, ref_grads = loss_and_grads(eager, batch)
    assert rel_err(loss, ref_loss) <= tol, (loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    floor = max(1e-6, floor_of_largest * max(g.abs().max().item() for g in ref_grads.values()))
    errors = {n: rel_err(grads[n], ref_grads[n], floor=floor) for n in grads}
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] <= tol, (worst, errors[worst])


def eager_copy(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def hf_llama(num_layers: int = 2) -> nn.Module:
    """A tiny random Hugging Face `LlamaForCausalLM` (nothing downloaded); skips without transformers."""
    import pytest

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(cfg)


def reference_step(
    model: nn.Module,
    batch: list[torch.Tensor],
    lr: float,
    hf: bool = False,
    max_grad_norm: float = 1.0,
    optimizer: torch.optim.Optimizer | None = None,
) -> tuple[float, dict[str, torch.Tensor]]:
    """Plain single-process step over every sequence of a global batch, token-level loss (Eq. 1), of `optimizer`
    over `model`'s parameters (default: SGD at `lr`)."""
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=lr)
    num_items = num_targets([len(s) for s in batch])
    total = torch.zeros(())
    for seq in batch:
        loss = model(**packed_row(seq, [len(seq)], num_items=num_items).kwargs(labels=hf)).loss
        loss.backward()
        total += loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return total.item(), {n: p.detach().clone() for n, p in model.named_parameters()}
