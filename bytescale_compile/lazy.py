"""Public names of a package loaded on first use (PEP 562), so importing the package costs nothing until a name
is used: `import bytescale_compile` and the trainer's `--help` do not pay for torch. Also names and modules that
moved, kept importable for one release with a `DeprecationWarning` that names the new place."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

__all__ = ["alias_moved_modules", "lazy_getattr", "moved"]


def moved(old: str, new: str) -> None:
    """Warn that `old` (a dotted name) is now `new`: the old one goes in the next release."""
    warnings.warn(f"{old} moved to {new}; the old name goes in the next release", DeprecationWarning, stacklevel=3)


def lazy_getattr(
    package: str,
    exports: Mapping[str, str],
    namespace: dict[str, Any],
    *,
    renamed: Mapping[str, str] | None = None,
) -> Callable[[str], Any]:
    """A module `__getattr__` for `package`: imports the module `exports` names (relative, e.g. ".api") for a
    public name when it is first asked for, and caches the name in `namespace` (the package's globals()).

    `renamed` maps a former name to where it is now ("bytescale_compile.engine.runtime:Runtime"): it still
    resolves, with a `DeprecationWarning`, and is not cached so that every use warns."""
    renamed = renamed or {}

    def __getattr__(name: str) -> Any:
        if name in renamed:
            module, _, new = renamed[name].partition(":")
            moved(f"{package}.{name}", f"{module}.{new}")
            return getattr(importlib.import_module(module), new)
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name], package), name)
        namespace[name] = value
        return value

    return __getattr__


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves a former module path to the module now holding its code, so `import` of the old path and
    pickles naming it still work; the module object is the same one."""

    def __init__(self, modules: Mapping[str, str]) -> None:
        self.modules = dict(modules)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.modules:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        moved(spec.name, self.modules[spec.name])
        return importlib.import_module(self.modules[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        """The module it resolves to has already run."""


def alias_moved_modules(modules: Mapping[str, str]) -> None:
    """Keep each former module path in `modules` (old -> new, absolute) importable for one release."""
    sys.meta_path.append(_MovedModuleFinder(modules))
