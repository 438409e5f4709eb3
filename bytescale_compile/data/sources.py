"""Users' text: JSONL, JSON, Parquet and plain-text files, directories of them, `datasets` directories.

Every record either becomes a document (a string with some non-whitespace) or is counted under the
reason it was left out, with its first few locations, so whoever trains on the result can see what the
data lost. Formats go by suffix: `.jsonl`/`.ndjson` one JSON record per line; `.json` an array of
records, one record, or JSON Lines under a `.json` name; `.parquet` a column per field; anything else
is plain UTF-8 text, one document per file. A directory is walked in sorted order (hidden entries
skipped); one written by `Dataset.save_to_disk` is read as that dataset.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["SKIP_REASONS", "Source", "SourceError", "SourceStats", "read_documents", "resolve_inputs"]

SKIP_REASONS = {
    "no_text_field": "records without a string text field",
    "empty": "empty or whitespace-only documents",
    "undecodable": "lines or files that are not valid UTF-8 / JSON",
}
_EXAMPLES = 3
"""Locations kept per skip reason: enough to find the problem, bounded for huge inputs."""
_BATCH_ROWS = 1024


class SourceError(ValueError):
    """An input that cannot be read at all (not a record that is skipped); names the path."""


@dataclass(frozen=True)
class Source:
    """One input to read: `kind` is "jsonl", "json", "parquet", "text" or "datasets"."""

    kind: str
    path: Path


@dataclass
class SourceStats:
    """What reading the inputs found, updated while the documents stream out."""

    records: int = 0
    documents: int = 0
    text_field: str = "text"
    skipped: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def skip(self, reason: str, where: str, count: int = 1) -> None:
        self.skipped[reason] += count
        places = self.examples.setdefault(reason, [])
        if len(places) < _EXAMPLES:
            places.append(where)

    def summary(self) -> str:
        lines = [f"{self.records} records read, {self.documents} documents kept"]
        for reason, count in sorted(self.skipped.items()):
            what = SKIP_REASONS[reason].replace("text field", f"{self.text_field!r} field")
            lines.append(f"  skipped {count} {what} (e.g. {'; '.join(self.examples[reason])})")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "records": self.records,
            "documents": self.documents,
            "skipped": dict(self.skipped),
            "examples": self.examples,
        }


def resolve_inputs(inputs: Sequence[str | Path]) -> list[Source]:
    """Every file to read, in order; a missing path fails here, before any work starts."""
    if not inputs:
        raise SourceError("no input paths given")
    sources: list[Source] = []
    for path in map(Path, inputs):
        if not path.exists():
            raise FileNotFoundError(f"input path {path} does not exist")
        sources.extend(_expand(path))
    return sources


def _expand(path: Path) -> Iterator[Source]:
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir())
        if not splits:
            raise SourceError(f"{path} is a DatasetDict without splits")
        raise SourceError(
            f"{path} is a DatasetDict with splits {splits}: pass the split to read, e.g. {path / splits[0]}"
        )
    if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
        yield Source("datasets", path)
    elif path.is_dir():
        for child in sorted(path.iterdir()):
            if not child.name.startswith("."):
                yield from _expand(child)
    elif path.is_file():
        yield Source(_kind(path), path)


def _kind(path: Path) -> str:
    suffix = path.suffix.lower()
    return {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet"}.get(suffix, "text")


def read_documents(sources: Sequence[Source], text_field: str, stats: SourceStats) -> Iterator[str]:
    """The documents of `sources` in order; skipped records are counted in `stats`."""
    readers = {"jsonl": _jsonl, "json": _json, "parquet": _parquet, "text": _text, "datasets": _datasets}
    stats.text_field = text_field
    for source in sources:
        for text in readers[source.kind](source.path, text_field, stats):
            stats.documents += 1
            yield text


def _keep(value: object, where: str, stats: SourceStats) -> str | None:
    """The text of one record's field value, or None after counting why it is left out."""
    stats.records += 1
    if not isinstance(value, str):
        stats.skip("no_text_field", where)
        return None
    if not value.strip():
        stats.skip("empty", where)
        return None
    return value


def _field(record: object, text_field: str) -> object:
    return record.get(text_field) if isinstance(record, dict) else None


def _jsonl(path: Path, text_field: str, stats: SourceStats) -> Iterator[str]:
    with open(path, "rb") as lines:
        for lineno, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                stats.records += 1
                stats.skip("undecodable", where)
                continue
            if (text := _keep(_field(record, text_field), where, stats)) is not None:
                yield text


def _json(path: Path, text_field: str, stats: SourceStats) -> Iterator[str]:
    try:
        data = json.loads(path.read_bytes())
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # more than one value: JSON Lines under a .json name
            yield from _jsonl(path, text_field, stats)
            return
        raise SourceError(f"{path}: not valid JSON ({e}); fix the file or leave it out") from e
    except UnicodeDecodeError as e:
        raise SourceError(f"{path}: not UTF-8 encoded JSON ({e})") from e
    records = data if isinstance(data, list) else [data]
    for i, record in enumerate(records):
        if (text := _keep(_field(record, text_field), f"{path}[{i}]", stats)) is not None:
            yield text


def _text(path: Path, text_field: str, stats: SourceStats) -> Iterator[str]:
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError:
        stats.records += 1
        stats.skip("undecodable", str(path))
        return
    if (kept := _keep(text, str(path), stats)) is not None:
        yield kept


def _parquet(path: Path, text_field: str, stats: SourceStats) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise SourceError(f"{path}: not a readable Parquet file ({e})") from e
    if text_field not in table.schema_arrow.names:
        stats.records += table.metadata.num_rows
        stats.skip("no_text_field", f"{path} (columns {table.schema_arrow.names})", table.metadata.num_rows)
        return
    batches = (batch.column(0).to_pylist() for batch in table.iter_batches(_BATCH_ROWS, columns=[text_field]))
    yield from _rows(batches, path, stats)


def _datasets(path: Path, text_field: str, stats: SourceStats) -> Iterator[str]:
    import datasets

    dataset = datasets.load_from_disk(str(path))
    if text_field not in dataset.column_names:
        stats.records += len(dataset)
        stats.skip("no_text_field", f"{path} (columns {dataset.column_names})", len(dataset))
        return
    batches = (batch[text_field] for batch in dataset.select_columns([text_field]).iter(_BATCH_ROWS))
    yield from _rows(batches, path, stats)


def _rows(batches: Iterator[list], path: Path, stats: SourceStats) -> Iterator[str]:
    """Column values batch by batch; a row's location is its index in the file."""
    row = 0
    for values in batches:
        for value in values:
            if (text := _keep(value, f"{path}, row {row}", stats)) is not None:
                yield text
            row += 1
