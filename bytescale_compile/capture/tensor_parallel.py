"""Tensor-parallel models (DTensor parameters from torch's `parallelize_module`) compiled on their local shards.

Dynamo and AOTAutograd trace DTensor with a dynamic token dimension poorly (the joint graph of even one
column-parallel linear recurses without end in torch's proxy tracing), and a DTensor graph would hide the
local heads from the attention pass and the vocabulary shards from the loss pass. So the compiled
graphs never see a DTensor. For each call:

- every DTensor parameter is swapped for `to_local()` of it, outside the graph: autograd carries the
  local gradient back to the DTensor parameter, which the optimizer and checkpoints keep seeing;
- each module `parallelize_module` gave a style runs, instead of the style's DTensor hooks, the same
  computation on local tensors with the collectives of `ops/tensor_parallel.py`, Megatron's way:

    colwise Linear     y = linear(copy_to_tp(x), W_i, b_i)         [gathered: tp_all_gather(y, -1)]
    rowwise Linear     y = tp_all_reduce(linear(x_i, W_i)) + b     [x replicated: x_i = split_to_tp(x)]
    rowwise Embedding  vocabulary-parallel lookup: out-of-shard ids give zeros, then tp_all_reduce
    colwise Embedding  y = embedding(ids, W_i)                      [gathered: tp_all_gather(y, -1)]
    MoE experts        y = tp_all_reduce(experts(copy_to_tp(x), ids_i, copy_to_tp(w)))
                       (ids_i: the rank's own experts' ids, others a sentinel it skips, under expert-parallel)

The swap is undone after the call, so outside it the model is exactly the user's DTensor model.
Styles this does not know (sequence parallel, `PrepareModuleInput`, ...) are refused by name.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ..ops.tensor_parallel import copy_to_tp, split_to_tp, tp_all_gather, tp_all_reduce

__all__ = [
    "EXPERTS_LAYOUT",
    "TensorParallelError",
    "TPModule",
    "TPLayout",
    "LocalRunner",
    "find_tp_layout",
    "check_tp_innermost",
]


GRAD_ALL_REDUCE = "tp_grad_all_reduce"
"""Attribute marking a plain (replicated) parameter whose gradient each TP rank computes only in part, like a
per-head norm applied to the rank's local heads (Hugging Face's `replicated_with_grad_allreduce`): it enters each
call through `copy_to_tp`, so its gradient is summed over the TP group."""

EXPERTS_LAYOUT = "tp_experts_layout"
"""Attribute `tensor_parallel` sets on a Hugging Face MoE experts module it sharded (`capture/tp_experts.py`):
"ep" (the rank holds E/tp whole experts) or "tp" (a slice of every expert)."""


class TensorParallelError(ValueError):
    """A tensor-parallel model this compiler cannot run on local shards: the module and what is wrong."""


@dataclass(frozen=True)
class TPModule:
    """One module whose parameters are sharded, and how it runs on local shards."""

    path: str
    style: str
    """colwise, colwise_gather_output, rowwise, rowwise_split_input, vocab_parallel_embedding, colwise_embedding,
    colwise_embedding_gather, replicated_with_grad_allreduce, experts_ep, experts_tp."""

    def describe(self) -> str:
        return {
            "colwise": "column-parallel (output sharded)",
            "colwise_gather_output": "column-parallel, output gathered (vocabulary-parallel if the loss pass fuses it)",
            "rowwise": "row-parallel (all-reduce)",
            "rowwise_split_input": "row-parallel, input split, all-reduce",
            "vocab_parallel_embedding": "vocabulary-parallel embedding (all-reduce)",
            "colwise_embedding": "column-parallel embedding (hidden sharded)",
            "colwise_embedding_gather": "column-parallel embedding, output gathered",
            "replicated_with_grad_allreduce": "replicated, gradient summed over the TP group",
            "experts_ep": "MoE experts, E/tp whole experts per rank (all-reduce)",
            "experts_tp": "MoE experts, every expert split like an MLP (all-reduce)",
        }[self.style]


@dataclass
class TPLayout:
    """The TP group a model's DTensor parameters live on, and what each sharded module does."""

    mesh: DeviceMesh
    modules: list[TPModule]

    @property
    def size(self) -> int:
        return self.mesh.size()

    @property
    def rank(self) -> int:
        return self.mesh.get_local_rank()

    @property
    def group_name(self) -> str:
        return self.mesh.get_group().group_name

    def describe(self) -> dict[str, str]:
        """Module path -> its layout, for the compile report."""
        return {m.path: m.describe() for m in self.modules}


