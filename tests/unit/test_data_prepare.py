"""Tokenizers and data preparation (bytescale_compile/data/): every input format, the counts of what was
skipped, token dtypes, the eval split, long documents and the errors, checked against the `tokenizers`
library encoding each document directly."""

import importlib
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("pyarrow")
pytest.importorskip("transformers")

from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: E402

from bytescale_compile.cli import main  # noqa: E402
from bytescale_compile.data import (  # noqa: E402
    EOS_TOKEN,
    PAD_TOKEN,
    SourceError,
    TokenizerError,
    eval_prefix,
    load_tokenizer,
    prepare,
    train_tokenizer,
)
from bytescale_compile.data.dataset import DatasetError, TokenDataset  # noqa: E402

WORDS = "the quick brown fox jumps over a lazy dog while naive cafe owners count sheep".split()


def corpus(n: int, seed: int = 0) -> list[str]:
    """Distinct documents of 1..40 words, with non-ASCII text so byte-level encoding matters."""
    rng = np.random.default_rng(seed)
    return [f"doc {i}: " + " ".join(rng.choice(WORDS, rng.integers(1, 40))) + " caf\u00e9 \u2713" for i in range(n)]


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bpe")
    train_tokenizer([write_jsonl(root / "train.jsonl", corpus(300))], 400, root / "tok")
    return root / "tok"


def reference(tokenizer_dir: Path, texts: list[str]) -> list[list[int]]:
    """Each text encoded by the `tokenizers` library itself (not through transformers), EOS appended."""
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = AutoTokenizer.from_pretrained(tokenizer_dir).eos_token_id
    return [tok.encode(t, add_special_tokens=False).ids + [eos] for t in texts]


def sequences(ds: TokenDataset) -> list[list[int]]:
    return [ds.tokens(i).tolist() for i in range(len(ds))]


