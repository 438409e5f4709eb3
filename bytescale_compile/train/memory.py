"""From a compiled model to the planner's `MemoryModel`: parameters per rank, activations per token, workspace.

The activation figures are the compile report's saved-activation table (what the backward really keeps, as
the partitioner CUDA training uses chose it), so no formula per architecture is needed; the model can live on
the `meta` device, where compiling costs seconds and no memory (`meta_model`, `compile_on_meta`).

Approximations, each erring towards more memory:
- Parameters per rank with tp: every matrix of a layer and the embedding and lm_head are divided by tp; vectors
  (norm gains, biases) stay whole. With pp: the largest stage, ceil(layers / pp) layers plus the larger of the
  embedding and the lm_head plus everything outside the layers.
- Activations with tp (no sequence parallelism): a tensor of at most `hidden` elements per token that is not
  split over heads (the residual stream, norm inputs and statistics, token ids, rotary tables) stays whole on
  every tp rank; every other (q/k/v and attention outputs laid out by heads, the MLP's intermediates) is divided
  by tp. The attention output reshaped to hidden width before o_proj counts whole.
- Activations with pp: every stage is charged the tensors outside the layers (embedding side and loss side).
- Layers: the mean over the model's layers, the layers the report lists standing for them: the last listed one
  for the model's last layer (it also keeps its output, the final norm's input), the others for the rest.
  Exact when the report lists every layer; a 2-layer copy stands for a uniform model's layers.
- Gradient checkpointing: the report's table then lists each layer's inputs only, and the backward rebuilds one
  layer's activations at a time. Their bytes are not in the report; they are read from the table of a 2-layer
  copy of the model's config compiled on meta without checkpointing (same partitioner), its larger layer.
- Transients (not in the table, which lists what the forward saves): one layer's backward from the model's shape
  (`layer_backward_bytes_per_token`), the fused loss from lm_head's (`loss_workspace`).
- Reserved over allocated: the caching allocator's fragmentation (`FRAGMENTATION`, by whether expandable segments
  are on) and granules; none for a model on the CPU, whose allocator caches nothing.
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..config import CompileConfig
from ..engine.collectives import local
from ..engine.stages import checkpointed, stage_specs
from ..kernels.cross_entropy_ref import logit_bytes
from ..kernels.dispatch import choose
from ..passes.report import CompileReport, SavedActivation
from ..planner.memory import (
    BUCKET_BYTES,
    DEVICE_HEADROOM,
    FRAGMENTATION,
    SEGMENT_GRANULES_BYTES,
    LossWorkspace,
    MemoryModel,
)
from ..planner.model_shape import LAYERS, ModelConfigError, ModelShape, model_shape

if TYPE_CHECKING:
    from ..api import OptimizedModule

__all__ = [
    "ALLOC_CONF_VARIABLES",
    "MLP_BACKWARD_BUFFERS",
    "TORCH_DTYPES",
    "ParamCounts",
    "compile_on_meta",
    "device_memory",
    "expandable_segments",
    "layer_backward_bytes_per_token",
    "loss_workspace",
    "memory_model",
    "meta_model",
    "param_counts",
    "parse_memory",
    "trainer_expandable_segments",
]

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""The training dtype's name -> the dtype the model's weights (and so its activations) are built in."""

ALLOC_CONF_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
"""Where torch reads its allocator's settings, the first one set winning (the second is the older name)."""

MLP_BACKWARD_BUFFERS = 4
"""[T, intermediate] tensors a SwiGLU MLP's backward holds at once: the gradient of the down projection's input,
the gradients of gate and up that one fused pointwise kernel writes from it, and the product silu(gate)·up that
the partitioner recomputes rather than saves, for the down projection's weight gradient. A GELU MLP needs fewer."""

