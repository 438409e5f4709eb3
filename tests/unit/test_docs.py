"""The documentation's links: every relative link and image resolves to a file of the repository, every
`#anchor` to a heading of its page, and nothing points outside the repository.

Checked: README.md, docs/**/*.md, benchmarks/**/*.md and tests/README.md when present. Links inside code
(fenced blocks, `inline code`) are not links and are skipped. Fast: no torch import.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[2]
ALLOWED_HOSTS = {"arxiv.org"}
"""External sites a page may link to. Prefer plain text; add a host here only where a link is needed."""

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
_INLINE_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^\s()]*(?:\([^\s()]*\)[^\s()]*)*)(?:\s+[\"'(][^)]*)?\)"
)
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")


def doc_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "benchmarks").rglob("*.md"))]
    files += [p for p in [ROOT / "tests" / "README.md"] if p.exists()]
    return [p for p in files if p.exists()]


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced code blocks."""
    lines, fenced = [], None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        fence = _FENCE.match(line)
        if fence:
            fenced = None if fenced == fence.group(1) else (fenced or fence.group(1))
            continue
        if fenced is None:
            lines.append((number, line))
    return lines


def links(path: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in prose_lines(path):
        line = _INLINE_CODE.sub("", line)
        found += [(number, m.group(1)) for m in _INLINE_LINK.finditer(line)]
        found += [(number, m.group(1)) for m in [_REFERENCE.match(line)] if m]
    return [(number, target.strip("<>")) for number, target in found]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lower-cased, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    text = re.sub(r"(\*\*|__|\*|_)(\S(?:.*?\S)?)\1", r"\2", text)
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a link may name in `path`: its headings' slugs (repeats numbered -1, -2, ...) and HTML anchors."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(path):
        found.update(_HTML_ANCHOR.findall(line))
        m = _HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def link_problem(page: Path, target: str) -> str | None:
    """Why `target`, linked from `page`, is broken or leaves the repository; None when it is fine."""
    parts = urlsplit(target)
    if parts.scheme or target.startswith("//"):
        if parts.scheme not in ("http", "https"):
            return f"scheme {parts.scheme or '//'!r} is not allowed"
        host = (parts.hostname or "").removeprefix("www.")
        return None if host in ALLOWED_HOSTS else f"external host {host!r} is not in ALLOWED_HOSTS"
    path, fragment = unquote(parts.path), unquote(parts.fragment)
    if path.startswith("/") or re.match(r"^[A-Za-z]:[\\/]", path):
        return "absolute path: link relative to the page"
    file = (page.parent / path).resolve() if path else page
    if not file.is_relative_to(ROOT):
        return "points outside the repository"
    if not file.exists():
        return "no such file"
    if fragment and file.suffix == ".md" and fragment not in anchors(file):
        return f"no heading with anchor #{fragment} in {file.relative_to(ROOT)}"
    return None


PAGES = doc_files()


def test_the_pages_exist():
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "benchmarks/RESULTS.md"} <= names
    assert any(name.startswith("docs/") for name in names)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_link_resolves_inside_the_repository(page):
    broken = [
        f"{page.relative_to(ROOT)}:{number}: ({target}) {why}"
        for number, target in links(page)
        if (why := link_problem(page, target))
    ]
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_text_names_a_path_outside_the_repository(page):
    """Code spans and blocks included: a reader of the repository has neither ../shared nor this machine's paths."""
    text = page.read_text(encoding="utf-8")
    bad = [
        f"{page.relative_to(ROOT)}:{n}: {line.strip()}"
        for n, line in enumerate(text.splitlines(), 1)
        if re.search(r"\.\./shared|(?<![\w.~])/(?:work|home|tmp|root|Users)/", line)
    ]
    assert not bad, "\n".join(bad)


def test_the_checker_catches_what_it_should(tmp_path):
    page = ROOT / "docs" / "_probe.md"
    assert link_problem(page, "../README.md") is None
    assert link_problem(page, "../README.md#no-such-heading") is not None
    assert link_problem(page, "../../outside.md") == "points outside the repository"
    assert link_problem(page, "/etc/passwd") is not None
    assert link_problem(page, "file:///etc/passwd") is not None
    assert link_problem(page, "https://arxiv.org/abs/2502.21231") is None
    assert link_problem(page, "https://example.com/") is not None
    assert slug("Part 2 — compiler core (2026-11-22)") == "part-2--compiler-core-2026-11-22"
    assert slug("The `token_mixers` pass") == "the-token_mixers-pass"
    sample = tmp_path / "sample.md"
    sample.write_text(
        "# A\n\n```\n[x](missing.md)\n# not a heading\n```\nsee `[y](missing.md)` and [z](other.md) "
        "![i](pic.png)\n## A\n[ref]: <ref.md>\n### The `--pp` flag\n",
        encoding="utf-8",
    )
    assert links(sample) == [(7, "other.md"), (7, "pic.png"), (9, "ref.md")]
    assert anchors(sample) == {"a", "a-1", "the---pp-flag"}


CURRENT_RESULTS_MAX_BYTES = 25_000
"""The current section of benchmarks/RESULTS.md stays readable in one sitting; older figures go to history/."""


def test_the_current_results_stay_short():
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")
    start = text.index("\n## Current")
    end = text.find("\n## ", start + 1)
    current = text[start : end if end != -1 else len(text)]
    assert len(current.encode()) <= CURRENT_RESULTS_MAX_BYTES, (
        f"RESULTS.md's current section is {len(current.encode()):,} bytes, over {CURRENT_RESULTS_MAX_BYTES:,}: move "
        "superseded tables to benchmarks/history/"
    )
