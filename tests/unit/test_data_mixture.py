"""Mixing several token datasets by weight (data/mixture.py)."""

import itertools
import pickle

import numpy as np
import pytest

from bytescale_compile.data.dataset import DatasetError, GlobalBatch, TokenDataset, TokenizerInfo, write_dataset
from bytescale_compile.data.mixture import (
    MixedDataset,
    MixtureSampler,
    batch_sources,
    eval_spec,
    format_data_spec,
    open_data,
    parse_data_spec,
)


def byte_docs(seed: int, n: int, lo: int, hi: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [bytes(rng.integers(0, 256, size=k, dtype=np.uint8)) for k in rng.integers(lo, hi, size=n)]


@pytest.fixture
def prefixes(tmp_path) -> list[str]:
    """Three datasets of very different sequence lengths: short, long and medium, with their held-out splits."""
    shapes = {"short": (400, 2, 20), "long": (30, 100, 600), "mid": (100, 20, 120)}
    for seed, (name, (n, lo, hi)) in enumerate(shapes.items()):
        write_dataset(tmp_path / name, byte_docs(seed, n, lo, hi), source=name)
        write_dataset(tmp_path / f"{name}_eval", byte_docs(seed + 10, 5, lo, hi), source=f"{name} held out")
    return [str(tmp_path / name) for name in shapes]


def take(sampler, n: int) -> list[GlobalBatch]:
    return list(itertools.islice(iter(sampler), n))


def same(a: list[GlobalBatch], b: list[GlobalBatch]) -> bool:
    return len(a) == len(b) and all(
        np.array_equal(x.indices, y.indices) and np.array_equal(x.lengths, y.lengths) for x, y in zip(a, b)
    )


# --- parsing -------------------------------------------------------------------------------------


def test_parse_single_and_weighted():
    assert parse_data_spec("data/a") == [("data/a", 1.0)]
    assert parse_data_spec("data/a:0.7, data/b:0.3") == [("data/a", 0.7), ("data/b", 0.3)]
    assert parse_data_spec("a:3,b:1") == [("a", 0.75), ("b", 0.25)]
    assert parse_data_spec("a,b") == [("a", 0.5), ("b", 0.5)]
    assert parse_data_spec("a:1e-3") == [("a", 1.0)]


def test_parse_keeps_prefixes_with_colons_whole():
    assert parse_data_spec(r"C:\data\a") == [(r"C:\data\a", 1.0)]
    assert parse_data_spec(r"C:\data\a:0.25,C:/data/b:0.75") == [(r"C:\data\a", 0.25), ("C:/data/b", 0.75)]
    assert parse_data_spec("runs:2/corpus") == [("runs:2/corpus", 1.0)]


def test_parse_accepts_an_existing_dataset_whose_name_has_a_colon(tmp_path):
    """Even when what follows the colon reads as a weight (a time of day): an existing dataset stays whole."""
    for name in ("corpus:v2", "crawl-2024-01-01T10:30"):
        prefix = str(tmp_path / name)
        write_dataset(prefix, [b"abc"], source="test")
        assert parse_data_spec(prefix) == [(prefix, 1.0)]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("a:0.7,b:x", "--data a:0.7,b:x: weight of 'b' must be a number > 0, got 'x'"),
        ("a:0.7,b:0", "weight of 'b' must be a number > 0, got '0'"),
        ("a:0.7,b:-1", "weight of 'b' must be a number > 0, got '-1'"),
        ("a:nan,b:1", "weight of 'a' must be a number > 0, got 'nan'"),
        ("a:inf,b:1", "weight of 'a' must be a number > 0, got 'inf'"),
        ("a:,b:1", "weight of 'a' must be a number > 0, got ''"),
        ("a:0.5,,b:0.5", "empty item"),
        ("", "empty item"),
        ("a:0.5,a:0.5", "dataset 'a' given twice"),
        ("a,./a", "dataset './a' given twice"),
        ("a:0.7,b", "['b'] have no weight; give every dataset a weight or none"),
        (":0.5", "has a weight but no dataset prefix"),
    ],
)
def test_parse_refuses(spec, message):
    with pytest.raises(DatasetError) as e:
        parse_data_spec(spec)
    assert str(e.value).startswith(f"--data {spec}: ") and message in str(e.value)


