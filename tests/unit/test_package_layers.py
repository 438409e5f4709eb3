"""The package's layers hold: every import of `bytescale_compile` (top-level, inside functions, under
TYPE_CHECKING) runs down its stack, and no modules or subpackages import each other in a cycle.

Two stacks, each from the bottom up, on a floor that imports nothing of ours (`config`, `units`, `strategies`,
`lazy`, `models`):

    kernels -> runtime -> ops -> passes -> capture -> api
    data -> planner -> sim

`engine` (the Runtime) sits above both, the trainer application `train` above it; `cli` is on top and
`testing` (the tests' and benchmarks' process spawner) beside it, and nothing in the package imports either. Read with `ast` alone: fast, nothing is imported.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "bytescale_compile"
FLOOR = ("config", "units", "strategies", "lazy", "models")
STACKS = (("kernels", "runtime", "ops", "passes", "capture", "api"), ("data", "planner", "sim"))
ABOVE_BOTH = "engine"
APPLICATION = "train"
TOP = ("cli", "testing")


def _allowed() -> dict[str, set[str]]:
    """Unit -> the units it may import."""
    allowed: dict[str, set[str]] = {unit: set() for unit in FLOOR}
    for stack in STACKS:
        for i, unit in enumerate(stack):
            allowed[unit] = {*FLOOR, *stack[:i]}
    allowed[ABOVE_BOTH] = {*FLOOR, *(unit for stack in STACKS for unit in stack)}
    allowed[APPLICATION] = {*allowed[ABOVE_BOTH], ABOVE_BOTH}
    allowed["cli"] = {*allowed[APPLICATION], APPLICATION}
    allowed["testing"] = set()
    return allowed


ALLOWED = _allowed()


def _module_name(path: Path) -> str:
    parts = path.with_suffix("").relative_to(PACKAGE.parent).parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unit(module: str) -> str:
    """The subpackage or top-level module `module` belongs to ("" for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path, module: str, modules: set[str]) -> set[str]:
    """The package's modules `path` imports, anywhere in it; `from pkg import name` counts as the submodule
    `pkg.name` where one exists."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` of a name inside a module: that module
                target = target.rpartition(".")[0]
            if target and target != module:
                found.add(target)
    return found


def module_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {module: _imports(path, module, set(paths)) for module, path in paths.items()}


def unit_graph(modules: dict[str, set[str]]) -> dict[str, set[str]]:
    """Unit -> the other units it imports. The package's own `__init__` (lazy public names) is the facade over
    every layer and left out, as is importing it."""
    units: dict[str, set[str]] = defaultdict(set)
    for module, imported in modules.items():
        for target in imported:
            src, dst = _unit(module), _unit(target)
            if src and dst and src != dst:
                units[src].add(dst)
    return units


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.fixture(scope="module")
def modules() -> dict[str, set[str]]:
    return module_graph()


def test_every_unit_has_a_layer(modules):
    units = {_unit(m) for m in modules} - {""}
    assert units <= set(ALLOWED), f"units without a layer: {sorted(units - set(ALLOWED))}; add them to this test"


def test_imports_run_down_the_layers(modules):
    upward = sorted(
        f"{module} -> {target}"
        for module, imported in modules.items()
        for target in imported
        if _unit(module)
        and _unit(target)
        and _unit(module) != _unit(target)
        and _unit(target) not in ALLOWED.get(_unit(module), set())
    )
    assert not upward, "imports that run upward or across the stacks:\n" + "\n".join(upward)


def test_no_cycle_between_units(modules):
    found = cycles(unit_graph(modules))
    assert not found, f"subpackages that import each other: {found}"


def test_no_cycle_between_modules(modules):
    found = cycles(modules)
    assert not found, f"modules that import each other (imports under TYPE_CHECKING count too): {found}"


def test_the_checks_see_lazy_and_type_checking_imports(tmp_path):
    """The graph counts an import inside a function and one under TYPE_CHECKING, and resolves `from . import x`."""
    source = (
        "from typing import TYPE_CHECKING\nfrom . import sibling\nif TYPE_CHECKING:\n    from ..planner import plan\n"
        "def f():\n    from ..sim.simulator import step_time\n"
    )
    path = tmp_path / "probe.py"
    path.write_text(source)
    known = {
        "bytescale_compile.passes.sibling",
        "bytescale_compile.planner",
        "bytescale_compile.sim.simulator",
        "bytescale_compile.passes.probe",
    }
    assert _imports(path, "bytescale_compile.passes.probe", known) == known - {"bytescale_compile.passes.probe"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_name_loaded_on_first_use_is_also_a_module_of_its_package():
    """A package's `_EXPORTS` name that is also one of its modules' names reads as the module once anything imports
    that module first (the import system sets the attribute, and `__getattr__` is never asked)."""
    clashes = []
    for init in PACKAGE.rglob("__init__.py"):
        for node in ast.walk(ast.parse(init.read_text())):
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets):
                names = {key.value for key in node.value.keys if isinstance(key, ast.Constant)}
                modules = {path.stem for path in init.parent.glob("*.py")} | {
                    path.name for path in init.parent.iterdir() if (path / "__init__.py").exists()
                }
                clashes += [f"{init.parent.name}.{name}" for name in sorted(names & modules)]
    assert not clashes, f"names that are also modules of their package: {clashes}"
