"""Token ids held against the model's vocabulary: a sample of every dataset before step 1 (train/preflight.py),
every id a micro-batch reads while it is still on the host (engine/batch.py), and `data check --vocab-size/--model`
over all of them (cli/data.py). A Megatron dataset declares no vocabulary, so `?vocab_size=N` can be wrong."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import bytescale_compile as bsc
from bytescale_compile.cli import main as cli
from bytescale_compile.data import GlobalBatch, MixedDataset, open_data
from bytescale_compile.engine.batch import BatchError, ids_checked
from bytescale_compile.models.llama import tiny
from bytescale_compile.train.preflight import TokenIdError, check_token_ids
from tests.unit.test_data_megatron import write_megatron

VOCAB = 128
"""Of `tiny()`'s embedding."""


def _sequences(n: int, bad: dict[tuple[int, int], int] | None = None) -> list[np.ndarray]:
    """`n` sequences of ids below VOCAB, with `bad` {(sequence, position): id} put in."""
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, VOCAB, int(k)) for k in rng.integers(5, 30, n)]
    for (seq, position), token in (bad or {}).items():
        sequences[seq][position] = token
    return sequences


def test_a_sample_of_each_dataset_is_checked_against_the_model(tmp_path):
    good = write_megatron(tmp_path / "good", _sequences(40))
    bad = write_megatron(tmp_path / "bad", _sequences(40, {(39, 2): 300, (39, 4): 200}))
    check_token_ids(open_data(f"{good}?vocab_size=100")[0], VOCAB, "tiny")  # ids fit the model, not the option
    with pytest.raises(TokenIdError) as refused:
        check_token_ids(open_data(f"{good}?vocab_size=100,{bad}?vocab_size=100")[0], VOCAB, "tiny")
    message = str(refused.value)
    assert f"dataset {bad}?vocab_size=100 (Megatron indexed dataset" in message
    assert "sequence 39 holds token id 300 at position 2, outside model tiny's vocabulary of 128" in message
    assert "the dataset declares vocab_size 100" in message
    assert f"`bytescale-compile data check --data {bad}?vocab_size=100 --vocab-size 128`" in message
    many = write_megatron(tmp_path / "many", _sequences(1000, {(500, 0): 999}))
    check_token_ids(open_data(f"{many}?vocab_size=128")[0], VOCAB, "tiny", sample=4)  # 0, 333, 666, 999
    with pytest.raises(TokenIdError, match="sequence 500 holds token id 999"):
        check_token_ids(open_data(f"{many}?vocab_size=128")[0], VOCAB, "tiny", sample=3)  # 0, 500, 999


def test_a_micro_batch_names_the_sequence_of_an_id_past_the_embedding(tmp_path):
    first = write_megatron(tmp_path / "first", _sequences(4))
    second = write_megatron(tmp_path / "second", _sequences(4, {(2, 3): 1999}))
    data = open_data(f"{first}?vocab_size=2000,{second}?vocab_size=2000")[0]
    assert isinstance(data, MixedDataset)
    indices = np.array([1, 6])  # the second part's sequence 2
    batch = GlobalBatch(data, indices, data.lengths[indices])
    checked = ids_checked(batch, VOCAB)
    assert torch.equal(checked.tokens(0), batch.tokens(0))
    with pytest.raises(BatchError) as refused:
        checked.tokens(1, 2)
    assert str(refused.value).startswith(
        f"dataset {second}?vocab_size=2000: sequence 2 (sequence 1 of the global batch) holds token id 1999 at "
        "position 3, outside the model's vocabulary of 128 (ids 0 to 127)"
    )
    assert f"bytescale-compile data check --data {second}?vocab_size=2000 --vocab-size 128" in str(refused.value)
    model = tiny()
    runtime = bsc.Runtime(model, torch.optim.SGD(model.parameters(), lr=0.1), capacity=128)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(BatchError, match=re.escape("sequence 2 (sequence 1 of the global batch) holds token id 1999")):
        runtime.step(batch)  # not the embedding's IndexError
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_data_check_holds_every_id_against_a_vocabulary_or_a_model(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    prefix = write_megatron(tmp_path / "ids", _sequences(30, {(17, 5): 1999}))
    transformers.LlamaConfig(vocab_size=1024).save_pretrained(tmp_path / "model")
    spec = f"{prefix}?vocab_size=1000"
    for against, of in ((["--vocab-size", "1024"], "--vocab-size"), (["--model", str(tmp_path / "model")], "model")):
        assert cli(["data", "check", "--data", spec, *against]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1
        assert err.startswith(
            f"bytescale-compile data: error: {spec}: sequence 17 holds token id 1999 at position 5 (ids 0 to 1999 "
            f"in all), outside the vocabulary of 1024 ({of}"
        ), err
    assert cli(["data", "check", "--data", spec, "--vocab-size", "2000"]) == 0
    out = capsys.readouterr().out
    assert "max id 1999, every id below vocab_size 2000 (--vocab-size; the dataset declares 1000)" in out
    assert cli(["data", "check", "--data", spec, "--model", str(tmp_path)]) == 2
    assert "cannot read" in capsys.readouterr().err
