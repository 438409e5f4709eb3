"""Token dataset on disk and the global-batch sampler (data/dataset.py)."""

import json
import pickle

import numpy as np
import pytest
import torch

from bytescale_compile.data.dataset import (
    DatasetError,
    DatasetWriter,
    GlobalBatch,
    GlobalBatchSampler,
    TokenDataset,
    TokenizerInfo,
    eval_batches,
    python_source_files,
    token_dtype,
    write_dataset,
)

DOCS = [b"hello world", b"", b"x", bytes(range(256)), "na\u00efve caf\u00e9".encode(), b"a" * 1000]
NON_EMPTY = [d for d in DOCS if d]


def as_bytes(t: torch.Tensor) -> bytes:
    assert t.dtype == torch.int64
    return bytes(t.tolist())


@pytest.fixture
def dataset(tmp_path) -> TokenDataset:
    return write_dataset(tmp_path / "corpus.v1", DOCS, source="test")


def skewed_dataset(tmp_path, n: int = 200) -> TokenDataset:
    """Lengths 1..~2000, heavy-tailed, so budgets, truncation and min_len all bite."""
    rng = np.random.default_rng(1)
    lengths = np.minimum(rng.pareto(1.2, n) * 40 + 1, 2000).astype(int)
    docs = (bytes(rng.integers(0, 256, size=k, dtype=np.uint8)) for k in lengths)
    return write_dataset(tmp_path / "skewed", docs, source="synthetic")


# --- dataset -------------------------------------------------------------------------------------


def test_round_trip_skips_empty_documents(dataset, tmp_path):
    assert len(dataset) == len(NON_EMPTY)
    assert [as_bytes(dataset.tokens(i)) for i in range(len(dataset))] == NON_EMPTY
    reopened = TokenDataset.open(tmp_path / "corpus.v1")
    assert [as_bytes(reopened.tokens(i)) for i in range(len(reopened))] == NON_EMPTY
    assert dataset.vocab_size == 256


def test_lengths_and_metadata(dataset, tmp_path):
    lengths = dataset.lengths
    assert lengths.dtype == np.int64 and lengths.tolist() == [len(d) for d in NON_EMPTY]
    with pytest.raises(ValueError):
        lengths[0] = 7
    meta = json.loads((tmp_path / "corpus.v1.json").read_text())
    assert meta == {
        "dtype": "uint8",
        "vocab_size": 256,
        "num_sequences": len(NON_EMPTY),
        "num_tokens": sum(map(len, NON_EMPTY)),
        "source": "test",
        "tokenizer": None,
    }
    assert isinstance(np.load(tmp_path / "corpus.v1.idx", mmap_mode="r"), np.memmap)
    assert dataset.dtype == np.uint8 and dataset.tokenizer is None


def test_reads_datasets_without_tokenizer_key(dataset, tmp_path):
    """Datasets written before the tokenizer metadata existed still open, as bytes."""
    path = tmp_path / "corpus.v1.json"
    meta = json.loads(path.read_text())
    del meta["tokenizer"]
    path.write_text(json.dumps(meta))
    old = TokenDataset.open(tmp_path / "corpus.v1")
    assert old.tokenizer is None and [as_bytes(old.tokens(i)) for i in range(len(old))] == NON_EMPTY


@pytest.mark.parametrize(
    "vocab_size, dtype",
    [(1, np.uint8), (256, np.uint8), (257, np.uint16), (65536, np.uint16), (65537, np.uint32), (2**32, np.uint32)],
)
def test_token_dtype_is_the_smallest_that_holds_the_vocabulary(vocab_size, dtype):
    assert token_dtype(vocab_size) == dtype


def test_token_dtype_limits():
    with pytest.raises(ValueError, match="exceeds the 4294967296 ids uint32 holds"):
        token_dtype(2**32 + 1)
    with pytest.raises(ValueError, match="vocab_size must be >= 1"):
        token_dtype(0)


@pytest.mark.parametrize("vocab_size", [300, 70_000])
def test_wide_token_ids_round_trip(tmp_path, vocab_size):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, vocab_size, n) for n in (5, 1, 40)] + [np.array([vocab_size - 1, 0, 256])]
    info = TokenizerInfo("/tok", "ab" * 32, eos_token_id=3)
    ds = write_dataset(tmp_path / "wide", docs, source="ids", vocab_size=vocab_size, tokenizer=info)
    assert ds.dtype == token_dtype(vocab_size) and ds.vocab_size == vocab_size
    assert (tmp_path / "wide.bin").stat().st_size == sum(map(len, docs)) * ds.dtype.itemsize
    reopened = TokenDataset.open(tmp_path / "wide")
    assert reopened.tokenizer == info and reopened.max_token() == vocab_size - 1
    for i, doc in enumerate(docs):
        assert reopened.tokens(i).tolist() == doc.tolist()


