"""`tensor_parallel(model, tp_size)`: shard a model with torch's `parallelize_module`, from the plan it names.

The plan comes from, in order: the `plan` argument; a Hugging Face model's `config.base_model_tp_plan`
(under its `base_model_prefix`) plus the class's `_tp_plan` (the lm_head); or the model's own `tp_plan`
(our LLaMA's). Plans use Hugging Face's style names, or torch `ParallelStyle` objects:

    colwise                 ColwiseParallel()                          output stays sharded
    rowwise                 RowwiseParallel()                          all-reduce
    colwise_gather_output   ColwiseParallel(output_layouts=Replicate()) a vocabulary-parallel lm_head
    rowwise_split_input     RowwiseParallel(input_layouts=Replicate())
    embedding_rowwise       RowwiseParallel(input_layouts=Replicate()) a vocabulary-parallel embedding
    replicated_with_grad_allreduce    whole on every rank, gradient summed (a per-head norm on local heads)
    moe_tp_experts          a Hugging Face MoE experts module, in the `expert_layout` of `capture/tp_experts.py`
                            (its parameters' own entries, `packed_colwise` and `rowwise`, are what that layout does)

A Hugging Face config's `base_model_ep_plan` adds its `ep_dispatch_experts` modules as `moe_tp_experts` where the
TP plan has none (gpt-oss).

Everything is checked before any parameter moves: the heads and KV heads of every attention layer
divide by tp, and each sharded dimension does.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import re
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from ..strategies import EXPERT_LAYOUTS, ExpertLayout
from .tensor_parallel import GRAD_ALL_REDUCE, TensorParallelError, check_tp_innermost
from .tp_experts import EXPERTS_STYLE, ExpertsStyle, experts_style, shard_experts

__all__ = ["tensor_parallel", "check_tensor_parallel", "tp_plan_of", "tp_mesh"]

log = logging.getLogger(__name__)


class GradAllReduce:
    """Hugging Face's `replicated_with_grad_allreduce`: the module stays whole on every rank, but it sees the rank's
    local heads, so its parameters are marked `GRAD_ALL_REDUCE` and their gradients summed over the group."""


STYLES: dict[str, Any] = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "replicated_with_grad_allreduce": GradAllReduce,
}
"""Hugging Face's plan names this compiler runs -> the torch style."""


def tp_plan_of(model: nn.Module) -> dict[str, str | ParallelStyle]:
    """The model's known plan, keys relative to `model`; `TensorParallelError` when it has none."""
    own = getattr(model, "tp_plan", None)
    if isinstance(own, dict) and own:  # a Hugging Face model's merged plans (`tp_plan`, `ep_plan`), or our LLaMA's
        return {**_ep_experts(getattr(model, "ep_plan", None)), **own}
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    if base:
        prefix = getattr(model, "base_model_prefix", "")
        nested = prefix and hasattr(model, prefix)
        experts = _ep_experts(getattr(config, "base_model_ep_plan", None))
        plan: dict[str, str | ParallelStyle] = {
            f"{prefix}.{k}" if nested else k: v for k, v in {**experts, **base}.items()
        }
        plan.update(getattr(model, "_tp_plan", None) or {})
        return plan
    raise TensorParallelError(
        f"{type(model).__name__} has no known tensor-parallel plan (no `tp_plan`, no Hugging Face "
        f"`config.base_model_tp_plan`); pass one: tensor_parallel(model, tp, plan={{'layers.*.q_proj': 'colwise', ...}})"
    )


def _ep_experts(ep_plan: Any) -> dict[str, str | ParallelStyle]:
    """An expert-parallel plan's experts modules (`ep_dispatch_experts`), as `moe_tp_experts` entries."""
    plan = ep_plan if isinstance(ep_plan, dict) else {}
    return {k: EXPERTS_STYLE for k, v in plan.items() if v == "ep_dispatch_experts"}


def tp_mesh(tp_size: int, device_type: str = "cpu", pp_size: int = 1) -> DeviceMesh:
    """This rank's TP group as a 1-D mesh of the world laid out (pp, hdp, tp), tp innermost."""
    if dist.is_initialized():
        world = dist.get_world_size()
    elif "WORLD_SIZE" in os.environ:  # under torchrun: init_device_mesh below starts the default process group
        world = int(os.environ["WORLD_SIZE"])
    else:
        raise TensorParallelError(
            f"tensor parallelism over {tp_size} ranks needs that many processes: run the script under torchrun "
            f"(torchrun --nproc_per_node={tp_size * pp_size} script.py), or initialise torch.distributed first"
        )
    if tp_size < 1 or world % (tp_size * pp_size):
        raise TensorParallelError(
            f"world size {world} is not divisible by tp × pp = {tp_size} × {pp_size}: the world is laid out "
            f"(pp, hdp, tp), so it must be a multiple of {tp_size * pp_size}"
        )
    hdp = world // (tp_size * pp_size)
    mesh = init_device_mesh(device_type, (pp_size, hdp, tp_size), mesh_dim_names=("pp", "hdp", "tp"))
    return mesh["tp"]