def find_tp_layout(model: nn.Module) -> TPLayout | None:
    """The model's TP layout, None when no parameter is a DTensor; `TensorParallelError` for what cannot run."""
    hf_tp = getattr(model, "_tp_size", None)  # set by Hugging Face's from_pretrained(tp_plan=...)
    if isinstance(hf_tp, int) and hf_tp > 1:
        raise TensorParallelError(
            f"{type(model).__name__} was sharded by Hugging Face's tp_plan (tp_size {hf_tp}), whose styles this "
            f"compiler does not read: load it without tp_plan and shard it with bytescale_compile.tensor_parallel("
            f"model, {hf_tp}), which applies the same base_model_tp_plan through torch's parallelize_module"
        )
    dtensors = {name: p for name, p in model.named_parameters() if isinstance(p, DTensor)}
    if not dtensors:
        _refuse_orphan_hooks(model)
        return None
    meshes = {name: p.device_mesh for name, p in dtensors.items()}
    first, mesh = next(iter(meshes.items()))
    other = next((name for name, m in meshes.items() if m != mesh), None)
    if other is not None:
        raise TensorParallelError(
            f"parameters `{first}` and `{other}` are DTensors on different device meshes ({mesh} and "
            f"{meshes[other]}); tensor parallelism needs every parameter on one TP mesh"
        )
    if mesh.ndim != 1:
        name = next(iter(dtensors))
        raise TensorParallelError(
            f"parameter `{name}` is a DTensor on a {mesh.ndim}-D mesh {tuple(mesh.shape)}; parallelize the model on "
            f"its 1-D TP sub-mesh (`mesh['tp']`), as torchtitan does"
        )
    check_tp_innermost(mesh)
    modules: list[TPModule] = []
    for path, module in model.named_modules():
        style = _style(path, module)
        if getattr(module, EXPERTS_LAYOUT, None) is not None:
            modules.append(TPModule(path, f"experts_{getattr(module, EXPERTS_LAYOUT)}"))
        elif style is not None:
            modules.append(TPModule(path, style))
        elif _grad_summed(module):
            modules.append(TPModule(path, "replicated_with_grad_allreduce"))
    sharded = {m.path for m in modules}
    for name, p in dtensors.items():
        owner = name.rpartition(".")[0]
        if not all(isinstance(pl, Replicate) for pl in p.placements) and owner not in sharded:
            raise TensorParallelError(
                f"parameter `{name}` is sharded ({p.placements}) but its module `{owner}` has no tensor-parallel "
                f"style this compiler knows (ColwiseParallel or RowwiseParallel on nn.Linear / nn.Embedding, or "
                f"Hugging Face MoE experts sharded by bytescale_compile.tensor_parallel)"
            )
    return TPLayout(mesh, modules)


def _grad_summed(module: nn.Module) -> list[str]:
    return [n for n, p in module._parameters.items() if p is not None and getattr(p, GRAD_ALL_REDUCE, False)]


def check_tp_innermost(mesh: DeviceMesh) -> None:
    """A TP group must be adjacent global ranks (tp the innermost mesh dim): one node, and the (pp, hdp, tp)
    numbering every other part relies on."""
    ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
    size = len(ranks)
    if ranks != list(range(ranks[0], ranks[0] + size)) or ranks[0] % size:
        raise TensorParallelError(
            f"the TP mesh holds global ranks {ranks}: tensor parallelism must be the innermost mesh dimension "
            f"(a TP group of {size} is ranks [k*{size}, (k+1)*{size})), e.g. init_device_mesh(..., (hdp, tp), "
            f"mesh_dim_names=('hdp', 'tp'))['tp']"
        )


