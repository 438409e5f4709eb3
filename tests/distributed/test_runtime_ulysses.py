"""The u × r split (Ulysses beside the ring): head assignment and refusals in one process, then every split of
4 gloo ranks through the attention op against the single-process reference, in one spawn."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import pytest
import torch

from bytescale_compile.ops.attention import attention
from bytescale_compile.runtime.context import ContextError, MicroBatchContext, micro_batch
from bytescale_compile.runtime.layout import ulysses_layout, zigzag_layout
from bytescale_compile.runtime.p2p import P2PError, P2PStats, P2PTimeoutError
from bytescale_compile.runtime.ulysses import HeadSplit, UlyssesError, ulysses_attention_fwd
from bytescale_compile.testing import run_distributed
from tests.distributed.test_runtime_ring_attention import Case, _reference
from tests.helpers import rel_err

# --- one process ----------------------------------------------------------------------------------


@pytest.mark.parametrize("heads,kv_heads,u", [(4, 2, 2), (4, 2, 4), (8, 2, 4), (6, 3, 2), (12, 4, 6), (4, 4, 1)])
def test_head_split_gives_every_member_the_kv_heads_its_queries_read(heads, kv_heads, u):
    split = HeadSplit(heads, kv_heads, u)
    rep = heads // kv_heads
    for m in range(u):
        queries, kv = range(heads)[split.queries(m)], split.kv(m)
        local_rep = len(queries) // len(kv)
        assert len(kv) == split.kv_per_member and len(queries) % len(kv) == 0
        assert [kv[i // local_rep] for i in range(len(queries))] == [h // rep for h in queries]
    if u <= kv_heads and kv_heads % u == 0:  # no replication when u divides the K/V heads
        assert sorted(h for m in range(u) for h in split.kv(m)) == list(range(kv_heads))


def test_head_split_refuses_a_degree_that_does_not_divide_the_heads():
    with pytest.raises(UlyssesError, match=r"u=4 must divide the query heads \(H=6, H_kv=2\)"):
        HeadSplit(6, 2, 4)


def test_context_refuses_a_degree_that_does_not_divide_the_group():
    with pytest.raises(ContextError, match="Ulysses degree 3 must divide the number of ranks .* a group of 4 ranks"):
        MicroBatchContext(group=(0, 1, 2, 3), layout=zigzag_layout([8], 1), ulysses=3)
    with pytest.raises(ContextError, match="needs a zigzag layout made for 2 ranks"):
        MicroBatchContext(group=(0, 1, 2, 3), layout=zigzag_layout([8], 4), ulysses=2)
    with pytest.raises(ContextError, match="must be an int >= 1"):
        MicroBatchContext(group=(0, 1), layout=zigzag_layout([8], 2), ulysses=0)
    assert MicroBatchContext(group=(0, 1, 2, 3), layout=zigzag_layout([8], 2), ulysses=2).split_layout.group_size == 4


def test_split_refuses_a_group_the_layout_was_not_made_for():
    q = torch.randn(2, 4, 8)
    with pytest.raises(P2PError, match=r"ulysses × ring group \[0, 1, 2\] has 3 ranks but the layout was made for 4"):
        ulysses_attention_fwd(q, q, q, ulysses_layout([8], 2, 2), [0, 1, 2])


# --- four ranks -----------------------------------------------------------------------------------

_WORLD = 4
_LENS = [1, 3, 2, 37, 5, 2]
"""Some sequences shorter than the 4 ranks (or than 2r chunks), one long."""


@dataclass(frozen=True)
class Split:
    ulysses: int
    hq: int = 4
    hkv: int = 2
    dv: int = 8
    window: int | None = None
    softcap: float | None = None


_SPLITS = [
    Split(4),  # u > H_kv: each K/V head goes to two members
    Split(4, hq=4, hkv=1, dv=6, window=5, softcap=2.0),
    Split(2),
    Split(2, hq=6, hkv=3, dv=4, window=3),  # u does not divide H_kv: members share K/V head 1
    Split(1),
    Split(1, window=4, softcap=3.0),
]


def _expected_a2a_bytes(rank: int, split: Split, d: int) -> int:
    """What the forward's two all-to-alls send from `rank`: its token shard of every other member's heads, then
    its heads (out and fp32 lse) of every other member's tokens."""
    u = split.ulysses
    if u == 1:
        return 0
    layout = ulysses_layout(_LENS, u, _WORLD // u)
    heads = HeadSplit(split.hq, split.hkv, u)
    group = range(rank - rank % u, rank - rank % u + u)
    shard = layout.rank(rank).num_tokens * (heads.q_per_member * d + heads.kv_per_member * (d + split.dv)) * 4
    back = sum(layout.rank(j).num_tokens for j in group if j != rank) * heads.q_per_member * (split.dv + 1) * 4
    return (u - 1) * shard + back


def _splits_worker(rank: int, world: int) -> None:
    for i, split in enumerate(_SPLITS):
        d = 8
        case = Case([list(range(world))], [_LENS], split.hq, split.hkv, d, split.dv, split.window, split.softcap)
        (q, k, v, weight), (ref_out, ref_dq, ref_dk, ref_dv) = _reference(_LENS, case, seed=i)
        layout = ulysses_layout(_LENS, split.ulysses, world // split.ulysses)
        idx = layout.rank(rank).token_index
        ql, kl, vl = (x[idx].transpose(0, 1)[None].clone().requires_grad_() for x in (q, k, v))
        with micro_batch(group=range(world), layout=layout.ring, ulysses=split.ulysses) as ctx:
            out, _ = attention(ql, kl, vl, d**-0.5, None, split.window, split.softcap)
            forward = P2PStats(**vars(ctx.ring_stats))
            (out * weight[idx].transpose(0, 1)[None]).sum().backward()
        results = (("out", out, ref_out), ("dq", ql.grad, ref_dq), ("dk", kl.grad, ref_dk), ("dv", vl.grad, ref_dv))
        for name, got, want in results:
            # relative to the whole tensor: a rank may hold only first tokens, whose exact dq is 0
            err = rel_err(got[0].transpose(0, 1), want[idx], floor=want.abs().max().item())
            assert err <= 1e-5, f"{name} rank {rank} {split}: relative error {err:.2e}"
        assert forward.ulysses_bytes_sent == _expected_a2a_bytes(rank, split, d), f"rank {rank} {split}: {forward}"
        assert ctx.ring_stats.bytes_sent >= ctx.ring_stats.ulysses_bytes_sent >= forward.ulysses_bytes_sent
    # every rank refuses a degree that does not divide the heads, before anything moves
    layout = ulysses_layout(_LENS, 4, 1)
    t = layout.rank(rank).num_tokens
    stats = P2PStats()
    q = torch.randn(t, 6, 8)
    with pytest.raises(
        UlyssesError, match=r"rank \d: the Ulysses degree u=4 must divide the query heads \(H=6, H_kv=2"
    ):
        ulysses_attention_fwd(q, q[:, :2], q[:, :2], layout, list(range(world)), stats=stats)
    assert stats.ulysses_bytes_sent == 0


@pytest.mark.slow  # by default the Runtime's step runs (2, 2) and a ring in tests/distributed/test_train_ulysses.py
def test_every_split_of_four_ranks_matches_the_reference():
    """(u, r) = (4, 1), (2, 2), (1, 4) on mixed packed lengths, causal and windowed, GQA with u > H_kv: outputs,
    gradients and the all-to-all's bytes; then the refusal of u not dividing H on every rank."""
    run_distributed(_splits_worker, _WORLD)


def _timeout_worker(rank: int, world: int) -> None:
    if rank == 0:
        q = torch.randn(ulysses_layout([8], 2, 1).rank(0).num_tokens, 2, 4)
        with pytest.raises(P2PTimeoutError, match=r"ulysses group \[0, 1\]: rank 0 waited 2s for q/k/v head shards"):
            ulysses_attention_fwd(q, q, q, ulysses_layout([8], 2, 1), [0, 1], check=False, timeout_s=2)
    else:
        time.sleep(6)  # alive but never joining the all-to-all
    os._exit(0)  # rank 0 has a receive still posted; skip the process-group teardown


@pytest.mark.slow
def test_member_that_never_arrives_times_out():
    run_distributed(_timeout_worker, 2)
