"""Megatron-LM indexed datasets (data/megatron.py), opened through `--data` (data/formats.py, data/mixture.py).

The `.bin`/`.idx` files are written here by a writer of our own that follows Megatron's documented layout
(megatron/core/datasets/indexed_dataset.py), not by the reader's code; the batches drawn from them must equal
those drawn from the same sequences in our own format."""

import itertools
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from bytescale_compile.data import (
    DatasetError,
    GlobalBatchSampler,
    MegatronDataset,
    MixedDataset,
    eval_batches,
    eval_spec,
    open_data,
    open_dataset,
    parse_data_spec,
    write_dataset,
)

CODES = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "float64": 6, "float32": 7, "uint16": 8}
HEADER = 34
POINTERS = HEADER + 4 * 3
"""Of the `small` fixture's 3 sequences."""
VOCAB = 5000


def write_megatron(
    prefix: Path, sequences: list[np.ndarray], dtype: str = "uint16", documents: list[int] | None = None
) -> Path:
    """Megatron's layout: magic, <Q version 1, <B dtype code, <Q sequences, <Q documents, then int32 lengths,
    int64 byte pointers and int64 document indices; the tokens back to back in the .bin."""
    itemsize = np.dtype(dtype).itemsize
    lengths = np.array([len(s) for s in sequences], dtype=np.int32)
    pointers = np.concatenate(([0], np.cumsum(lengths.astype(np.int64) * itemsize)))[: len(sequences)].astype(np.int64)
    documents = list(range(len(sequences) + 1)) if documents is None else documents
    Path(f"{prefix}.bin").write_bytes(b"".join(np.asarray(s, dtype=dtype).tobytes() for s in sequences))
    header = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, CODES[dtype], len(sequences), len(documents))
    index = lengths.tobytes() + pointers.tobytes() + np.array(documents, dtype=np.int64).tobytes()
    Path(f"{prefix}.idx").write_bytes(header + index)
    return prefix


