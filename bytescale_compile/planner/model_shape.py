"""A transformer's shape (`ModelShape`, the Table 1 `PRESETS`) and how to read one from a model's config: our
LLaMA's, or any Hugging Face one. The class sits beside its reader so that what a shape holds and where each
number comes from read together.

Hugging Face families name the same numbers differently (GPT-2's `n_embd`, `n_layer`, `n_head`,
`n_inner`; OPT's `ffn_dim`; Falcon's `ffn_hidden_size`, `num_kv_heads`, `multi_query`); each field
is looked up through its aliases, and through the config's `attribute_map`, in the order below.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["BF16", "PRESETS", "ModelConfigError", "ModelShape", "model_shape", "shape_from_config"]

BF16 = 2
"""Bytes per element of the bf16 activations, gradients and parameters the analytic model assumes."""


@dataclass(frozen=True)
class ModelShape:
    """What the analytic model needs of a transformer. MoE: FFN FLOPs and activations scale by top_k,
    FFN parameters by experts."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    experts: int = 1
    top_k: int = 1

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "experts", "top_k"):
            if getattr(self, f) < 1:
                raise ValueError(f"ModelShape {self.name!r}: {f} must be >= 1, got {getattr(self, f)}")
        if self.top_k > self.experts:
            raise ValueError(f"ModelShape {self.name!r}: top_k {self.top_k} > experts {self.experts}")

    @property
    def head_dim(self) -> int:
        """hidden // heads (Table 1's LLaMA-30B, 6656 over 56 heads, rounds down to 118)."""
        return self.hidden // self.heads

    @property
    def linear_flops_per_token(self) -> int:
        """Forward FLOPs of a layer's matmuls per token: qkv, o and the SwiGLU gate/up/down of top_k
        experts, 2 FLOPs per multiply-add."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        return 2 * (h * (h + 2 * kv) + h * h + 3 * h * self.ffn * self.top_k)

    @property
    def act_bytes_per_token(self) -> int:
        """bf16 bytes a layer saves for backward per token, no recompute, flash attention (which keeps
        no s x s matrix): the input-norm input, the qkv input, q (after RoPE), k and v, the attention
        output (also the o-proj input), the post-norm input and the MLP input: 6 x hidden + 2 x kv dim;
        a fused SwiGLU keeps gate and up outputs and their product (the down-proj input): 3 x ffn per
        routed expert. Per-token fp32 norm statistics and the attention log-sum-exp are left out."""
        return BF16 * (6 * self.hidden + 2 * self.kv_heads * self.head_dim + 3 * self.ffn * self.top_k)

    @property
    def params(self) -> int:
        """Parameters: per layer qkv, o, experts x SwiGLU, the router (MoE) and two norms; untied
        embedding and lm_head; the final norm."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        router = h * self.experts if self.experts > 1 else 0
        layer = h * (h + 2 * kv) + h * h + 3 * h * self.ffn * self.experts + router + 2 * h
        return self.layers * layer + 2 * self.vocab * h + h


PRESETS: dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        ModelShape("llama-7b", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=11008, vocab=32000),
        ModelShape("llama-13b", layers=40, hidden=5120, heads=40, kv_heads=8, ffn=13824, vocab=32000),
        ModelShape("llama-30b", layers=60, hidden=6656, heads=56, kv_heads=8, ffn=17920, vocab=32000),
        ModelShape("llama-70b", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=32000),
        ModelShape(
            "mistral-8x7b", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=32000, experts=8, top_k=2
        ),
        ModelShape(
            "mistral-8x22b", layers=56, hidden=6144, heads=48, kv_heads=8, ffn=16384, vocab=32000, experts=8, top_k=2
        ),
    )
}
"""The paper's Table 1 models (vocab 32000 throughout)."""

LAYERS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers")
HIDDEN = ("hidden_size", "n_embd", "n_embed", "d_model")
HEADS = ("num_attention_heads", "num_heads", "n_head", "n_heads")
KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "n_kv_heads", "multi_query_group_num")
FFN = ("intermediate_size", "ffn_dim", "ffn_hidden_size", "n_inner", "d_ff")
MOE_FFN = ("moe_intermediate_size",)
VOCAB = ("vocab_size", "padded_vocab_size", "n_vocab")
EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts")
TOP_K = ("num_experts_per_tok",)

FFN_MULTIPLE = 4
"""GPT-style MLP width over hidden: what `n_inner=None` (GPT-2, GPT-J, CodeGen), `intermediate_size=None`
(GPT-Neo) and `ffn_hidden_size=None` (Falcon) mean, and what Bloom, which has no such field, always uses."""

_FIXED_FFN_MODEL_TYPES = frozenset({"bloom"})


