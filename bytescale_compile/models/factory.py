"""`package.module:factory` specs: the way the CLI and the trainer name a model they build by calling a function."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

__all__ = ["FactoryError", "load_factory", "resolve_factory"]


class FactoryError(ValueError):
    """A MODULE:FACTORY spec that names nothing callable, or a factory that builds no `nn.Module`."""


def _cwd_importable() -> None:
    """MODULE:FACTORY specs name modules of the current project, like `python -m` would find them."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


def resolve_factory(spec: str) -> Callable[[], Any]:
    """`package.module:factory` → the factory, imported but not called (the current directory is importable)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise FactoryError(f"expected MODULE:FACTORY (e.g. bytescale_compile.models.llama:small), got {spec!r}")
    _cwd_importable()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise FactoryError(f"cannot import module {module_name!r}: {e}") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise FactoryError(f"{module_name} has no callable {attr!r}")
    return factory


def load_factory(spec: str) -> nn.Module:
    """`package.module:factory` → the model the factory builds."""
    from torch import nn

    model = resolve_factory(spec)()
    if not isinstance(model, nn.Module):
        raise FactoryError(f"{spec} returned {type(model).__name__}, not an nn.Module")
    return model
