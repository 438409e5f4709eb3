"""Segment-aware forwards for the token mixers of Hugging Face hybrid models, swapped in before capture.

The torch paths of Hugging Face's short convolutions and linear recurrences (LFM2, Mamba, Mamba2 and its
relatives, Jamba, Qwen3-Next) run straight across the sequences packed in a row, and over a rank's zigzag chunks
only. `adapt_mixers` replaces the `forward` of each known mixer module with one that computes exactly what the
module's torch path computes, except that the token convolution and the scan are `bytescale::causal_conv1d` and
`bytescale::scan`, which know where each row's sequences start (`ops/mixers.py`). Parameters, state_dict and call
signature stay as they are. A call these forwards do not cover (a cache for generation, packing passed as
kwargs) goes to the class's own forward, so nothing changes silently; `split_reached` then tells, after capture,
which swapped modules' ops reached the compiled graphs.

Classes are matched by name, so transformers is not imported here; a module is adapted only when its class
comes from transformers and its forward has the signature these forwards mirror: `(hidden_states, cache,
attention_mask, **kwargs)`, where transformers 5.24 renamed the cache argument from `past_key_values` or
`cache_params` to `cache` (the torch paths are the same in 5.0 to 5.24).
"""

from __future__ import annotations

import importlib.metadata
import inspect
import re
import types
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import ops  # noqa: F401  (registers torch.ops.bytescale)

__all__ = ["ADAPTERS", "AdaptedMixer", "MixerAdapter", "adapt_mixers", "split_reached", "wants_no_cache"]

NEWEST_CHECKED = (5, 24)
"""The newest transformers (major, minor) whose mixer torch paths the tests check these forwards against. A newer
release may change a path behind the same signature, so its mixers are left alone (and packed rows refused)."""

_LEGACY_CACHE_NAMES = ("past_key_values", "cache_params")
"""What the cache argument of a mixer's forward was called before transformers 5.24 named it `cache`."""

_PACKING_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens", "seq_idx")
"""Packing passed as kwargs (Hugging Face's flattening collator) for the CUDA kernels: the ops read the packing
from the micro-batch context or the rows' position_ids instead, so such a call goes to the class's forward."""

_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"silu": F.silu, "swish": F.silu}
"""The convolution activations covered (by name, as `ACT2FN` reads `self.activation`)."""


@dataclass(frozen=True)
class MixerAdapter:
    """How to adapt one Hugging Face mixer class."""

    pattern: str
    """What the compile report calls the mixer."""
    compute: Callable[[Any, Tensor, Tensor | None], Tensor]
    """(module, hidden_states, attention_mask) -> output: the class's torch path with segment-aware ops."""
    unsupported: Callable[[nn.Module], str | None]
    """Why this instance cannot be adapted (a config the forward does not cover), or None."""


@dataclass(frozen=True)
class AdaptedMixer:
    """A module of the model whose forward now runs its token mixing as segment-aware ops."""

    path: str
    cls: str
    pattern: str


def _mask(hidden_states: Tensor, attention_mask: Tensor | None) -> Tensor:
    """Hugging Face's `apply_mask_to_padding_states`: zero the padding tokens of a 2D mask."""
    if attention_mask is None:
        return hidden_states
    return (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)


def _conv(conv: nn.Conv1d, x: Tensor, activation: str | None = None) -> Tensor:
    """Hugging Face's `causal_conv1d_fn` (in the weight's dtype, then back to x's) on token-major x [B, T, C]."""
    y, _ = torch.ops.bytescale.causal_conv1d(x.to(conv.weight.dtype), conv.weight[:, 0], conv.bias)
    if activation is not None:
        y = _ACTIVATIONS[activation](y)
    return y.to(x.dtype)


def _adapted_forward(
    self: Any,
    hidden_states: Tensor,
    cache: Any = None,
    attention_mask: Tensor | None = None,
    **kwargs: Any,
) -> Tensor:
    """The forward of every adapted module. Generation with a cache, or packing passed for the CUDA kernels, goes to
    the class's own forward; the cache may come under its pre-5.24 name."""
    for name in _LEGACY_CACHE_NAMES:
        if cache is None and name in kwargs:
            cache = kwargs.pop(name)
    if cache is not None or any(kwargs.get(name) is not None for name in _PACKING_KWARGS):
        return type(self).forward(self, hidden_states, cache, attention_mask, **kwargs)
    return ADAPTERS[type(self).__name__].compute(self, hidden_states, attention_mask)