def test_writer_rejects_ids_outside_the_vocabulary(tmp_path):
    with DatasetWriter(tmp_path / "ds", vocab_size=300) as writer:
        writer.append(np.array([1, 299]))
        with pytest.raises(DatasetError, match=r"sequence 1 holds ids 0\.\.300, outside the vocabulary 0\.\.299"):
            writer.append(np.array([0, 300]))
        with pytest.raises(DatasetError, match=r"ids -1\.\.2"):
            writer.append(np.array([-1, 2]))
        with pytest.raises(TypeError, match="1-D integer array"):
            writer.append(np.array([0.5]))
    with pytest.raises(FileNotFoundError, match="ds.json"):
        TokenDataset.open(tmp_path / "ds")  # left without finish: nothing opens


def test_metadata_dtype_and_vocab_checked(dataset, tmp_path):
    path = tmp_path / "corpus.v1.json"
    meta = json.loads(path.read_text())
    path.write_text(json.dumps({**meta, "dtype": "int16"}))
    with pytest.raises(DatasetError, match=r"token dtype 'int16' is not one of \['uint8', 'uint16', 'uint32'\]"):
        TokenDataset.open(tmp_path / "corpus.v1")
    path.write_text(json.dumps({**meta, "vocab_size": 300}))
    with pytest.raises(DatasetError, match="vocab_size 300 does not fit token dtype uint8"):
        TokenDataset.open(tmp_path / "corpus.v1")
    path.write_text(json.dumps({**meta, "vocab_size": "256"}))
    with pytest.raises(DatasetError, match=r"\['vocab_size'\] must be integers"):
        TokenDataset.open(tmp_path / "corpus.v1")
    path.write_text(json.dumps({**meta, "tokenizer": {"name_or_path": "x"}}))
    with pytest.raises(DatasetError, match='"tokenizer" must be null or an object'):
        TokenDataset.open(tmp_path / "corpus.v1")


def test_slices(dataset):
    assert as_bytes(dataset.tokens(0, 6)) == b"world"
    assert as_bytes(dataset.tokens(0, 2, 4)) == b"ll"
    assert as_bytes(dataset.tokens(2, 10, 20)) == bytes(range(10, 20))
    assert dataset.tokens(1, 1, 1).numel() == 0
    with pytest.raises(IndexError):
        dataset.tokens(0, 5, 100)
    with pytest.raises(IndexError):
        dataset.tokens(len(dataset))


def test_pickles_as_prefix(dataset):
    clone = pickle.loads(pickle.dumps(dataset))
    assert clone == dataset and as_bytes(clone.tokens(3)) == NON_EMPTY[3]


