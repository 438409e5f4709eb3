"""The u × r token layout (`UlyssesLayout`): u = 1 is the zigzag layout, and every split partitions the tokens."""

from __future__ import annotations

import pytest
import torch

from bytescale_compile.runtime.layout import LayoutError, ulysses_layout, zigzag_layout

_LENS = [[7, 3, 1], [1], [10, 5, 33, 2], [16], [1, 3, 2, 37, 5, 2]]


@pytest.mark.parametrize("seq_lens", _LENS)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_degree_one_is_the_zigzag_layout(seq_lens, size):
    split, zigzag = ulysses_layout(seq_lens, 1, size), zigzag_layout(seq_lens, size)
    assert split.group_size == size and split.rank_tokens() == zigzag.rank_tokens()
    for g in range(size):
        mine, theirs = split.rank(g), zigzag.rank(g)
        assert torch.equal(mine.token_index, theirs.token_index) and torch.equal(mine.position_ids, theirs.position_ids)
        assert mine.pieces == theirs.pieces


@pytest.mark.parametrize("seq_lens", _LENS)
@pytest.mark.parametrize("u,r", [(4, 1), (2, 2), (1, 4), (3, 2)])
def test_every_token_lands_on_exactly_one_rank(seq_lens, u, r):
    split = ulysses_layout(seq_lens, u, r)
    starts = torch.tensor([0, *seq_lens]).cumsum(0)[:-1]
    owned = torch.cat([split.rank(g).token_index for g in range(u * r)]).sort().values
    assert torch.equal(owned, torch.arange(sum(seq_lens)))
    for ring_index in range(r):
        # the u parts, in member order, are the virtual rank's tokens, as equal as possible
        parts = [split.rank(ring_index * u + m) for m in range(u)]
        virtual = split.ring.rank(ring_index)
        assert torch.equal(torch.cat([p.token_index for p in parts]), virtual.token_index)
        assert max(p.num_tokens for p in parts) - min(p.num_tokens for p in parts) <= 1
        for part in parts:
            seq = torch.bucketize(part.token_index, starts, right=True) - 1
            assert torch.equal(part.position_ids, part.token_index - starts[seq])
            # the pieces tile the part: each a run of one chunk of one sequence
            assert sum(p.length for p in part.pieces) == part.num_tokens
            assert [p.offset for p in part.pieces] == [
                sum(q.length for q in part.pieces[:i]) for i in range(len(part.pieces))
            ]


def test_layout_refuses_a_bad_degree():
    with pytest.raises(LayoutError, match="Ulysses degree must be an int >= 1"):
        ulysses_layout([8], 0, 2)
    with pytest.raises(LayoutError, match="outside the group of 4"):
        ulysses_layout([8], 2, 2).rank(4)
