"""Split a causal LM into pipeline stages at decoder-layer boundaries (ByteScale's PP inside each HDP rank).

Every rank builds (or loads) the full model, keeps the stage its pipeline position owns, and compiles that
stage alone with `optimize()`. Stage 0 holds the embedding, the last stage the final norm, lm_head and the
loss, every stage its contiguous range of decoder layers; no parameter belongs to two stages, so ZeRO and
checkpoints can later work stage by stage.

Stage call protocol (`stage_inputs` builds it from the model protocol's kwargs):
- stage 0: `input_ids`, `position_ids` -> hidden states `[1, T, hidden]`;
- a middle stage: `hidden_states`, `position_ids` -> hidden states;
- the last stage: `hidden_states`, `position_ids`, `shift_labels`, `num_items_in_batch` (and `labels` for
  Hugging Face) -> an output with `.loss`.
With `pp_size == 1` the single stage is the model itself, called like the model.

Hugging Face models (laid out as LlamaForCausalLM: `model.embed_tokens`, `model.layers`, `model.norm`,
`lm_head`) reuse their own forward: a stage is a shallow copy of the model, its class given the stage
protocol's forward, whose base model has the `layers` list cut to the stage's slice, so the model's own mask
and rotary construction runs on every stage and the attention pass sees the same patterns as in the full
model. Stages after the first pass `inputs_embeds=hidden_states` (their embedding is dropped, and what the
forward does to `inputs_embeds` is switched off or, unknown, refused), stages before the last replace the
final norm by `nn.Identity` and drop lm_head. Decoder layers keep their own `layer_idx` (their sliding
windows are read from it); the base model's config is a copy whose `num_hidden_layers` and `layer_types`
describe the slice, because the forward looks layer types up by position in the slice. Tied embeddings
are refused: stage 0 and the last stage would both own the matrix.

Other models are split as our LLaMA (`bytescale_compile/models/llama.py`): `embed_tokens`, `rotary(position_ids)`,
`layers` called as `layer(x, cos, sin)`, `norm`, `lm_head`, and its summed cross-entropy over
`num_items_in_batch`.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, cast

import torch
from torch import nn

if TYPE_CHECKING:
    from ..config import CompileConfig
    from ..passes.report import CompileReport

__all__ = [
    "StageSpec",
    "StageOutput",
    "UnsupportedModelError",
    "checkpointed",
    "compile_stages",
    "full_model_name",
    "is_hf_model",
    "stage_spec",
    "stage_specs",
    "split_stages",
    "stage_inputs",
]

_FIRST_STAGE_KWARGS = ("input_ids", "position_ids")
_LAYER_NAME = re.compile(r"^((?:model\.)?layers)\.(\d+)\.")
"""A decoder layer's name prefix in a stage: `layers.<j>.` (ours) or `model.layers.<j>.` (Hugging Face)."""
_FINAL_NORMS = ("norm", "final_layernorm")
"""Names of a Hugging Face base model's final norm (LLaMA's, Phi's and Persimmon's)."""


class StageOutput(NamedTuple):
    """The last stage's output for our LLaMA: the model's own `(loss, logits)`."""

    loss: torch.Tensor | None
    logits: torch.Tensor


class UnsupportedModelError(TypeError):
    """The model lacks the structure a stage split needs (decoder layers in one ModuleList, an embedding, ...)."""


@dataclass(frozen=True)
class StageSpec:
    """Stage `index` of `pp_size`, holding the model's decoder layers `layers` (indices in the full model)."""

    index: int
    pp_size: int
    layers: range

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.pp_size - 1


def stage_spec(model: nn.Module) -> StageSpec | None:
    """The `StageSpec` of a module from `split_stages` (through `optimize()` or not); None for a whole model."""
    spec = getattr(getattr(model, "original_module", model), "spec", None)
    return spec if isinstance(spec, StageSpec) else None


def stage_specs(num_layers: int, pp_size: int) -> list[StageSpec]:
    """`pp_size` contiguous layer ranges as even as possible; earlier stages take the extra layers."""
    if pp_size < 1:
        raise ValueError(f"pp_size must be at least 1, got {pp_size}")
    if pp_size > num_layers:
        raise ValueError(
            f"pp_size {pp_size} is larger than the model's {num_layers} decoder layers: "
            f"every pipeline stage needs at least one layer"
        )
    base, extra = divmod(num_layers, pp_size)
    specs, start = [], 0
    for index in range(pp_size):
        stop = start + base + (index < extra)
        specs.append(StageSpec(index, pp_size, range(start, stop)))
        start = stop
    return specs