def skewed(n: int, seed: int = 0, vocab: int = VOCAB) -> list[np.ndarray]:
    """Heavy-tailed lengths 1..3000, so budgets, truncation and min_len all bite."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.pareto(1.2, n) * 40 + 1, 3000).astype(int)
    return [rng.integers(0, vocab, k) for k in lengths]


@pytest.fixture
def sequences() -> list[np.ndarray]:
    return skewed(300)


@pytest.fixture
def megatron(tmp_path, sequences) -> Path:
    return write_megatron(tmp_path / "corpus_text_document", sequences)


def batches(dataset, n: int = 12, **kw) -> list:
    return list(itertools.islice(GlobalBatchSampler(dataset, global_tokens=4096, seed=3, max_len=1500, **kw), n))


def assert_same_batches(ours, theirs) -> None:
    a, b = batches(ours), batches(theirs)
    assert len(a) == len(b) == 12
    for x, y in zip(a, b):
        assert np.array_equal(x.indices, y.indices) and np.array_equal(x.lengths, y.lengths)
        for seq in range(len(x.indices)):
            assert x.tokens(seq).tolist() == y.tokens(seq).tolist()


# --- reading -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["uint16", "int32", "uint8", "int64"])
def test_batches_equal_our_format(tmp_path, dtype):
    vocab = 250 if dtype == "uint8" else VOCAB
    seqs = skewed(300, vocab=vocab)
    ours = write_dataset(tmp_path / "ours", seqs, source="same", vocab_size=vocab)
    theirs = MegatronDataset.open(write_megatron(tmp_path / "theirs", seqs, dtype), vocab_size=vocab)
    assert theirs.dtype == np.dtype(dtype) and theirs.vocab_size == vocab and theirs.tokenizer is None
    assert np.array_equal(theirs.lengths, ours.lengths) and theirs.lengths.dtype == np.int64
    assert_same_batches(ours, theirs)
    held_out = eval_batches(theirs, 4096, max_len=1500, max_tokens=20_000)
    assert [b.indices.tolist() for b in held_out] == [
        b.indices.tolist() for b in eval_batches(ours, 4096, 1500, 20_000)
    ]
    assert theirs.max_token() == ours.max_token()


def test_sequences_documents_and_slices(megatron, sequences):
    ds = MegatronDataset.open(megatron, vocab_size=VOCAB)
    assert len(ds) == len(sequences)
    assert ds.tokens(7).tolist() == sequences[7].tolist()
    assert ds.tokens(7, 1, 3).tolist() == sequences[7][1:3].tolist()
    assert ds.document_indices.tolist() == list(range(len(sequences) + 1))
    with pytest.raises(ValueError):
        ds.lengths[0] = 1
    with pytest.raises(IndexError):
        ds.tokens(len(sequences))


def test_sentences_grouped_into_documents(tmp_path):
    """With --split-sentences a document is several sequences; each sequence is still one of ours."""
    seqs = [np.arange(k) + 1 for k in (3, 4, 5, 6)]
    ds = MegatronDataset.open(write_megatron(tmp_path / "s", seqs, documents=[0, 2, 4]), vocab_size=10)
    assert ds.lengths.tolist() == [3, 4, 5, 6] and ds.document_indices.tolist() == [0, 2, 4]


def test_multimodal_sequence_modes_are_accepted(tmp_path):
    prefix = write_megatron(tmp_path / "mm", [np.array([1, 2]), np.array([3])])
    with open(f"{prefix}.idx", "ab") as f:
        f.write(np.zeros(2, dtype=np.int8).tobytes())
    assert MegatronDataset.open(prefix, vocab_size=4).tokens(1).tolist() == [3]


def test_pickles_without_the_tokens(megatron, sequences):
    ds = MegatronDataset.open(megatron, vocab_size=VOCAB)
    data = pickle.dumps(ds)
    assert len(data) < 1000
    clone = pickle.loads(data)
    assert clone == ds and clone.vocab_size == VOCAB and clone.tokens(5).tolist() == sequences[5].tolist()


def test_vocabulary_must_be_given(megatron):
    with pytest.raises(DatasetError, match=r"do not record the vocabulary.*\?vocab_size=N.*\?tokenizer=DIR"):
        MegatronDataset.open(megatron)
    with pytest.raises(DatasetError, match=r"\?vocab_size=N"):
        open_data(str(megatron))


def test_vocabulary_from_a_tokenizer(tmp_path):
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[EOS]": 0, "[UNK]": 1} | {f"w{i}": i for i in range(2, 300)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[EOS]").save_pretrained(
        tmp_path / "tok"
    )
    prefix = write_megatron(tmp_path / "m", [np.array([5, 299, 0])])
    ds, _ = open_data(f"{prefix}?tokenizer={tmp_path / 'tok'}")
    assert ds.vocab_size == 300 and ds.tokenizer is not None and ds.tokenizer.eos_token_id == 0
    assert open_dataset(ds.spec).tokenizer == ds.tokenizer
    padded, _ = open_data(f"{prefix}?tokenizer={tmp_path / 'tok'}&vocab_size=384")  # Megatron pads the vocabulary
    assert padded.vocab_size == 384 and padded.tokenizer == ds.tokenizer
    with pytest.raises(DatasetError, match="vocab_size 100 is smaller than the 300 ids of tokenizer"):
        open_data(f"{prefix}?tokenizer={tmp_path / 'tok'}&vocab_size=100")


def test_check_tokens_names_the_file_and_offset(tmp_path):
    prefix = write_megatron(tmp_path / "ids", [np.array([1, 2, 3]), np.array([4, 9, 5])])
    MegatronDataset.open(prefix, vocab_size=10).check_tokens()
    with pytest.raises(DatasetError, match=rf"{prefix}\.bin: byte 8: token id 9 is outside the vocabulary 0\.\.8"):
        MegatronDataset.open(prefix, vocab_size=9).check_tokens()
    signed = write_megatron(tmp_path / "signed", [np.array([1, -100])], dtype="int32")
    with pytest.raises(DatasetError, match=r"signed\.bin: byte 4: token id -100"):
        MegatronDataset.open(signed, vocab_size=10).check_tokens()


# --- bad files -----------------------------------------------------------------------------------


def corrupt(prefix: Path, offset: int, data: bytes) -> None:
    path = Path(f"{prefix}.idx")
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))


def idx_error(prefix: Path, offset: int, message: str) -> None:
    with pytest.raises(DatasetError, match=rf"{prefix}\.idx: byte {offset}: {message}"):
        MegatronDataset.open(prefix, vocab_size=VOCAB)


@pytest.fixture
def small(tmp_path) -> Path:
    """3 sequences of 2, 3 and 4 uint16 tokens in 2 documents (18 bytes): lengths at byte 34 of the index,
    pointers at 46, document indices at 70."""
    return write_megatron(
        tmp_path / "small", [np.array([1, 2]), np.array([3, 4, 5]), np.arange(4)], documents=[0, 1, 3]
    )


def test_wrong_magic(small):
    corrupt(small, 0, b"NOTMEGA")
    idx_error(small, 0, "expected Megatron's magic")


def test_unsupported_version_and_dtype(small):
    corrupt(small, 9, struct.pack("<Q", 2))
    idx_error(small, 9, "index version 2 is not supported")
    corrupt(small, 9, struct.pack("<Q", 1))
    corrupt(small, 17, struct.pack("<B", 9))
    idx_error(small, 17, r"dtype code 9 \(unknown\)")
    corrupt(small, 17, struct.pack("<B", 7))
    idx_error(small, 17, r"dtype code 7 \(float32: no token ids\)")


def test_truncated_index(small):
    path = Path(f"{small}.idx")
    raw = path.read_bytes()
    path.write_bytes(raw[:-4])
    idx_error(small, len(raw) - 4, rf"truncated: 3 sequences and 3 documents need {len(raw)} bytes")
    path.write_bytes(raw[:20])
    idx_error(small, 20, "the file ends inside the 34-byte header")
    path.write_bytes(raw + b"\x00" * 7)
    idx_error(small, len(raw), "7 bytes follow the document index")


def test_pointers_and_lengths_past_the_bin(small):
    pointer_2 = POINTERS + 16
    corrupt(small, pointer_2, struct.pack("<q", 100))
    idx_error(
        small,
        pointer_2,
        rf"sequence 2 at byte 100 \+ 4 tokens x 2 bytes ends at byte 108, past the 18 bytes of {small}\.bin",
    )
    corrupt(small, pointer_2, struct.pack("<q", 3))
    idx_error(small, pointer_2, "sequence 2 at byte 3 is not a multiple of the 2-byte uint16 tokens")
    corrupt(small, pointer_2, struct.pack("<q", 10))
    corrupt(small, HEADER + 4, struct.pack("<i", 9))  # sequence 1's length
    idx_error(small, POINTERS + 8, r"sequence 1 at byte 4 \+ 9 tokens x 2 bytes ends at byte 22, past the 18 bytes")
    corrupt(small, HEADER + 4, struct.pack("<i", -1))
    idx_error(small, HEADER + 4, "sequence 1 has length -1")


def test_document_index(small):
    documents = POINTERS + 8 * 3
    corrupt(small, documents + 16, struct.pack("<q", 2))
    idx_error(small, documents + 16, "the document index ends at 2, not at the sequence count 3")
    corrupt(small, documents + 16, struct.pack("<q", 3))
    corrupt(small, documents, struct.pack("<q", 1))
    idx_error(small, documents, "the document index starts at 1, not 0")
    corrupt(small, documents, struct.pack("<q", 0))
    corrupt(small, documents + 8, struct.pack("<q", 5))
    idx_error(small, documents + 16, "document index 2 is 3, below the 5 before it")


def test_empty_index(tmp_path):
    prefix = write_megatron(tmp_path / "none", [], documents=[0])
    idx_error(prefix, 18, "0 sequences and 1 documents: the dataset is empty")


# --- --data --------------------------------------------------------------------------------------


def test_open_data_detects_megatron(tmp_path, megatron, sequences):
    ds, weights = open_data(f"{megatron}?vocab_size={VOCAB}")
    assert isinstance(ds, MegatronDataset) and weights is None
    assert ds.prefix == megatron and ds.spec == f"{megatron}?vocab_size={VOCAB}"
    ours = write_dataset(tmp_path / "ours", skewed(50, seed=1), source="ours", vocab_size=VOCAB)
    mixed, weights = open_data(f"{megatron}?vocab_size={VOCAB}:0.25,{ours.prefix}:0.75")
    assert isinstance(mixed, MixedDataset) and weights == [0.25, 0.75]
    assert mixed.names == ["corpus_text_document", "ours"]
    assert mixed.tokens(3).tolist() == sequences[3].tolist()
    clone = pickle.loads(pickle.dumps(mixed))
    assert isinstance(clone.parts[0], MegatronDataset) and clone.prefix == mixed.prefix
    bytes_data = write_dataset(tmp_path / "bytes", [b"abc"], source="bytes")
    with pytest.raises(DatasetError, match=r"tokenizer unknown, vocab_size 5000\).*tokenizer bytes\)"):
        open_data(f"{bytes_data.prefix},{megatron}?vocab_size={VOCAB}")


def test_options_are_checked(tmp_path, megatron):
    assert parse_data_spec(f"{megatron}?vocab_size=7:0.5,b:0.5") == [(f"{megatron}?vocab_size=7", 0.5), ("b", 0.5)]
    assert parse_data_spec("a?tokenizer=tok")[0][0] == f"a?tokenizer={Path.cwd() / 'tok'}"
    for spec, message in [
        ("a?vocab=7", r"option 'vocab=7' is not KEY=VALUE with KEY one of \['vocab_size', 'tokenizer', 'column'\]"),
        ("a?vocab_size=x", "vocab_size must be an integer >= 1, got 'x'"),
        ("a?vocab_size=0", "vocab_size must be an integer >= 1"),
        ("a?vocab_size=1&vocab_size=2", "option 'vocab_size' given twice"),
    ]:
        with pytest.raises(DatasetError, match=message):
            parse_data_spec(spec)
    with pytest.raises(
        DatasetError, match=r"option\(s\) \['column'\] do not apply .*a Megatron dataset has no columns"
    ):
        open_data(f"{megatron}?vocab_size=9&column=x")
    ours = write_dataset(tmp_path / "ours", [b"abc"], source="ours")
    with pytest.raises(DatasetError, match="records its vocabulary and tokenizer"):
        open_data(f"{ours.prefix}?vocab_size=300")


def test_eval_spec_keeps_the_options(megatron):
    assert eval_spec(f"{megatron}?vocab_size=9") == f"{megatron}_eval?vocab_size=9"


def test_missing_or_partial_files(tmp_path, megatron):
    Path(f"{megatron}.bin").unlink()
    with pytest.raises(FileNotFoundError, match=rf"Megatron dataset file {megatron}\.bin not found"):
        open_data(f"{megatron}?vocab_size=9")
    with pytest.raises(
        FileNotFoundError, match=r"nothing\.json not found .*nothing\.bin and .*nothing\.idx \(Megatron\)"
    ):
        open_data(str(tmp_path / "nothing"))
    write_megatron(megatron, [np.array([1])])
    with pytest.raises(DatasetError, match=rf"give the dataset's prefix, {megatron}"):
        open_data(f"{megatron}.idx")


def test_data_check_command(tmp_path, capsys):
    from bytescale_compile.cli import main

    prefix = write_megatron(tmp_path / "ids", [np.array([1, 2, 3]), np.array([4, 9, 5])])
    assert main(["data", "check", "--data", f"{prefix}?vocab_size=10"]) == 0
    assert (
        "2 sequences, 6 tokens (uint16), max id 9, every id below vocab_size 10; tokenizer none"
        in capsys.readouterr().out
    )
    assert main(["data", "check", "--data", f"{prefix}?vocab_size=9"]) == 2
    assert f"data: error: {prefix}.bin: byte 8: token id 9 is outside" in capsys.readouterr().err
