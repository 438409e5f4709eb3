"""The cost model's ModelShape read from tiny configs of every family, through their own field names."""

import pytest
import torch
from torch import nn

import bytescale_compile as bsc
from bytescale_compile.engine.runtime import default_cost_model
from bytescale_compile.models.llama import LlamaConfig, LlamaForCausalLM
from bytescale_compile.planner.model_shape import ModelConfigError, ModelShape, model_shape, shape_from_config

transformers = pytest.importorskip("transformers")

# config class, its own keyword arguments, expected (layers, hidden, heads, kv_heads, ffn, vocab, experts, top_k)
HF_CASES = {
    "gpt2 (n_inner None)": ("GPT2Config", dict(n_layer=2, n_embd=32, n_head=4, vocab_size=96), (2, 32, 4, 4, 128, 96)),
    "gpt2 (n_inner)": (
        "GPT2Config",
        dict(n_layer=3, n_embd=32, n_head=4, n_inner=80, vocab_size=96),
        (3, 32, 4, 4, 80, 96),
    ),
    "gpt-neox": (
        "GPTNeoXConfig",
        dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=72, vocab_size=96),
        (2, 32, 4, 4, 72, 96),
    ),
    "bloom": ("BloomConfig", dict(n_layer=2, hidden_size=32, n_head=4, vocab_size=96), (2, 32, 4, 4, 128, 96)),
    "opt": (
        "OPTConfig",
        dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, ffn_dim=56, vocab_size=96),
        (2, 32, 4, 4, 56, 96),
    ),
    "gpt-j": ("GPTJConfig", dict(n_layer=2, n_embd=32, n_head=4, rotary_dim=4, vocab_size=96), (2, 32, 4, 4, 128, 96)),
    "codegen": (
        "CodeGenConfig",
        dict(n_layer=2, n_embd=32, n_head=4, n_inner=48, rotary_dim=4, vocab_size=96),
        (2, 32, 4, 4, 48, 96),
    ),
    "gpt-neo": (
        "GPTNeoConfig",
        dict(num_layers=2, hidden_size=32, num_heads=4, vocab_size=96, attention_types=[[["global", "local"], 1]]),
        (2, 32, 4, 4, 128, 96),
    ),
    "falcon (multi-query)": (
        "FalconConfig",
        dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=96),
        (2, 32, 4, 1, 128, 96),
    ),
    "falcon (multi-head)": (
        "FalconConfig",
        dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, multi_query=False, vocab_size=96),
        (2, 32, 4, 4, 128, 96),
    ),
    "falcon (new architecture)": (
        "FalconConfig",
        dict(
            num_hidden_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            new_decoder_architecture=True,
            num_kv_heads=2,
            ffn_hidden_size=40,
            vocab_size=96,
        ),
        (2, 32, 4, 2, 40, 96),
    ),
    "llama": (
        "LlamaConfig",
        dict(
            num_hidden_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=88,
            vocab_size=96,
        ),
        (2, 32, 4, 2, 88, 96),
    ),
    "qwen2": (
        "Qwen2Config",
        dict(
            num_hidden_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=1,
            intermediate_size=64,
            vocab_size=96,
        ),
        (2, 32, 4, 1, 64, 96),
    ),
    "mixtral": (
        "MixtralConfig",
        dict(
            num_hidden_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=48,
            vocab_size=96,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
        (2, 32, 4, 2, 48, 96, 4, 2),
    ),
}


def expected_shape(name: str, numbers: tuple[int, ...]) -> ModelShape:
    return ModelShape(name, *numbers)


@pytest.mark.parametrize("case", list(HF_CASES))
def test_hf_config_shape(case):
    config_class, kwargs, numbers = HF_CASES[case]
    config = getattr(transformers, config_class)(**kwargs)
    assert shape_from_config(config, "Model") == expected_shape("Model", numbers)
    assert shape_from_config(config.to_dict(), "Model") == expected_shape("Model", numbers)