def stage_inputs(
    spec: StageSpec, model_kwargs: Mapping[str, Any], hidden_states: torch.Tensor | None = None
) -> dict[str, Any]:
    """The kwargs stage `spec` takes, from the model protocol's kwargs and the previous stage's output."""
    if spec.is_first:
        return dict(model_kwargs) if spec.is_last else {k: model_kwargs[k] for k in _FIRST_STAGE_KWARGS}
    if hidden_states is None:
        raise ValueError(f"stage {spec.index} of {spec.pp_size} needs the previous stage's hidden_states")
    if spec.is_last:
        rest = {k: v for k, v in model_kwargs.items() if k != "input_ids"}
        return {"hidden_states": hidden_states, **rest}
    return {"hidden_states": hidden_states, "position_ids": model_kwargs["position_ids"]}


def compile_stages(
    stages: list[nn.Module], config: CompileConfig, model_kwargs: Mapping[str, Any]
) -> list[tuple[StageSpec, CompileReport]]:
    """Each of `split_stages`' stages compiled alone through `optimize()`, as pipelined training runs it, on the
    model protocol's kwargs and the previous stage's hidden states (forward only): its spec and compile report."""
    from ..api import optimize

    hidden, reports = None, []
    for stage in stages:
        spec = stage_spec(stage)
        assert spec is not None  # every stage of a split into more than one has its spec
        optimized = optimize(stage, config)
        out = optimized(**stage_inputs(spec, model_kwargs, hidden))
        hidden = out.detach() if not spec.is_last else None
        reports.append((spec, optimized.report))
    return reports


def full_model_name(spec: StageSpec, name: str) -> str:
    """The whole model's name of a stage's parameter or buffer `name`: a stage numbers its layers from 0.
    Checkpoints and final/ use these names, so no two stages' tensors share one."""
    return _LAYER_NAME.sub(lambda m: f"{m[1]}.{int(m[2]) + spec.layers.start}.", name, count=1)


def split_stages(model: nn.Module, pp_size: int) -> list[nn.Module]:
    """The model's pipeline stages, each a module holding only its own parameters (the same objects as the
    model's); `pp_size == 1` gives `[model]`. Each stage module has a `spec` (`StageSpec`)."""
    _check_whole_model(model)
    layers = _decoder_layers(model)
    specs = stage_specs(len(layers), pp_size)
    if pp_size == 1:
        return [model]
    if is_hf_model(model):
        _check_embeds_pass_through(model)
    build = _hf_stage if is_hf_model(model) else _LlamaStage
    stages = [build(model, spec) for spec in specs]
    _check_ownership(model, stages)
    return stages


def _check_whole_model(model: nn.Module) -> None:
    if hasattr(model, "original_module") and hasattr(model, "compile_config"):
        raise TypeError(
            "split_stages() takes the plain model: split it first, then optimize() each stage "
            "(an optimized model's compiled graphs span every layer)"
        )
    if isinstance(model, (_HFStageForward, _LlamaStage)):
        raise TypeError(f"split_stages() takes the whole model, got stage {model.spec.index} of {model.spec.pp_size}")


