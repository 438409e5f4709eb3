"""MoE routers of Hugging Face models made independent of how sequences are packed or sharded.

`adapt_load_balancing` swaps the `load_balancing_loss_func` that an MoE causal LM's modeling module calls for one
that computes the same Switch-Transformer loss per sequence (`ops/router.py`): the modeling modules of transformers
5.24 hold one function, the same in every one of them (Mixtral, Qwen2/3-MoE, OLMoE, GPT-OSS, Jamba, ...), and it
is swapped only where its code (docstring and comments aside) is that one. Without a micro-batch context the swap
computes exactly what Hugging Face's does, so a model called outside a Runtime is unchanged.

`count_routed_experts` makes each router with an `e_score_correction_bias` (DeepSeek-V3 and its relatives) count
the experts it picks, for aux-loss-free balancing (`engine/routing.py`).

None of the 5.24 MoE causal LMs has a router z-loss (only the encoder-decoder Switch Transformers and NLLB-MoE
do): there is none to adapt.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import sys
import textwrap
import types
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor, nn

from ..ops import router as _router_ops  # noqa: F401  (registers bytescale::router_balance_weights)

__all__ = [
    "RouterLossError",
    "KNOWN_LOAD_BALANCING",
    "adapt_load_balancing",
    "aux_loss_enabled",
    "bias_routers",
    "count_routed_experts",
    "expert_bias",
    "num_experts",
    "router_layers",
]

KNOWN_LOAD_BALANCING = "7dc70a50e7a942bd"
"""Fingerprint of the code of transformers 5.24's `load_balancing_loss_func` (see `_fingerprint`)."""

_ADAPTED = "__bytescale_per_sequence__"
"""Attribute marking a swapped-in function, so a module is adapted once."""


class RouterLossError(ValueError):
    """An MoE model's router losses or balancing cannot be computed exactly under packing and sharding."""


def _fingerprint(fn: Callable[..., Any]) -> str:
    """Hash of a function's code without its docstring and comments (the same code in every modeling module)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    node = tree.body[0]
    assert isinstance(node, ast.FunctionDef)
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        node.body = body[1:]
    return hashlib.sha256(ast.dump(node).encode()).hexdigest()[:16]


def _config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def aux_loss_enabled(model: nn.Module) -> bool:
    """The model adds its routers' load-balancing loss to its loss (Hugging Face's `output_router_logits`)."""
    return bool(
        getattr(_config(model), "output_router_logits", False)
        or getattr(getattr(model, "config", None), "output_router_logits", False)
    )


def _per_sequence(original: Callable[..., Any]) -> Callable[..., Any]:
    """Hugging Face's `load_balancing_loss_func(gate_logits, num_experts, top_k, attention_mask)`, per sequence."""

    def load_balancing_loss_func(
        gate_logits: tuple[Tensor, ...] | Tensor | None,
        num_experts: int | None = None,
        top_k: int = 2,
        attention_mask: Tensor | None = None,
    ) -> Tensor | int:
        if gate_logits is None or not isinstance(gate_logits, tuple):
            return 0
        if attention_mask is not None:  # padded rows, never packed ones: Hugging Face's own weighting
            return original(gate_logits, num_experts, top_k, attention_mask)
        assert num_experts is not None
        device = gate_logits[0].device
        probs = torch.softmax(torch.stack([g.to(device) for g in gate_logits]), dim=-1)
        _, selected = torch.topk(probs, top_k, dim=-1)
        weights = torch.ops.bytescale.router_balance_weights(selected, probs.detach().float(), num_experts)
        return (probs.float() * weights).sum()

    setattr(load_balancing_loss_func, _ADAPTED, True)
    load_balancing_loss_func.__wrapped__ = original  # type: ignore[attr-defined]
    return load_balancing_loss_func


def _modeling_modules(model: nn.Module) -> list[types.ModuleType]:
    """The Python modules defining the classes of `model`'s modules, the model's own first."""
    names = dict.fromkeys(type(m).__module__ for m in model.modules())
    return [sys.modules[n] for n in names if n in sys.modules]