def test_shape_of_hf_model_behind_optimize():
    """The wrapper's config reads through; the shape and errors carry the model's class, not OptimizedModule's."""
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=96)
    optimized = bsc.optimize(transformers.GPT2LMHeadModel(config))
    assert model_shape(optimized) == expected_shape("GPT2LMHeadModel", (2, 32, 4, 4, 128, 96))
    assert default_cost_model(optimized).source == "analytic:GPT2LMHeadModel"


def test_shape_of_our_llama():
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=72, num_layers=3, num_heads=4, num_kv_heads=2)
    torch.manual_seed(0)
    model = bsc.optimize(LlamaForCausalLM(config))
    assert model_shape(model) == expected_shape("LlamaForCausalLM", (3, 32, 4, 2, 72, 64))


def test_missing_field_names_model_class_and_field():
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=96).to_dict()
    del config["n_layer"]
    with pytest.raises(ModelConfigError, match=r"GPT2LMHeadModel \(config dict\).*layers.*n_layer"):
        shape_from_config(config, "GPT2LMHeadModel")


def test_moe_without_experts_per_token_is_an_error():
    config = dict(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=48,
        vocab_size=96,
        num_local_experts=4,
    )
    with pytest.raises(ModelConfigError, match="experts per token.*num_experts_per_tok"):
        shape_from_config(config, "MyMoE")


def test_bad_value_names_the_field():
    config = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=0, vocab_size=96)
    with pytest.raises(ModelConfigError, match="intermediate_size.*is 0"):
        shape_from_config(config, "Tiny")


class NoConfig(nn.Module):
    def forward(self, x):
        return x


def test_model_without_config_names_its_class():
    with pytest.raises(ModelConfigError, match="NoConfig has no `config`"):
        default_cost_model(bsc.optimize(NoConfig()))


# --- MoE counts, by hand -------------------------------------------------------------------------------------

MIXTRAL = ModelShape("m", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=32000, experts=8, top_k=2)


def test_mixtral_parameters_are_the_published_46_7_billion():
    # per layer: q and o 4096^2 each, k and v 4096 x 1024 each; 8 experts x 3 x 4096 x 14336; router 4096 x 8;
    # two norms 4096. Embedding and lm_head 32000 x 4096 each, the final norm 4096.
    layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 8 * 3 * 4096 * 14336 + 4096 * 8 + 2 * 4096
    assert MIXTRAL.params == 32 * layer + 2 * 32000 * 4096 + 4096 == 46_702_792_704


@pytest.mark.parametrize("layout", ["ep", "tp"])
def test_experts_are_split_over_tp_in_either_layout_and_the_router_is_not(layout):
    # tp 8, pp 4: 8 layers on the largest stage; every matrix but the router over 8, one vocab-parallel end
    attention, experts = 2 * 4096 * 4096 + 2 * 4096 * 1024, 8 * 3 * 4096 * 14336
    layer = (attention + experts) // 8 + 4096 * 8 + 2 * 4096
    assert MIXTRAL.resolve_expert_layout(8, layout) == layout
    assert MIXTRAL.params_per_device(tp=8, pp=4) == 8 * layer + 32000 * 4096 // 8 + 4096
    # pp 1 holds both ends
    assert MIXTRAL.params_per_device(tp=8) == 32 * layer + 2 * 32000 * 4096 // 8 + 4096
    # the largest parameter: one layer's fused gate_up_proj [8, 2 x 14336, 4096] over 8
    assert MIXTRAL.largest_param_per_device(8) == 8 * 2 * 14336 * 4096 // 8