def is_hf_model(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    """`model.model.layers` of a Hugging Face decoder, `model.layers` of ours; a named error otherwise."""
    if is_hf_model(model):
        base = getattr(model, "model", None)
        layers = getattr(base, "layers", None)
        if not isinstance(layers, nn.ModuleList):
            raise UnsupportedModelError(
                f"Model {type(model).__name__} has no .model.layers ModuleList: pipeline stages are cut from "
                f"Hugging Face decoders laid out as LlamaForCausalLM (model.embed_tokens, model.layers, model.norm, "
                f"lm_head)"
            )
        _require(base, ("embed_tokens",), f"{type(model).__name__}.model")
        if not any(isinstance(getattr(base, n, None), nn.Module) for n in _FINAL_NORMS):
            _require(base, _FINAL_NORMS[:1], f"{type(model).__name__}.model")
        _require(model, ("lm_head",), type(model).__name__)
        return layers
    _require(model, ("embed_tokens", "rotary", "layers", "norm", "lm_head"), type(model).__name__)
    if not isinstance(model.layers, nn.ModuleList):
        raise UnsupportedModelError(
            f"Model {type(model).__name__}.layers is a {type(model.layers).__name__}, "
            f"not the ModuleList of decoder layers pipeline stages are cut from"
        )
    return model.layers


def _require(module: object, names: tuple[str, ...], where: str) -> None:
    missing = [n for n in names if not isinstance(getattr(module, n, None), nn.Module)]
    if missing:
        raise UnsupportedModelError(
            f"Model {where} has no {', '.join('.' + n for n in missing)}: pipeline stages need an embedding, a "
            f"ModuleList of decoder layers, a final norm and an lm_head (LLaMA's layout)"
        )


def _check_ownership(model: nn.Module, stages: list[nn.Module]) -> None:
    """Each of the model's parameters in exactly one stage: a tied embedding would be updated by two ranks."""
    owner: dict[int, int] = {}
    for k, stage in enumerate(stages):
        for p in stage.parameters():
            if owner.setdefault(id(p), k) != k:
                names = [n for n, q in model.named_parameters(remove_duplicate=False) if q is p]
                raise UnsupportedModelError(
                    f"Model {type(model).__name__}: parameter {' = '.join(names)} is shared by stages "
                    f"{owner[id(p)]} and {k} (tied embeddings?); untie it (e.g. tie_word_embeddings=False) "
                    f"before splitting into pipeline stages"
                )
    orphans = [n for n, p in model.named_parameters() if id(p) not in owner]
    if orphans:
        raise UnsupportedModelError(
            f"Model {type(model).__name__}: parameters {orphans[:5]} belong to no pipeline "
            f"stage (only embedding, decoder layers, final norm and lm_head are placed)"
        )


def _shallow(module: nn.Module) -> nn.Module:
    """A copy sharing parameters and submodules whose own submodule dicts can be changed independently."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    return clone


class _LlamaLayout(Protocol):
    """A model laid out as our LLaMA, as `_decoder_layers` checks it."""

    config: Any
    embed_tokens: nn.Module
    rotary: nn.Module
    layers: nn.ModuleList
    norm: nn.Module
    lm_head: nn.Module


class _LlamaStage(nn.Module):
    """A stage of our LLaMA (`bytescale_compile/models/llama.py`): its forward, cut at `spec`'s layers.

    Submodules keep the model's names (`embed_tokens`, `layers`, `norm`, `lm_head`), the layers renumbered
    from 0 within the stage.
    """

    def __init__(self, model: nn.Module, spec: StageSpec) -> None:
        super().__init__()
        llama = cast(_LlamaLayout, model)  # what `_decoder_layers` checked
        self.spec = spec
        self.config = llama.config
        if spec.is_first:
            self.embed_tokens = llama.embed_tokens
        self.rotary = llama.rotary
        self.layers = nn.ModuleList(llama.layers[i] for i in spec.layers)
        if spec.is_last:
            self.norm = llama.norm
            self.lm_head = llama.lm_head

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        shift_labels: torch.Tensor | None = None,
        num_items_in_batch: torch.Tensor | None = None,
    ) -> Any:
        x = self.embed_tokens(input_ids) if self.spec.is_first else cast(torch.Tensor, hidden_states)
        if position_ids is None:
            position_ids = torch.arange(x.shape[1], device=x.device)[None].expand(x.shape[:2])
        cos, sin = self.rotary(position_ids, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        if not self.spec.is_last:
            return x
        return self._output(self.lm_head(self.norm(x)), shift_labels, num_items_in_batch)

    @staticmethod
    def _output(
        logits: torch.Tensor, shift_labels: torch.Tensor | None, num_items_in_batch: torch.Tensor | None
    ) -> Any:
        """The model's loss, op for op, so the fused-loss pass matches it as in the full model."""
        loss = None
        if shift_labels is not None:
            flat_logits = logits.float().view(-1, logits.shape[-1])
            if num_items_in_batch is None:
                loss = nn.functional.cross_entropy(flat_logits, shift_labels.view(-1), ignore_index=-100)
            else:
                loss = nn.functional.cross_entropy(
                    flat_logits, shift_labels.view(-1), ignore_index=-100, reduction="sum"
                )
                loss = loss / num_items_in_batch
        return StageOutput(loss, logits)


if TYPE_CHECKING:  # the checker sees the Hugging Face model class `_HFStageForward` is mixed into
    _ModelMixin = nn.Module
else:
    _ModelMixin = object


class _HFStageForward(_ModelMixin):
    """The stage protocol on a Hugging Face causal LM: mixed into a subclass of the model's own class, so a
    stage is the model (cut to its layers) and its parameter names and compile report read like the model's
    (`model.layers.0...`, `lm_head.weight`; the layers renumbered from 0 within the stage)."""

    spec: StageSpec
    model: nn.Module
    lm_head: nn.Module | None

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **loss_kwargs: Any,
    ) -> Any:
        if self.spec.is_last:
            return super().forward(
                inputs_embeds=hidden_states, position_ids=position_ids, use_cache=False, **loss_kwargs
            )
        if loss_kwargs:
            raise TypeError(
                f"stage {self.spec.index} of {self.spec.pp_size} computes no loss; it got {sorted(loss_kwargs)}"
            )
        out = self.model(input_ids=input_ids, inputs_embeds=hidden_states, position_ids=position_ids, use_cache=False)
        return out.last_hidden_state


