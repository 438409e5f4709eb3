"""Tiny random Hugging Face causal LMs of the architectures users train, built from configs (nothing downloaded).

Each factory returns a model with 2 decoder layers, vocab 128 and hidden 64, in training mode, seeded, so
the suite can compare them against themselves eagerly and across ranks. Windows are small (8 tokens) where
the architecture has them, so sequences of a few dozen tokens cross them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

VOCAB = 128
WINDOW = 8


@dataclass(frozen=True)
class Arch:
    """An architecture of the matrix: how to build it and what its compile report must show."""

    name: str
    build: Callable[[Any], nn.Module]
    layers: int = 2
    fused_loss: bool = True
    """Whether the loss pass fuses lm_head + cross-entropy for it."""


def _common(**overrides: Any) -> dict[str, Any]:
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        use_cache=False,
        pad_token_id=0,
    )
    base.update(overrides)
    return base


ARCHS = [
    Arch("llama", lambda tf: tf.LlamaForCausalLM(tf.LlamaConfig(**_common()))),
    Arch(
        "qwen2-sliding",
        lambda tf: tf.Qwen2ForCausalLM(
            tf.Qwen2Config(**_common(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1))
        ),
    ),
    Arch("qwen3", lambda tf: tf.Qwen3ForCausalLM(tf.Qwen3Config(**_common(head_dim=16)))),
    Arch("mistral", lambda tf: tf.MistralForCausalLM(tf.MistralConfig(**_common()))),
    Arch(
        "mixtral",
        lambda tf: tf.MixtralForCausalLM(tf.MixtralConfig(**_common(num_local_experts=4, num_experts_per_tok=2))),
    ),
    Arch("gemma2", lambda tf: tf.Gemma2ForCausalLM(tf.Gemma2Config(**_common(head_dim=16, sliding_window=WINDOW)))),
    Arch(
        "gemma3",
        lambda tf: tf.Gemma3ForCausalLM(
            tf.Gemma3TextConfig(
                **_common(head_dim=16, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
            )
        ),
    ),
    Arch("phi3", lambda tf: tf.Phi3ForCausalLM(tf.Phi3Config(**_common(sliding_window=WINDOW)))),
    Arch(
        "deepseek-v3",
        lambda tf: tf.DeepseekV3ForCausalLM(
            tf.DeepseekV3Config(
                **_common(
                    num_key_value_heads=4,
                    kv_lora_rank=16,
                    q_lora_rank=16,
                    qk_rope_head_dim=8,
                    qk_nope_head_dim=8,
                    v_head_dim=12,
                    n_routed_experts=4,
                    num_experts_per_tok=2,
                    moe_intermediate_size=32,
                    first_k_dense_replace=1,
                    n_group=1,
                    topk_group=1,
                )
            )
        ),
    ),
    Arch(
        "gpt-neox",
        lambda tf: tf.GPTNeoXForCausalLM(
            tf.GPTNeoXConfig(
                vocab_size=VOCAB,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=512,
                use_cache=False,
            )
        ),
    ),
]
BY_NAME = {a.name: a for a in ARCHS}


def build(name: str, seed: int = 0) -> nn.Module:
    """The architecture's tiny model, seeded, in training mode; skips the test without transformers."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    model = BY_NAME[name].build(transformers)
    return model.train()