def test_flops_count_top_k_experts_and_the_shared_ones():
    attention = 2 * 4096 * 4096 + 2 * 4096 * 1024
    assert MIXTRAL.linear_flops_per_token == 2 * (attention + 2 * 3 * 4096 * 14336)
    shared = ModelShape(
        "d", layers=2, hidden=64, heads=4, kv_heads=4, ffn=32, vocab=100, experts=8, top_k=2, shared_ffn=64
    )
    assert shared.linear_flops_per_token == 2 * (4 * 64 * 64 + 3 * 64 * (2 * 32 + 64))
    assert shared.params == 2 * (4 * 64 * 64 + 8 * 3 * 64 * 32 + 3 * 64 * 64 + 64 * 8 + 2 * 64) + 2 * 100 * 64 + 64


def test_moe_activations_by_layout_by_hand():
    # bf16, tp 8: 5 hidden-wide tensors whole, q / 8, k and v one K/V head each (1024 / 8 = 128 wide),
    # 3 x 14336 x 2 SwiGLU intermediates / 8, the routed copies' inputs and outputs 2 x 2 x 4096 (/ 8 under ep),
    # the router's fp32 probabilities 8 x 4
    common = 2 * (5 * 4096 + 4096 / 8 + 2 * 128 + 3 * 14336 * 2 / 8)
    assert MIXTRAL.layer_act_bytes_per_token(8, "ep") == common + 2 * (2 * 2 * 4096 / 8) + 8 * 4
    assert MIXTRAL.layer_act_bytes_per_token(8, "tp") == common + 2 * (2 * 2 * 4096) + 8 * 4
    # tp 1: the whole layer, as the cost model's alpha2 charges it
    assert MIXTRAL.act_bytes_per_token == 2 * (6 * 4096 + 2 * 1024 + 3 * 14336 * 2 + 2 * 2 * 4096) + 8 * 4
    dense = ModelShape("l", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=11008, vocab=32000)
    assert dense.act_bytes_per_token == 2 * (6 * 4096 + 2 * 1024 + 3 * 11008)


@pytest.mark.parametrize(
    "tp, layout, match",
    [
        (16, "ep", "8 experts are not divisible by tp 16.*use the 'tp' expert layout"),
        (3, "auto", "tp 3 does not divide its 32 attention heads"),
        (2, "sideways", "expert layout must be auto, ep or tp"),
    ],
)
def test_layouts_that_cannot_split_are_refused_naming_the_fix(tp, layout, match):
    with pytest.raises(ValueError, match=match):
        MIXTRAL.resolve_expert_layout(tp, layout)


def test_auto_layout_is_ep_where_tp_divides_the_experts_else_tp():
    assert MIXTRAL.resolve_expert_layout(4) == "ep"
    assert MIXTRAL.resolve_expert_layout(16) == "tp"
    odd = ModelShape("o", layers=2, hidden=64, heads=16, kv_heads=16, ffn=24, vocab=10, experts=8, top_k=2)
    with pytest.raises(ValueError, match="width 24.*not divisible by tp 16.*'ep' expert layout"):
        odd.resolve_expert_layout(16)
    dense = ModelShape("l", layers=2, hidden=64, heads=4, kv_heads=4, ffn=24, vocab=10)
    assert dense.resolve_expert_layout(2) == "tp"
    with pytest.raises(ValueError, match="'ep' needs an MoE model"):
        dense.resolve_expert_layout(2, "ep")


def test_shared_experts_are_read_from_deepseek_and_qwen2_moe_configs():
    common = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100, intermediate_size=256)
    deepseek = dict(common, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=2)
    assert shape_from_config(deepseek, "D").shared_ffn == 2 * 32
    qwen2 = dict(
        common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=96
    )
    assert shape_from_config(qwen2, "Q").shared_ffn == 96
    assert shape_from_config(dict(deepseek, n_shared_experts=None), "D").shared_ffn == 0
    with pytest.raises(ModelConfigError, match="n_shared_experts.*is -1"):
        shape_from_config(dict(deepseek, n_shared_experts=-1), "D")
    with pytest.raises(ValueError, match="shared_ffn must be >= 0, and 0 without routed experts"):
        ModelShape("x", layers=2, hidden=64, heads=4, kv_heads=4, ffn=24, vocab=10, shared_ffn=8)
