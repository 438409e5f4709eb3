"""Zigzag layout and packed ring attention: single-process units, then gloo runs on 2, 3 and 4 ranks."""

from __future__ import annotations

import os
import random
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from bytescale_compile.kernels.attention_ref import block_attention_bwd, block_attention_fwd
from bytescale_compile.runtime.dist_attn import RingError, RingStats, RingTimeoutError, packed_ring_attention
from bytescale_compile.runtime.layout import LayoutError, zigzag_layout
from tests.conftest import rel_err
from bytescale_compile.runtime.spawn import run_distributed

# --- layout ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("seq_lens,n", [([7, 3, 1], 2), ([1], 4), ([10, 5, 33, 2], 3), ([16], 4)])
def test_zigzag_layout_partitions_every_sequence(seq_lens, n):
    layout = zigzag_layout(seq_lens, n)
    owned = torch.cat([layout.rank(i).token_index for i in range(n)]).sort().values
    assert torch.equal(owned, torch.arange(sum(seq_lens)))
    starts = torch.tensor([0, *seq_lens]).cumsum(0)[:-1]
    for i in range(n):
        rank = layout.rank(i)
        assert torch.equal(rank.token_index, rank.token_index.sort().values)
        seq = torch.bucketize(rank.token_index, starts, right=True) - 1
        assert torch.equal(rank.position_ids, rank.token_index - starts[seq])
    for s, length in enumerate(seq_lens):
        sizes = [b - a for a, b in zip(layout.chunk_bounds(s)[:-1], layout.chunk_bounds(s)[1:])]
        assert len(sizes) == 2 * n and sum(sizes) == length and max(sizes) - min(sizes) <= 1


def test_zigzag_pairs_chunks_i_and_2n_minus_1_minus_i():
    layout = zigzag_layout([16], 4)
    assert layout.rank(1).token_index.tolist() == [2, 3, 12, 13]
    assert layout.rank_tokens() == [4, 4, 4, 4]


def test_zigzag_layout_rejects_bad_input():
    with pytest.raises(LayoutError, match="positive"):
        zigzag_layout([5, 0], 2)
    with pytest.raises(LayoutError, match="group_size"):
        zigzag_layout([5], 0)
    with pytest.raises(LayoutError, match="outside the group"):
        zigzag_layout([5], 2).rank(2)


def test_blocks_cover_exactly_the_segment_causal_mask():
    """Union of every rank pair's blocks = the segment-causal mask over the full sequences."""
    seq_lens, n = [9, 2, 14], 3
    layout = zigzag_layout(seq_lens, n)
    total = sum(seq_lens)
    covered = torch.zeros(total, total, dtype=torch.int64)
    for i in range(n):
        qi = layout.rank(i).token_index
        for j in range(n):
            kj = layout.rank(j).token_index
            for b in layout.blocks(i, j):
                block = torch.ones(b.q_end - b.q_start, b.k_end - b.k_start, dtype=torch.int64)
                if b.causal:
                    block = block.tril()
                covered[qi[b.q_start:b.q_end][:, None], kj[b.k_start:b.k_end][None, :]] += block
    expected = torch.block_diag(*[torch.ones(n_, n_, dtype=torch.int64).tril() for n_ in seq_lens])
    assert torch.equal(covered, expected)