def test_format_reads_back_unchanged():
    assert format_data_spec([("data/a", 1.0)]) == "data/a"
    assert format_data_spec([("runs:2/a", 1.0)]) == "runs:2/a:1.0"
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 7):
        spec = ",".join(f"/d/p{i}:{w!r}" for i, w in enumerate(rng.uniform(0.01, 100, size=n).tolist()))
        formatted = format_data_spec(parse_data_spec(spec))
        assert format_data_spec(parse_data_spec(formatted)) == formatted
        assert parse_data_spec(formatted) == parse_data_spec(spec)
    with pytest.raises(DatasetError, match="contains ','"):
        format_data_spec([("/a,b/c", 0.5), ("d", 0.5)])


# --- the mixed dataset ---------------------------------------------------------------------------


def test_mixed_dataset_reads_the_parts(prefixes):
    parts = [TokenDataset.open(p) for p in prefixes]
    mixed = MixedDataset(parts)
    assert len(mixed) == sum(len(p) for p in parts)
    assert mixed.lengths.tolist() == [n for p in parts for n in p.lengths.tolist()]
    with pytest.raises(ValueError):
        mixed.lengths[0] = 1
    expected = [p.tokens(i).tolist() for p in parts for i in range(len(p))]
    assert [mixed.tokens(i).tolist() for i in range(len(mixed))] == expected
    assert mixed.tokens(len(parts[0]), 1, 3).tolist() == parts[1].tokens(0, 1, 3).tolist()
    assert mixed.part_of([0, len(parts[0]) - 1, len(parts[0]), len(mixed) - 1]).tolist() == [0, 0, 1, 2]
    assert mixed.names == ["short", "long", "mid"]
    assert mixed.vocab_size == 256 and mixed.tokenizer is None
    assert mixed.max_token() == max(p.max_token() for p in parts)
    assert mixed.source == "short: short; long: long; mid: mid"
    for bad in (-1, len(mixed)):
        with pytest.raises(IndexError):
            mixed.tokens(bad)
        with pytest.raises(IndexError):
            mixed.part_of([bad])


def test_mixed_dataset_pickles_as_its_prefixes(prefixes):
    mixed = MixedDataset.open(prefixes)
    data = pickle.dumps(mixed)
    assert len(data) < 1000  # the prefixes, not the tokens
    copy = pickle.loads(data)
    assert copy.prefix == mixed.prefix == ",".join(prefixes)
    assert np.array_equal(copy.lengths, mixed.lengths)
    assert copy.tokens(len(mixed) - 1).tolist() == mixed.tokens(len(mixed) - 1).tolist()


def test_names_are_unique(tmp_path):
    for d in ("x", "y"):
        write_dataset(tmp_path / d / "train", [b"abc"], source=d)
    mixed = MixedDataset.open([tmp_path / "x" / "train", tmp_path / "y" / "train"])
    assert mixed.names == ["train", "train_2"]


def test_mixed_dataset_refuses_another_tokenizer(tmp_path, prefixes):
    tokenizer = TokenizerInfo("tok", "ab" * 32, 0)
    write_dataset(tmp_path / "tok", [np.array([1, 2, 3])], source="t", vocab_size=300, tokenizer=tokenizer)
    with pytest.raises(DatasetError, match=r"tok \(tokenizer tok, sha256 abab.*short \(tokenizer bytes\)"):
        MixedDataset.open([prefixes[0], tmp_path / "tok"])


# --- the sampler ---------------------------------------------------------------------------------


@pytest.mark.parametrize("weights", [[0.7, 0.3], [0.2, 0.5, 0.3]])
def test_token_shares_follow_the_weights(prefixes, weights):
    mixed = MixedDataset.open(prefixes[: len(weights)])
    sampler = MixtureSampler(mixed, weights, global_tokens=2000, seed=3, max_len=400)
    batches = take(sampler, 50)
    assert all(b.num_tokens >= 2000 and b.num_tokens - int(b.lengths[-1]) < 2000 for b in batches)
    assert all(int(b.lengths.max()) <= 400 and int(b.lengths.min()) >= 2 for b in batches)
    totals = np.zeros(len(weights))
    for batch in batches:
        totals += list(batch_sources(batch).values())
    assert np.all(np.abs(totals / totals.sum() - weights) < 0.02), totals / totals.sum()


def test_every_part_cycles_through_its_epochs(prefixes):
    mixed = MixedDataset.open(prefixes[:2])
    batches = take(MixtureSampler(mixed, [0.5, 0.5], global_tokens=1000, min_len=5), 30)
    drawn = np.concatenate([b.indices for b in batches])
    short = drawn[mixed.part_of(drawn) == 0]
    eligible = np.flatnonzero(mixed.lengths[: len(mixed.parts[0])] >= 5)
    first_epoch = short[: len(eligible)]
    assert sorted(first_epoch.tolist()) == eligible.tolist()  # each sequence once before any repeats
    assert not np.array_equal(short[len(eligible) : 2 * len(eligible)], first_epoch)  # then reshuffled