@functools.cache
def _stage_class(cls: type) -> type:
    """`cls` with the stage protocol's forward, made once per class (`isinstance(stage, cls)` holds)."""
    namespace = {"__module__": cls.__module__, "__qualname__": f"{cls.__qualname__}Stage", "__doc__": cls.__doc__}
    return type(f"{cls.__name__}Stage", (_HFStageForward, cls), namespace)


def _hf_stage(model: nn.Module, spec: StageSpec) -> nn.Module:
    """Cut a shallow copy of the Hugging Face model to `spec`: its layers, embedding on stage 0 only, final
    norm and lm_head on the last stage only."""
    model_class: type = type(model)  # plain `type`: mypy takes a type[Module] for unhashable
    stage = _shallow(model)
    stage.__class__ = _stage_class(model_class)
    assert isinstance(stage, _HFStageForward)
    stage.spec = spec
    stage.model = _hf_base(stage.model, spec.layers, first=spec.is_first, last=spec.is_last)
    if not spec.is_last:
        stage.lm_head = None
    return stage


def _hf_base(base: nn.Module, layers: range, first: bool, last: bool) -> nn.Module:
    """A shallow copy of the base model running `layers` only. After the first stage the forward's own
    changes to `inputs_embeds` (Granite's `embedding_multiplier`, Phi's embedding dropout) are switched off:
    the first stage applied them already."""
    cut = _shallow(base)
    cut.config = _sliced_config(base.config, layers)
    cut.layers = nn.ModuleList(cast(nn.ModuleList, base.layers)[i] for i in layers)  # checked by `_decoder_layers`
    if not first:
        # torch types Module.__setattr__'s value as Tensor | Module; it takes None and plain values too
        cut.embed_tokens = None  # type: ignore[assignment]
        if hasattr(base, "embedding_multiplier"):
            cut.embedding_multiplier = 1.0  # type: ignore[assignment]
        if isinstance(getattr(base, "embed_dropout", None), nn.Module):
            cut.embed_dropout = nn.Identity()
    if not last:
        setattr(cut, _final_norm_name(base), nn.Identity())
    return cut


def _final_norm_name(base: nn.Module) -> str:
    return next(n for n in _FINAL_NORMS if isinstance(getattr(base, n, None), nn.Module))


def _check_embeds_pass_through(model: nn.Module) -> None:
    """A stage after the first must hand `inputs_embeds` to its first layer unchanged; run the base model
    without layers on random embeddings to make sure (skipped for a model on the meta device)."""
    param = next(model.parameters())
    if param.device.type == "meta":
        return
    probe = _hf_base(model.get_submodule("model"), range(0), first=False, last=False)
    config: Any = model.config
    x = torch.randn(1, 4, config.hidden_size, dtype=param.dtype, device=param.device)
    with torch.no_grad():
        out = probe(inputs_embeds=x, position_ids=torch.arange(4, device=x.device)[None], use_cache=False)
    if not torch.equal(out.last_hidden_state, x):
        raise UnsupportedModelError(
            f"Model {type(model).__name__}.model changes inputs_embeds before its first decoder layer (a scale, "
            f"dropout or position embedding in its forward): a pipeline stage after the first would apply it again"
        )


def _sliced_config(config: Any, layers: range) -> Any:
    """The base model's config for the stage: forwards loop `self.layers[:num_hidden_layers]` and read
    `layer_types[i]` by position in the slice. The decoder layers keep the full config (and their layer_idx)."""
    sliced = copy.deepcopy(config)
    layer_types = getattr(config, "layer_types", None)
    sliced.num_hidden_layers = len(layers)
    if layer_types is not None:
        sliced.layer_types = [layer_types[i] for i in layers]
    return sliced


def checkpointed(model: nn.Module) -> bool:
    """Whether `model`'s decoder layers recompute their forward in the backward: Hugging Face's gradient
    checkpointing is on (`gradient_checkpointing_enable`, the trainer's --gradient-checkpointing), which Dynamo
    captures as one checkpointed region per layer."""
    inner = getattr(model, "original_module", model)
    return any(getattr(m, "gradient_checkpointing", False) is True for m in inner.modules())