_LOSS_PASS = "fused_loss"
_PROBE_TOKENS = 32
"""Tokens of the row the un-checkpointed copy is compiled on: any length, the table is per token."""
_LAYER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")
"""The first numbered component of a parameter's name is its decoder layer (`model.layers.3.mlp...`)."""
_MEMORY_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)
_MEMORY_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_memory(text: str) -> int:
    """A memory size as people write it, binary units: '80G', '80GB' and '80GiB' are 80 x 2^30 bytes; '141G',
    '1.5T', '1000' (bytes)."""
    m = _MEMORY_SIZE.match(text)
    if m is None:
        raise ValueError(f"expected a memory size like 80G, 141GiB or 24GB, got {text!r}")
    value = int(float(m.group(1)) * _MEMORY_UNITS[m.group(2).upper()])
    if value < 1:
        raise ValueError(f"a memory size must be at least 1 byte, got {text!r}")
    return value


def device_memory(device: torch.device | str) -> int:
    """The bytes this process may have its allocator reserve on a CUDA device: the device's free memory plus what
    the allocator already reserves (weights moved there, cached blocks), so the figure is the same before and
    after the model is on the device; what the CUDA context and other processes hold is out of it. Anything
    other than CUDA has no budget to read, so the caller must give one."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(
            f"device {device} has no memory size to plan with: pass the per-device budget explicitly "
            f"(--memory-budget SIZE, e.g. 80G)"
        )
    free, _total = torch.cuda.mem_get_info(device)
    return int(free) + int(torch.cuda.memory_reserved(device))


def expandable_segments(environ: Mapping[str, str] | None = None) -> bool:
    """Whether torch's CUDA allocator runs with expandable segments, as its settings variable says (read from
    `environ`, default the process's): the first of `ALLOC_CONF_VARIABLES` that is set, `expandable_segments:True`
    among its comma-separated options."""
    env = os.environ if environ is None else environ
    conf = next((env[name] for name in ALLOC_CONF_VARIABLES if env.get(name)), "")
    options = dict(item.split(":", 1) for item in conf.replace(" ", "").split(",") if ":" in item)
    return options.get("expandable_segments", "").lower() == "true"


def trainer_expandable_segments(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the trainer would run with expandable segments under `environ` (default the process's): as its
    allocator settings say, or, with none set, yes (the trainer's default); what a plan for a trainer's run uses."""
    env = os.environ if environ is None else environ
    return expandable_segments(env) or not any(env.get(name) for name in ALLOC_CONF_VARIABLES)


@dataclass(frozen=True)
class ParamCounts:
    """A model's parameters by where they live: what pp and tp divide differently."""

    embedding: int
    head: int
    """0 when tied to the embedding (counted there)."""
    layer_matrices: float
    """Per decoder layer, mean over the layers present: the weights tp splits."""
    layer_vectors: float
    """Per decoder layer: norm gains and biases, which stay whole under tp."""
    other: int
    """Outside the layers, the embedding and the head (the final norm)."""
    layers_present: int
    largest: int
    """Elements of the largest matrix (the embedding or lm_head in a language model)."""

    def total(self, total_layers: int) -> int:
        """The whole model's parameters with `total_layers` such layers."""
        per_layer = self.layer_matrices + self.layer_vectors
        return round(total_layers * per_layer) + self.embedding + self.head + self.other

    def per_rank(self, total_layers: int, pp: int, tp: int) -> int:
        """Parameters of the largest pipeline stage's tensor-parallel shard (module docstring)."""
        layers = max(len(s.layers) for s in stage_specs(total_layers, pp))
        per_layer = math.ceil(self.layer_matrices / tp) + self.layer_vectors
        embedding, head = math.ceil(self.embedding / tp), math.ceil(self.head / tp)
        ends = embedding + head if pp == 1 else max(embedding, head)
        return round(layers * per_layer) + ends + self.other