class ModelConfigError(ValueError):
    """A model's config does not say a number the analytic cost model needs."""


def model_shape(model: Any) -> ModelShape:
    """The shape of `model` (or of the model an `optimize()`/`torch.compile` wrapper holds) from its `config`."""
    inner = _unwrap(model)
    name = type(inner).__name__
    config = getattr(inner, "config", None)
    if config is None:
        raise ModelConfigError(
            f"{name} has no `config` to read layers, hidden size and heads from; "
            f"pass cost_model=CostModel.analytic(ModelShape(...)) or a profiled cost model"
        )
    return shape_from_config(config, name)


def shape_from_config(config: Any, name: str) -> ModelShape:
    """The shape a config describes; `name` (the model's class) names the shape and every error."""
    reader = _ConfigReader(config, name)
    hidden = reader.positive_int("hidden size", HIDDEN)
    heads = reader.positive_int("attention heads", HEADS)
    experts = reader.positive_int("experts", EXPERTS, default=1)
    kv_heads = _kv_heads(reader, heads)
    if heads % kv_heads:
        raise reader.error(f"{heads} attention heads are not a multiple of {kv_heads} key/value heads")
    return ModelShape(
        name=name,
        layers=reader.positive_int("layers", LAYERS),
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        ffn=_ffn(reader, hidden, experts),
        vocab=reader.positive_int("vocabulary size", VOCAB),
        experts=experts,
        top_k=reader.positive_int("experts per token", TOP_K, default=None if experts > 1 else 1),
    )


def _unwrap(model: Any) -> Any:
    """Our OptimizedModule (`original_module`) and torch's (`_orig_mod`) hold the model that has the config."""
    for attr in ("original_module", "_orig_mod"):
        inner = getattr(model, attr, None)
        if inner is not None and inner is not model:
            return _unwrap(inner)
    return model


def _kv_heads(reader: _ConfigReader, heads: int) -> int:
    """Falcon's old layout and GPT-BigCode share one K/V head (`multi_query`); configs with no K/V field are MHA."""
    if reader.present("multi_query") and not reader.present("new_decoder_architecture"):
        return 1
    return reader.positive_int("key/value heads", KV_HEADS, default=heads)


def _ffn(reader: _ConfigReader, hidden: int, experts: int) -> int:
    """The MLP width (per expert in an MoE); a GPT-style field left None means FFN_MULTIPLE x hidden."""
    names = (*MOE_FFN, *FFN) if experts > 1 else FFN
    if reader.first_set(names) is None and (reader.any_defined(names) or reader.model_type in _FIXED_FFN_MODEL_TYPES):
        return FFN_MULTIPLE * hidden
    return reader.positive_int("MLP width", names)


class _ConfigReader:
    """Looks fields up by alias in a config object or mapping, following its `attribute_map`."""

    def __init__(self, config: Any, model_name: str) -> None:
        self.config = config
        self.model_name = model_name
        self.attribute_map: Mapping[str, str] = self._raw("attribute_map") or {}
        self.model_type = self._raw("model_type")

    def _raw(self, name: str) -> Any:
        if isinstance(self.config, Mapping):
            return self.config.get(name)
        return getattr(self.config, name, None)

    def _defined(self, name: str) -> bool:
        return name in self.config if isinstance(self.config, Mapping) else hasattr(self.config, name)

    def _spellings(self, name: str) -> tuple[str, ...]:
        mapped = self.attribute_map.get(name)
        return (name, mapped) if mapped else (name,)

    def any_defined(self, names: tuple[str, ...]) -> bool:
        return any(self._defined(s) for n in names for s in self._spellings(n))

    def present(self, name: str) -> bool:
        """A flag that is set and true."""
        return any(bool(self._raw(s)) for s in self._spellings(name))

    def first_set(self, names: tuple[str, ...]) -> tuple[str, Any] | None:
        """(field, value) of the first alias whose value is not None."""
        for n in names:
            for s in self._spellings(n):
                value = self._raw(s)
                if value is not None:
                    return s, value
        return None

    def positive_int(self, what: str, names: tuple[str, ...], default: Any = None) -> int:
        found = self.first_set(names)
        if found is None:
            if default is not None:
                return default
            raise self.error(f"cannot read the {what}: none of {', '.join(names)} is set")
        field, value = found
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self.error(f"{field} (the {what}) is {value!r}, expected an int >= 1")
        return value

    def error(self, detail: str) -> ModelConfigError:
        return ModelConfigError(
            f"{self.model_name} (config {type(self.config).__name__}): {detail}; fix the config or pass "
            f"cost_model=CostModel.analytic(ModelShape(...)) or a profiled cost model"
        )