def word_level_dir(path: Path, vocab_size: int, eos: bool = True) -> Path:
    """A tokenizer with `vocab_size` ids: "[EOS]" = 0, "[UNK]" = 1, and words "w2".."w{vocab_size - 1}"."""
    vocab = {"[EOS]": 0, "[UNK]": 1} | {f"w{i}": i for i in range(2, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    specials = {"eos_token": "[EOS]"} if eos else {}
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", **specials).save_pretrained(path)
    return path


# --- tokenizer ------------------------------------------------------------------------------------


def test_trained_tokenizer_loads_with_auto_tokenizer(bpe_dir):
    tok = AutoTokenizer.from_pretrained(bpe_dir)
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token, tok.pad_token_id) == (EOS_TOKEN, 0, PAD_TOKEN, 1)
    assert 258 < len(tok) <= 400
    text = "the lazy dog \u2713 unseen \U0001f600 \t\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text  # byte-level: nothing is unknown
    assert len(tok("the quick brown fox", add_special_tokens=False)["input_ids"]) < len("the quick brown fox") / 2


def test_train_tokenizer_errors(tmp_path, bpe_dir):
    data = write_jsonl(tmp_path / "a.jsonl", corpus(5))
    with pytest.raises(ValueError, match="vocab_size must be at least 258"):
        train_tokenizer([data], 100, tmp_path / "tok")
    with pytest.raises(FileExistsError, match=rf"{bpe_dir / 'tokenizer.json'} exists"):
        train_tokenizer([data], 300, bpe_dir)
    (tmp_path / "empty.jsonl").write_text(json.dumps({"text": " "}) + "\n")
    with pytest.raises(SourceError, match="no documents to train on(.|\n)*skipped 1 empty"):
        train_tokenizer([tmp_path / "empty.jsonl"], 300, tmp_path / "tok")


def test_load_tokenizer_identity(tmp_path, bpe_dir):
    loaded = load_tokenizer(bpe_dir)
    assert loaded.info.name_or_path == str(bpe_dir.resolve()) and loaded.info.eos_token_id == 0
    assert loaded.vocab_size == len(AutoTokenizer.from_pretrained(bpe_dir))
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in bpe_dir.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    (copy / "model.safetensors").write_bytes(b"weights are not part of the tokenizer")
    assert load_tokenizer(copy).info.sha256 == loaded.info.sha256
    other = word_level_dir(tmp_path / "other", 300)
    assert load_tokenizer(other).info.sha256 != loaded.info.sha256


# --- inputs ---------------------------------------------------------------------------------------


def mixed_inputs(root: Path) -> tuple[list[Path], list[str]]:
    """One file of each format, each with records to skip; returns the paths and the kept texts in order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    datasets = pytest.importorskip("datasets")
    lines = [
        json.dumps({"text": "alpha"}).encode(),
        b"{bad json",
        json.dumps({"body": "no text"}).encode(),
        json.dumps({"text": ""}).encode(),
        json.dumps({"text": 5}).encode(),
        b"",
        b'{"text": "\xff"}',
        json.dumps({"text": "beta"}).encode(),
    ]
    (root / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (root / "b.json").write_text(json.dumps([{"text": "gamma"}, {"text": "  "}, "not a record"]))
    (root / "c.json").write_text(json.dumps({"text": "delta"}) + "\n" + json.dumps({"text": "epsilon"}) + "\n")
    pq.write_table(pa.table({"text": ["zeta", None, "eta"], "id": [1, 2, 3]}), root / "d.parquet")
    pq.write_table(pa.table({"body": ["x", "y", "z"]}), root / "e.parquet")
    (root / "f.txt").write_text("theta, a plain\ntext file\n")
    (root / "g.dat").write_bytes(b"\xff\xfe\x00 binary")
    datasets.Dataset.from_dict({"text": ["iota", "", "kappa"], "n": [0, 1, 2]}).save_to_disk(root / "h_ds")
    paths = [root / n for n in ("a.jsonl", "b.json", "c.json", "d.parquet", "e.parquet", "f.txt", "g.dat", "h_ds")]
    texts = [
        "alpha",
        "beta",
        "gamma",
        "delta",
        "epsilon",
        "zeta",
        "eta",
        "theta, a plain\ntext file\n",
        "iota",
        "kappa",
    ]
    return paths, texts


def test_every_format_with_skip_counts(tmp_path, bpe_dir):
    (tmp_path / "in").mkdir()
    paths, texts = mixed_inputs(tmp_path / "in")
    report = prepare(paths, bpe_dir, tmp_path / "out" / "ds", eval_fraction=0)
    assert report.eval is None and not (tmp_path / "out" / "ds_eval.json").exists()
    assert sequences(report.train) == reference(bpe_dir, texts)
    assert sequences(TokenDataset.open(tmp_path / "out" / "ds")) == reference(bpe_dir, texts)
    stats = report.sources
    assert (stats.records, stats.documents) == (23, 10)
    assert dict(stats.skipped) == {"no_text_field": 7, "empty": 3, "undecodable": 3}
    assert stats.examples["undecodable"] == [f"{paths[0]}:2", f"{paths[0]}:7", str(paths[6])]
    summary = report.summary()
    assert "skipped 7 records without a string 'text' field" in summary and "skipped 3 empty" in summary


def test_directory_walk_matches_listed_files(tmp_path, bpe_dir):
    root = tmp_path / "in"
    (root / "sub").mkdir(parents=True)
    write_jsonl(root / "sub" / "b.jsonl", ["second", "third"])
    (root / "a.txt").write_text("first")
    (root / ".hidden.txt").write_text("never read")
    listed = prepare([root / "a.txt", root / "sub" / "b.jsonl"], bpe_dir, tmp_path / "listed", eval_fraction=0)
    walked = prepare([root], bpe_dir, tmp_path / "walked", eval_fraction=0)
    assert sequences(walked.train) == sequences(listed.train) == reference(bpe_dir, ["first", "second", "third"])


def test_text_field_option(tmp_path, bpe_dir):
    (tmp_path / "a.jsonl").write_text(json.dumps({"content": "one"}) + "\n" + json.dumps({"text": "two"}) + "\n")
    report = prepare([tmp_path / "a.jsonl"], bpe_dir, tmp_path / "ds", text_field="content", eval_fraction=0)
    assert sequences(report.train) == reference(bpe_dir, ["one"])
    assert report.sources.skipped == {"no_text_field": 1}
    assert "records without a string 'content' field" in report.summary()


def test_dataset_dict_names_its_splits(tmp_path, bpe_dir):
    datasets = pytest.importorskip("datasets")
    splits = {"train": datasets.Dataset.from_dict({"text": ["a"]}), "test": datasets.Dataset.from_dict({"text": ["b"]})}
    datasets.DatasetDict(splits).save_to_disk(tmp_path / "dd")
    with pytest.raises(SourceError, match=r"DatasetDict with splits \['test', 'train'\]: pass the split"):
        prepare([tmp_path / "dd"], bpe_dir, tmp_path / "ds")
    report = prepare([tmp_path / "dd" / "train"], bpe_dir, tmp_path / "ds", eval_fraction=0)
    assert sequences(report.train) == reference(bpe_dir, ["a"])


# --- tokens ---------------------------------------------------------------------------------------


def test_uint16_for_the_trained_tokenizer(tmp_path, bpe_dir):
    texts = corpus(20, seed=3)
    report = prepare([write_jsonl(tmp_path / "a.jsonl", texts)], bpe_dir, tmp_path / "ds", eval_fraction=0)
    assert report.train.dtype == np.uint16 and report.train.vocab_size == load_tokenizer(bpe_dir).vocab_size
    assert (tmp_path / "ds.bin").stat().st_size == 2 * int(report.train.lengths.sum())
    assert report.train.tokenizer == load_tokenizer(bpe_dir).info
    assert report.text_bytes == sum(len(t.encode()) for t in texts)


def test_uint32_above_65536_ids(tmp_path):
    tok = word_level_dir(tmp_path / "big", 70_000)
    texts = ["w69999 w2 w65536", "w65535 nope w40000"]
    report = prepare([write_jsonl(tmp_path / "a.jsonl", texts)], tok, tmp_path / "ds", eval_fraction=0)
    assert report.train.dtype == np.uint32 and report.train.vocab_size == 70_000
    assert sequences(TokenDataset.open(tmp_path / "ds")) == [[69999, 2, 65536, 0], [65535, 1, 40000, 0]]
    assert sequences(report.train) == reference(tok, texts)


@pytest.mark.parametrize("policy", ["split", "drop"])
def test_long_documents(tmp_path, bpe_dir, policy):
    texts = corpus(30, seed=1)
    refs = reference(bpe_dir, texts)
    max_len = 12
    report = prepare(
        [write_jsonl(tmp_path / "a.jsonl", texts)],
        bpe_dir,
        tmp_path / "ds",
        max_len=max_len,
        long_docs=policy,
        eval_fraction=0,
    )
    long = [r for r in refs if len(r) > max_len]
    assert 0 < len(long) < len(refs) and report.long_documents == len(long)
    if policy == "split":
        want = [r[i : i + max_len] for r in refs for i in range(0, len(r), max_len)]
    else:
        want = [r for r in refs if len(r) <= max_len]
    assert sequences(report.train) == want
    assert f"{len(long)} documents longer than {max_len} tokens" in report.summary()


# --- eval split -----------------------------------------------------------------------------------


def test_eval_split_is_deterministic_by_seed(tmp_path, bpe_dir):
    texts = corpus(200, seed=2)
    refs = reference(bpe_dir, texts)
    data = write_jsonl(tmp_path / "a.jsonl", texts)
    report = prepare([data], bpe_dir, tmp_path / "ds", eval_fraction=0.2, seed=7)
    held = np.random.default_rng(7).random(len(texts)) < 0.2  # one draw per document, in order
    assert report.eval.prefix == eval_prefix(tmp_path / "ds") == tmp_path / "ds_eval"
    assert sequences(report.eval) == [r for r, h in zip(refs, held) if h]
    assert sequences(report.train) == [r for r, h in zip(refs, held) if not h]
    assert 20 < len(report.eval) < 60
    assert report.eval.tokenizer == report.train.tokenizer
    again = prepare([data], bpe_dir, tmp_path / "again", eval_fraction=0.2, seed=7)
    other = prepare([data], bpe_dir, tmp_path / "other", eval_fraction=0.2, seed=8)
    assert sequences(again.eval) == sequences(report.eval) != sequences(other.eval)


def test_long_document_pieces_stay_in_one_split(tmp_path, bpe_dir):
    texts = corpus(60, seed=4)
    report = prepare(
        [write_jsonl(tmp_path / "a.jsonl", texts)], bpe_dir, tmp_path / "ds", eval_fraction=0.3, max_len=10
    )
    eos = load_tokenizer(bpe_dir).info.eos_token_id
    for ds in (report.train, report.eval):
        flat = np.concatenate([ds.tokens(i).numpy() for i in range(len(ds))])
        assert flat[-1] == eos  # every split ends with a whole document
        docs = np.split(flat, np.flatnonzero(flat == eos)[:-1] + 1)
        assert all(d.tolist() in reference(bpe_dir, texts) for d in docs)


def test_empty_eval_split_is_an_error(tmp_path, bpe_dir):
    data = write_jsonl(tmp_path / "a.jsonl", corpus(3))
    with pytest.raises(DatasetError, match=r"no document of 3 fell into the eval split .*ds_eval at eval_fraction"):
        prepare([data], bpe_dir, tmp_path / "ds", eval_fraction=0.001)
    with pytest.raises(FileNotFoundError):
        TokenDataset.open(tmp_path / "ds")  # neither split was finished


@pytest.mark.slow
def test_workers_give_the_same_datasets(tmp_path, bpe_dir, monkeypatch):
    module = importlib.import_module("bytescale_compile.data.preparation")
    monkeypatch.setattr(module, "_CHUNK_CHARS", 500)  # many chunks, so both workers get some
    data = write_jsonl(tmp_path / "a.jsonl", corpus(300, seed=5))
    one = prepare([data], bpe_dir, tmp_path / "one", eval_fraction=0.1, max_len=16)
    two = prepare([data], bpe_dir, tmp_path / "two", eval_fraction=0.1, max_len=16, workers=2)
    for a, b in ((one.train, two.train), (one.eval, two.eval)):
        for ext in ("bin", "idx"):
            assert Path(f"{a.prefix}.{ext}").read_bytes() == Path(f"{b.prefix}.{ext}").read_bytes()


# --- errors ---------------------------------------------------------------------------------------


def test_missing_input_and_tokenizer(tmp_path, bpe_dir):
    data = write_jsonl(tmp_path / "a.jsonl", corpus(3))
    with pytest.raises(FileNotFoundError, match=f"input path {tmp_path / 'nope.jsonl'} does not exist"):
        prepare([data, tmp_path / "nope.jsonl"], bpe_dir, tmp_path / "ds")
    with pytest.raises(TokenizerError, match=f"tokenizer directory {tmp_path / 'tok'} does not exist"):
        prepare([data], tmp_path / "tok", tmp_path / "ds")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match=f"cannot load a tokenizer from {tmp_path / 'empty'}"):
        prepare([data], tmp_path / "empty", tmp_path / "ds")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    (broken / "tokenizer_config.json").write_text((bpe_dir / "tokenizer_config.json").read_text())
    with pytest.raises(TokenizerError, match=f"cannot load a tokenizer from {broken}"):
        prepare([data], broken, tmp_path / "ds")
    with pytest.raises(TokenizerError, match="defines no EOS token"):
        prepare([data], word_level_dir(tmp_path / "no_eos", 300, eos=False), tmp_path / "ds")
    assert not list(tmp_path.glob("ds*"))


def test_existing_outputs_need_overwrite(tmp_path, bpe_dir):
    data = write_jsonl(tmp_path / "a.jsonl", corpus(100))
    prepare([data], bpe_dir, tmp_path / "ds", eval_fraction=0.1)
    with pytest.raises(FileExistsError, match=f"{tmp_path / 'ds.json'} exists: pass overwrite"):
        prepare([data], bpe_dir, tmp_path / "ds")
    (tmp_path / "ds.json").unlink()
    with pytest.raises(FileExistsError, match=f"{tmp_path / 'ds.idx'} exists"):
        prepare([data], bpe_dir, tmp_path / "ds")
    report = prepare([data], bpe_dir, tmp_path / "ds", eval_fraction=0, overwrite=True)
    assert len(report.train) == 100
    assert not (tmp_path / "ds_eval.json").exists()  # no stale eval split beside the new training set


def test_unreadable_json_and_bad_options(tmp_path, bpe_dir):
    (tmp_path / "bad.json").write_text('{"text": "unterminated')
    with pytest.raises(SourceError, match=f"{tmp_path / 'bad.json'}: not valid JSON"):
        prepare([tmp_path / "bad.json"], bpe_dir, tmp_path / "ds")
    assert not list(tmp_path.glob("ds*"))  # the failed run removed what it had written
    data = write_jsonl(tmp_path / "a.jsonl", ["x"])
    for options, message in [
        ({"workers": 0}, "workers must be >= 1"),
        ({"max_len": 1}, "max_len must be >= 2"),
        ({"long_docs": "truncate"}, "long_docs must be one of"),
        ({"eval_fraction": 1.0}, r"eval_fraction must be in \[0, 1\)"),
    ]:
        with pytest.raises(ValueError, match=message):
            prepare([data], bpe_dir, tmp_path / "ds", **options)
    (tmp_path / "blank.jsonl").write_text(json.dumps({"text": ""}) + "\n")
    with pytest.raises(DatasetError, match="no documents to write(.|\n)*skipped 1 empty"):
        prepare([tmp_path / "blank.jsonl"], bpe_dir, tmp_path / "ds", eval_fraction=0)


# --- command line ---------------------------------------------------------------------------------


def test_cli_tokenizer_train_and_data_prepare(tmp_path, capsys):
    texts = corpus(80, seed=6)
    data = write_jsonl(tmp_path / "a.jsonl", texts)
    tok = tmp_path / "tok"
    assert main(["tokenizer", "train", "--input", str(data), "--vocab-size", "300", "--out", str(tok)]) == 0
    assert "special tokens <|endoftext|> = 0, <|pad|> = 1" in capsys.readouterr().out
    args = [
        "data",
        "prepare",
        "--input",
        str(data),
        "--tokenizer",
        str(tok),
        "--out",
        str(tmp_path / "ds"),
        "--eval-fraction",
        "0.25",
        "--max-len",
        "20",
        "--long-docs",
        "drop",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"train: {tmp_path / 'ds'}:" in out and f"eval: {tmp_path / 'ds_eval'}:" in out
    train, held = TokenDataset.open(tmp_path / "ds"), TokenDataset.open(tmp_path / "ds_eval")
    kept = [r for r in reference(tmp_path / "tok", texts) if len(r) <= 20]
    assert sorted(sequences(train) + sequences(held)) == sorted(kept)
    assert main(args) == 2
    assert f"data: error: {tmp_path / 'ds.json'} exists: pass overwrite (--overwrite)" in capsys.readouterr().err
    assert main(args[:3] + [str(tmp_path / "missing")] + args[4:]) == 2
    assert f"input path {tmp_path / 'missing'} does not exist" in capsys.readouterr().err