def param_counts(model: nn.Module) -> ParamCounts:
    """Count `model`'s parameters by embedding, lm_head, decoder layer (the first numbered name component) and
    the rest; shared parameters once; a tensor-parallel parameter by this rank's shard. Works on the meta
    device."""
    inner = getattr(model, "original_module", model)
    embedding_ids = {id(p) for p in _module(inner, "get_input_embeddings", "embed_tokens").parameters()}
    head_ids = {id(p) for p in _module(inner, "get_output_embeddings", "lm_head").parameters()} - embedding_ids
    embedding = head = other = 0
    matrices: dict[int, int] = {}
    vectors: dict[int, int] = {}
    for name, p in inner.named_parameters():
        n = local(p).numel()
        m = _LAYER.search(name)
        if id(p) in embedding_ids:
            embedding += n
        elif id(p) in head_ids:
            head += n
        elif m is not None:
            layer = int(m.group(1))
            bucket = matrices if p.dim() >= 2 else vectors
            bucket[layer] = bucket.get(layer, 0) + n
        else:
            other += n
    layers = sorted(set(matrices) | set(vectors))
    count = max(1, len(layers))
    return ParamCounts(
        embedding=embedding,
        head=head,
        layer_matrices=sum(matrices.values()) / count,
        layer_vectors=sum(vectors.values()) / count,
        other=other,
        layers_present=len(layers),
        largest=max((local(p).numel() for p in inner.parameters() if p.dim() >= 2), default=0),
    )


def _module(model: nn.Module, getter: str, attr: str) -> nn.Module:
    """The module a Hugging Face getter returns, else the attribute of our LLaMA's name, else an empty one."""
    found = getattr(model, getter, None)
    module = found() if callable(found) else getattr(model, attr, None)
    return module if isinstance(module, nn.Module) else nn.Module()


def loss_workspace(
    vocab: int,
    hidden: int,
    *,
    compute_bytes: int,
    logit_bytes: int | None = None,
    head_grad_bytes: int = 0,
    tp: int = 1,
    max_buffer_bytes: int | None = None,
) -> LossWorkspace:
    """The fused loss's transients (`LossWorkspace`) for an lm_head of `vocab` x `hidden`, hidden states of
    `compute_bytes` per element, `logit_bytes` per entry of a chunk's buffers (default: the torch reference's,
    which keeps an fp32 copy of low-precision logits for the softmax; the Triton kernel holds the logits alone),
    lm_head's gradient of `head_grad_bytes` outside the gradient buffer, and chunks capped at `max_buffer_bytes`
    (the config's `loss_workspace_bytes`)."""
    if logit_bytes is None:
        logit_bytes = compute_bytes + (4 if compute_bytes < 4 else 0)
    return LossWorkspace(
        vocab=vocab,
        hidden=hidden,
        hidden_bytes=compute_bytes,
        logit_bytes=logit_bytes,
        head_grad_bytes=head_grad_bytes,
        tp=tp,
        max_buffer_bytes=max_buffer_bytes,
    )


def layer_backward_bytes_per_token(shape: ModelShape, *, compute_bytes: int, tp: int = 1) -> float:
    """Bytes per token of one layer's largest backward transient: the MLP's `MLP_BACKWARD_BUFFERS` [T, ffn] tensors
    (ffn x top_k for an MoE's routed tokens, split by tp) beside the gradient coming into the layer and the one it
    sends down ([T, hidden] each). The attention's dq, dk, dv are [T, hidden] or narrower, so the MLP's are the
    largest wherever ffn > hidden / 2."""
    return float((MLP_BACKWARD_BUFFERS * shape.ffn * shape.top_k / tp + 2 * shape.hidden) * compute_bytes)


