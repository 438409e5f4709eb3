"""Pipeline stages cut at decoder-layer boundaries: run in sequence (eager or optimized) they equal the full model,
and each parameter belongs to exactly one stage."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

import bytescale_compile as bsc
from bytescale_compile.engine.stages import StageSpec, UnsupportedModelError, split_stages, stage_inputs, stage_specs
from bytescale_compile.models.llama import LlamaConfig, LlamaForCausalLM
from tests.helpers import hf_llama, protocol_batch, rel_err
from tests.hf_models import VOCAB, build

SEQ_LENS = [21, 7, 30]


def ours(num_layers: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=num_layers, num_heads=4, num_kv_heads=2
        )
    )


MODELS = {"ours": (ours, False), "hf-llama": (lambda: hf_llama(4).train(), True)}


def run_pipeline(stages: list[nn.Module], batch: dict) -> torch.Tensor:
    """Forward stage by stage, each on a detached copy of the previous output; backward from the loss, each
    stage's output receiving the gradient of the next stage's input (what the pipeline executor does)."""
    outputs, inputs, hidden = [], [], None
    for stage in stages:
        if hidden is not None:
            hidden = hidden.detach().requires_grad_()
            inputs.append(hidden)
        hidden = stage(**stage_inputs(stage.spec, batch, hidden))
        outputs.append(hidden)
    loss = outputs[-1].loss
    loss.backward()
    for out, next_input in zip(reversed(outputs[:-1]), reversed(inputs)):
        torch.autograd.backward(out, next_input.grad)
    return loss.detach()


def assert_stages_match_model(model: nn.Module, stages: list[nn.Module], reference: nn.Module, batch: dict) -> None:
    """Loss and every gradient of `model`'s parameters (run through `stages`) equal `reference`'s, run whole."""
    torch.manual_seed(1)
    loss = run_pipeline(stages, batch)
    torch.manual_seed(1)
    ref_loss = reference(**batch).loss
    ref_loss.backward()
    assert rel_err(loss, ref_loss) <= 1e-5, (loss, ref_loss)
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert rel_err(p.grad, ref_params[name].grad) <= 1e-5, name


@pytest.mark.parametrize(
    ("layers", "pp", "sizes"), [(4, 1, [4]), (4, 2, [2, 2]), (5, 2, [3, 2]), (7, 3, [3, 2, 2]), (4, 4, [1, 1, 1, 1])]
)
def test_layers_split_evenly_and_contiguously_earlier_stages_take_the_extra(layers, pp, sizes):
    specs = stage_specs(layers, pp)
    assert [len(s.layers) for s in specs] == sizes
    assert [i for s in specs for i in s.layers] == list(range(layers))
    assert [s.is_first for s in specs] == [True] + [False] * (pp - 1)
    assert [s.is_last for s in specs] == [False] * (pp - 1) + [True]


@pytest.mark.parametrize("pp", [5, 9])
def test_more_stages_than_layers_is_an_error_naming_both(pp):
    with pytest.raises(ValueError, match=f"pp_size {pp} .* 4 decoder layers"):
        split_stages(ours(4), pp)


@pytest.mark.parametrize("pp", [0, -1])
def test_fewer_than_one_stage_is_an_error(pp):
    with pytest.raises(ValueError, match=f"at least 1, got {pp}"):
        split_stages(ours(4), pp)


def test_one_stage_is_the_model_itself():
    model = ours(2)
    assert split_stages(model, 1) == [model]
    batch = protocol_batch(SEQ_LENS, VOCAB)
    assert stage_inputs(StageSpec(0, 1, range(2)), batch) == batch


def test_stage_inputs_follow_the_stage_protocol():
    batch = protocol_batch(SEQ_LENS, VOCAB, hf=True)
    hidden = torch.zeros(1, sum(SEQ_LENS), 8)
    first, middle, last = stage_specs(3, 3)
    assert stage_inputs(first, batch).keys() == {"input_ids", "position_ids"}
    assert stage_inputs(middle, batch, hidden).keys() == {"hidden_states", "position_ids"}
    assert stage_inputs(last, batch, hidden).keys() == {
        "hidden_states",
        "position_ids",
        "shift_labels",
        "num_items_in_batch",
        "labels",
    }
    with pytest.raises(ValueError, match="hidden_states"):
        stage_inputs(middle, batch)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("pp", [2, 4])
def test_stages_own_disjoint_parameters_covering_the_model(name, pp):
    factory, _ = MODELS[name]
    model = factory()
    stages = split_stages(model, pp)
    owned = [{id(p) for p in s.parameters()} for s in stages]
    assert sum(len(o) for o in owned) == len(set().union(*owned))
    assert set().union(*owned) == {id(p) for p in model.parameters()}
    embedding = (model.model if hasattr(model, "model") else model).embed_tokens.weight
    head = model.lm_head.weight
    assert [id(embedding) in o for o in owned] == [True] + [False] * (pp - 1)
    assert [id(head) in o for o in owned] == [False] * (pp - 1) + [True]
    assert [s.spec.layers for s in stages] == [s.layers for s in stage_specs(4, pp)]


@pytest.mark.parametrize("name", MODELS)
def test_a_rank_keeping_its_stage_frees_the_other_stages_parameters(name):
    model = MODELS[name][0]()
    stages = split_stages(model, 2)
    kept, others = stages[0], [weakref.ref(p) for p in stages[1].parameters()]
    del model, stages
    gc.collect()
    assert [r for r in others if r() is not None] == []
    assert kept(**stage_inputs(kept.spec, protocol_batch(SEQ_LENS, VOCAB))).shape == (1, sum(SEQ_LENS), 64)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("pp", [2, 4])
def test_eager_stages_in_sequence_equal_the_model(name, pp):
    factory, hf = MODELS[name]
    model = factory()
    reference = copy.deepcopy(model)
    assert_stages_match_model(model, split_stages(model, pp), reference, protocol_batch(SEQ_LENS, VOCAB, hf=hf))


@pytest.mark.parametrize(
    ("name", "pp"),
    [
        pytest.param("ours", 2, marks=pytest.mark.slow),
        ("ours", 4),
        ("hf-llama", 2),
        pytest.param("hf-llama", 4, marks=pytest.mark.slow),
    ],
)
def test_optimized_stages_equal_the_model_and_rewrite_every_attention(name, pp):
    factory, hf = MODELS[name]
    model = factory()
    reference = copy.deepcopy(model)
    stages = [bsc.optimize(s) for s in split_stages(model, pp)]
    assert_stages_match_model(model, stages, reference, protocol_batch(SEQ_LENS, VOCAB, hf=hf))
    for stage in stages:
        report = stage.report
        assert report.skipped("attention") == []
        assert len(report.rewrites("attention")) == len(stage.spec.layers)
        assert len(report.rewrites("fused_loss")) == int(stage.spec.is_last), report.skipped("fused_loss")
        assert stage.shard_blockers() == []


@pytest.mark.parametrize("name", ["qwen2-sliding", "granite"])
def test_per_layer_windows_and_embedding_scales_survive_the_cut(name):
    # qwen2-sliding: layer 0 full, layer 1 sliding (looked up by position in the stage); granite multiplies
    # inputs_embeds in its forward, which a stage after the first must not do again
    model = build(name)
    reference = copy.deepcopy(model)
    assert_stages_match_model(model, split_stages(model, 2), reference, protocol_batch(SEQ_LENS, VOCAB, hf=True))


def test_a_model_without_decoder_layers_in_model_layers_is_named():
    with pytest.raises(UnsupportedModelError, match=r"GPT2LMHeadModel has no .model.layers ModuleList"):
        split_stages(build("gpt2"), 2)


def test_a_model_missing_the_llama_layout_is_named():
    with pytest.raises(UnsupportedModelError, match=r"Sequential has no .embed_tokens, .rotary, .layers"):
        split_stages(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), 2)


def test_a_change_to_inputs_embeds_that_a_later_stage_would_repeat_is_refused():
    model = hf_llama(2)

    class DoublingModel(type(model.model)):
        def forward(self, inputs_embeds=None, **kwargs):
            return super().forward(inputs_embeds=None if inputs_embeds is None else 2 * inputs_embeds, **kwargs)

    model.model.__class__ = DoublingModel
    with pytest.raises(UnsupportedModelError, match="changes inputs_embeds before its first decoder layer"):
        split_stages(model, 2)


def test_tied_embeddings_are_refused_rather_than_owned_twice():
    with pytest.raises(UnsupportedModelError, match=r"embed_tokens.weight = lm_head.weight is shared by stages 0 and"):
        split_stages(build("gemma"), 2)


def test_an_optimized_model_or_a_stage_is_refused():
    with pytest.raises(TypeError, match="split it first, then optimize"):
        split_stages(bsc.optimize(ours(2)), 2)
    with pytest.raises(TypeError, match="got stage 1 of 2"):
        split_stages(split_stages(hf_llama(4), 2)[1], 2)