def _activation_unsupported(module: nn.Module) -> str | None:
    activation = getattr(module, "activation", None)
    if activation not in _ACTIVATIONS:
        return f"convolution activation {activation!r}: only {sorted(_ACTIVATIONS)} are covered"
    return None


def _always_supported(module: nn.Module) -> None:
    del module


# --- LFM2 short convolution -----------------------------------------------------------------------


def _lfm2(self: Any, hidden_states: Tensor, attention_mask: Tensor | None) -> Tensor:
    """`Lfm2ShortConv`: y = out_proj(C * conv(B * x)), no activation."""
    B, C, x = self.in_proj(_mask(hidden_states, attention_mask)).chunk(3, dim=-1)
    return self.out_proj(C * _conv(self.conv, B * x))


# --- Mamba2 (SSD) ---------------------------------------------------------------------------------


def _mamba2(self: Any, hidden_states: Tensor, attention_mask: Tensor | None) -> Tensor:
    """`Mamba2Mixer` and its copies: in_proj -> (gate, conv'd x B C, dt) -> SSD + D skip -> gated RMSNorm -> out_proj."""
    batch, seq_len, _ = hidden_states.shape
    dtype = hidden_states.dtype
    projected = self.in_proj(_mask(hidden_states, attention_mask))
    gate, xbc, dt = projected.split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
    xbc = _mask(_conv(self.conv1d, xbc, self.activation), attention_mask)
    groups = self.n_groups * self.ssm_state_size
    x, B, C = xbc.split([self.intermediate_size, groups, groups], dim=-1)
    dt = F.softplus(dt + self.dt_bias.to(dt.dtype))
    dt = torch.clamp(dt, min=self.time_step_limit[0], max=self.time_step_limit[1])
    x = x.reshape(batch, seq_len, self.num_heads, self.head_dim).float()
    B, C = (t.reshape(batch, seq_len, self.n_groups, self.ssm_state_size).float() for t in (B, C))
    A = -torch.exp(self.A_log.float())
    y, _ = torch.ops.bytescale.scan("ssd", [x, dt.float(), A, B, C])
    y = y + self.D[:, None] * x
    y = self.norm(y.reshape(batch, seq_len, -1), gate)
    return self.out_proj(y.to(dtype))


# --- Mamba1 selective scan ------------------------------------------------------------------------


def _selective(self: Any, hidden_states: Tensor, attention_mask: Tensor | None, norms: bool) -> Tensor:
    """`MambaMixer`'s torch path; Jamba's adds RMSNorms on dt, B and C (`norms`)."""
    dtype = hidden_states.dtype
    x, gate = self.in_proj(_mask(hidden_states, attention_mask)).chunk(2, dim=-1)
    x = _mask(_conv(self.conv1d, x, self.activation), attention_mask)
    time_step, B, C = self.x_proj(x).split([self.time_step_rank, self.ssm_state_size, self.ssm_state_size], dim=-1)
    if norms:
        time_step, B, C = self.dt_layernorm(time_step), self.b_layernorm(B), self.c_layernorm(C)
    dt = F.linear(time_step, self.dt_proj.weight)
    dt = F.softplus(dt + self.dt_proj.bias.to(dt.dtype))
    A = -torch.exp(self.A_log.float())
    y, _ = torch.ops.bytescale.scan("selective", [x, dt, A, B, C])
    y = (y + x * self.D.float()) * F.silu(gate)
    return self.out_proj(y.to(dtype))


def _mamba(self: Any, hidden_states: Tensor, attention_mask: Tensor | None) -> Tensor:
    """`MambaMixer`."""
    return _selective(self, hidden_states, attention_mask, norms=False)


def _jamba(self: Any, hidden_states: Tensor, attention_mask: Tensor | None) -> Tensor:
    """`JambaMambaMixer`."""
    return _selective(self, hidden_states, attention_mask, norms=True)


def _jamba_unsupported(module: nn.Module) -> str | None:
    if hasattr(module.config, "_is_quantized"):
        return "quantized: its dt_proj runs through the quantized layer, not a plain weight"
    return _activation_unsupported(module)