def memory_model(
    model: OptimizedModule | nn.Module,
    *,
    total_layers: int,
    hdp: int,
    dtype: str,
    pp: int = 1,
    tp: int = 1,
    zero: bool = False,
    grad_reduce_dtype: str = "fp32",
    budget: int | None = None,
    workspace_bytes: int | None = None,
    params: int | None = None,
    bucket_bytes: int = BUCKET_BYTES,
    activations: bool = True,
    expandable: bool | None = None,
) -> MemoryModel:
    """The `MemoryModel` of one rank training `model` (compiled in training mode) as a model of `total_layers`
    decoder layers over pp stages, tp shards and `hdp` HDP ranks. Every graph in `model.compiled_graphs` counts
    (the pieces of a graph break add up), so call it after one training compilation: a recompilation's graphs
    would count twice. Its peak is the allocator's reserved peak (`planner/memory.py`).

    `params`: parameters per rank when known better than counted (default: the model's, its mean layer scaled
    to `total_layers`, split by pp and tp). `workspace_bytes` default: `DEVICE_HEADROOM` of `budget` (none
    without a budget) plus the allocator's `SEGMENT_GRANULES_BYTES`. `expandable`: whether the CUDA allocator
    runs with expandable segments, which sets the fragmentation (default: as the environment says,
    `expandable_segments`). A model on the CPU gets neither granules nor fragmentation: its allocator caches
    nothing. `activations=False`: the static part alone, from a model not compiled yet (the fused loss assumed),
    to check a budget before paying for a compilation.
    Raises ValueError for a model never compiled, compiled without a backward, saving [T, T] tensors, or a tp
    that does not divide its heads.
    """
    layers = max(len(s.layers) for s in stage_specs(total_layers, pp))
    share = _tp_share(model, tp) if tp > 1 else None
    layer_bytes, outside, recomputed, fused = 0.0, 0.0, 0.0, True
    if activations:
        report = _report(model)
        per_layer, outside = report.activation_bytes_per_token(share)
        if not per_layer:
            logger.warning(
                "the compile report places no saved activation in a numbered layer: all count as outside the "
                "layers, which offloading never frees"
            )
        layer_bytes = _mean_layer(per_layer, total_layers)
        fused = bool(report.rewrites(_LOSS_PASS))
        if checkpointed(model):
            recomputed = _recomputed_layer(model, dtype=dtype, share=share)
    counts = param_counts(model)
    caching = _device_type(model) != "cpu"
    if workspace_bytes is None:
        workspace_bytes = (round(DEVICE_HEADROOM * budget) if budget else 0) + (
            SEGMENT_GRANULES_BYTES if caching else 0
        )
    if expandable is None:
        expandable = expandable_segments()
    if caching:
        logger.info(
            "memory model: the allocator's reserved peak with expandable segments %s (%.0f%% fragmentation)",
            "on" if expandable else "off",
            100 * FRAGMENTATION[expandable],
        )
    compute_bytes = TORCH_DTYPES[dtype].itemsize
    return MemoryModel(
        params=params if params is not None else counts.per_rank(total_layers, pp, tp),
        hdp_size=hdp,
        dtype=dtype,
        zero=zero,
        grad_reduce_dtype=grad_reduce_dtype,
        bucket_bytes=bucket_bytes,
        largest_param=math.ceil(counts.largest / tp),
        layers=layers,
        layer_bytes_per_token=layer_bytes,
        other_bytes_per_token=outside,
        recomputed_bytes_per_token=recomputed,
        workspace_bytes=workspace_bytes,
        in_flight=pp,
        backward_bytes_per_token=_layer_backward(model, compute_bytes=compute_bytes, tp=tp) if activations else 0.0,
        loss=_loss_workspace(model, dtype=dtype, tp=tp) if activations and fused else None,
        fragmentation=FRAGMENTATION[expandable] if caching else 0.0,
    )


def _device_type(model: nn.Module) -> str:
    """Where `model`'s parameters live ("meta" for a model planned without weights: planned as for CUDA)."""
    inner = getattr(model, "original_module", model)
    first = next(inner.parameters(), None)
    return first.device.type if first is not None else "cpu"


def _layer_backward(model: nn.Module, *, compute_bytes: int, tp: int) -> float:
    """`layer_backward_bytes_per_token` of the model's shape; 0, with a warning, for a model without one."""
    try:
        shape = model_shape(model)
    except ModelConfigError as e:
        logger.warning("a layer's backward transients are not counted: %s", e)
        return 0.0
    return layer_backward_bytes_per_token(shape, compute_bytes=compute_bytes, tp=tp)