def test_blocks_merge_to_full_attention_forward_and_backward():
    """Splitting keys into blocks and merging by lse gives full causal attention and its gradients."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, 12, 8, dtype=torch.float64) for h in (4, 2, 2))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    o1, l1 = block_attention_fwd(q[:, :, 6:], k[:, :, :6], v[:, :, :6], 8 ** -0.5, causal=False)
    o2, l2 = block_attention_fwd(q[:, :, 6:], k[:, :, 6:], v[:, :, 6:], 8 ** -0.5, causal=True)
    lse = torch.logaddexp(l1, l2)
    merged = o1 * (l1 - lse).exp().unsqueeze(-1) + o2 * (l2 - lse).exp().unsqueeze(-1)
    assert rel_err(merged, ref[:, :, 6:]) <= 1e-6  # lse is fp32 by contract
    g = torch.randn_like(merged)
    dq1, dk1, dv1 = block_attention_bwd(g, q[:, :, 6:], k[:, :, :6], v[:, :, :6], merged, lse, 8 ** -0.5, causal=False)
    dq2, _, _ = block_attention_bwd(g, q[:, :, 6:], k[:, :, 6:], v[:, :, 6:], merged, lse, 8 ** -0.5, causal=True)
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    F.scaled_dot_product_attention(qr, kr, vr, is_causal=True, enable_gqa=True)[:, :, 6:].backward(g)
    assert rel_err(dq1 + dq2, qr.grad[:, :, 6:]) <= 1e-6
    # only queries 6..11 carry gradient, and they reach keys 0..5 through the off-diagonal block alone
    assert rel_err(dk1, kr.grad[:, :, :6]) <= 1e-6 and rel_err(dv1, vr.grad[:, :, :6]) <= 1e-6


def test_group_of_one_runs_without_torch_distributed():
    torch.manual_seed(0)
    layout = zigzag_layout([5, 8], 1)
    q, k, v = (torch.randn(13, h, 4, requires_grad=True) for h in (2, 1, 1))
    out = packed_ring_attention(q, k, v, layout, [0])
    ref = torch.cat([F.scaled_dot_product_attention(*(x[s:e].transpose(0, 1)[None] for x in (q, k, v)),
                                                    is_causal=True, enable_gqa=True)[0].transpose(0, 1)
                     for s, e in ((0, 5), (5, 13))])
    assert rel_err(out, ref) <= 1e-6


# --- multi-process --------------------------------------------------------------------------------


def _reference(seq_lens, hq, hkv, d, seed):
    """Full q, k, v of a micro-batch, segment-causal attention over whole sequences, and its grads."""
    g = torch.Generator().manual_seed(seed)
    total = sum(seq_lens)
    q, k, v = (torch.randn(total, h, d, generator=g, dtype=torch.float32) for h in (hq, hkv, hkv))
    weight = torch.randn(total, hq, d, generator=g)
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    outs, start = [], 0
    for n in seq_lens:
        piece = [x[start:start + n].transpose(0, 1)[None] for x in (qr, kr, vr)]
        outs.append(F.scaled_dot_product_attention(*piece, is_causal=True, enable_gqa=hq != hkv)[0].transpose(0, 1))
        start += n
    out = torch.cat(outs)
    (out * weight).sum().backward()
    return (q, k, v, weight), (out.detach(), qr.grad, kr.grad, vr.grad)


def _run_case(rank: int, groups: list[list[int]], seq_lens: list[list[int]], hq: int, hkv: int, d: int, seed: int) -> RingStats:
    which = next(i for i, grp in enumerate(groups) if rank in grp)
    group, lens = groups[which], seq_lens[which]
    layout = zigzag_layout(lens, len(group))
    (q, k, v, weight), (ref_out, ref_dq, ref_dk, ref_dv) = _reference(lens, hq, hkv, d, seed + which)
    idx = layout.rank(group.index(rank)).token_index
    ql, kl, vl = (x[idx].clone().requires_grad_() for x in (q, k, v))
    stats = RingStats()
    out = packed_ring_attention(ql, kl, vl, layout, group, stats=stats)
    forward_stats = RingStats(**vars(stats))
    (out * weight[idx]).sum().backward()
    context = f"rank {rank} group {group} lens {lens} heads {hq}/{hkv}"
    for name, got, want in (("out", out, ref_out), ("dq", ql.grad, ref_dq), ("dk", kl.grad, ref_dk), ("dv", vl.grad, ref_dv)):
        # relative to the whole tensor: a rank may hold only first tokens, whose exact dq is 0
        diff, scale = (got - want[idx]).abs().max().item(), want.abs().max().item()
        err = diff / scale if scale else diff
        assert err <= 1e-5, f"{name} {context}: relative error {err:.2e}"
    return forward_stats


def _ring_cases_worker(rank: int, world: int, cases: list[tuple]) -> None:
    for case in cases:
        _run_case(rank, *case)


def _random_cases(world: int, count: int, seed: int) -> list[tuple]:
    """Random groups partitioning the ranks (shuffled order), lengths including 1, odd and < 2N."""
    rng = random.Random(seed)
    cases = []
    for c in range(count):
        ranks = list(range(world))
        rng.shuffle(ranks)
        cut = rng.randint(1, world)
        groups = [ranks[:cut]] + [[r] for r in ranks[cut:]]
        lens = [[rng.choice([1, 2, 3, 2 * len(g) - 1, rng.randint(1, 40)]) for _ in range(rng.randint(1, 4))] for g in groups]
        hq, hkv = rng.choice([(4, 2), (4, 4), (2, 1)])
        cases.append((groups, lens, hq, hkv, 8, seed + 100 * c))
    return cases


def test_ring_on_two_ranks_mha_and_gqa():
    cases = [([[0, 1]], [[1, 2, 3, 17]], 4, 2, 8, 0), ([[1, 0]], [[40]], 4, 4, 8, 1)]
    run_distributed(_ring_cases_worker, 2, cases)


def test_ring_subgroups_on_four_ranks():
    """{0, 2} share a ring while 1 and 3 work alone in the same call; then a non-contiguous 3-ring."""
    cases = [([[0, 2], [1], [3]], [[13, 1, 6], [9], [4, 4]], 4, 2, 8, 7),
             ([[3, 0, 2], [1]], [[5, 31, 2], [11]], 4, 2, 8, 8)]
    run_distributed(_ring_cases_worker, 4, cases)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_random_cases(world):
    run_distributed(_ring_cases_worker, world, _random_cases(world, 6, seed=world))


def _bytes_worker(rank: int, world: int) -> None:
    n, hkv, d = world, 2, 8
    stats = _run_case(rank, [list(range(world))], [[8 * n, 4 * n]], 4, hkv, d, 3)
    t_local = 12
    assert stats.bytes_sent == stats.bytes_received == (n - 1) * t_local * 2 * hkv * d * 4
    assert stats.blocks_skipped > 0 and stats.calls == 1


def test_forward_bytes_match_the_analytic_count():
    run_distributed(_bytes_worker, 3)


def _no_new_groups_worker(rank: int, world: int) -> None:
    before = len(dist.distributed_c10d._world.pg_map)
    layout = zigzag_layout([6, 3], world)
    q, k, v = (torch.randn(layout.rank(rank).num_tokens, h, 4, requires_grad=True) for h in (2, 2, 2))
    for _ in range(50):
        packed_ring_attention(q, k, v, layout, list(range(world))).sum().backward()
    assert len(dist.distributed_c10d._world.pg_map) == before


def test_no_process_group_is_created_per_call():
    run_distributed(_no_new_groups_worker, 2)


def _mismatch_worker(rank: int, world: int, what: str) -> None:
    lens = [10, 3] if (what != "layout" or rank == 0) else [9, 4]
    hkv = 2 if (what != "heads" or rank == 0) else 1
    layout = zigzag_layout(lens, 2)
    t = layout.rank(rank).num_tokens
    q, k, v = torch.randn(t, 4, 8), torch.randn(t, hkv, 8), torch.randn(t, hkv, 8)
    with pytest.raises(RingError) as err:
        packed_ring_attention(q, k, v, layout, [0, 1])
    message = str(err.value)
    expected = "layout (sequence lengths) differs" if what == "layout" else "kv heads differs (rank 0: 2, rank 1: 1)"
    assert "ring group [0, 1]" in message and expected in message, message


@pytest.mark.parametrize("what", ["layout", "heads"])
def test_mismatched_inputs_raise_on_every_rank(what):
    run_distributed(_mismatch_worker, 2, what)


def _timeout_worker(rank: int, world: int) -> None:
    if rank == 0:
        layout = zigzag_layout([8], 2)
        q = torch.randn(4, 2, 4)
        with pytest.raises(RingTimeoutError, match=r"ring group \[0, 1\]: rank 0 waited 2s"):
            packed_ring_attention(q, q, q, layout, [0, 1], timeout_s=2)
    else:
        time.sleep(6)  # alive but never joining the ring
    os._exit(0)  # rank 0 has a receive still posted; skip the process-group teardown


@pytest.mark.slow
def test_peer_that_never_arrives_times_out():
    run_distributed(_timeout_worker, 2)
