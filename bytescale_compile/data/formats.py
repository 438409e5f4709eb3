"""One `--data` item opened in whichever format it is, told apart by the files at its path.

- `PREFIX` with `PREFIX.json`: our own format (`data prepare`, `write_dataset`), `TokenDataset`;
- `PREFIX` with `PREFIX.bin` and `PREFIX.idx`: a Megatron-LM indexed dataset, `MegatronDataset`;
- a folder written by `Dataset.save_to_disk`, an `.arrow` file or a folder of them: Hugging Face `datasets`,
  memory-mapped, `HFDataset`;
- a `.parquet`, `.jsonl`, `.ndjson` or `.json` (JSON Lines) file, or a folder of them: token ids converted
  once into our own format in a cache (`token_files.py`).

The last three need the vocabulary as an option (`spec.DataItem`); a folder is read recursively, its files by
suffix, as `load_dataset(data_dir=...)` picks them.
"""

from __future__ import annotations

from pathlib import Path

from .dataset import DatasetError, TokenDataset, dataset_files
from .hf_datasets import HFDataset, arrow_files, visible_files
from .megatron import MegatronDataset, megatron_files
from .spec import DEFAULT_COLUMN, DataItem
from .token_files import TOKEN_FILE_SUFFIXES, convert_token_files
from .vocabulary import resolve_vocabulary

__all__ = ["held_out_path", "open_dataset"]

_ARROW = ".arrow"
_HF_METADATA = frozenset({"dataset_info.json", "state.json", "dataset_dict.json"})
"""JSON files of `datasets` folders and caches that are not data."""
_NUMPY_MAGIC = b"\x93NUMPY"
"""How our own `.idx` starts (np.save), where Megatron's has its magic."""


def open_dataset(item: str) -> TokenDataset:
    """The dataset of one `--data` item, `PATH` or `PATH?options` (module docstring)."""
    parsed = DataItem.parse(item)
    path = Path(parsed.path)
    if dataset_files(path)[0].is_file():
        _refuse_options(parsed, [], "a dataset of `data prepare` records its vocabulary and tokenizer")
        return TokenDataset.open(path)
    idx_path, bin_path = megatron_files(path)
    if idx_path.is_file() or bin_path.is_file():
        _refuse_options(parsed, ["vocab_size", "tokenizer"], "a Megatron dataset has no columns")
        if idx_path.is_file() and _starts_with(idx_path, _NUMPY_MAGIC):
            raise FileNotFoundError(f"dataset file {dataset_files(path)[0]} not found")  # ours, never finished
        return MegatronDataset.open(path, parsed.vocab_size, parsed.tokenizer)
    stem = path.with_suffix("")
    if path.suffix in (".json", ".idx", ".bin") and (
        all(p.is_file() for p in dataset_files(stem)) or all(p.is_file() for p in megatron_files(stem))
    ):
        raise DatasetError(f"{path} is a file of the dataset {stem}: give the dataset's prefix, {stem}")
    files = _data_files(path)
    column = parsed.column or DEFAULT_COLUMN
    if all(file.suffix.lower() == _ARROW for file in files):
        return HFDataset.open(path, parsed.vocab_size, parsed.tokenizer, column)
    if any(file.suffix.lower() == _ARROW for file in files):
        raise DatasetError(
            f"{path} holds both Arrow files (read in place) and Parquet/JSON Lines files (converted): give them "
            "as two datasets"
        )
    vocabulary = resolve_vocabulary(path, parsed.vocab_size, parsed.tokenizer)
    return convert_token_files(files, path.stem if path.is_file() else path.name, vocabulary, column)


def held_out_path(path: str) -> str:
    """Where the held-out split of the dataset at `path` is: `PATH_eval`, or `NAME_eval.SUFFIX` for a
    Parquet, JSON Lines or Arrow file."""
    data = Path(path)
    if data.suffix.lower() in (*TOKEN_FILE_SUFFIXES, _ARROW):
        return str(data.with_name(f"{data.stem}_eval{data.suffix}"))
    return str(data.with_name(f"{data.name}_eval"))


def _refuse_options(item: DataItem, allowed: list[str], why: str) -> None:
    given = [key for key in item.options if key not in allowed]
    if given:
        raise DatasetError(f"--data {item}: option(s) {given} do not apply to {item.path}: {why}")


def _starts_with(path: Path, magic: bytes) -> bool:
    with open(path, "rb") as f:
        return f.read(len(magic)) == magic


def _data_files(path: Path) -> list[Path]:
    """The Arrow, Parquet or JSON Lines files at `path`: a save_to_disk folder's, a file, or a folder's."""
    if not path.exists():
        raise FileNotFoundError(
            f"dataset file {dataset_files(path)[0]} not found (a dataset of `data prepare`), nor {path}.bin and "
            f"{path}.idx (Megatron), nor a file or folder of Hugging Face `datasets`, Arrow, Parquet or JSON Lines"
        )
    if path.is_dir() and (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir())
        raise DatasetError(f"{path} is a DatasetDict with splits {splits}: give one split's folder, e.g. {path}/train")
    if path.is_dir() and (path / "state.json").is_file():
        return arrow_files(path)
    suffixes = (*TOKEN_FILE_SUFFIXES, _ARROW)
    if path.is_file():
        if path.suffix.lower() not in suffixes:
            raise DatasetError(f"{path}: not a dataset file (expected .arrow, .parquet, .jsonl, .ndjson or .json)")
        return [path]
    files = [p for p in visible_files(path) if p.suffix.lower() in suffixes and p.name not in _HF_METADATA]
    if not files:
        raise DatasetError(f"{path}: no .arrow, .parquet, .jsonl, .ndjson or .json files in the folder")
    return files