def adapt_load_balancing(model: nn.Module, *, pp_size: int = 1) -> list[str]:
    """Swap the load-balancing loss of `model`'s modeling modules for the per-sequence one; the modules swapped.

    Nothing is swapped (and nothing refused) when the model does not add the loss. `RouterLossError` when it does
    and the loss cannot be made exact: a form not known, or pipeline stages (the loss spans every MoE layer).
    """
    if not aux_loss_enabled(model):
        return []
    name = type(model).__name__
    off = "train it without the aux loss (config.output_router_logits=False)"
    if pp_size > 1:
        raise RouterLossError(
            f"{name} adds its routers' load-balancing loss over every MoE layer, which pipeline stages (pp_size "
            f"{pp_size}) split: it is not computed exactly there; {off}, or without pipelines"
        )
    owner = sys.modules.get(type(model).__module__)
    found = getattr(owner, "load_balancing_loss_func", None)
    if not callable(found):
        raise RouterLossError(
            f"{name} has output_router_logits on but its modeling module {type(model).__module__} holds no "
            f"load_balancing_loss_func: its router's aux loss is of a form not known here, and would depend on how "
            f"sequences are packed or sharded; {off}"
        )
    swapped = []
    for module in _modeling_modules(model):
        fn = getattr(module, "load_balancing_loss_func", None)
        if not callable(fn) or getattr(fn, _ADAPTED, False):
            continue
        if _fingerprint(fn) != KNOWN_LOAD_BALANCING:
            raise RouterLossError(
                f"{name}: the load_balancing_loss_func of {module.__name__} is not the Switch-Transformer loss of "
                f"transformers 5.24 that is computed per sequence here; its aux loss would depend on how sequences "
                f"are packed or sharded; {off}"
            )
        module.load_balancing_loss_func = _per_sequence(fn)  # type: ignore[attr-defined]
        swapped.append(module.__name__)
    return swapped


def router_layers(model: nn.Module) -> int | None:
    """How many router logits the model's load-balancing loss takes (its MoE layers), from the router class
    Hugging Face records them from; None where that is not known."""
    for module in model.modules():
        recorder = (getattr(type(module), "_can_record_outputs", None) or {}).get("router_logits")
        target = getattr(recorder, "target_class", None)
        if isinstance(target, type):
            return sum(isinstance(m, target) for m in model.modules())
    return None


def num_experts(model: nn.Module) -> int | None:
    config = _config(model)
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def bias_routers(model: nn.Module) -> list[nn.Module]:
    """The routers with DeepSeek-V3's expert bias (`e_score_correction_bias`), in module order."""
    return [m for m in model.modules() if isinstance(getattr(m, "e_score_correction_bias", None), Tensor)]


def expert_bias(router: nn.Module) -> Tensor:
    """A router's expert bias [experts], added to its scores when it picks experts (not when it weighs them)."""
    return cast(Tensor, router.e_score_correction_bias)


def count_routed_experts(routers: list[nn.Module]) -> None:
    """Make each router count the experts it picks (its forward's last output) into row i of the ambient tally."""
    for layer, router in enumerate(routers):
        if getattr(router, _ADAPTED, False):
            continue
        experts = int(expert_bias(router).shape[0])
        own = type(router).forward

        def forward(self: nn.Module, *args: Any, _layer: int = layer, _own: Any = own, _experts: int = experts) -> Any:
            out = _own(self, *args)
            if not (isinstance(out, tuple) and isinstance(out[-1], Tensor) and not out[-1].is_floating_point()):
                raise RouterLossError(
                    f"{type(self).__name__} does not return its chosen experts last, as DeepSeek-V3's router does: "
                    f"aux-loss-free balancing cannot count them; train it without expert_bias_update"
                )
            return (*out[:-1], torch.ops.bytescale.count_experts(out[-1], _layer, _experts))

        router.forward = types.MethodType(forward, router)
        setattr(router, _ADAPTED, True)