def _recomputed_layer(model: nn.Module, *, dtype: str, share: Callable[[SavedActivation], float] | None) -> float:
    """Bytes per token of the activations one checkpointed layer rebuilds in the backward: the larger layer of
    a 2-layer copy of the model's config compiled on meta without checkpointing, by the partitioner `model` was
    compiled with (module docstring)."""
    inner = getattr(model, "original_module", model)
    config = getattr(inner, "config", None)
    if config is None or not hasattr(config, "vocab_size"):
        raise ValueError(
            f"{type(inner).__name__} is gradient-checkpointed but has no Hugging Face config to compile an "
            f"un-checkpointed copy from: its recomputed activations cannot be measured"
        )
    copy_, _ = meta_model(config, dtype)
    compile_config = getattr(model, "compile_config", CompileConfig())
    device = next(inner.parameters()).device.type
    ids = torch.zeros(1, _PROBE_TOKENS, dtype=torch.long)
    inputs: dict[str, Any] = {
        "input_ids": ids,
        "position_ids": torch.arange(_PROBE_TOKENS)[None],
        "shift_labels": ids,
        "num_items_in_batch": torch.tensor(_PROBE_TOKENS),
    }
    if "labels" in inspect.signature(copy_.forward).parameters:
        inputs["labels"] = ids
    compiled = compile_on_meta(copy_, inputs, partitioner=compile_config.resolve_partitioner(device))
    per_layer, _ = _report(compiled).activation_bytes_per_token(share)
    largest = max(per_layer.values(), default=0.0)
    logger.info("gradient checkpointing: a recomputed layer holds up to %.0f bytes per token", largest)
    return largest


def _mean_layer(per_layer: dict[int, float], total_layers: int) -> float:
    """Bytes per token of the mean layer of `total_layers`, from the layers a report lists (module docstring)."""
    if not per_layer:
        return 0.0
    listed = [per_layer[i] for i in sorted(per_layer)]
    if len(listed) == 1 or total_layers <= 1:
        return sum(listed) / len(listed)
    rest = sum(listed[:-1]) / (len(listed) - 1)
    return ((total_layers - 1) * rest + listed[-1]) / total_layers


def _report(model: nn.Module) -> CompileReport:
    """Every graph `model` compiled so far, checked: a backward's saved activations, each linear in the tokens."""
    name = type(getattr(model, "original_module", model)).__name__
    graphs = getattr(model, "compiled_graphs", None)
    if not isinstance(graphs, list):
        raise ValueError(f"{name} is not an optimize()d model: it has no compile report to read activations from")
    report = CompileReport(graphs=graphs)
    if not report.graphs:
        raise ValueError(f"{name} has not been compiled: run it once (compile_and_run) before modelling its memory")
    if not report.saved_activations:
        notes = "; ".join(g.saved_activations_note for g in report.graphs if g.saved_activations_note)
        raise ValueError(
            f"{name}'s compile report lists no saved activations ({notes or 'compiled without a backward?'}): "
            f"compile it in training mode"
        )
    quadratic = [a for a in report.saved_activations if a.bytes_per_token is None and a.alias_of is None]
    if quadratic:
        listed = ", ".join(f"`{a.name}` {a.shape} from `{a.source}`" for a in quadratic[:3])
        raise ValueError(
            f"{name} saves {len(quadratic)} tensor(s) whose size grows with the square of the tokens ({listed}"
            f"{' ...' if len(quadratic) > 3 else ''}): no capacity per token exists for them. Let the attention "
            f"pass rewrite the model's attention (`bytescale-compile inspect` says why it was left alone)"
        )
    return report