def test_exact_resume(prefixes):
    mixed = MixedDataset.open(prefixes)
    weights = [0.2, 0.5, 0.3]
    full = take(MixtureSampler(mixed, weights, global_tokens=1500, seed=1), 40)
    first = MixtureSampler(mixed, weights, global_tokens=1500, seed=1)
    it = iter(first)
    for _ in range(17):
        next(it)
    resumed = MixtureSampler(mixed, weights, global_tokens=1500, seed=1)
    resumed.load_state_dict(pickle.loads(pickle.dumps(first.state_dict())))
    assert same(take(resumed, 23), full[17:])
    assert same([next(it) for _ in range(23)], full[17:])


def test_same_seed_same_batches_other_seed_others(prefixes):
    mixed = MixedDataset.open(prefixes[:2])

    def batches(seed: int) -> list[GlobalBatch]:
        return take(MixtureSampler(mixed, [0.7, 0.3], global_tokens=1000, seed=seed), 10)

    assert same(batches(0), batches(0))
    assert not same(batches(0), batches(1))


def test_batch_sources_sum_to_the_batch(prefixes):
    mixed = MixedDataset.open(prefixes)
    for batch in take(MixtureSampler(mixed, [0.2, 0.5, 0.3], global_tokens=1000), 5):
        sources = batch_sources(batch)
        assert list(sources) == ["short", "long", "mid"]
        assert sum(sources.values()) == batch.num_tokens
    plain = TokenDataset.open(prefixes[0])
    batch = GlobalBatch(plain, np.array([0, 1]), plain.lengths[:2])
    assert batch_sources(batch) == {"short": batch.num_tokens}


def test_sampler_refuses_bad_arguments(prefixes):
    mixed = MixedDataset.open(prefixes[:2])
    usable_short = int(mixed.parts[0].lengths.sum())
    with pytest.raises(
        ValueError, match=rf"short: only {usable_short} tokens .* fewer than its share of a batch \(0.5 x"
    ):
        MixtureSampler(mixed, [1, 1], global_tokens=2 * usable_short + 2)
    MixtureSampler(mixed, [1, 1], global_tokens=2 * usable_short)
    with pytest.raises(ValueError, match="only 0 tokens in sequences of >= 1000 tokens"):
        MixtureSampler(mixed, [1, 1], global_tokens=100, min_len=1000)
    with pytest.raises(ValueError, match="3 weights for the 2 datasets"):
        MixtureSampler(mixed, [1, 1, 1], global_tokens=100)
    with pytest.raises(ValueError, match="weights must be numbers > 0"):
        MixtureSampler(mixed, [1, 0], global_tokens=100)
    with pytest.raises(ValueError, match="global_tokens must be >= 1"):
        MixtureSampler(mixed, [1, 1], global_tokens=0)
    with pytest.raises(ValueError, match="min_len <= max_len"):
        MixtureSampler(mixed, [1, 1], global_tokens=100, min_len=10, max_len=5)
    sampler = MixtureSampler(mixed, [1, 1], global_tokens=100)
    with pytest.raises(ValueError, match="does not fit 2 datasets"):
        sampler.load_state_dict({"taken": [0, 0], "epochs": [0, 0], "positions": [0, 10**6]})


# --- specs ---------------------------------------------------------------------------------------


def test_open_data(prefixes, tmp_path):
    single, weights = open_data(prefixes[0])
    assert isinstance(single, TokenDataset) and weights is None
    mixed, weights = open_data(f"{prefixes[0]}:3,{prefixes[1]}:1")
    assert isinstance(mixed, MixedDataset) and weights == [0.75, 0.25]
    assert isinstance(open_data(mixed.prefix)[0], MixedDataset)
    missing = str(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="missing"):
        open_data(f"{prefixes[0]}:1,{missing}:1")


def test_eval_spec_opens_the_held_out_splits(prefixes):
    assert eval_spec(prefixes[0]) == f"{prefixes[0]}_eval"
    spec = eval_spec(f"{prefixes[0]}:0.7,{prefixes[1]}:0.3")
    assert spec == f"{prefixes[0]}_eval:0.7,{prefixes[1]}_eval:0.3"
    held_out, weights = open_data(spec)
    assert isinstance(held_out, MixedDataset) and weights == [0.7, 0.3]
    assert held_out.names == ["short_eval", "long_eval"]
    assert eval_spec(r"C:\data\a:1,b:1") == r"C:\data\a_eval:0.5,b_eval:0.5"
