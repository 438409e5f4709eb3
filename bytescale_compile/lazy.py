"""Public names of a package loaded on first use (PEP 562), so importing the package costs nothing until a name
is used: `import bytescale_compile` and the trainer's `--help` do not pay for torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["lazy_getattr"]


def lazy_getattr(package: str, exports: dict[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package`: imports the module `exports` names (relative, e.g. ".api") for a
    public name when it is first asked for, and caches the name in `namespace` (the package's globals())."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name], package), name)
        namespace[name] = value
        return value

    return __getattr__