def _tp_share(model: nn.Module, tp: int) -> Callable[[SavedActivation], float]:
    """The share of each saved tensor a tp rank keeps (module docstring), from the model's hidden size and heads."""
    try:
        shape = model_shape(model)
    except ModelConfigError as e:
        raise ValueError(f"tp {tp} needs the model's hidden size and heads: {e}") from e
    if shape.heads % tp or (shape.kv_heads % tp and tp % shape.kv_heads):
        raise ValueError(
            f"tp {tp} does not divide the model's {shape.heads} attention heads ({shape.kv_heads} key/value heads): "
            f"pick a tp that divides both (or that the key/value heads divide)"
        )
    heads = {h for h in (shape.heads, shape.kv_heads) if h > 1}

    def share(a: SavedActivation) -> float:
        dims = [d.strip() for d in a.shape.strip("()").split(",") if d.strip()]
        sizes = [int(d) for d in dims if d.isdigit()]
        by_heads = any(d.isdigit() and int(d) in heads for d in dims[:-1])
        return 1.0 if math.prod(sizes) <= shape.hidden and not by_heads else 1.0 / tp

    return share


def _loss_workspace(model: nn.Module, *, dtype: str, tp: int) -> LossWorkspace | None:
    """`loss_workspace` of the model's lm_head, for a model whose loss the fused-loss pass rewrote (unfused logits
    are [T, vocab] activations, in the saved-activation table). The loss returns lm_head's gradient in the weight's
    dtype, and its backward scales it out of place in the compiled graph: two [V, H] tensors until the gradient
    reaches the optimizer's buffer. On CUDA (and for a meta model, planned as for CUDA) the Triton kernel's chunk
    holds its logits alone."""
    weight = getattr(
        _module(getattr(model, "original_module", model), "get_output_embeddings", "lm_head"), "weight", None
    )
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        logger.warning("fused loss found but no lm_head weight: its workspace is not counted")
        return None
    vocab, hidden = weight.shape
    compute = TORCH_DTYPES[dtype]
    triton = _device_type(model) != "cpu" and choose(torch.device("cuda")) == "triton"
    return loss_workspace(
        vocab,
        hidden,
        compute_bytes=compute.itemsize,
        logit_bytes=compute.itemsize if triton else logit_bytes(compute, upcast=True, softcap=None),
        head_grad_bytes=2 * vocab * hidden * compute.itemsize,
        tp=tp,
        max_buffer_bytes=getattr(model, "compile_config", CompileConfig()).loss_workspace_bytes,
    )


def meta_model(config: Any, dtype: str, layers: int = 2) -> tuple[nn.Module, int]:
    """A Hugging Face causal LM of `config` with its decoder layers cut to `layers`, on the meta device in the
    run's dtype (no memory, no initialisation), and the config's own layer count. A per-layer list
    (`layer_types`) is cut alike: the copy has the first layers' kinds."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(config)
    field = next((name for name in LAYERS if isinstance(getattr(config, name, None), int)), None)
    if field is None:
        raise ValueError(f"{type(config).__name__} says no layer count (none of {', '.join(LAYERS)})")
    total = getattr(config, field)
    kept = min(layers, total)
    setattr(config, field, kept)
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, list) and len(layer_types) == total:
        config.layer_types = layer_types[:kept]
    config.use_cache = False
    with torch.device("meta"):
        module = AutoModelForCausalLM.from_config(config, dtype=TORCH_DTYPES[dtype])
    return module, total


def compile_on_meta(model: nn.Module, inputs: dict[str, Any], *, partitioner: str | None = None) -> OptimizedModule:
    """`optimize()` `model` (on the meta device) with `partitioner` (default: the one CUDA training uses), and
    run it once in training mode on `inputs` (the model protocol's kwargs, moved to meta): its report holds the
    saved activations a run with that partitioner keeps."""
    from ..api import optimize

    config = CompileConfig(partitioner=partitioner or CompileConfig().resolve_partitioner("cuda"), codegen="none")
    model.train()
    optimized = optimize(model, config)
    meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    optimized.compile_and_run(**meta)
    return optimized
