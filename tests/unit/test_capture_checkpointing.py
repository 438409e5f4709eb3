"""Gradient checkpointing: the passes look inside checkpointed layers, and the backward recomputes our ops."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.utils.checkpoint

import bytescale_compile as bsc
from tests.helpers import assert_matches_eager, hf_llama, protocol_batch
from tests.hf_models import VOCAB
from tests.moe import qwen3_moe

CASES = [
    pytest.param(False, "none", id="non-reentrant"),
    pytest.param(True, "none", id="reentrant"),
    pytest.param(False, "inductor", marks=pytest.mark.slow, id="inductor"),
]
"""(`use_reentrant` of Hugging Face's gradient_checkpointing_kwargs, codegen): Dynamo captures both modes as one
higher-order op."""


def _checkpointed(num_layers: int = 2, reentrant: bool = False) -> torch.nn.Module:
    model = hf_llama(num_layers).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model


@pytest.mark.parametrize(("reentrant", "codegen"), CASES)
def test_checkpointed_llama_is_rewritten_per_layer_and_a_packed_row_equals_eager(reentrant, codegen):
    model = _checkpointed(reentrant=reentrant)
    eager = copy.deepcopy(model)
    optimized = bsc.optimize(model, codegen=codegen)
    assert_matches_eager(optimized, eager, protocol_batch([11, 3, 18], 128, hf=True))
    report = optimized.report
    assert report.mixer_layers() == [
        f"layer {i} (`model.layers.{i}.self_attn`): segments from position_ids restarts, "
        f"repeat-kv unwrapped: 2 kv heads, rewritten"
        for i in range(2)
    ]
    assert optimized.shard_blockers() == []
    graph = report.graphs[0]
    assert graph.graph_before.count("higher_order.tag_activation_checkpoint(") == 2
    assert graph.graph_after.count("torch.ops.bytescale.attention.default(") == 2  # one per checkpointed body
    assert "bytescale.attention.default(" in graph.backward_graph  # recomputed in the backward, rewritten
    assert all(a.bytes_per_token is not None for a in report.saved_activations)  # no T x T mask saved
    assert {a.layer for a in report.saved_activations if a.layer is not None} == {0, 1}  # layer inputs only


@pytest.mark.parametrize(
    "reentrant", [pytest.param(False, id="non-reentrant"), pytest.param(True, marks=pytest.mark.slow, id="reentrant")]
)
def test_checkpointed_moe_layers_recording_router_logits_are_compiled(reentrant):
    """Hugging Face records the router logits of an aux-loss MoE by a hook appending to a list made outside the
    checkpointed layer; compiled anyway, not run eagerly out of the passes' reach. The reference is the model
    without checkpointing: eager reentrant checkpointing records the logits under no_grad, so the aux loss does
    not reach the routers there, while Dynamo captures both modes as one region that gets the whole gradient."""
    eager = qwen3_moe()
    model = copy.deepcopy(eager)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    optimized = bsc.optimize(model, codegen="none")
    assert_matches_eager(optimized, eager, protocol_batch([11, 3, 18], VOCAB, hf=True))
    assert len(optimized.report.rewrites("attention")) == 2, optimized.report.mixer_layers()


def test_checkpointing_saves_less_than_without():
    sizes = {}
    for checkpointing in (False, True):
        model = _checkpointed() if checkpointing else hf_llama().train()
        report = bsc.explain(bsc.optimize(model, codegen="none", offload="off"), **protocol_batch([16], 128, hf=True))
        layers, _ = report.activation_bytes_per_token()
        sizes[checkpointing] = sum(layers.values())
    assert sizes[True] < sizes[False] / 4, sizes


def test_compile_layers_once_with_checkpointing_is_refused_by_name():
    with pytest.raises(ValueError, match="gradient_checkpointing_disable"):
        bsc.optimize(_checkpointed(), compile_layers_once=True)


class CheckpointedLoss(torch.nn.Module):
    """lm_head and cross-entropy inside one checkpointed region: the logits never leave it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(128, 32)
        self.head = torch.nn.Linear(32, 128, bias=False)

    def loss(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(h).float()
        return torch.nn.functional.cross_entropy(logits.view(-1, 128), labels.view(-1), reduction="sum")

    def forward(self, input_ids, position_ids, shift_labels, num_items_in_batch):
        h = self.embed(input_ids)
        loss = torch.utils.checkpoint.checkpoint(self.loss, h, shift_labels, use_reentrant=False)
        return SimpleNamespace(loss=loss / num_items_in_batch)


def test_loss_inside_a_checkpointed_region_is_fused():
    model = CheckpointedLoss()
    optimized = bsc.optimize(model, codegen="none")
    assert_matches_eager(optimized, copy.deepcopy(model), protocol_batch([9, 4], 128))
    assert [r.target for r in optimized.report.rewrites("fused_loss")] == ["bytescale.fused_linear_cross_entropy"]
    assert "bytescale.fused_linear_cross_entropy.default(" in optimized.report.graphs[0].backward_graph
