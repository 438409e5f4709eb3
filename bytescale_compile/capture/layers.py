"""Mark the repeated decoder layers of a model so Dynamo traces one and reuses it (`CompileConfig(compile_layers_once=True)`).

The layers are found by structure, not by name: the `nn.ModuleList` of same-class children holding the
most parameters (`model.layers` of a Hugging Face model, `layers` of ours). Each child's class is swapped for a
subclass whose `forward` is wrapped in `torch.compiler.nested_compile_region`: the class's own function,
so every layer passes itself (and with it its weights) as an operand of the one body. Wrapping a bound
method per instance instead made torch 2.13 reuse the first layer's weights for every layer. The
original class is untouched (other instances and plain `torch.compile` of it behave as before), and in
eager mode the wrapper is a no-op.
"""

from __future__ import annotations

import functools
import logging
from typing import cast

import torch
from torch import nn

__all__ = ["mark_repeated_layers", "repeated_layers"]

log = logging.getLogger(__name__)

_MARKED = "_bytescale_compiled_once"


def repeated_layers(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The ModuleList of at least 2 same-class children holding the most parameters, with its path; None if none.

    Parameters, not length: a MoE layer's list of experts may be longer than the list of layers holding it.
    """
    lists = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.ModuleList) and len(m) >= 2 and len({_original(type(c)) for c in m}) == 1
    ]
    return max(lists, key=lambda item: sum(p.numel() for p in item[1].parameters()), default=None)


def mark_repeated_layers(model: nn.Module) -> str | None:
    """Mark each layer of `repeated_layers(model)` as a nested compile region; the list's path, or None."""
    found = repeated_layers(model)
    if found is None:
        log.info(
            "compile_layers_once: %s has no ModuleList of identical layers; compiling it whole", type(model).__name__
        )
        return None
    path, layers = found
    if any(getattr(layer, "gradient_checkpointing", False) is True for layer in layers):
        raise ValueError(
            f"CompileConfig(compile_layers_once=True) with gradient checkpointing on the layers of `{path}`: torch's "
            f"Dynamo cannot trace a layer compiled once inside a checkpointed region. Turn one of them off: "
            f"model.gradient_checkpointing_disable(), or CompileConfig(compile_layers_once=False) (checkpointed layers "
            f"are rewritten as any other)"
        )
    for layer in layers:
        layer.__class__ = _marked_class(type(layer))
    log.info(
        "compile_layers_once: the %d layers of `%s` (%s) share one compiled body",
        len(layers),
        path or "<root>",
        _original(type(layers[0])).__name__,
    )
    return path


def _original(cls: type) -> type:
    return cls.__bases__[0] if getattr(cls, _MARKED, False) else cls


def _marked_class(cls: type) -> type:
    """`cls` with its forward marked (isinstance and names unchanged); a marked class is its own."""
    return cls if getattr(cls, _MARKED, False) else _subclass(cls)


@functools.cache
def _subclass(cls: type) -> type:
    """Made once per class and reused: every model of the class shares one marked class, so Dynamo sees one."""
    forward = cast(type[nn.Module], cls).forward
    namespace = {
        "forward": torch.compiler.nested_compile_region(forward),
        _MARKED: True,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
    }
    return type(cls.__name__, (cls,), namespace)
