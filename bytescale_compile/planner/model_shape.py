"""A transformer's shape (`ModelShape`, the Table 1 `PRESETS`) and how to read one from a model's config: our
LLaMA's, or any Hugging Face one. The class sits beside its reader so that what a shape holds and where each
number comes from read together.

Hugging Face families name the same numbers differently (GPT-2's `n_embd`, `n_layer`, `n_head`,
`n_inner`; OPT's `ffn_dim`; Falcon's `ffn_hidden_size`, `num_kv_heads`, `multi_query`); each field
is looked up through its aliases, and through the config's `attribute_map`, in the order below.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ..strategies import EXPERT_LAYOUTS, ExpertLayout, chosen_expert_layout

__all__ = ["BF16", "PRESETS", "ModelConfigError", "ModelShape", "model_shape", "shape_from_config"]

BF16 = 2
"""Bytes per element of the bf16 activations, gradients and parameters the analytic model assumes."""


"""How a TP group holds an MoE layer's experts (`capture/tp_experts.py`): "ep" E/tp whole experts per rank, "tp"
every expert split like a dense MLP, "auto" ep where tp divides E, else tp."""

_ROUTER_PROB_BYTES = 4
"""The router's softmax runs in fp32 and saves its [T, E] output."""


@dataclass(frozen=True)
class ModelShape:
    """What the analytic model needs of a transformer. MoE: FFN FLOPs and activations scale by top_k,
    FFN parameters by experts; shared experts (`shared_ffn`) are a dense MLP beside them."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    experts: int = 1
    top_k: int = 1
    shared_ffn: int = 0
    """MoE: the shared experts' width, all of them together (DeepSeek-V3's n_shared_experts x
    moe_intermediate_size), a SwiGLU MLP every token runs beside its routed experts; 0: none."""

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "experts", "top_k"):
            if getattr(self, f) < 1:
                raise ValueError(f"ModelShape {self.name!r}: {f} must be >= 1, got {getattr(self, f)}")
        if self.top_k > self.experts:
            raise ValueError(f"ModelShape {self.name!r}: top_k {self.top_k} > experts {self.experts}")
        if self.shared_ffn < 0 or (self.shared_ffn and self.experts == 1):
            raise ValueError(
                f"ModelShape {self.name!r}: shared_ffn must be >= 0, and 0 without routed experts (a dense "
                f"model's MLP is ffn), got {self.shared_ffn} with {self.experts} expert(s)"
            )

    @property
    def head_dim(self) -> int:
        """hidden // heads (Table 1's LLaMA-30B, 6656 over 56 heads, rounds down to 118)."""
        return self.hidden // self.heads

    @property
    def moe(self) -> bool:
        return self.experts > 1

    @property
    def kv_dim(self) -> int:
        """Width of k (and of v): kv_heads x head_dim."""
        return self.kv_heads * self.head_dim

    @property
    def attention_params(self) -> int:
        """A layer's q, k, v and o projections."""
        h = self.hidden
        return h * (h + 2 * self.kv_dim) + h * h

    @property
    def expert_params(self) -> int:
        """A layer's routed experts (the dense MLP of a dense model): gate, up and down of each, 3 x hidden x ffn."""
        return 3 * self.hidden * self.ffn * self.experts

    @property
    def shared_expert_params(self) -> int:
        return 3 * self.hidden * self.shared_ffn

    @property
    def router_params(self) -> int:
        """The router's hidden x experts matrix (none in a dense model)."""
        return self.hidden * self.experts if self.moe else 0

    @property
    def linear_flops_per_token(self) -> int:
        """Forward FLOPs of a layer's matmuls per token: qkv, o, the SwiGLU gate/up/down of top_k experts and
        of the shared experts, 2 FLOPs per multiply-add. The router's hidden x experts is left out."""
        return 2 * (self.attention_params + 3 * self.hidden * (self.ffn * self.top_k + self.shared_ffn))

    @property
    def act_bytes_per_token(self) -> int:
        """bf16 bytes a layer saves for backward per token on one device (`layer_act_bytes_per_token` at tp 1)."""
        return round(self.layer_act_bytes_per_token())

    def layer_act_bytes_per_token(
        self, tp: int = 1, expert_layout: ExpertLayout = "auto", element_bytes: int = BF16
    ) -> float:
        """Bytes a layer saves for backward per token on one of `tp` devices, no recompute, flash attention (no
        s x s matrix), no sequence parallelism. Whole on every device: the input-norm input, the qkv input, the
        attention output (the o-proj input, at hidden width), the post-norm input and the MLP input, 5 x hidden.
        Split by heads over tp: q (after RoPE), k and v (a K/V head is copied to the devices that share it).
        Split over tp: a fused SwiGLU's gate and up outputs and their product (the down-proj input), 3 x ffn per
        routed expert and 3 x shared_ffn; with "ep" each device runs top_k / tp of a token's experts on average.
        MoE, beside them: each routed copy's gathered input and its expert output before the routing weight,
        2 x top_k x hidden (split over tp under "ep"; whole under "tp", where every device sees every routed
        copy), and the router's fp32 probabilities, experts x 4 bytes. Per-token norm statistics and the
        attention log-sum-exp are left out."""
        layout = self.resolve_expert_layout(tp, expert_layout)
        kv_per_device = max(self.kv_heads // tp, 1) * self.head_dim
        heads = self.hidden / tp + 2 * kv_per_device
        mlp = 3 * (self.ffn * self.top_k + self.shared_ffn) / tp
        per_token = (5 * self.hidden + heads + mlp) * element_bytes
        if self.moe:
            routed = 2 * self.top_k * self.hidden / (tp if layout == "ep" else 1)
            per_token += routed * element_bytes + self.experts * _ROUTER_PROB_BYTES
        return per_token

    def backward_bytes_per_token(self, tp: int = 1, element_bytes: int = BF16) -> float:
        """One layer's largest backward transient per token on one device: 4 [T, ffn] SwiGLU buffers per
        routed expert and of the shared experts, split over tp (`train/memory.MLP_BACKWARD_BUFFERS`), beside
        the gradients into and out of the layer, [T, hidden] each."""
        return (4 * (self.ffn * self.top_k + self.shared_ffn) / tp + 2 * self.hidden) * element_bytes

    @property
    def params(self) -> int:
        """Parameters: per layer qkv, o, experts x SwiGLU, the shared experts and the router (MoE) and two norms;
        untied embedding and lm_head; the final norm."""
        return self.layers * self._layer_params(1) + 2 * self.vocab * self.hidden + self.hidden

    def _layer_params(self, tp: int) -> int:
        """A layer's parameters on one of `tp` devices: every matrix but the router split (the experts in
        either layout: E/tp whole experts or 1/tp of each), the router and the norms whole."""
        split = self.attention_params + self.expert_params + self.shared_expert_params
        return math.ceil(split / tp) + self.router_params + 2 * self.hidden

    def params_per_device(self, *, tp: int = 1, pp: int = 1) -> int:
        """Parameters of the largest pipeline stage's device: ceil(layers / pp) layers (earlier stages take
        the extra ones), the embedding and the lm_head split over tp (the larger of the two when pp > 1: each
        end on its own stage), and the final norm (as `train/memory.ParamCounts.per_rank` counts)."""
        end = math.ceil(self.vocab * self.hidden / tp)
        ends = 2 * end if pp == 1 else end
        return math.ceil(self.layers / pp) * self._layer_params(tp) + ends + self.hidden

    def largest_param_per_device(self, tp: int = 1) -> int:
        """Elements of the largest parameter on one device: the embedding (or lm_head), an MoE's fused
        gate_up_proj [E, 2 x ffn, hidden], or a dense MLP's gate (or up) projection, each split over tp."""
        mlp = 2 * self.ffn * self.hidden * self.experts if self.moe else self.ffn * self.hidden
        return math.ceil(max(self.vocab * self.hidden, mlp, self.hidden * self.hidden) / tp)

    def resolve_expert_layout(self, tp: int, expert_layout: ExpertLayout = "auto") -> Literal["ep", "tp"]:
        """The layout a TP group of `tp` holds the experts in, after refusing what would not split evenly
        (ValueError naming the fix). A dense model's MLP is split like "tp"."""
        if expert_layout not in EXPERT_LAYOUTS:
            raise ValueError(f"expert layout must be auto, ep or tp, got {expert_layout!r}")
        self._check_heads(tp)
        if not self.moe:
            if expert_layout == "ep":
                raise ValueError(f"{self.name}: expert layout 'ep' needs an MoE model; {self.name} has no experts")
            return "tp"
        layout = chosen_expert_layout(expert_layout, experts=self.experts, tp=tp)
        if layout == "ep" and self.experts % tp:
            raise ValueError(
                f"{self.name}: {self.experts} experts are not divisible by tp {tp}, so the TP ranks cannot hold "
                f"whole experts each; use the 'tp' expert layout (every expert split like a dense MLP)"
            )
        if layout == "tp" and (self.ffn % tp or self.shared_ffn % tp):
            raise ValueError(
                f"{self.name}: the experts' width {self.ffn} (shared {self.shared_ffn}) is not divisible by tp "
                f"{tp}; use the 'ep' expert layout with a tp that divides the {self.experts} experts"
            )
        return layout

    def _check_heads(self, tp: int) -> None:
        if tp < 1 or self.heads % tp or (self.kv_heads % tp and tp % self.kv_heads):
            raise ValueError(
                f"{self.name}: tp {tp} does not divide its {self.heads} attention heads ({self.kv_heads} key/value "
                f"heads): pick a tp that divides both (or that the key/value heads divide)"
            )


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
SHARED_FFN = ("shared_expert_intermediate_size",)
"""The shared experts' width, all of them together (Qwen2-MoE)."""
SHARED_EXPERTS = ("n_shared_experts",)
"""How many shared experts of the routed experts' width (DeepSeek-V2/V3 and their followers)."""

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
    ffn = _ffn(reader, hidden, experts)
    return ModelShape(
        name=name,
        layers=reader.positive_int("layers", LAYERS),
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        ffn=ffn,
        vocab=reader.positive_int("vocabulary size", VOCAB),
        experts=experts,
        top_k=reader.positive_int("experts per token", TOP_K, default=None if experts > 1 else 1),
        shared_ffn=_shared_ffn(reader, experts, ffn),
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


def _shared_ffn(reader: _ConfigReader, experts: int, ffn: int) -> int:
    """The shared experts' width: Qwen2-MoE's total, or DeepSeek's count x the routed experts' width; 0 for a
    dense model and an MoE without them (a field left None or 0)."""
    if experts == 1:
        return 0
    width = reader.non_negative_int("shared experts' width", SHARED_FFN)
    return width if width else reader.non_negative_int("shared experts", SHARED_EXPERTS) * ffn


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

    def non_negative_int(self, what: str, names: tuple[str, ...]) -> int:
        """An optional count: 0 when no alias is set."""
        found = self.first_set(names)
        if found is None:
            return 0
        field, value = found
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self.error(f"{field} (the {what}) is {value!r}, expected an int >= 0")
        return value

    def error(self, detail: str) -> ModelConfigError:
        return ModelConfigError(
            f"{self.model_name} (config {type(self.config).__name__}): {detail}; fix the config or pass "
            f"cost_model=CostModel.analytic(ModelShape(...)) or a profiled cost model"
        )