def tensor_parallel(
    model: nn.Module,
    tp_size: int,
    plan: dict[str, str | ParallelStyle] | None = None,
    mesh: DeviceMesh | None = None,
    *,
    expert_layout: ExpertLayout = "auto",
) -> nn.Module:
    """Shard `model` in place over a TP group of `tp_size` ranks (a new (hdp, tp) mesh unless `mesh` is the 1-D TP
    mesh to use) and return it; tp 1 returns it untouched. `expert_layout` places MoE experts: "ep" (E/tp whole
    experts per rank), "tp" (every expert split), or "auto" ("ep" where tp divides E, else "tp")."""
    if tp_size == 1 and mesh is None:
        return model
    styles = check_tensor_parallel(model, tp_size, plan, expert_layout=expert_layout)
    if mesh is None:
        device = next(model.parameters()).device.type
        mesh = tp_mesh(tp_size, "cpu" if device == "meta" else device)
    if mesh.ndim != 1 or mesh.size() != tp_size:
        raise TensorParallelError(f"the TP mesh must be 1-D of size tp {tp_size}, got shape {tuple(mesh.shape)}")
    check_tp_innermost(mesh)
    for path, style in list(styles.items()):
        if isinstance(style, GradAllReduce):
            for p in model.get_submodule(path).parameters(recurse=False):
                setattr(p, GRAD_ALL_REDUCE, True)
            del styles[path]
        elif isinstance(style, ExpertsStyle):
            shard_experts(model.get_submodule(path), style, mesh)
            del styles[path]
    parallelize_module(model, mesh, styles)
    log.info("tensor parallel over %d ranks: %d modules sharded", tp_size, len(styles))
    return model


def check_tensor_parallel(
    model: nn.Module,
    tp_size: int,
    plan: dict[str, str | ParallelStyle] | None = None,
    *,
    expert_layout: ExpertLayout = "auto",
) -> dict[str, Any]:
    """The style of every module `plan` (default: the model's) shards over `tp_size` ranks (a `ParallelStyle`,
    `GradAllReduce` or `ExpertsStyle`), after refusing what would split a head, a row or the experts unevenly: no
    process group needed, so a job checks before any work."""
    if expert_layout not in EXPERT_LAYOUTS:
        raise TensorParallelError(f"expert_layout {expert_layout!r} is not one of {EXPERT_LAYOUTS}")
    styles = _resolve(model, dict(plan) if plan is not None else tp_plan_of(model))
    for path in _tied_embeddings(model) & styles.keys():
        del styles[path]
        log.warning("`%s` shares its weight with another module (tied embeddings): it stays replicated", path)
    check_divisible(model, styles, tp_size)  # heads first: a layout's advice must not lead into a heads error
    for path, style in styles.items():
        if style == EXPERTS_STYLE:
            styles[path] = experts_style(path, model.get_submodule(path), tp_size, expert_layout)
    return styles


def _tied_embeddings(model: nn.Module) -> set[str]:
    """Paths of the modules whose weight is also another module's (a tied embedding and lm_head): sharding one
    would untie them."""
    owners: dict[int, list[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        weight = module._parameters.get("weight")
        if weight is not None:
            owners.setdefault(id(weight), []).append(path)
    return {path for paths in owners.values() if len(paths) > 1 for path in paths}


def _resolve(model: nn.Module, plan: dict[str, str | ParallelStyle]) -> dict[str, Any]:
    """Plan patterns (`layers.*.q_proj`) -> the style of every module path they match (`EXPERTS_STYLE` for an
    experts module)."""
    names = [name for name, _ in model.named_modules() if name]
    styles: dict[str, Any] = {}
    experts = [pattern for pattern, style in plan.items() if style == EXPERTS_STYLE]
    for pattern in experts:
        for name in names:
            if fnmatch.fnmatchcase(name, pattern) and _same_depth(name, pattern):
                styles[name] = EXPERTS_STYLE  # its layout once the heads are checked
    for pattern, style in plan.items():
        if pattern in experts or any(pattern.startswith(f"{e}.") for e in experts):
            continue  # an experts module, or one of its parameters: sharded by its layout
        if isinstance(style, str):
            if style not in STYLES:
                raise TensorParallelError(
                    f"tensor-parallel plan entry `{pattern}`: style {style!r} is not supported (known: {sorted([*STYLES, EXPERTS_STYLE])})"
                )
            make = STYLES[style]
        else:
            make = lambda s=style: s  # noqa: E731 - the user's style object, shared as given
        matched = [n for n in names if fnmatch.fnmatchcase(n, pattern) and _same_depth(n, pattern)]
        for name in matched:
            styles[name] = make()
    if not styles:
        raise TensorParallelError(
            f"the tensor-parallel plan {sorted(plan)} matches no module of {type(model).__name__}"
        )
    return styles


def _same_depth(name: str, pattern: str) -> bool:
    return name.count(".") == pattern.count(".")


def check_divisible(model: nn.Module, styles: dict[str, Any], tp_size: int) -> None:
    """Refuse, before sharding, what would split a head or a row unevenly."""
    heads = _head_counts(model)
    for path in styles:
        parent = path.rpartition(".")[0]
        if re.search(r"(q|k|v|qkv|query|key|value)_?proj$|\.(q|k|v)$", path):
            for label, count in heads:
                if count % tp_size:
                    raise TensorParallelError(
                        f"layer `{parent}`: {count} {label} are not divisible by tp {tp_size}; choose a tp that "
                        f"divides both the heads and the KV heads"
                    )
    for path, style in styles.items():
        module = model.get_submodule(path)
        weight = getattr(module, "weight", None)
        if weight is None or isinstance(style, GradAllReduce):
            continue
        dim = 0 if isinstance(style, ColwiseParallel) == isinstance(module, nn.Linear) else 1  # see the styles
        if weight.shape[dim] % tp_size:
            raise TensorParallelError(
                f"module `{path}`: dimension {weight.shape[dim]} of its weight {tuple(weight.shape)} is not "
                f"divisible by tp {tp_size}"
            )


def _head_counts(model: nn.Module) -> list[tuple[str, int]]:
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "num_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or getattr(config, "num_kv_heads", None) or heads
    return [(label, n) for label, n in (("attention heads", heads), ("KV heads", kv)) if isinstance(n, int)]
