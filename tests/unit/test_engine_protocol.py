"""The model protocol's inputs (`engine/protocol.py`) against the hand-built rows they replace: the same tensors,
value for value and dtype for dtype, on packed rows, pieces of a sequence and the setup probe's row."""

import pytest
import torch

from bytescale_compile.engine.protocol import (
    IGNORE_INDEX,
    ModelProtocolError,
    ProtocolInputs,
    forward_kwargs,
    model_inputs,
    next_token_labels,
    num_targets,
    packed_row,
)
from bytescale_compile.models.llama import tiny
from tests.helpers import hf_llama


def _hand_built(seq_lens: list[int], vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """A packed row as the tests built one by hand: each sequence drawn one token longer, its last target -100."""
    g = torch.Generator().manual_seed(seed)
    ids, pos, tgt = [], [], []
    for n in seq_lens:
        seq = torch.randint(0, vocab, (n + 1,), generator=g)
        ids.append(seq[:-1])
        pos.append(torch.arange(n))
        tgt.append(torch.cat([seq[1:-1], torch.tensor([-100])]))
    return {
        "input_ids": torch.cat(ids)[None],
        "position_ids": torch.cat(pos)[None],
        "shift_labels": torch.cat(tgt)[None],
        "num_items_in_batch": torch.tensor(sum(seq_lens) - len(seq_lens)),
    }


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("seq_lens", [[7], [5, 1, 3], [1, 1], [4, 9, 2, 6]])
def test_a_packed_row_is_the_hand_built_one(seq_lens):
    want = _hand_built(seq_lens, vocab=50, seed=3)
    g = torch.Generator().manual_seed(3)
    ids = torch.cat([torch.randint(0, 50, (n + 1,), generator=g)[:-1] for n in seq_lens])
    _assert_same(packed_row(ids, seq_lens).kwargs(), want)
    _assert_same(packed_row(ids[None], seq_lens).kwargs(), want)


def test_labels_point_at_the_row_s_labels_and_num_items_counts_the_global_batch():
    row = packed_row(torch.arange(6), [2, 4], num_items=40)
    kwargs = row.kwargs(labels=True)
    assert kwargs["labels"] is kwargs["shift_labels"]
    assert int(row.num_items_in_batch) == 40 and num_targets([2, 4]) == 4
    assert row.shift_labels.tolist() == [[1, IGNORE_INDEX, 3, 4, 5, IGNORE_INDEX]]
    assert row.position_ids.tolist() == [[0, 1, 0, 1, 2, 3]]


def test_the_setup_probe_row_is_the_one_it_built_by_hand():
    positions = torch.arange(4).repeat(2)[None]
    labels = torch.zeros_like(positions)
    labels[:, 3::4] = -100
    want = {
        "input_ids": torch.zeros_like(positions),
        "position_ids": positions,
        "shift_labels": labels,
        "num_items_in_batch": torch.tensor(6),
        "labels": labels,
    }
    _assert_same(packed_row(torch.zeros(8, dtype=torch.long), [4, 4]).kwargs(labels=True), want)


def test_a_piece_of_a_sequence_reads_its_last_target_one_token_past_it():
    tokens = torch.tensor([5, 6, 7, 8])  # a piece of 3 tokens and the next piece's first
    assert next_token_labels(tokens, ends_sequence=False).tolist() == [6, 7, 8]
    assert next_token_labels(tokens[:3]).tolist() == [6, 7, IGNORE_INDEX]
    rows = torch.randint(0, 128, (2, 16))
    assert torch.equal(next_token_labels(rows), torch.cat([rows[:, 1:], torch.full((2, 1), -100)], dim=1))


def test_the_row_stays_on_the_device_and_dtype_of_its_ids():
    row = packed_row(torch.arange(5, dtype=torch.int32), [3, 2])
    assert row.shift_labels.dtype == torch.int32 and row.position_ids.dtype == torch.int64
    moved = row.to("meta")
    assert all(t.device.type == "meta" for t in moved.kwargs().values())
    assert isinstance(moved, ProtocolInputs)


@pytest.mark.parametrize("lengths", [[3, 3], [6, 0], []])
def test_lengths_that_do_not_tile_the_row_are_refused(lengths):
    with pytest.raises(ValueError, match="cannot hold sequences of lengths"):
        packed_row(torch.arange(5), lengths)


def test_forward_kwargs_add_what_a_hugging_face_forward_takes():
    row = packed_row(torch.arange(8), [8])
    assert set(forward_kwargs(tiny(), row)) == {"input_ids", "position_ids", "shift_labels", "num_items_in_batch"}
    hf = forward_kwargs(hf_llama(), row)
    assert hf["labels"] is hf["shift_labels"] and hf["use_cache"] is False
    with pytest.raises(ModelProtocolError, match=r"Identity.forward does not take \['input_ids'"):
        forward_kwargs(torch.nn.Identity(), row)


def test_model_inputs_draw_one_sequence_below_the_model_s_vocabulary():
    model = tiny()
    torch.manual_seed(0)
    got = model_inputs(model, 16)
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    want = {
        "input_ids": ids,
        "position_ids": torch.arange(16)[None],
        "shift_labels": torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1),
        "num_items_in_batch": torch.tensor(15),
    }
    _assert_same(got, want)
    with pytest.raises(ModelProtocolError, match="no config.vocab_size"):
        model_inputs(torch.nn.Identity(), 4)
