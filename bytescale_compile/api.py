"""`optimize()` and `explain()`: the public surface of the compiler."""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch._dynamo.utils import counters

from .capture import Backend, ShardingError
from .capture.layers import mark_repeated_layers
from .capture.mixers import BYPASSED, AdaptedMixer, adapt_mixers, split_reached, wants_no_cache
from .capture.tensor_parallel import LocalRunner, TPLayout, find_tp_layout
from .config import CompileConfig
from .passes.loss import EVAL_MODE
from .passes.loss import NAME as FUSED_LOSS
from .passes.report import CompileReport, GraphReport
from .runtime.context import MicroBatchContext, current_context, row_packing

__all__ = ["optimize", "explain", "OptimizedModule", "RecompileLimitError"]

logger = logging.getLogger(__name__)

RECOMPILE_LIMIT = 64
"""Compilations of one forward allowed per process, across all optimized instances of the class."""


LOGGER_METHODS = ("debug", "info", "warning", "info_once", "warning_once", "warning_advice")
"""`logging.Logger` methods (the last three are Hugging Face's) that compiled code skips instead of breaking
the graph on: GPT-2 calls `logger.warning_once` on every forward, between its lm_head and its loss."""


class RecompileLimitError(RuntimeError):
    """Too many compilations of one forward: running it unoptimized instead would be a silent slowdown."""