_TP_STYLES = ("ColwiseParallel", "RowwiseParallel")


def _tp_hook(hook: Callable) -> tuple[str, tuple] | None:
    """(style class, the layouts it was given) when `hook` is one `distribute_module` registered for a style."""
    code = getattr(hook, "__code__", None)
    if code is None or not code.co_filename.replace("\\", "/").endswith("distributed/tensor/_api.py"):
        return None
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in hook.__closure__ or ())))
    fn = cells.get("input_fn", cells.get("output_fn"))
    inner = getattr(fn, "func", fn)
    owner = getattr(inner, "__qualname__", repr(inner)).partition(".")[0]
    return owner, tuple(getattr(fn, "args", ()))


def _hooks(module: nn.Module) -> tuple[list[tuple[str, tuple]], list[tuple[str, tuple]]]:
    pre = [h for h in map(_tp_hook, module._forward_pre_hooks.values()) if h is not None]
    post = [h for h in map(_tp_hook, module._forward_hooks.values()) if h is not None]
    return pre, post


def _refuse_orphan_hooks(model: nn.Module) -> None:
    for path, module in model.named_modules():
        pre, post = _hooks(module)
        if pre or post:
            raise TensorParallelError(
                f"module `{path}` has a tensor-parallel style ({(pre or post)[0][0]}) but no DTensor parameter: "
                f"styles without sharded parameters (sequence parallel, PrepareModuleInput/Output) are not supported"
            )


def _style(path: str, module: nn.Module) -> str | None:
    pre, post = _hooks(module)
    if not pre and not post:
        return None
    owners = {owner for owner, _ in pre + post}
    if len(owners) != 1 or not owners <= set(_TP_STYLES) or len(pre) != 1 or len(post) != 1:
        raise TensorParallelError(
            f"module `{path}` has the tensor-parallel style(s) {sorted(owners)}; this compiler runs "
            f"{' and '.join(_TP_STYLES)} on nn.Linear and nn.Embedding (no sequence parallel yet)"
        )
    owner = owners.pop()
    input_layouts, _ = pre[0][1]
    output_layouts, use_local_output = post[0][1]
    where = f"module `{path}` ({owner})"
    if not use_local_output:
        raise TensorParallelError(f"{where} returns DTensors (use_local_output=False); use the default True")
    if not isinstance(module, (nn.Linear, nn.Embedding)):
        raise TensorParallelError(f"{where} is a {type(module).__name__}; only nn.Linear and nn.Embedding are")
    inp, out = _one(input_layouts, where), _one(output_layouts, where)
    embedding = isinstance(module, nn.Embedding)
    if owner == "ColwiseParallel":
        if not isinstance(inp, Replicate):
            raise TensorParallelError(
                f"{where}: input layout {inp} (sequence parallel) is not supported; use Replicate"
            )
        if isinstance(out, Replicate):
            return "colwise_embedding_gather" if embedding else "colwise_gather_output"
        if _last_dim(out):
            return "colwise_embedding" if embedding else "colwise"
        raise TensorParallelError(f"{where}: output layout {out} is not supported (Shard(-1) or Replicate)")
    if not isinstance(out, Replicate):
        raise TensorParallelError(f"{where}: output layout {out} (sequence parallel) is not supported; use Replicate")
    if embedding:
        if not isinstance(inp, Replicate):
            raise TensorParallelError(f"{where}: a vocabulary-parallel embedding takes Replicate input ids")
        return "vocab_parallel_embedding"
    if isinstance(inp, Replicate):
        return "rowwise_split_input"
    if _last_dim(inp):
        return "rowwise"
    raise TensorParallelError(f"{where}: input layout {inp} is not supported (Shard(-1) or Replicate)")