# --- gated delta rule (Qwen3-Next, Qwen3.5) -------------------------------------------------------


def _l2norm(x: Tensor) -> Tensor:
    """Hugging Face's `l2norm(x, dim=-1, eps=1e-6)` (FLA's)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _gated_delta(self: Any, mixed_qkv: Tensor, z: Tensor, b: Tensor, a: Tensor) -> Tensor:
    """From the projections: conv -> q k v -> gated delta rule (as `torch_chunk_gated_delta_rule` prepares its
    inputs: GQA heads repeated, fp32, q and k l2-normalised, q scaled) -> gated RMSNorm -> out_proj."""
    batch, seq_len, _ = mixed_qkv.shape
    mixed_qkv = _conv(self.conv1d, mixed_qkv, self.activation)
    query, key, value = mixed_qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
    repeat = self.num_v_heads // self.num_k_heads
    query, key = (
        _l2norm(t.reshape(batch, seq_len, -1, self.head_k_dim).repeat_interleave(repeat, dim=2).float())
        for t in (query, key)
    )
    value = value.reshape(batch, seq_len, -1, self.head_v_dim)
    beta = b.sigmoid()
    g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
    inputs = [query * self.head_k_dim**-0.5, key, value.float(), g, beta.float()]
    out, _ = torch.ops.bytescale.scan("gated_delta", inputs)
    out = self.norm(out.to(mixed_qkv.dtype), z)
    return self.out_proj(out.reshape(batch, seq_len, -1))


def _qwen3_next(self: Any, hidden_states: Tensor, attention_mask: Tensor | None) -> Tensor:
    """`Qwen3NextGatedDeltaNet`: q k v z b a from two projections interleaved per key head."""
    hidden_states = _mask(hidden_states, attention_mask)
    batch, seq_len, _ = hidden_states.shape
    query, key, value, z, b, a = self.fix_query_key_value_ordering(
        self.in_proj_qkvz(hidden_states), self.in_proj_ba(hidden_states)
    )
    mixed_qkv = torch.cat([t.reshape(batch, seq_len, -1) for t in (query, key, value)], dim=-1)
    return _gated_delta(self, mixed_qkv, z, b, a)


def _qwen3_5(self: Any, hidden_states: Tensor, attention_mask: Tensor | None) -> Tensor:
    """`Qwen3_5GatedDeltaNet`: q k v, z, b and a from a projection each."""
    hidden_states = _mask(hidden_states, attention_mask)
    batch, seq_len, _ = hidden_states.shape
    z = self.in_proj_z(hidden_states).reshape(batch, seq_len, -1, self.head_v_dim)
    return _gated_delta(
        self, self.in_proj_qkv(hidden_states), z, self.in_proj_b(hidden_states), self.in_proj_a(hidden_states)
    )


_SHORT_CONV = MixerAdapter("short convolution", _lfm2, _always_supported)
_MAMBA2 = MixerAdapter("Mamba2 SSD scan", _mamba2, _activation_unsupported)
_QWEN3_5 = MixerAdapter("gated delta rule", _qwen3_5, _activation_unsupported)

ADAPTERS: dict[str, MixerAdapter] = {
    "Lfm2ShortConv": _SHORT_CONV,
    "Lfm2MoeShortConv": _SHORT_CONV,
    "Mamba2Mixer": _MAMBA2,
    "BambaMixer": _MAMBA2,
    "GraniteMoeHybridMambaLayer": _MAMBA2,
    "NemotronHMamba2Mixer": _MAMBA2,
    "Zamba2MambaMixer": _MAMBA2,
    "MambaMixer": MixerAdapter("selective scan (Mamba)", _mamba, _activation_unsupported),
    "JambaMambaMixer": MixerAdapter("selective scan (Mamba)", _jamba, _jamba_unsupported),
    "Qwen3NextGatedDeltaNet": MixerAdapter("gated delta rule", _qwen3_next, _activation_unsupported),
    "Qwen3_5GatedDeltaNet": _QWEN3_5,
    "Qwen3_5MoeGatedDeltaNet": _QWEN3_5,
}
"""Hugging Face class name -> adapter. Each `compute` mirrors the class's torch path in transformers 5."""


