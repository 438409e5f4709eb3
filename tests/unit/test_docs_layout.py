"""docs/design.md's layout names the package as it is: every module file under `bytescale_compile/` is named in
the entry of its package (packages by their folder), and every file an entry names exists, so a split or a rename
shows up here until the page follows it.

The layout is the first fenced block under the page's "## Layout" heading. An entry starts at a line indented two
spaces under `bytescale_compile/`: a package's folder (`engine/`) or top-level files (`api.py config.py`); the
lines indented further continue it. Files are named as `name.py`. Fast: no torch import.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "bytescale_compile"
DESIGN = ROOT / "docs" / "design.md"
TOP_LEVEL = ""
"""The entry key of the package's own top-level modules."""

_FILE = re.compile(r"(?<![\w/.])(\w+)\.py\b")


@dataclass
class Entry:
    """One package folder of the layout (or the top level, `TOP_LEVEL`) and the text that describes it."""

    folder: str
    text: list[str] = field(default_factory=list)

    def files(self) -> set[str]:
        """The `name.py` files the entry names, as file names."""
        return {f"{name}.py" for line in self.text for name in _FILE.findall(line)}


def layout_block(page: str) -> list[str]:
    """The lines of the first fenced block after the "## Layout" heading."""
    lines = page.splitlines()
    start = lines.index("## Layout")
    fences = [i for i in range(start, len(lines)) if lines[i].startswith("```")]
    if len(fences) < 2:
        raise AssertionError(f"{DESIGN.relative_to(ROOT)}: no fenced block under '## Layout'")
    return lines[fences[0] + 1 : fences[1]]


def layout_entries(block: list[str]) -> dict[str, Entry]:
    """The package's entries by folder ("engine", "cli", ...; `TOP_LEVEL` for its own modules)."""
    entries: dict[str, Entry] = {}
    current: Entry | None = None
    in_package = False
    for line in block:
        indent = len(line) - len(line.lstrip(" "))
        if not line.strip():
            continue
        if indent == 0:  # a root: the package itself, or examples/, benchmarks/, tests/ after it
            in_package, current = line.split()[0] == f"{PACKAGE.name}/", None
            continue
        if not in_package:
            continue
        if indent == 2:
            head = line.split()[0]
            folder = head.rstrip("/") if head.endswith("/") else TOP_LEVEL
            current = entries.setdefault(folder, Entry(folder))
        if current is not None:
            current.text.append(line if current.folder == TOP_LEVEL or indent > 2 else line.split(None, 1)[-1])
    return entries


def module_files() -> dict[str, set[str]]:
    """Every module file under the package by folder relative to it (`TOP_LEVEL` for its own), `__init__.py` aside."""
    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if "__pycache__" in path.parts:
            continue
        folder = path.parent.relative_to(PACKAGE).as_posix()
        found.setdefault(TOP_LEVEL if folder == "." else folder, set())
        if path.name != "__init__.py":
            found[TOP_LEVEL if folder == "." else folder].add(path.name)
    return found


def unnamed(entries: dict[str, Entry], modules: dict[str, set[str]]) -> list[str]:
    """The module files (and package folders) the layout does not name."""
    missing = [f"{folder}/" for folder in modules if folder != TOP_LEVEL and folder not in entries]
    for folder, files in modules.items():
        named = entries[folder].files() if folder in entries else set()
        missing += [f"{folder}/{name}" if folder else name for name in sorted(files - named)]
    return sorted(missing)


def stale(entries: dict[str, Entry], modules: dict[str, set[str]]) -> list[str]:
    """The files (and folders) the layout names that the package does not have."""
    gone = [f"{folder}/" for folder in entries if folder != TOP_LEVEL and folder not in modules]
    for folder, entry in entries.items():
        if folder in modules:
            have = modules[folder] | {"__init__.py"}
            gone += [f"{folder}/{name}" if folder else name for name in sorted(entry.files() - have)]
    return sorted(gone)


def test_every_module_is_named_in_the_layout():
    entries = layout_entries(layout_block(DESIGN.read_text(encoding="utf-8")))
    missing = unnamed(entries, module_files())
    assert not missing, f"docs/design.md's layout does not name: {', '.join(missing)}"


def test_the_layout_names_no_file_the_package_lacks():
    entries = layout_entries(layout_block(DESIGN.read_text(encoding="utf-8")))
    gone = stale(entries, module_files())
    assert not gone, f"docs/design.md's layout names files that do not exist: {', '.join(gone)}"


def test_the_checker_catches_what_it_should():
    block = [
        "bytescale_compile/",
        "  __init__.py                 the public surface",
        "  api.py config.py            optimize(); CompileConfig",
        "  engine/                     runtime.py (the Runtime; the former train/engine.py), batch.py",
        "                              mesh.py",
        "  sim/                        lengths",
        "benchmarks/                   scripts; RESULTS.md and x.py are not the package's",
    ]
    entries = layout_entries(block)
    assert entries[TOP_LEVEL].files() == {"__init__.py", "api.py", "config.py"}
    assert entries["engine"].files() == {"runtime.py", "batch.py", "mesh.py"}  # train/engine.py is another folder's
    modules = {TOP_LEVEL: {"api.py", "config.py", "cli.py"}, "engine": {"runtime.py", "mesh.py"}, "sim": {"lengths.py"}}
    modules["data"] = {"dataset.py"}
    assert unnamed(entries, modules) == ["cli.py", "data/", "data/dataset.py", "sim/lengths.py"]
    assert stale(entries, modules) == ["engine/batch.py"]
    assert stale(entries, {TOP_LEVEL: {"api.py", "config.py"}}) == ["engine/", "sim/"]
    assert layout_block("# t\n\n## Layout\n\ntext\n\n```\nbytescale_compile/\n```\n") == ["bytescale_compile/"]
