"""A region the passes do not look into (a higher-order op with a body of its own) blocks packing and sharding."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import bytescale_compile as bsc
from tests.helpers import assert_matches_eager, protocol_batch

VOCAB, HIDDEN = 32, 16


class CumsumFunction(torch.autograd.Function):
    """A custom kernel over the tokens: Dynamo captures it as `autograd_function_apply` with bodies of its own."""

    @staticmethod
    def forward(ctx, x):
        return x.cumsum(1)

    @staticmethod
    def backward(ctx, grad):
        return grad.flip(1).cumsum(1).flip(1)


class Mixer(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.kind == "function":
            return self.proj(CumsumFunction.apply(h))
        q = self.proj(h).view(h.shape[0], h.shape[1], 2, HIDDEN // 2).transpose(1, 2)

        def attend(q: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, q, q, is_causal=True)

        if self.kind == "nested":  # the passes look into a checkpointed region, not into one nested in it

            def outer(q: torch.Tensor) -> torch.Tensor:
                return checkpoint(attend, q, use_reentrant=False) * 2

            out = checkpoint(outer, q, use_reentrant=False)
        else:
            out = torch.cond(h.shape[1] > 4, attend, attend, (q,))
        return out.transpose(1, 2).reshape(h.shape)


class Tiny(nn.Module):
    """One layer whose token mixer sits in a region the passes do not see: a custom Function, `torch.cond`, or a
    checkpointed region nested in another."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList([Mixer(kind)])
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids, position_ids, shift_labels, num_items_in_batch):
        h = self.embed(input_ids)
        for layer in self.layers:
            h = h + layer(h)
        logits = self.head(h)
        loss = F.cross_entropy(logits.view(-1, VOCAB), shift_labels.view(-1), reduction="sum") / num_items_in_batch
        return SimpleNamespace(loss=loss)


@pytest.mark.parametrize(
    ("kind", "hop", "hidden"),
    [
        ("function", "autograd_function_apply", "a token mixer: cumulative op over tokens (cumsum)"),
        ("cond", "cond", "attention (`scaled_dot_product_attention`)"),
        ("nested", "tag_activation_checkpoint", "attention (`scaled_dot_product_attention`)"),
    ],
)
def test_hidden_mixer_is_reported_per_layer_and_blocks_sharding_and_packing(kind, hop, hidden):
    model = Tiny(kind)
    optimized = bsc.optimize(model, codegen="none")
    one_sequence = protocol_batch([12], VOCAB)
    if kind == "function":  # still trains as eager on one sequence
        assert_matches_eager(optimized, copy.deepcopy(model), one_sequence)
    else:
        optimized.compile_and_run(**one_sequence)
    blockers = optimized.shard_blockers()
    assert blockers and all(b.startswith("`layers.0`: ") and f"inside `{hop}`" in b and hidden in b for b in blockers)
    assert any(line.startswith("layer 0 (`layers.0`): left alone: ") for line in optimized.report.mixer_layers())
    with pytest.raises(bsc.ShardingError, match=f"`layers.0` .*inside `{hop}`"):
        optimized(**protocol_batch([5, 7], VOCAB))


def test_weight_gradients_in_a_custom_backward_do_not_count():
    """A custom Function's backward contracts the tokens for its weight gradient: only forward bodies are searched."""

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x * w

        @staticmethod
        def backward(ctx, grad):
            x, w = ctx.saved_tensors
            return grad * w, torch.einsum("btd,btd->d", grad, x)

    class ScaledEmbedding(Tiny):
        def __init__(self) -> None:
            super().__init__("function")
            self.layers = nn.ModuleList()
            self.w = nn.Parameter(torch.ones(HIDDEN))

        def forward(self, input_ids, position_ids, shift_labels, num_items_in_batch):
            h = Scale.apply(self.embed(input_ids), self.w)
            loss = F.cross_entropy(self.head(h).view(-1, VOCAB), shift_labels.view(-1), reduction="sum")
            return SimpleNamespace(loss=loss / num_items_in_batch)

    model = ScaledEmbedding()
    optimized = bsc.optimize(model, codegen="none")
    assert_matches_eager(optimized, copy.deepcopy(model), protocol_batch([5, 7], VOCAB))
    assert optimized.shard_blockers() == []


def _run_layers(layers: nn.ModuleList, h: torch.Tensor) -> torch.Tensor:
    """A graph break in a loop makes Dynamo skip this frame: torch's checkpoint, which Dynamo never traces
    itself, then runs each layer eagerly."""
    for layer in layers:
        torch._dynamo.graph_break()
        h = h + checkpoint(layer, h, use_reentrant=False)
    return h


def test_checkpointed_layers_run_outside_the_graphs_block_sharding():
    """Hugging Face's flag says which layers are checkpointed; those no compiled graph holds ran eagerly, their
    attention out of the passes' reach (silently wrong on a shared sequence), and are named as a blocker."""

    class Skipped(Tiny):
        def __init__(self) -> None:
            super().__init__("cond")
            self.layers = nn.ModuleList([Mixer("cond"), Mixer("cond")])
            for layer in self.layers:
                layer.gradient_checkpointing = True

        def forward(self, input_ids, position_ids, shift_labels, num_items_in_batch):
            logits = self.head(_run_layers(self.layers, self.embed(input_ids)))
            loss = F.cross_entropy(logits.view(-1, VOCAB), shift_labels.view(-1), reduction="sum")
            return SimpleNamespace(loss=loss / num_items_in_batch)

    optimized = bsc.optimize(Skipped(), codegen="none")
    optimized.compile_and_run(**protocol_batch([12], VOCAB))
    (blocker,) = optimized.shard_blockers()
    assert blocker.startswith("2 of 2 checkpointed layers ran outside the compiled graphs (graph breaks: ")
    assert "Outside the compiled graphs" in optimized.report.to_markdown()
