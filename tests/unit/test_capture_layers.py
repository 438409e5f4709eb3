"""`CompileConfig(compile_layers_once=True)`: one traced body for the repeated layers, our passes inside it, eager numerics."""

from __future__ import annotations

import copy

import pytest
import torch

import bytescale_compile as bsc
from bytescale_compile.capture.layers import repeated_layers
from bytescale_compile.models.llama import LlamaConfig, LlamaForCausalLM, tiny
from tests import hf_models
from tests.helpers import assert_matches_eager, hf_llama, protocol_batch

SEQ_LENS = [5, 9, 3]


def _optimized(model: torch.nn.Module, codegen: str = "none", **overrides) -> bsc.OptimizedModule:
    return bsc.optimize(model, codegen=codegen, compile_layers_once=True, **overrides)


def _body_count(optimized: bsc.OptimizedModule) -> int:
    """invoke_subgraph calls in the latest graph after our passes (its text is kept in the report)."""
    return sum(g.graph_after.count("torch.ops.higher_order.invoke_subgraph(") for g in optimized.report.graphs)


CODEGENS = ["none", pytest.param("inductor", marks=pytest.mark.slow)]


@pytest.mark.parametrize("codegen", CODEGENS)
def test_our_llama_matches_eager_with_one_body(codegen):
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4, num_kv_heads=2)
    )
    eager = copy.deepcopy(model)
    optimized = _optimized(model, codegen)
    assert_matches_eager(optimized, eager, protocol_batch(SEQ_LENS, 128))
    report = optimized.report
    assert _body_count(optimized) == 3
    assert optimized.report.graphs[0].graph_after.count("torch.ops.bytescale.attention.default(") == 1  # in the body
    assert [line.split(":")[0] for line in report.mixer_layers()] == [
        f"layer {i} (`layers.{i}.self_attn`)" for i in range(3)
    ]
    assert optimized.shard_blockers() == []


@pytest.mark.parametrize("codegen", CODEGENS)
def test_hf_llama_mask_proved_through_the_body_input(codegen):
    model = hf_llama(num_layers=3).train()
    eager = copy.deepcopy(model)
    optimized = _optimized(model, codegen)
    assert_matches_eager(optimized, eager, protocol_batch(SEQ_LENS, 128, hf=True))
    lines = optimized.report.mixer_layers()
    assert len(lines) == 3 and all(
        "segments from position_ids restarts" in line and "rewritten" in line for line in lines
    )
    assert optimized.shard_blockers() == []
    assert "attention_mask: " not in optimized.report.graphs[0].graph_after  # the proved mask left the body's inputs


@pytest.mark.parametrize("codegen", CODEGENS)
def test_qwen2_matches_eager(codegen):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            use_cache=False,
        )
    ).train()
    eager = copy.deepcopy(model)
    optimized = _optimized(model, codegen)
    assert_matches_eager(optimized, eager, protocol_batch(SEQ_LENS, 128, hf=True))
    assert len(optimized.report.rewrites("attention")) == 3
    assert optimized.shard_blockers() == []


def test_layers_with_different_masks_are_left_alone_and_block_sharding():
    """Qwen2 with sliding layers past max_window_layers hands the one body two masks: no proof, a named blocker."""
    model = hf_models.build("qwen2-sliding")
    eager = copy.deepcopy(model)
    optimized = _optimized(model)
    assert_matches_eager(optimized, eager, protocol_batch(SEQ_LENS, hf_models.VOCAB, hf=True))
    blockers = optimized.shard_blockers()
    assert len(blockers) == 2 and all("not one tensor passed to every layer" in b for b in blockers)


def test_offload_is_off_for_graphs_with_a_shared_body_and_says_why():
    model = tiny()
    optimized = _optimized(model, offload=0.5)
    optimized(**protocol_batch(SEQ_LENS, 128)).loss.backward()
    offload = optimized.report.pass_results("offload")
    assert offload and all("compile_layers_once" in (p.disabled or "") for p in offload)


def test_repeated_layers_found_by_structure_and_original_class_untouched():
    model = hf_llama(num_layers=2)
    cls = type(model.model.layers[0])
    path, layers = repeated_layers(model)
    assert path == "model.layers" and layers is model.model.layers
    _optimized(model)
    assert isinstance(model.model.layers[0], cls) and type(model.model.layers[0]) is not cls
    assert type(hf_llama(num_layers=2).model.layers[0]) is cls
    assert repeated_layers(model)[0] == "model.layers"  # marking twice finds the same list
    moe = torch.nn.Module()
    moe.layers = torch.nn.ModuleList(
        torch.nn.ModuleDict({"experts": torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(4))}) for _ in range(2)
    )
    assert repeated_layers(moe)[0] == "layers"  # not the longer list of a layer's experts
    assert repeated_layers(torch.nn.Sequential(torch.nn.Linear(2, 2))) is None
