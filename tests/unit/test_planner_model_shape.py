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