def _one(layouts: Any, where: str) -> Placement:
    if not isinstance(layouts, tuple) or len(layouts) != 1:
        raise TensorParallelError(f"{where}: layouts {layouts} are not one placement on a 1-D mesh")
    return layouts[0]


def _last_dim(placement: Placement) -> bool:
    return isinstance(placement, Shard) and placement.dim in (-1, 2)


# Local forwards: each reads the module's (swapped, local) parameters.


def _colwise(module: nn.Linear, x: Tensor, *, group: str, gather: bool) -> Tensor:
    y = F.linear(copy_to_tp(x, group), module.weight, module.bias)
    return tp_all_gather(y, y.dim() - 1, group) if gather else y


def _rowwise(module: nn.Linear, x: Tensor, *, group: str, split: tuple[int, int] | None, bias: Tensor | None) -> Tensor:
    """`split`: (rank, size) of the TP group when `x` is replicated and this rank takes its slice."""
    x = split_to_tp(x, group, rank=split[0], size=split[1]) if split is not None else x
    y = tp_all_reduce(F.linear(x, module.weight), group)
    return y + bias if bias is not None else y


def _vocab_parallel_embedding(module: nn.Embedding, ids: Tensor, *, group: str, start: int) -> Tensor:
    rows = module.weight.shape[0]
    local = ids - start
    outside = (local < 0) | (local >= rows)
    out = F.embedding(local.masked_fill(outside, 0), module.weight, _local_padding(module, start))
    return tp_all_reduce(out.masked_fill(outside.unsqueeze(-1), 0), group)


def _colwise_embedding(module: nn.Embedding, ids: Tensor, *, group: str, gather: bool) -> Tensor:
    y = F.embedding(ids, module.weight, module.padding_idx)
    return tp_all_gather(y, y.dim() - 1, group) if gather else y


def _local_padding(module: nn.Embedding, start: int) -> int | None:
    p = module.padding_idx
    return p - start if p is not None and 0 <= p - start < module.weight.shape[0] else None


def _experts(
    module: nn.Module, x: Tensor, ids: Tensor, weights: Tensor, *, group: str, start: int, count: int | None
) -> Tensor:
    """The experts' own forward on the rank's shards; under expert-parallel (`count` local experts from `start`)
    another rank's expert id becomes the sentinel `count`, which Hugging Face's experts skip, with weight 0."""
    x, weights = copy_to_tp(x, group), copy_to_tp(weights, group)  # each rank's gradients are partial
    if count is not None:
        local = ids - start
        foreign = (local < 0) | (local >= count)
        ids, weights = local.masked_fill(foreign, count), weights.masked_fill(foreign, 0)
    return tp_all_reduce(type(module).forward(module, x, ids, weights), group)


@dataclass
class _Swap:
    """What `localized` changes on one module, made once so every call sees the same hook dicts (no recompiles)."""

    module: nn.Module
    dtensors: list[str]
    forward: Callable | None
    pre_hooks: OrderedDict
    hooks: OrderedDict
    bias_after_reduce: bool = False
    """A row-parallel linear with a (replicated) bias: added after the all-reduce, not by every rank's linear."""
    grad_summed: list[str] = field(default_factory=list)
    """Plain parameters marked `GRAD_ALL_REDUCE`, entering the call through `copy_to_tp`."""
    attributes: dict[str, Any] = field(default_factory=dict)
    """Plain attributes set for the call (an expert-parallel module's local expert count)."""