# More architectures, each attention site either rewritten or left alone with a named reason
# (tests/unit/test_passes_attention_sites.py). Dropout is off where a config defaults it on (GPT-2, GPT-BigCode, OPT,
# BioGPT, XGLM) so that optimized and eager runs compare exactly.
def _gpt_style(**overrides: Any) -> dict[str, Any]:
    """GPT-2-lineage configs name their sizes n_embd / n_layer / n_head."""
    base = dict(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=512,
        use_cache=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    base.update(overrides)
    return base


_SLIDING_THEN_FULL = ["sliding_attention", "full_attention"]

MORE_ARCHS = [
    Arch(
        "gpt-oss",
        lambda tf: tf.GptOssForCausalLM(
            tf.GptOssConfig(
                **_common(
                    head_dim=16,
                    num_local_experts=4,
                    num_experts_per_tok=2,
                    sliding_window=WINDOW,
                    layer_types=_SLIDING_THEN_FULL,
                )
            )
        ),
    ),
    Arch(
        "bloom",
        lambda tf: tf.BloomForCausalLM(
            tf.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4, use_cache=False)
        ),
    ),
    Arch(
        "phimoe",
        lambda tf: tf.PhimoeForCausalLM(
            tf.PhimoeConfig(**_common(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW))
        ),
    ),
    Arch(
        "ministral",
        lambda tf: tf.MinistralForCausalLM(
            tf.MinistralConfig(**_common(head_dim=16, sliding_window=WINDOW, layer_types=_SLIDING_THEN_FULL))
        ),
    ),
    Arch(
        "exaone4",
        lambda tf: tf.Exaone4ForCausalLM(
            tf.Exaone4Config(**_common(sliding_window=WINDOW, layer_types=_SLIDING_THEN_FULL))
        ),
    ),
    Arch("gpt-j", lambda tf: tf.GPTJForCausalLM(tf.GPTJConfig(**_gpt_style(rotary_dim=8)))),
    Arch("codegen", lambda tf: tf.CodeGenForCausalLM(tf.CodeGenConfig(**_gpt_style(rotary_dim=8, n_ctx=512)))),
    Arch(
        "gpt-neo",
        lambda tf: tf.GPTNeoForCausalLM(
            tf.GPTNeoConfig(
                vocab_size=VOCAB,
                hidden_size=64,
                num_layers=2,
                num_heads=4,
                intermediate_size=128,
                attention_types=[[["global", "local"], 1]],
                window_size=WINDOW,
                max_position_embeddings=512,
                use_cache=False,
            )
        ),
    ),
    Arch(
        "opt",
        lambda tf: tf.OPTForCausalLM(
            tf.OPTConfig(
                vocab_size=VOCAB,
                hidden_size=64,
                word_embed_proj_dim=64,
                num_hidden_layers=2,
                ffn_dim=128,
                num_attention_heads=4,
                max_position_embeddings=512,
                dropout=0.0,
                use_cache=False,
            )
        ),
    ),
    Arch(
        "falcon",
        lambda tf: tf.FalconForCausalLM(
            tf.FalconConfig(
                vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, use_cache=False
            )
        ),
    ),
    Arch("gpt2", lambda tf: tf.GPT2LMHeadModel(tf.GPT2Config(**_gpt_style()))),
    Arch(
        "granite",
        lambda tf: tf.GraniteForCausalLM(
            tf.GraniteConfig(
                **_common(
                    attention_multiplier=0.5, embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=2.0
                )
            )
        ),
    ),
    Arch("cohere", lambda tf: tf.CohereForCausalLM(tf.CohereConfig(**_common(logit_scale=0.5)))),
    Arch("stablelm", lambda tf: tf.StableLmForCausalLM(tf.StableLmConfig(**_common()))),
    Arch("starcoder2", lambda tf: tf.Starcoder2ForCausalLM(tf.Starcoder2Config(**_common(sliding_window=WINDOW)))),
    Arch("olmo2", lambda tf: tf.Olmo2ForCausalLM(tf.Olmo2Config(**_common()))),
    Arch("phi", lambda tf: tf.PhiForCausalLM(tf.PhiConfig(**_common()))),
    Arch("gemma", lambda tf: tf.GemmaForCausalLM(tf.GemmaConfig(**_common(head_dim=16)))),
    Arch(
        "qwen3-moe",
        lambda tf: tf.Qwen3MoeForCausalLM(
            tf.Qwen3MoeConfig(**_common(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32))
        ),
    ),
    Arch("gpt-bigcode", lambda tf: tf.GPTBigCodeForCausalLM(tf.GPTBigCodeConfig(**_gpt_style(multi_query=True)))),
    Arch(
        "cohere2",
        lambda tf: tf.Cohere2ForCausalLM(
            tf.Cohere2Config(**_common(sliding_window=WINDOW, layer_types=_SLIDING_THEN_FULL))
        ),
    ),
    Arch(
        "olmo3",
        lambda tf: tf.Olmo3ForCausalLM(
            tf.Olmo3Config(**_common(sliding_window=WINDOW, layer_types=_SLIDING_THEN_FULL))
        ),
    ),
    Arch("smollm3", lambda tf: tf.SmolLM3ForCausalLM(tf.SmolLM3Config(**_common(no_rope_layers=[1, 0])))),
    Arch(
        "granite-moe",
        lambda tf: tf.GraniteMoeForCausalLM(
            tf.GraniteMoeConfig(**_common(num_local_experts=4, num_experts_per_tok=2, attention_multiplier=0.5))
        ),
    ),
    Arch(
        "llama4",
        lambda tf: tf.Llama4ForCausalLM(
            tf.Llama4TextConfig(
                **_common(
                    head_dim=16,
                    intermediate_size_mlp=128,
                    num_local_experts=2,
                    num_experts_per_tok=1,
                    attention_chunk_size=WINDOW,
                    no_rope_layers=[1, 0],
                )
            )
        ),
    ),
    Arch(
        "mpt",
        lambda tf: tf.MptForCausalLM(
            tf.MptConfig(vocab_size=VOCAB, d_model=64, n_heads=4, n_layers=2, max_seq_len=512, use_cache=False)
        ),
    ),
    Arch("persimmon", lambda tf: tf.PersimmonForCausalLM(tf.PersimmonConfig(**_common()))),
    Arch(
        "biogpt",
        lambda tf: tf.BioGptForCausalLM(
            tf.BioGptConfig(**_common(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
        ),
    ),
    Arch(
        "xglm",
        lambda tf: tf.XGLMForCausalLM(
            tf.XGLMConfig(
                vocab_size=VOCAB,
                d_model=64,
                ffn_dim=128,
                num_layers=2,
                attention_heads=4,
                max_position_embeddings=512,
                dropout=0.0,
                attention_dropout=0.0,
                activation_dropout=0.0,
                use_cache=False,
            )
        ),
    ),
    Arch("glm4", lambda tf: tf.Glm4ForCausalLM(tf.Glm4Config(**_common(head_dim=16)))),
    Arch("nemotron", lambda tf: tf.NemotronForCausalLM(tf.NemotronConfig(**_common()))),
    Arch("olmoe", lambda tf: tf.OlmoeForCausalLM(tf.OlmoeConfig(**_common(num_experts=4, num_experts_per_tok=2)))),
    Arch(
        "deepseek-v2",
        lambda tf: tf.DeepseekV2ForCausalLM(
            tf.DeepseekV2Config(
                **_common(
                    num_key_value_heads=4,
                    kv_lora_rank=16,
                    q_lora_rank=16,
                    qk_rope_head_dim=8,
                    qk_nope_head_dim=8,
                    v_head_dim=12,
                    n_routed_experts=4,
                    num_experts_per_tok=2,
                    moe_intermediate_size=32,
                    first_k_dense_replace=1,
                    n_group=1,
                    topk_group=1,
                )
            )
        ),
    ),
]
BY_NAME.update({a.name: a for a in MORE_ARCHS})


@dataclass(frozen=True)
class Hybrid:
    """A hybrid architecture: softmax attention in some layers, another token mixer in the others."""

    name: str
    build: Callable[[Any], nn.Module]
    attention: tuple[str, ...]
    """Module paths of the softmax attention sites (rewritten)."""
    mixers: tuple[str, ...]
    """Module paths of the other token mixers (adapted onto the segment-aware mixer ops)."""


_HYBRID_LAYERS = 4


def _hybrid(**overrides: Any) -> dict[str, Any]:
    return _common(num_hidden_layers=_HYBRID_LAYERS, **overrides)


def _layers(template: str, *indices: int) -> tuple[str, ...]:
    return tuple(template.format(i) for i in indices)


HYBRIDS = [
    Hybrid(
        "lfm2",
        lambda tf: tf.Lfm2ForCausalLM(
            tf.Lfm2Config(**_hybrid(layer_types=["conv", "full_attention", "conv", "conv"], conv_L_cache=3))
        ),
        _layers("model.layers.{}.self_attn", 1),
        _layers("model.layers.{}.conv", 0, 2, 3),
    ),
    Hybrid(
        "bamba",
        lambda tf: tf.BambaForCausalLM(
            tf.BambaConfig(
                **_hybrid(
                    attn_layer_indices=[1],
                    mamba_n_heads=8,
                    mamba_d_head=16,
                    mamba_n_groups=1,
                    mamba_d_state=16,
                    mamba_chunk_size=16,
                    mamba_expand=2,
                )
            )
        ),
        _layers("model.layers.{}.self_attn", 1),
        _layers("model.layers.{}.mamba", 0, 2, 3),
    ),
    Hybrid(
        "qwen3-next",
        lambda tf: tf.Qwen3NextForCausalLM(
            tf.Qwen3NextConfig(
                **_hybrid(
                    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
                    head_dim=16,
                    linear_num_value_heads=4,
                    linear_num_key_heads=2,
                    linear_key_head_dim=16,
                    linear_value_head_dim=16,
                    linear_conv_kernel_dim=4,
                    num_experts=4,
                    num_experts_per_tok=2,
                    moe_intermediate_size=32,
                    shared_expert_intermediate_size=32,
                )
            )
        ),
        _layers("model.layers.{}.self_attn", 1),
        _layers("model.layers.{}.linear_attn", 0, 2, 3),
    ),
    Hybrid(
        "jamba",
        lambda tf: tf.JambaForCausalLM(
            tf.JambaConfig(
                **_hybrid(
                    attn_layer_period=4,
                    attn_layer_offset=1,
                    expert_layer_period=2,
                    expert_layer_offset=1,
                    num_experts=2,
                    num_experts_per_tok=1,
                    mamba_d_state=8,
                    mamba_d_conv=4,
                    mamba_expand=2,
                    mamba_dt_rank=8,
                )
            )
        ),
        _layers("model.layers.{}.self_attn", 1),
        _layers("model.layers.{}.mamba", 0, 2, 3),
    ),
    Hybrid(
        "mamba2",
        lambda tf: tf.Mamba2ForCausalLM(
            tf.Mamba2Config(
                vocab_size=VOCAB,
                hidden_size=64,
                num_hidden_layers=2,
                num_heads=8,
                head_dim=16,
                n_groups=1,
                state_size=16,
                chunk_size=16,
                expand=2,
                use_cache=False,
                pad_token_id=0,
            )
        ),
        (),
        _layers("backbone.layers.{}.mixer", 0, 1),
    ),
    # The Mamba2 copies below keep their configs' use_cache=True, as released checkpoints do: in a training
    # forward, their models then build a cache that would send every mixer call to the class's own forward.
    Hybrid(
        "granite-moe-hybrid",
        lambda tf: tf.GraniteMoeHybridForCausalLM(
            tf.GraniteMoeHybridConfig(
                **_hybrid(
                    use_cache=True,
                    layer_types=["mamba", "attention", "mamba", "mamba"],
                    mamba_n_heads=8,
                    mamba_d_head=16,
                    mamba_n_groups=2,
                    mamba_d_state=8,
                    mamba_chunk_size=16,
                    num_local_experts=2,
                    num_experts_per_tok=1,
                )
            )
        ),
        _layers("model.layers.{}.self_attn", 1),
        _layers("model.layers.{}.mamba", 0, 2, 3),
    ),
    Hybrid(
        "nemotron-h",
        lambda tf: tf.NemotronHForCausalLM(
            tf.NemotronHConfig(
                **_hybrid(
                    use_cache=True,
                    hybrid_override_pattern="M*-M",
                    head_dim=16,
                    mamba_num_heads=8,
                    mamba_head_dim=16,
                    n_groups=1,
                    ssm_state_size=16,
                    chunk_size=16,
                )
            )
        ),
        _layers("model.layers.{}.mixer", 1),
        _layers("model.layers.{}.mixer", 0, 3),
    ),
    Hybrid(
        "zamba2",
        lambda tf: tf.Zamba2ForCausalLM(
            tf.Zamba2Config(
                **_hybrid(
                    use_cache=True,
                    layers_block_type=["mamba", "hybrid", "mamba", "mamba"],
                    mamba_d_state=8,
                    mamba_headdim=16,
                    mamba_ngroups=1,
                    n_mamba_heads=8,
                    chunk_size=16,
                )
            )
        ),
        _layers("model.layers.{}.shared_transformer.self_attn", 1),
        ("model.layers.0.mamba", "model.layers.1.mamba_decoder.mamba", "model.layers.2.mamba", "model.layers.3.mamba"),
    ),
]
HYBRID_BY_NAME = {h.name: h for h in HYBRIDS}


def build_hybrid(name: str, seed: int = 0) -> nn.Module:
    """The hybrid's tiny model, seeded, in training mode, in fp32; skips the test without transformers."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    return HYBRID_BY_NAME[name].build(transformers).float().train()