def _params(fn: Callable[..., Any]) -> list[tuple[str, Any]]:
    """Names and kinds of `fn`'s parameters, the cache one under its transformers 5.24 name."""
    return [
        ("cache" if p.name in _LEGACY_CACHE_NAMES else p.name, p.kind)
        for p in inspect.signature(fn).parameters.values()
    ]


def _transformers_version() -> str:
    return importlib.metadata.version("transformers")


def _cannot_adapt(module: nn.Module) -> str | None:
    """Why no adapter can take this instance, whatever its config."""
    cls = type(module)
    if not cls.__module__.startswith("transformers."):
        return f"{cls.__name__} from {cls.__module__}, not transformers: its forward may compute something else"
    version = _transformers_version()
    if tuple(int(part) for part in re.findall(r"\d+", version)[:2]) > NEWEST_CHECKED:
        newest = ".".join(map(str, NEWEST_CHECKED))
        return f"transformers {version} is newer than {newest}, the newest whose torch path its adapter is checked on"
    if _params(cls.forward) != _params(_adapted_forward):
        return f"its forward{inspect.signature(cls.forward)} is not the transformers 5 one the adapter mirrors"
    if "forward" in vars(module):
        return "its forward is already replaced on the instance (a hook?)"
    if any(hasattr(m, "_hf_hook") for m in module.modules()):
        return "accelerate hooks (device_map, offload) manage its weights"
    return None


def adapt_mixers(model: nn.Module) -> tuple[list[AdaptedMixer], list[tuple[str, str]]]:
    """Adapt every known mixer module of `model` in place; returns (adapted, [(path, reason) not adapted]).

    Idempotent: a module adapted before is listed as adapted again but not wrapped again, so every caller sees
    which mixers run as segment-aware ops.
    """
    adapted: list[AdaptedMixer] = []
    refused: list[tuple[str, str]] = []
    for path, module in model.named_modules():
        name = type(module).__name__
        adapter = ADAPTERS.get(name)
        if adapter is None:
            continue
        bound = vars(module).get("forward")
        if not (isinstance(bound, types.MethodType) and bound.__func__ is _adapted_forward):
            reason = _cannot_adapt(module) or adapter.unsupported(module)
            if reason is not None:
                refused.append((path, reason))
                continue
            module.forward = types.MethodType(_adapted_forward, module)
        adapted.append(AdaptedMixer(path, name, adapter.pattern))
    return adapted, refused


BYPASSED = (
    "its forward was swapped, but none of its ops reached the compiled graphs: every call went to the class's own "
    "forward, as calls with a cache (use_cache=True) or packing kwargs do"
)


def split_reached(
    swapped: list[AdaptedMixer], rewritten: Collection[str]
) -> tuple[list[AdaptedMixer], list[tuple[str, str]]]:
    """(adapted, [(path, reason) bypassed]): the swapped modules whose segment-aware ops are in the compiled graphs
    (`rewritten`: the module paths the token_mixers pass found them at), and those whose calls all went to the class's
    forward. A swap says nothing of what runs: the model decides how it calls the module."""
    return [m for m in swapped if m.path in rewritten], [(m.path, BYPASSED) for m in swapped if m.path not in rewritten]


def wants_no_cache(model: nn.Module, signature: inspect.Signature, arguments: Mapping[str, Any]) -> bool:
    """Whether a call of `model` with swapped mixers (its forward's `signature`, the call's bound `arguments`) should
    pass `use_cache=False`: a training call that leaves it unset, to a forward that takes it by name, or through
    **kwargs when the forward is Hugging Face's own and the config has `use_cache` (GraniteMoeHybrid's; a wrapper's
    **kwargs may mean something else). Hugging Face configs default to `use_cache=True`, and most hybrids then build
    a cache even in a training forward, which sends every mixer call to the class's own forward. A call that sets
    use_cache keeps it; so does an eval call (it may be decoding), unless it passes shift_labels: `OptimizedModule`
    fills use_cache=False into every call of the model protocol first."""
    if not model.training or "use_cache" in arguments:
        return False
    if "use_cache" in signature.parameters:
        return True
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    from_transformers = getattr(model.forward, "__module__", "").startswith("transformers.")
    return takes_kwargs and from_transformers and hasattr(getattr(model, "config", None), "use_cache")