class OptimizedModule(nn.Module):
    """An `nn.Module` that runs `model` through our `torch.compile` backend.

    It shares the model's parameter, buffer and submodule dicts instead of registering the model as
    a child, so parameters are the same objects and `state_dict` keys are exactly the model's
    (torch's own OptimizedModule prefixes them with `_orig_mod.`); other attributes (`config` of a
    Hugging Face model) read through to the model, which is why ours is `compile_config`. Train and
    eval compile separately because the fused loss applies in training only.
    """

    def __init__(self, model: nn.Module, config: CompileConfig) -> None:
        super().__init__()
        object.__setattr__(self, "_orig_mod", model)
        object.__setattr__(self, "compile_config", config)
        self._parameters = model._parameters
        self._buffers = model._buffers
        self._modules = model._modules
        self._non_persistent_buffers_set = model._non_persistent_buffers_set
        self.training = model.training
        self.__signature__ = inspect.signature(model.forward)
        if config.compile_layers_once:
            mark_repeated_layers(model)
        self.tp_layout: TPLayout | None = find_tp_layout(model)
        """The TP group and each sharded module's layout when parameters are DTensors (`capture/tensor_parallel.py`)."""
        self._local = LocalRunner(model, self.tp_layout) if self.tp_layout is not None else None
        self._mixers_swapped: list[AdaptedMixer] = []
        """Hugging Face mixer modules whose forward was swapped (what the model then calls is for capture to say)."""
        self.mixers_adapted: list[AdaptedMixer] = []
        """Swapped mixer modules whose convolution and scan reached a compiled graph as segment-aware ops (empty
        until the first call compiles)."""
        self.mixers_not_adapted: list[tuple[str, str]] = []
        """(module path, reason) of known mixer modules left as they are, or swapped but bypassed in every graph."""
        if config.token_mixers:
            self._mixers_swapped, self.mixers_not_adapted = adapt_mixers(model)
            for path, reason in self.mixers_not_adapted:
                logger.warning(
                    "token mixer `%s` stays as it is (%s): the model will be neither packed nor sharded", path, reason
                )
        self._report = CompileReport()
        self._warned_eval_backward = False
        """Whether the warning that a backward ran through an eval-mode, unfused loss was given (once per model)."""
        self._pending: list[GraphReport] = []
        self._compiled_graphs: list[GraphReport] = []
        self._graph_breaks: list[str] = []
        self._outside: list[str] = []
        """`CompileReport.outside_graphs` over every graph compiled so far, updated when something compiles."""
        """Why Dynamo broke a training forward's graph, once each (`CompileReport.graph_breaks`)."""
        self._mixers_left_alone: dict[str, list[str]] = {}
        """Token mixers left alone in every graph compiled so far, also those inside regions the passes did not look
        into, updated when one compiles (not per call)."""
        graph_ids = itertools.count()
        self._backends = {mode: Backend(config, mode, self._pending.append, graph_ids) for mode in (True, False)}
        self._compiled = {
            mode: torch.compile(model, backend=b, dynamic=None if config.dynamic else False)
            for mode, b in self._backends.items()
        }

    @property
    def original_module(self) -> nn.Module:
        return self._orig_mod

    @property
    def report(self) -> CompileReport:
        """The `CompileReport` of the latest call that compiled (empty before the first call)."""
        return self._report

    def shard_blockers(self) -> list[str]:
        """Why this model cannot run sequences over several ranks, from every graph compiled so far (empty: it can)."""
        return CompileReport(graphs=self._compiled_graphs, outside_graphs=self._outside).shard_blockers()

    @property
    def compiled_graphs(self) -> list[GraphReport]:
        """The reports of every graph compiled so far (`report` holds only the latest call's)."""
        return list(self._compiled_graphs)

    @property
    def compilations(self) -> int:
        """Graphs compiled so far (each recompilation and each graph-break piece counts)."""
        return sum(b.compilations for b in self._backends.values())

    def train(self, mode: bool = True) -> OptimizedModule:
        self._orig_mod.train(mode)
        self.training = mode
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # torch.compile of this module: run ours, compiled by its own backend
            return self._forward_untraced(*args, **kwargs)
        return self._forward(*args, **kwargs)

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.compile_and_run(*args, **kwargs)
        self._refuse_packed_mixers(args, kwargs)
        self._warn_unfused_backward(out)
        return out

    _forward_untraced = torch.compiler.disable(
        _forward,
        reason="bytescale_compile.optimize() already compiles the model with its own backend; an outer "
        "torch.compile runs it as it is: call the optimized model directly",
    )
    """`_forward` hidden from an outer `torch.compile`: Dynamo would otherwise inline our compiled model and compile
    it with its own backend, without our passes (one compile, ours; `fullgraph=True` refuses with the reason)."""

    def compile_and_run(self, *args: Any, **kwargs: Any) -> Any:
        """The forward, compiling on the way as needed, without refusing a packed row that a token mixer left
        alone would read across: for calls made only to compile and report (`explain`, the runtime's probe)."""
        if self.compile_config.dynamic:
            for t in (*args, *kwargs.values()):
                _mark_token_dim_dynamic(t)
        self._pending.clear()
        breaks_before = dict(counters["graph_break"])
        try:
            with (
                self._local.localized() if self._local is not None else contextlib.nullcontext(),
                self._row_packing(args, kwargs),
                torch._dynamo.config.patch(
                    fail_on_recompile_limit_hit=True,
                    recompile_limit=RECOMPILE_LIMIT,
                    ignore_logging_functions=_ignored_logging_functions(),
                    # Hugging Face records router logits (output_router_logits) by a forward hook that appends
                    # to a list made outside the layer: inside a checkpointed layer Dynamo refuses that side
                    # effect, skips the frame, and every layer runs eagerly, out of the passes' reach (attention
                    # over a rank's own chunks of a shared sequence). Allowed, the recompute in the backward does
                    # not append again, as eager checkpointing does not either (the collector is gone by then).
                    skip_fwd_side_effects_in_bwd_under_checkpoint=True,
                ),
            ):
                call_kwargs = self._without_cache(args, self._protocol_filled(args, kwargs))
                out = self._compiled[self._orig_mod.training](*args, **call_kwargs)
        except torch._dynamo.exc.FailOnRecompileLimitHit as e:
            raise RecompileLimitError(
                f"{type(self._orig_mod).__name__}.forward was compiled {RECOMPILE_LIMIT} times in this process "
                f"(each optimize() of the same model class and, with CompileConfig(dynamic=False), each new length "
                f"compiles anew); call torch._dynamo.reset() between independent models, or keep dynamic=True"
            ) from e
        broke = [reason for reason, n in counters["graph_break"].items() if n > breaks_before.get(reason, 0)]
        if self._orig_mod.training:
            for reason in broke:
                if (line := reason.strip().split("\n")[0]) not in self._graph_breaks:
                    self._graph_breaks.append(line)
        if self._pending or broke:
            self._compiled_graphs += self._pending
            self._outside = self._outside_graphs()
            self._report = CompileReport(
                graphs=list(self._pending),
                tensor_parallel=self._tp_described(),
                graph_breaks=list(self._graph_breaks),
                outside_graphs=self._outside,
            )
            compiled = CompileReport(graphs=self._compiled_graphs)
            self._mixers_left_alone = compiled.token_mixers_left_alone()
            for source, hidden in compiled.opaque_regions().items():
                self._mixers_left_alone.setdefault(source, []).extend(hidden)
            self._check_mixers_reached(compiled)
        return out

    def _outside_graphs(self) -> list[str]:
        """Checkpointed layers (Hugging Face's flag) that no compiled graph holds as a checkpoint region: Dynamo gave
        up on their caller, and torch's checkpoint, which Dynamo never traces itself, ran them eagerly."""
        expected = _checkpointed_layers(self._orig_mod)
        found = sum(g.graph_before.count("tag_activation_checkpoint(") for g in self._compiled_graphs)
        if not self._compiled_graphs or found >= expected:
            return []
        why = f" (graph breaks: {'; '.join(self._graph_breaks)})" if self._graph_breaks else ""
        return [
            f"{expected - found} of {expected} checkpointed layers ran outside the compiled graphs{why}: their "
            "attention and mixers run eagerly, where a shared sequence's would see only a rank's own tokens; "
            "train without gradient checkpointing, or remove the graph break"
        ]

    def _check_mixers_reached(self, compiled: CompileReport) -> None:
        """`mixers_adapted`: the swapped mixers whose ops some compiled graph holds; the others go to
        `mixers_not_adapted` with the reason (warned once each)."""
        refused = [(path, reason) for path, reason in self.mixers_not_adapted if reason != BYPASSED]
        self.mixers_adapted, bypassed = split_reached(self._mixers_swapped, compiled.mixers_rewritten())
        for path, reason in bypassed:
            if (path, reason) not in self.mixers_not_adapted:
                logger.warning(
                    "token mixer `%s` stays as it is (%s): the model will be neither packed nor sharded", path, reason
                )
        self.mixers_not_adapted = refused + bypassed

    def _protocol_filled(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        """`kwargs`, for a call of the model protocol (`shift_labels` given), with what a Hugging Face forward needs to
        return its loss: `labels` = `shift_labels` where the forward names `labels` and takes `shift_labels` through
        **kwargs (it computes a loss only when labels is given, and reads the targets from shift_labels unshifted
        when that is given: the same loss), and `use_cache=False` where it names `use_cache`: with a cache, Hugging
        Face's mask reads a packed row as one sequence (it looks for restarting position_ids only without one), and
        a loss call decodes nothing. Only what the call leaves unset is filled."""
        if kwargs.get("shift_labels") is None:
            return kwargs
        params = self.__signature__.parameters
        given = self.__signature__.bind_partial(*args, **kwargs).arguments
        filled = dict(kwargs)
        if "labels" in params and "shift_labels" not in params and "labels" not in given:
            filled["labels"] = kwargs["shift_labels"]
        if "use_cache" in params and "use_cache" not in given:
            filled["use_cache"] = False
        return filled

    def _warn_unfused_backward(self, out: Any) -> None:
        """Warn, once per model and when a backward reaches it, about a loss of an eval-mode call whose graph left it
        unfused (`from_pretrained` returns models in eval mode): training so keeps the whole logits and their
        log-softmax, and the report that says so is rarely read."""
        if self.training or self._warned_eval_backward or not torch.is_grad_enabled():
            return
        loss = _output_field(out, "loss")
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad or not self._eval_loss_unfused():
            return
        logits = _output_field(out, "logits")
        vocab = logits.shape[-1] if isinstance(logits, torch.Tensor) and logits.dim() >= 1 else None
        loss.register_hook(functools.partial(self._warn_eval_backward, vocab=vocab))

    def _eval_loss_unfused(self) -> bool:
        """Whether a compiled graph left a loss unfused because the model was in eval mode."""
        compiled = CompileReport(graphs=self._compiled_graphs)
        return any(s.reason == EVAL_MODE for s in compiled.skipped(FUSED_LOSS))

    def _warn_eval_backward(self, grad: torch.Tensor, *, vocab: int | None) -> None:
        if self._warned_eval_backward:
            return
        self._warned_eval_backward = True
        saved = f" ({vocab * 4 / 1024:g} KiB per token for {vocab} logits)" if vocab else ""
        logger.warning(
            "%s is in eval mode during a backward (from_pretrained returns models in eval mode): its loss is not "
            "fused, so the logits are returned and their fp32 log-softmax is saved for the backward%s; call "
            "model.train() before training",
            type(self._orig_mod).__name__,
            saved,
        )

    def _without_cache(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        """`kwargs`, with `use_cache=False` for a training call of a model with swapped mixers that leaves it unset."""
        if not self._mixers_swapped:
            return kwargs
        arguments = self.__signature__.bind_partial(*args, **kwargs).arguments
        if wants_no_cache(self._orig_mod, self.__signature__, arguments):
            return {**kwargs, "use_cache": False}
        return kwargs

    def _tp_described(self) -> dict[str, str]:
        return self.tp_layout.describe() if self.tp_layout is not None else {}

    def _position_ids(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        arguments = self.__signature__.bind_partial(*args, **kwargs).arguments
        return arguments.get("position_ids", kwargs.get("position_ids"))  # also through **kwargs (Mamba2)

    def _row_packing(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        """The sequences packed in each row, ambient for the mixer ops, when the call packs them outside a
        micro-batch context (the ops cannot see `position_ids`); a host read of position_ids per such call."""
        arguments = self.__signature__.bind_partial(*args, **kwargs).arguments
        position_ids = arguments.get("position_ids", kwargs.get("position_ids"))
        input_ids = arguments.get("input_ids")
        if isinstance(position_ids, torch.Tensor) and isinstance(input_ids, torch.Tensor):
            if position_ids.shape[-1] != input_ids.shape[-1]:
                raise ValueError(
                    f"position_ids has {position_ids.shape[-1]} tokens per row but input_ids has "
                    f"{input_ids.shape[-1]}: they must describe the same tokens"
                )
        ctx: MicroBatchContext | None = current_context()
        if not self._mixers_swapped or not isinstance(position_ids, torch.Tensor) or position_ids.dim() < 1:
            return row_packing(None, 0)
        if ctx is not None and (ctx.is_ring or ctx.cu_seqlens is not None):
            return row_packing(None, 0)
        return row_packing(position_ids, position_ids.shape[-1])

    def _refuse_packed_mixers(self, args: tuple, kwargs: dict[str, Any]) -> None:
        """Raise `ShardingError` for a row that packs sequences (position_ids restart inside it) when a token
        mixer the compiler left alone would read across them. Raised before any backward: the result is unused.

        Hugging Face's eager forward is as wrong there (no `seq_idx`), so the eager model is no reference to
        fall back on. Costs a device sync, and only for such models.
        """
        mixers = self._mixers_left_alone
        if not mixers:
            return
        position_ids = self._position_ids(args, kwargs)
        if (
            isinstance(position_ids, torch.Tensor)
            and position_ids.dim() >= 1
            and bool((position_ids[..., 1:] == 0).any())
        ):
            layers = ", ".join(f"`{source}` ({', '.join(patterns)})" for source, patterns in list(mixers.items())[:3])
            raise ShardingError(
                f"position_ids restart inside a row, so the row packs several sequences, but "
                f"{len(mixers)} module(s) mix tokens in a way that would read across them: {layers}"
                f"{' ...' if len(mixers) > 3 else ''}. Pass one sequence per row (bytescale_compile's "
                f"Runtime does so for this model)"
            )

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "_orig_mod":
                raise
            return getattr(self._orig_mod, name)

    def extra_repr(self) -> str:
        return f"model={type(self._orig_mod).__name__}, compile_config={self.compile_config}"


def _ignored_logging_functions() -> set[Any]:
    """Dynamo's ignore set plus `LOGGER_METHODS`, looked up now: transformers adds its own on import."""
    methods = {getattr(logging.Logger, name) for name in LOGGER_METHODS if hasattr(logging.Logger, name)}
    return set(torch._dynamo.config.ignore_logging_functions) | methods


def _checkpointed_layers(model: nn.Module) -> int:
    """Modules with Hugging Face's `gradient_checkpointing` flag on and none below them (the layers themselves,
    not the model that also carries the flag)."""
    flagged = [m for m in model.modules() if getattr(m, "gradient_checkpointing", None) is True]
    ids = {id(m) for m in flagged}
    return sum(1 for m in flagged if not any(id(c) in ids for c in m.modules() if c is not m))


def _output_field(out: Any, name: str) -> Any:
    """`out.loss` / `out.logits` of a model's output: a Hugging Face `ModelOutput` (a mapping) or a named tuple."""
    return out.get(name) if isinstance(out, Mapping) else getattr(out, name, None)


def _mark_token_dim_dynamic(t: Any) -> None:
    """Dim 1 of `[B, T, ...]` inputs is the token dimension of the model protocol."""
    if isinstance(t, torch.Tensor) and t.dim() >= 2:
        torch._dynamo.maybe_mark_dynamic(t, 1)


_DECORATOR = object()
"""`optimize()`'s default model: called without one, it returns a decorator. An explicit None is an error
(a model that failed to load must not turn silently into a decorator)."""


def optimize(model: Any = _DECORATOR, config: CompileConfig | None = None, **overrides: Any) -> Any:
    """Optimize a module, or decorate a Module class so its instances come out optimized.

    model = optimize(model)                  # or optimize(model, CompileConfig(...), attention=False)
    @optimize                                 # or @optimize(CompileConfig(...)) / @optimize(fused_loss=False)
    class MyModel(nn.Module): ...
    """
    if isinstance(model, CompileConfig):
        model, config = _DECORATOR, model
    if config is not None and not isinstance(config, CompileConfig):
        raise TypeError(f"config must be a bytescale_compile.CompileConfig, got {type(config).__name__}")
    config = (config or CompileConfig()).with_overrides(**overrides)
    if model is _DECORATOR:
        return functools.partial(optimize, config=config)
    if isinstance(model, OptimizedModule):
        return model if model.compile_config == config else OptimizedModule(model.original_module, config)
    if isinstance(model, nn.Module):
        return OptimizedModule(model, config)
    if isinstance(model, type) and issubclass(model, nn.Module):
        return _optimized_class(model, config)
    raise TypeError(
        f"optimize() expects an nn.Module instance or subclass (or a CompileConfig, as @optimize(config)), "
        f"got {type(model).__name__} {model!r:.60}"
    )


def _optimized_class(cls: type[nn.Module], config: CompileConfig) -> type[nn.Module]:
    """A subclass of `cls` whose construction returns the optimized instance.

    Being a class keeps classmethods (`from_pretrained`) and the constructor signature; `__new__`
    returns an `OptimizedModule` around a plain `cls` instance, so `__init__` runs exactly once.
    """

    def __new__(klass: type, *args: Any, **kwargs: Any) -> OptimizedModule:
        return OptimizedModule(cls(*args, **kwargs), config)

    namespace = {
        "__new__": __new__,
        "__module__": cls.__module__,
        "__doc__": cls.__doc__,
        "__qualname__": cls.__qualname__,
        "__signature__": inspect.signature(cls),
    }
    return type(cls.__name__, (cls,), namespace)


def explain(model: nn.Module, *args: Any, **kwargs: Any) -> CompileReport:
    """Compile `model` on these inputs without training (no backward, no update) and report."""
    optimized = model if isinstance(model, OptimizedModule) else optimize(model)
    optimized.compile_and_run(*args, **kwargs)
    return optimized.report