class LocalRunner:
    """Swaps a TP model to local shards for the duration of a call (`localized`)."""

    def __init__(self, model: nn.Module, layout: TPLayout) -> None:
        self.layout = layout
        styles = {m.path: m.style for m in layout.modules}
        group = layout.group_name
        self._swaps: list[_Swap] = []
        self._bias_locals: dict[int, Tensor] = {}
        for path, module in model.named_modules():
            dtensors = [n for n, p in module._parameters.items() if isinstance(p, DTensor)]
            style = styles.get(path)
            if not dtensors and style is None:
                continue
            if style == "replicated_with_grad_allreduce":
                style = None  # no forward of its own: only its parameters enter through copy_to_tp
            if isinstance(module, nn.Embedding) and style and (module.max_norm or module.sparse):
                raise TensorParallelError(
                    f"embedding `{path}` uses max_norm or sparse gradients: not supported with TP"
                )
            swap = _Swap(
                module, dtensors, None, _without_tp(module._forward_pre_hooks), _without_tp(module._forward_hooks)
            )
            swap.grad_summed = _grad_summed(module)
            swap.forward = self._forward(module, style, group, swap)
            self._swaps.append(swap)

    def _forward(self, module: Any, style: str | None, group: str, swap: _Swap) -> Callable | None:
        if style in ("colwise", "colwise_gather_output"):
            return functools.partial(_colwise, module, group=group, gather=style == "colwise_gather_output")
        if style in ("rowwise", "rowwise_split_input"):
            swap.bias_after_reduce = module.bias is not None
            split = (self.layout.rank, self.layout.size) if style == "rowwise_split_input" else None
            return functools.partial(self._rowwise, module, swap, group=group, split=split)
        if style == "vocab_parallel_embedding":
            start = self.layout.rank * module.weight.to_local().shape[0]
            return functools.partial(_vocab_parallel_embedding, module, group=group, start=start)
        if style in ("colwise_embedding", "colwise_embedding_gather"):
            return functools.partial(_colwise_embedding, module, group=group, gather=style.endswith("gather"))
        if style == "experts_ep":
            count = module.gate_up_proj.to_local().shape[0] if module.has_gate else module.up_proj.to_local().shape[0]
            swap.attributes = {"num_experts": count, "_is_expert_parallel": True}
            return functools.partial(_experts, module, group=group, start=self.layout.rank * count, count=count)
        if style == "experts_tp":
            return functools.partial(_experts, module, group=group, start=0, count=None)
        return None

    def _rowwise(
        self, module: nn.Linear, swap: _Swap, x: Tensor, *, group: str, split: tuple[int, int] | None
    ) -> Tensor:
        return _rowwise(module, x, group=group, split=split, bias=self._bias_locals.get(id(swap)))

    @contextmanager
    def localized(self) -> Iterator[None]:
        """The model on local shards for one call; the user's DTensor model again on exit, also on error."""
        saved = []
        try:
            for swap in self._swaps:
                m = swap.module
                saved.append(
                    (
                        m,
                        dict(m._parameters),
                        m._forward_pre_hooks,
                        m._forward_hooks,
                        m.__dict__.get("forward"),
                        {k: getattr(m, k) for k in swap.attributes},
                    )
                )
                for k, v in swap.attributes.items():
                    setattr(m, k, v)
                params = cast(dict[str, Any], m._parameters)  # local tensors, not Parameters, for the call
                for name in swap.dtensors:
                    params[name] = params[name].to_local()
                for name in swap.grad_summed:
                    params[name] = copy_to_tp(params[name], self.layout.group_name)
                if swap.bias_after_reduce:
                    self._bias_locals[id(swap)] = cast(Tensor, m._parameters["bias"])
                    m._parameters["bias"] = None
                m._forward_pre_hooks, m._forward_hooks = swap.pre_hooks, swap.hooks
                if swap.forward is not None:
                    m.forward = swap.forward
            yield
        finally:
            self._bias_locals.clear()
            for m, params, pre, post, forward, attributes in saved:
                m._parameters.update(params)
                for k, v in attributes.items():
                    setattr(m, k, v)
                m._forward_pre_hooks, m._forward_hooks = pre, post
                if forward is None:
                    m.__dict__.pop("forward", None)
                else:
                    m.forward = forward


def _without_tp(hooks: OrderedDict) -> OrderedDict:
    return OrderedDict((k, h) for k, h in hooks.items() if _tp_hook(h) is None)
