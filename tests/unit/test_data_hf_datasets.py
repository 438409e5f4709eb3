"""Hugging Face `datasets` folders and Arrow files read in place (data/hf_datasets.py), and Parquet / JSON Lines
token files converted once into our own format (data/token_files.py), all opened through `--data`.

The folders are written by `datasets` itself (`Dataset.save_to_disk`) and the files by pyarrow; the batches
drawn from them must equal those drawn from the same sequences in our own format."""

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

from bytescale_compile.data import (  # noqa: E402
    DatasetError,
    HFDataset,
    TokenDataset,
    eval_spec,
    open_data,
    write_dataset,
)
from bytescale_compile.data.token_files import CACHE_ENV  # noqa: E402
from tests.unit.test_data_megatron import assert_same_batches  # noqa: E402

datasets.disable_progress_bars()

VOCAB = 5000


def skewed(n: int, seed: int = 0) -> list[np.ndarray]:
    """Heavy-tailed lengths 1..3000, so budgets, truncation and min_len all bite."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.pareto(1.2, n) * 40 + 1, 3000).astype(int)
    return [rng.integers(0, VOCAB, k) for k in lengths]


@pytest.fixture(scope="module")
def sequences() -> list[np.ndarray]:
    return skewed(300)


@pytest.fixture(scope="module")
def ours(tmp_path_factory, sequences) -> TokenDataset:
    return write_dataset(tmp_path_factory.mktemp("ours") / "ours", sequences, source="same", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, sequences) -> Path:
    """`save_to_disk` in 3 shards, an int32 token column beside a text column, record batches of 64 rows."""
    path = tmp_path_factory.mktemp("hf") / "saved"
    features = datasets.Features(
        {"input_ids": datasets.List(datasets.Value("int32")), "text": datasets.Value("string")}
    )
    rows = {"input_ids": [s.tolist() for s in sequences], "text": ["x"] * len(sequences)}
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(path, num_shards=3, max_shard_size=None)
    return path


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def table(sequences: list[np.ndarray], column: str = "input_ids", value=None) -> "pa.Table":
    return pa.table({column: pa.array([s.tolist() for s in sequences], type=pa.list_(value or pa.int64()))})


# --- save_to_disk and Arrow files ----------------------------------------------------------------


def test_save_to_disk_batches_equal_our_format(saved, ours, sequences):
    theirs, weights = open_data(f"{saved}?vocab_size={VOCAB}")
    assert isinstance(theirs, HFDataset) and weights is None
    assert len(list(saved.glob("*.arrow"))) == 3 and theirs.dtype == np.int32 and theirs.column == "input_ids"
    assert np.array_equal(theirs.lengths, ours.lengths)
    assert_same_batches(ours, theirs)
    long = int(np.flatnonzero(theirs.lengths >= 5)[0])
    assert theirs.tokens(long, 2, 5).tolist() == sequences[long][2:5].tolist()
    assert theirs.max_token() == ours.max_token()


def test_arrow_files_and_folders(tmp_path, saved, ours):
    folder = tmp_path / "cache_files"
    folder.mkdir()
    for shard in sorted(saved.glob("*.arrow")):
        shutil.copy(shard, folder / shard.name)
    (folder / "dataset_info.json").write_text("{}")
    (folder / ".hidden.arrow").write_bytes(b"not arrow")
    assert_same_batches(ours, open_data(f"{folder}?vocab_size={VOCAB}")[0])
    first = sorted(folder.glob("data-*.arrow"))[0]
    one = open_data(f"{first}?vocab_size={VOCAB}")[0]
    assert one.tokens(0).tolist() == ours.tokens(0).tolist()
    ipc_file = tmp_path / "ids.arrow"  # the IPC file format (Feather v2), besides datasets' stream format
    with pa.ipc.new_file(ipc_file, table(ours_sequences := [ours.tokens(i).numpy() for i in range(5)]).schema) as w:
        w.write_table(table(ours_sequences))
    assert open_data(f"{ipc_file}?vocab_size={VOCAB}")[0].lengths.tolist() == ours.lengths[:5].tolist()


def test_pickles_and_reopens_from_its_spec(saved, sequences):
    ds = HFDataset.open(saved, vocab_size=VOCAB)
    data = pickle.dumps(ds)
    assert len(data) < 1000
    clone = pickle.loads(data)
    assert clone == ds and clone.tokens(299).tolist() == sequences[299].tolist()
    assert open_data(ds.spec)[0].lengths.tolist() == ds.lengths.tolist()


def test_other_columns_types_and_nulls(tmp_path):
    path = tmp_path / "cols"
    rows = {"tokens": [[1, 2], [3]], "text": ["a", "b"], "fixed": [[1, 2], [3, 4]], "maybe": [[1], None]}
    features = datasets.Features(
        {
            "tokens": datasets.List(datasets.Value("int64")),
            "text": datasets.Value("string"),
            "fixed": datasets.List(datasets.Value("uint16"), length=2),
            "maybe": datasets.List(datasets.Value("int64")),
        }
    )
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(path)
    ds, _ = open_data(f"{path}?vocab_size=10&column=tokens")
    assert ds.tokens(0).tolist() == [1, 2] and ds.spec == f"{path}?vocab_size=10&column=tokens"
    fixed, _ = open_data(f"{path}?vocab_size=10&column=fixed")
    assert fixed.lengths.tolist() == [2, 2] and fixed.tokens(1).tolist() == [3, 4]
    with pytest.raises(DatasetError, match=r"no column 'input_ids' \(it has .*'tokens'.*'PATH\?column=NAME'"):
        open_data(f"{path}?vocab_size=10")
    with pytest.raises(DatasetError, match="column 'text' is string, not lists of integer token ids .*data prepare"):
        open_data(f"{path}?vocab_size=10&column=text")
    with pytest.raises(DatasetError, match="data-00000-of-00001.arrow: row 1: column 'maybe' is null"):
        open_data(f"{path}?vocab_size=10&column=maybe")


def test_vocabulary_and_ids_checked(saved, tmp_path):
    with pytest.raises(DatasetError, match=r"do not record the vocabulary.*\?vocab_size=N"):
        open_data(str(saved))
    small = tmp_path / "small"
    datasets.Dataset.from_dict({"input_ids": [[1, 2], [3, 70, 4]]}).save_to_disk(small)
    ds = HFDataset.open(small, vocab_size=50)
    with pytest.raises(
        DatasetError, match=r"data-00000-of-00001\.arrow: byte \d+: token id 70 is outside the vocabulary 0\.\.49"
    ) as e:
        ds.check_tokens()
    arrow, offset = str(e.value).split(": byte ")[0], int(str(e.value).split(": byte ")[1].split(":")[0])
    stored = Path(arrow).read_bytes()[offset : offset + ds.dtype.itemsize]
    assert np.frombuffer(stored, dtype=ds.dtype)[0] == 70
    HFDataset.open(small, vocab_size=71).check_tokens()


def test_dataset_dict_and_missing_paths(tmp_path):
    dd = tmp_path / "dd"
    split = datasets.Dataset.from_dict({"input_ids": [[1, 2]]})
    datasets.DatasetDict({"train": split, "test": split}).save_to_disk(dd)
    with pytest.raises(DatasetError, match=r"DatasetDict with splits \['test', 'train'\]: give one split's folder"):
        open_data(f"{dd}?vocab_size=5")
    assert open_data(f"{dd / 'train'}?vocab_size=5")[0].tokens(0).tolist() == [1, 2]
    with pytest.raises(FileNotFoundError, match=r"absent\.json not found .*Hugging Face"):
        open_data(f"{tmp_path / 'absent'}?vocab_size=5")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no .arrow, .parquet, .jsonl, .ndjson or .json files"):
        open_data(f"{tmp_path / 'empty'}?vocab_size=5")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(DatasetError, match=r"notes\.txt: not a dataset file"):
        open_data(f"{tmp_path / 'notes.txt'}?vocab_size=5")


# --- Parquet and JSON Lines, converted ----------------------------------------------------------


def test_parquet_converted_once(tmp_path, cache, ours, sequences):
    folder = tmp_path / "pq"
    folder.mkdir()
    pq.write_table(table(sequences[:100]), folder / "part-0.parquet", row_group_size=40)
    pq.write_table(table(sequences[100:]), folder / "part-1.parquet", row_group_size=64)
    theirs, _ = open_data(f"{folder}?vocab_size={VOCAB}")
    assert type(theirs) is TokenDataset and theirs.prefix.parent.parent == cache
    assert theirs.prefix.name == "pq" and "part-0.parquet, " in theirs.source and "Parquet" in theirs.source
    assert_same_batches(ours, theirs)
    entries = sorted(p.name for p in cache.iterdir() if p.is_dir())
    assert open_data(f"{folder}?vocab_size={VOCAB}")[0].prefix == theirs.prefix  # reused, not converted again
    assert sorted(p.name for p in cache.iterdir() if p.is_dir()) == entries
    pq.write_table(table(sequences[100:150]), folder / "part-1.parquet")
    changed, _ = open_data(f"{folder}?vocab_size={VOCAB}")
    assert changed.prefix != theirs.prefix and len(changed) == 150


def test_json_lines_and_columns(tmp_path, sequences):
    path = tmp_path / "ids.jsonl"
    path.write_text("".join(json.dumps({"ids": s.tolist(), "text": "x"}) + "\n" for s in sequences[:20]))
    ds, _ = open_data(f"{path}?vocab_size={VOCAB}&column=ids")
    assert [ds.tokens(i).tolist() for i in range(20)] == [s.tolist() for s in sequences[:20]]
    assert (
        eval_spec(f"{path}?vocab_size={VOCAB}&column=ids")
        == f"{tmp_path / 'ids_eval.jsonl'}?vocab_size={VOCAB}&column=ids"
    )
    with pytest.raises(DatasetError, match=r"ids\.jsonl: no column 'input_ids'"):
        open_data(f"{path}?vocab_size={VOCAB}")
    with pytest.raises(DatasetError, match=r"ids\.jsonl: row \d+: token id \d+ is outside the vocabulary 0\.\.99"):
        open_data(f"{path}?vocab_size=100&column=ids")
    broken = tmp_path / "broken.json"
    broken.write_text('[{"input_ids": [1]}]')
    with pytest.raises(DatasetError, match=r"broken\.json: not readable as JSON Lines"):
        open_data(f"{broken}?vocab_size=5")


def test_arrow_and_parquet_not_mixed(tmp_path, saved):
    folder = tmp_path / "mixed"
    folder.mkdir()
    shutil.copy(sorted(saved.glob("*.arrow"))[0], folder / "a.arrow")
    pq.write_table(table([np.array([1, 2])]), folder / "b.parquet")
    with pytest.raises(DatasetError, match="holds both Arrow files .* and Parquet/JSON Lines files"):
        open_data(f"{folder}?vocab_size={VOCAB}")