def test_missing_bin(dataset, tmp_path):
    (tmp_path / "corpus.v1.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"corpus\.v1\.bin"):
        TokenDataset.open(tmp_path / "corpus.v1")


def test_truncated_bin(dataset, tmp_path):
    path = tmp_path / "corpus.v1.bin"
    total = sum(map(len, NON_EMPTY))
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(DatasetError, match=rf"{path}: expected {total} bytes .* found {total - 5} bytes"):
        TokenDataset.open(tmp_path / "corpus.v1")


def test_decreasing_idx(dataset, tmp_path):
    path = tmp_path / "corpus.v1.idx"
    offsets = np.load(path).copy()
    offsets[1], offsets[2] = offsets[2], offsets[1]
    with open(path, "wb") as f:
        np.save(f, offsets)
    with pytest.raises(DatasetError, match=rf"{path}: offsets decrease"):
        TokenDataset.open(tmp_path / "corpus.v1")


def test_idx_inconsistent_with_metadata(dataset, tmp_path):
    path = tmp_path / "corpus.v1.idx"
    offsets = np.load(path)
    with open(path, "wb") as f:
        np.save(f, offsets[:-1])
    with pytest.raises(DatasetError, match=rf"{path}: expected int64 offsets of shape"):
        TokenDataset.open(tmp_path / "corpus.v1")
    path.write_bytes(b"")
    with pytest.raises(DatasetError, match=rf"{path}: not a readable"):
        TokenDataset.open(tmp_path / "corpus.v1")


def test_rewrite_replaces_dataset(dataset, tmp_path):
    ds = write_dataset(tmp_path / "corpus.v1", [b"new"], source="again")
    assert len(ds) == 1 and as_bytes(ds.tokens(0)) == b"new"
    with pytest.raises(DatasetError, match="no non-empty documents"):
        write_dataset(tmp_path / "empty", [b"", b""], source="none")


# --- sampler -------------------------------------------------------------------------------------


def take(sampler: GlobalBatchSampler, n: int) -> list[GlobalBatch]:
    it = iter(sampler)
    return [next(it) for _ in range(n)]


def test_token_budget(tmp_path):
    ds = skewed_dataset(tmp_path)
    for batch in take(GlobalBatchSampler(ds, global_tokens=3000, seed=3), 30):
        assert batch.num_tokens >= 3000
        assert batch.num_tokens - batch.lengths[-1] < 3000
        assert np.array_equal(batch.lengths, ds.lengths[batch.indices])
        assert len(set(batch.indices.tolist())) == len(batch.indices)


def test_deterministic_across_instances(tmp_path):
    ds = skewed_dataset(tmp_path)
    a = take(GlobalBatchSampler(ds, 2500, seed=7, max_len=500), 40)
    b = take(GlobalBatchSampler(TokenDataset.open(ds.prefix), 2500, seed=7, max_len=500), 40)
    for x, y in zip(a, b):
        assert np.array_equal(x.indices, y.indices) and np.array_equal(x.lengths, y.lengths)
    c = take(GlobalBatchSampler(ds, 2500, seed=8, max_len=500), 1)
    assert not np.array_equal(a[0].indices, c[0].indices)


def test_truncation_and_min_len(tmp_path):
    ds = skewed_dataset(tmp_path)
    assert ds.lengths.max() > 300 and (ds.lengths < 5).any()
    batches = take(GlobalBatchSampler(ds, 2000, max_len=300, min_len=5), 40)
    seen = np.concatenate([b.indices for b in batches])
    assert (ds.lengths[seen] >= 5).all()
    lengths = np.concatenate([b.lengths for b in batches])
    assert lengths.max() == 300
    assert np.array_equal(lengths, np.minimum(ds.lengths[seen], 300))


def test_epochs_reshuffle_and_cover(tmp_path):
    ds = skewed_dataset(tmp_path)
    eligible = set(np.flatnonzero(ds.lengths >= 2).tolist())
    sampler = GlobalBatchSampler(ds, 1000, seed=0)
    epochs: dict[int, list[int]] = {0: [], 1: []}
    for batch in sampler:
        epoch = sampler.state_dict()["epoch"]  # the epoch of the batch just handed out
        if epoch == 2:
            break
        epochs[epoch].extend(batch.indices.tolist())
    first, second = epochs[0], epochs[1]
    assert len(set(first)) == len(first) and set(first) <= eligible
    assert len(eligible - set(first)) < 20  # only the tail short of one budget is left out
    assert first[:20] != second[:20]


def test_resume_from_state_dict(tmp_path):
    ds = skewed_dataset(tmp_path)
    reference = take(GlobalBatchSampler(ds, 1500, seed=5, max_len=400), 60)  # spans several epochs
    first = GlobalBatchSampler(ds, 1500, seed=5, max_len=400)
    take(first, 37)
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint round trip
    resumed = GlobalBatchSampler(ds, 1500, seed=5, max_len=400)
    resumed.load_state_dict(state)
    for want, got in zip(reference[37:], take(resumed, 23)):
        assert np.array_equal(want.indices, got.indices) and np.array_equal(want.lengths, got.lengths)
    assert resumed.state_dict()["epoch"] > state["epoch"]


def test_global_batch_tokens(tmp_path):
    ds = skewed_dataset(tmp_path)
    batch = take(GlobalBatchSampler(ds, 3000, max_len=200), 1)[0]
    for seq, index in enumerate(batch.indices):
        whole = ds.tokens(int(index))
        assert torch.equal(batch.tokens(seq), whole[: batch.lengths[seq]])
        assert torch.equal(batch.tokens(seq, 1, 2), whole[1:2])
    long_seq = int(np.argmax(batch.lengths))
    with pytest.raises(IndexError):
        batch.tokens(long_seq, 0, int(batch.lengths[long_seq]) + 1)  # beyond the truncation


def test_sampler_rejects_bad_arguments(tmp_path):
    ds = skewed_dataset(tmp_path)
    with pytest.raises(ValueError, match="global_tokens"):
        GlobalBatchSampler(ds, 0)
    with pytest.raises(ValueError, match="fewer than global_tokens"):
        GlobalBatchSampler(ds, int(ds.lengths.sum()) + 1)
    with pytest.raises(ValueError, match="min_len"):
        GlobalBatchSampler(ds, 100, max_len=1)


def test_eval_batches_cover_the_sequences_in_order(tmp_path):
    ds = skewed_dataset(tmp_path)
    batches = eval_batches(ds, global_tokens=500, max_len=300)
    eligible = np.flatnonzero(ds.lengths >= 2)
    assert np.concatenate([b.indices for b in batches]).tolist() == eligible.tolist()
    assert all(b.num_tokens >= 500 for b in batches[:-1]) and 0 < batches[-1].num_tokens
    assert all(b.num_tokens - int(b.lengths[-1]) < 500 for b in batches)  # only the last sequence overshoots
    assert max(int(b.lengths.max()) for b in batches) == 300
    assert batches[0].tokens(0).tolist() == ds.tokens(int(eligible[0]), 0, int(batches[0].lengths[0])).tolist()
    first = eval_batches(ds, global_tokens=500, max_len=300, max_tokens=1200)
    total = sum(b.num_tokens for b in first)
    assert 1200 <= total < 1200 + 300
    taken = np.concatenate([b.indices for b in first])
    assert taken.tolist() == eligible[: len(taken)].tolist()


def test_python_source_files_stop_at_the_budget():
    files = python_source_files(200_000)
    sizes = [f.stat().st_size for f in files]
    assert files and all(f.suffix == ".py" for f in files) and sum(sizes) <= 200_000
    assert files == python_source_files(200_000)[: len(files)] and len(python_source_files(400_000)) > len(files)
