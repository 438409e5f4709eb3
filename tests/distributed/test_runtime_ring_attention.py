"""Zigzag layout and packed ring attention: single-process units, then gloo runs on 2, 3 and 4 ranks."""

from __future__ import annotations

import datetime
import math
import os
import random
import re
import time
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from bytescale_compile.kernels.attention_ref import block_attention_bwd, block_attention_fwd
from bytescale_compile.runtime.layout import Block, LayoutError, zigzag_layout
from bytescale_compile.runtime.p2p import P2PError, P2PStats, P2PTimeoutError
from bytescale_compile.runtime.ring_attention import _merge, packed_ring_attention
from bytescale_compile.testing import run_distributed
from tests.helpers import rel_err

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


def _dense_mask(seq_lens: list[int], window: int | None) -> torch.Tensor:
    """[T, T] windowed segment-causal mask over the concatenated sequences, straight from the definition."""
    seq = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens))
    pos = torch.cat([torch.arange(n) for n in seq_lens])
    i, j = pos[:, None], pos[None, :]
    mask = (seq[:, None] == seq[None, :]) & (j <= i)
    return mask if window is None else mask & (i - j < window)


def _block_mask(b) -> torch.Tensor:
    """The contract's visible(i, j) over one block."""
    i = torch.arange(b.q_end - b.q_start)[:, None] + b.offset
    j = torch.arange(b.k_end - b.k_start)[None, :]
    visible = torch.ones(i.shape[0], j.shape[1], dtype=torch.bool)
    if b.causal:
        visible &= j <= i
    if b.window is not None:
        visible &= i - j < b.window
    return visible


@pytest.mark.parametrize("window", [None, 1, 2, 3, 7, 100])
def test_blocks_cover_exactly_the_windowed_segment_causal_mask(window):
    """Union of every rank pair's blocks, each under its own mask, = the windowed segment-causal mask."""
    seq_lens, n = [9, 2, 14, 25], 3
    layout = zigzag_layout(seq_lens, n)
    total = sum(seq_lens)
    covered = torch.zeros(total, total, dtype=torch.int64)
    for i in range(n):
        qi = layout.rank(i).token_index
        for j in range(n):
            kj = layout.rank(j).token_index
            for b in layout.blocks(i, j, window):
                visible = _block_mask(b)
                # trimmed: every query row sees a key of the block and every key column is seen
                assert visible.any(1).all() and visible.any(0).all(), b
                covered[qi[b.q_start : b.q_end][:, None], kj[b.k_start : b.k_end][None, :]] += visible.long()
    assert torch.equal(covered, _dense_mask(seq_lens, window).long())


def test_window_trims_the_blocks_of_a_long_sequence():
    layout = zigzag_layout([64], 4)  # chunks of 8; rank 0 holds chunks 0 and 7, rank 2 chunks 2 and 5
    assert layout.blocks(2, 0, window=4) == ()
    (block,) = layout.blocks(0, 1, window=4)  # chunk 7 (positions 56..63) against chunk 6 (48..55)
    assert (block.q_start, block.q_end, block.k_start, block.k_end) == (8, 11, 13, 16)
    assert block.offset == 56 - 53 and not block.causal and block.window == 4
    assert all(b.window is None for b in layout.blocks(0, 1))


@pytest.mark.parametrize("window", [None, 2, 5, 40])
def test_transfer_packs_exactly_the_rows_some_query_sees(window):
    seq_lens, n = [31, 4, 17], 4
    layout = zigzag_layout(seq_lens, n)
    mask = _dense_mask(seq_lens, window)
    for i in range(n):
        qi = layout.rank(i).token_index
        for j in range(n):
            kj = layout.rank(j).token_index
            transfer = layout.transfer(i, j, window)
            seen = mask[qi][:, kj].any(0).nonzero().flatten().tolist()
            assert [r for start, end in transfer.ranges for r in range(start, end)] == seen
            packed = torch.cat([kj[start:end] for start, end in transfer.ranges]) if seen else kj[:0]
            for moved, local in zip(transfer.blocks, layout.blocks(i, j, window)):
                assert torch.equal(packed[moved.k_start : moved.k_end], kj[local.k_start : local.k_end])


def test_layout_rejects_a_bad_window():
    with pytest.raises(LayoutError, match="window must be None or an int >= 1"):
        zigzag_layout([8], 2).blocks(0, 0, window=0)


def test_merge_keeps_rows_without_keys_nan_free():
    """Rows where a block, or every block so far, saw no key (lse = -inf) merge to 0 / -inf, not NaN."""
    out, lse = torch.zeros(3, 2, 4), torch.full((2, 3), float("-inf"))
    block = Block(0, 3, 0, 1, causal=False, offset=0)
    block_lse = torch.tensor([[[float("-inf"), 0.5, float("-inf")], [float("-inf"), -1.0, float("-inf")]]])
    block_out = torch.ones(1, 2, 3, 4) * block_lse.isfinite().unsqueeze(-1)
    _merge(out, lse, block, block_out, block_lse)
    _merge(out, lse, block, block_out, block_lse)
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(out[0], torch.zeros(2, 4)) and lse[:, 0].isneginf().all()
    assert torch.allclose(out[1], torch.ones(2, 4)) and torch.allclose(lse[:, 1], block_lse[0, :, 1] + math.log(2))


def test_blocks_merge_to_full_attention_forward_and_backward():
    """Splitting keys into blocks and merging by lse gives full causal attention and its gradients."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, 12, 8, dtype=torch.float64) for h in (4, 2, 2))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    o1, l1 = block_attention_fwd(q[:, :, 6:], k[:, :, :6], v[:, :, :6], 8**-0.5, causal=False)
    o2, l2 = block_attention_fwd(q[:, :, 6:], k[:, :, 6:], v[:, :, 6:], 8**-0.5, causal=True)
    lse = torch.logaddexp(l1, l2)
    merged = o1 * (l1 - lse).exp().unsqueeze(-1) + o2 * (l2 - lse).exp().unsqueeze(-1)
    assert rel_err(merged, ref[:, :, 6:]) <= 1e-6  # lse is fp32 by contract
    g = torch.randn_like(merged)
    dq1, dk1, dv1 = block_attention_bwd(g, q[:, :, 6:], k[:, :, :6], v[:, :, :6], merged, lse, 8**-0.5, causal=False)
    dq2, _, _ = block_attention_bwd(g, q[:, :, 6:], k[:, :, 6:], v[:, :, 6:], merged, lse, 8**-0.5, causal=True)
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    F.scaled_dot_product_attention(qr, kr, vr, is_causal=True, enable_gqa=True)[:, :, 6:].backward(g)
    assert rel_err(dq1 + dq2, qr.grad[:, :, 6:]) <= 1e-6
    # only queries 6..11 carry gradient, and they reach keys 0..5 through the off-diagonal block alone
    assert rel_err(dk1, kr.grad[:, :, :6]) <= 1e-6 and rel_err(dv1, vr.grad[:, :, :6]) <= 1e-6


# --- reference -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One ring call: per group its sequence lengths; heads, head dims and the attention arguments."""

    groups: list[list[int]]
    seq_lens: list[list[int]]
    hq: int = 4
    hkv: int = 2
    d: int = 8
    dv: int = 8
    window: int | None = None
    softcap: float | None = None
    seed: int = 0


def _reference(seq_lens: list[int], case: Case, seed: int):
    """Full q, k, v of a micro-batch, dense windowed segment-causal attention in fp64, and its grads."""
    g = torch.Generator().manual_seed(seed)
    total = sum(seq_lens)
    q, k = (torch.randn(total, h, case.d, generator=g) for h in (case.hq, case.hkv))
    v, weight = torch.randn(total, case.hkv, case.dv, generator=g), torch.randn(total, case.hq, case.dv, generator=g)
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    rep = case.hq // case.hkv
    scores = torch.einsum("ihd,jhd->hij", qr, kr.repeat_interleave(rep, 1)) * case.d**-0.5
    if case.softcap is not None:
        scores = case.softcap * torch.tanh(scores / case.softcap)
    probs = scores.masked_fill(~_dense_mask(seq_lens, case.window), float("-inf")).softmax(-1)
    out = torch.einsum("hij,jhd->ihd", probs, vr.repeat_interleave(rep, 1))
    (out * weight).sum().backward()
    return (q, k, v, weight), (out.detach(), qr.grad, kr.grad, vr.grad)


def _check_case(rank: int, case: Case) -> tuple[P2PStats, P2PStats]:
    """Run this rank's part of `case` forward and backward, compare with the reference; (forward, backward) stats."""
    which = next(i for i, grp in enumerate(case.groups) if rank in grp)
    group, lens = case.groups[which], case.seq_lens[which]
    layout = zigzag_layout(lens, len(group))
    (q, k, v, weight), (ref_out, ref_dq, ref_dk, ref_dv) = _reference(lens, case, case.seed + which)
    idx = layout.rank(group.index(rank)).token_index
    ql, kl, vl = (x[idx].clone().requires_grad_() for x in (q, k, v))
    fwd = P2PStats()
    out = packed_ring_attention(ql, kl, vl, layout, group, stats=fwd, window=case.window, softcap=case.softcap)
    forward = P2PStats(**vars(fwd))
    (out * weight[idx]).sum().backward()
    context = f"rank {rank} group {group} lens {lens} {case}"
    results = (("out", out, ref_out), ("dq", ql.grad, ref_dq), ("dk", kl.grad, ref_dk), ("dv", vl.grad, ref_dv))
    problem = max(t.abs().max().item() for t in (ref_out, ref_dk, ref_dv))
    for name, got, want in results:
        # relative to the whole tensor: a rank may hold only first tokens, whose exact dq is 0; the whole dq is 0
        # where every query sees only itself (a window of 1), and then holds rounding noise of the problem's scale
        err = rel_err(got, want[idx], floor=want.abs().max().item() or problem)
        assert err <= 1e-5, f"{name} {context}: relative error {err:.2e}"
    return forward, P2PStats(**{f: getattr(fwd, f) - getattr(forward, f) for f in vars(fwd)})


def test_group_of_one_runs_without_torch_distributed():
    _check_case(0, Case([[0]], [[5, 8]], hq=2, hkv=1, d=4, dv=4))


def test_group_of_one_with_window_softcap_and_wider_values():
    _check_case(0, Case([[0]], [[5, 11, 1]], hq=4, hkv=2, d=4, dv=6, window=3, softcap=2.0))


# --- multi-process --------------------------------------------------------------------------------


def _ring_cases_worker(rank: int, world: int, cases: list[Case]) -> None:
    for case in cases:
        _check_case(rank, case)


def _random_cases(world: int, count: int, seed: int) -> list[Case]:
    """Random groups partitioning the ranks (shuffled order), lengths including 1, odd and < 2N, random windows."""
    rng = random.Random(seed)
    cases = []
    for c in range(count):
        ranks = list(range(world))
        rng.shuffle(ranks)
        cut = rng.randint(1, world)
        groups = [ranks[:cut]] + [[r] for r in ranks[cut:]]
        lens = [
            [rng.choice([1, 2, 3, 2 * len(g) - 1, rng.randint(1, 40)]) for _ in range(rng.randint(1, 4))]
            for g in groups
        ]
        hq, hkv = rng.choice([(4, 2), (4, 4), (2, 1)])
        cases.append(
            Case(
                groups,
                lens,
                hq,
                hkv,
                8,
                rng.choice([8, 4, 12]),
                window=rng.choice([None, 1, 2, 5, 13, 64]),
                softcap=rng.choice([None, 1.5]),
                seed=seed + 100 * c,
            )
        )
    return cases


def test_ring_on_two_ranks():
    cases = [
        Case([[0, 1]], [[1, 2, 3, 17]]),  # GQA, plain causal, lengths below 2N
        Case([[1, 0]], [[40, 7]], hq=4, hkv=4, dv=12, window=5, softcap=20.0, seed=1),
    ]  # window < a chunk of 10
    run_distributed(_ring_cases_worker, 2, cases)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_random_cases(world):
    run_distributed(_ring_cases_worker, world, _random_cases(world, 6, seed=world))


def _expected_traffic(case: Case, rank: int) -> tuple[P2PStats, P2PStats]:
    """Bytes and skipped transfers of one rank, from the dense mask: the rows of each peer some local query sees."""
    lens, n = case.seq_lens[0], len(case.groups[0])
    layout, mask = zigzag_layout(lens, n), _dense_mask(lens, case.window)
    tokens = [layout.rank(i).token_index for i in range(n)]

    def rows(receiver: int, sender: int) -> int:
        return int(mask[tokens[receiver]][:, tokens[sender]].any(0).sum())

    row_bytes = case.hkv * (case.d + case.dv) * 4  # fp32 K|V, and fp32 dK|dV
    me, peers = case.groups[0].index(rank), [i for i in range(n) if i != case.groups[0].index(rank)]
    sent = sum(rows(r, me) for r in peers) * row_bytes
    received = sum(rows(me, j) for j in peers) * row_bytes
    fwd = P2PStats(
        calls=1,
        bytes_sent=sent,
        bytes_received=received,
        sends_skipped=sum(rows(r, me) == 0 for r in peers),
        receives_skipped=sum(rows(me, j) == 0 for j in peers),
    )
    # the backward moves K/V again, and every received row's dK/dV goes back to its owner
    bwd = P2PStats(
        bytes_sent=sent + received,
        bytes_received=received + sent,
        sends_skipped=fwd.sends_skipped + fwd.receives_skipped,
        receives_skipped=fwd.receives_skipped + fwd.sends_skipped,
    )
    return fwd, bwd


def _traffic_worker(rank: int, world: int, cases: list[tuple[Case, float]]) -> None:
    for case, most_of_causal in cases:
        got = _check_case(rank, case)
        want = _expected_traffic(case, rank)
        for phase, g, w in zip(("forward", "backward"), got, want):
            for name in ("bytes_sent", "bytes_received", "sends_skipped", "receives_skipped"):
                assert getattr(g, name) == getattr(w, name), f"{phase} {name} rank {rank} {case}: {g} vs {w}"
        causal = _expected_traffic(Case(case.groups, case.seq_lens, case.hq, case.hkv, case.d, case.dv), rank)[0]
        assert got[0].bytes_sent <= most_of_causal * causal.bytes_sent, f"rank {rank} {case}: {got[0]} vs {causal}"
        assert got[0].blocks_computed > 0 and got[0].calls == 1


def _four_ranks_worker(rank: int, world: int, cases: list[Case], traffic_cases: list[tuple[Case, float]]) -> None:
    _ring_cases_worker(rank, world, cases)
    _traffic_worker(rank, world, traffic_cases)


def test_ring_on_four_ranks():
    """Subgroups, then the bytes a window saves (one spawn of 4 ranks for all of it).

    {0, 2} share a ring while 1 and 3 work alone in the same call; then a non-contiguous 3-ring. On
    the full group, chunks of 8: a window inside a chunk empties pairs, one spanning chunks trims
    them, one beyond the sequence changes nothing; each moves exactly the rows the receiver sees.
    """
    cases = [
        Case([[0, 2], [1], [3]], [[13, 1, 6], [9], [4, 4]], seed=7),
        Case([[3, 0, 2], [1]], [[5, 31, 2], [11]], window=6, seed=8),
    ]
    traffic_cases = [
        (Case([[0, 1, 2, 3]], [[64]], hq=4, hkv=2, d=8, dv=4, window=3, seed=3), 0.15),
        (Case([[0, 1, 2, 3]], [[61, 9]], hq=2, hkv=1, d=8, dv=8, window=11, softcap=5.0, seed=4), 0.6),
        (Case([[0, 1, 2, 3]], [[20, 3]], hq=4, hkv=2, d=4, dv=4, window=64, seed=5), 1.0),
    ]
    run_distributed(_four_ranks_worker, 4, cases, traffic_cases)


def _no_new_groups_worker(rank: int, world: int) -> None:
    before = len(dist.distributed_c10d._world.pg_map)
    layout = zigzag_layout([6, 3], world)
    q, k, v = (torch.randn(layout.rank(rank).num_tokens, h, 4, requires_grad=True) for h in (2, 2, 2))
    for _ in range(50):
        packed_ring_attention(q, k, v, layout, list(range(world))).sum().backward()
    assert len(dist.distributed_c10d._world.pg_map) == before


def test_no_process_group_is_created_per_call():
    run_distributed(_no_new_groups_worker, 2)


_MISMATCHES = {
    "layout": "layout (sequence lengths) differs (rank 0: [10, 3], rank 1: [9, 4])",
    "heads": "kv heads differs (rank 0: 2, rank 1: 1)",
    "attention": "v head dim differs (rank 0: 8, rank 1: 6); dtype differs (rank 0: float32, rank 1: float64); "
    "window differs (rank 0: none, rank 1: 4); softcap differs (rank 0: none, rank 1: 30.0)",
}


def _mismatch_worker(rank: int, world: int) -> None:
    """Every way in which the group can disagree, in one spawn: each raises on both ranks before K/V moves."""
    for what, expected in _MISMATCHES.items():
        odd = rank == 1
        lens = [9, 4] if odd and what == "layout" else [10, 3]
        hkv = 1 if odd and what == "heads" else 2
        dv, dtype, window, softcap = (
            (6, torch.float64, 4, 30.0) if odd and what == "attention" else (8, torch.float32, None, None)
        )
        layout = zigzag_layout(lens, 2)
        t = layout.rank(rank).num_tokens
        q, k = torch.randn(t, 4, 8, dtype=dtype), torch.randn(t, hkv, 8, dtype=dtype)
        v = torch.randn(t, hkv, dv, dtype=dtype)
        stats = P2PStats()
        with pytest.raises(P2PError) as err:
            packed_ring_attention(q, k, v, layout, [0, 1], stats=stats, window=window, softcap=softcap)
        message = str(err.value)
        assert "ring group [0, 1]: inputs differ across ranks" in message and expected in message, message
        assert stats == P2PStats()
    # one rank's bad argument must not leave the other waiting
    q = torch.randn(4, 2, 4)
    with pytest.raises(P2PError) as err:
        packed_ring_attention(q, q, q, zigzag_layout([8], 2), [0, 1], window=0 if rank == 1 else 4)
    assert "window differs (rank 0: 4, rank 1: 0); rank 1: window must be None or an int >= 1" in str(err.value)
    # groups that name ranks outside the world are refused before any P2P (they used to crash or hang)
    for group, expected in (([0, 5], "rank(s) [5] outside the world of 2 ranks"), ([0, -1], "rank(s) [-1] outside")):
        with pytest.raises(P2PError, match=re.escape(expected)):
            packed_ring_attention(q, q, q, zigzag_layout([8], 2), group)


def test_mismatched_inputs_raise_on_every_rank():
    run_distributed(_mismatch_worker, 2)


def _timeout_worker(rank: int, world: int) -> None:
    if rank == 0:
        layout = zigzag_layout([8], 2)
        q = torch.randn(4, 2, 4)
        with pytest.raises(P2PTimeoutError, match=r"ring group \[0, 1\]: rank 0 waited 2s"):
            packed_ring_attention(q, q, q, layout, [0, 1], timeout_s=2)
    else:
        time.sleep(6)  # alive but never joining the ring
    os._exit(0)  # rank 0 has a receive still posted; skip the process-group teardown


@pytest.mark.slow
def test_peer_that_never_arrives_times_out():
    run_distributed(_timeout_worker, 2)


class _FailingWork:
    """A posted transfer whose wait raises `error` after `seconds` (None: completes at once)."""

    def __init__(self, error: Exception | None, seconds: float = 0.0):
        self.error, self.seconds = error, seconds
        self.timeouts: list[object] = []

    def wait(self, timeout=None):
        self.timeouts.append(timeout)
        time.sleep(self.seconds)
        if self.error is not None:
            raise self.error


@pytest.mark.parametrize(
    "error,seconds,backend,raised",
    [
        (
            RuntimeError("[unbound_buffer.cc:78] Timed out waiting 50ms for recv operation to complete"),
            0.06,
            "gloo",
            "P2PTimeoutError",
        ),
        (RuntimeError("Connection closed by peer"), 0.06, "gloo", "P2PTimeoutError"),
        (RuntimeError("[Rank 0] Work timed out after 5000 ms"), 0.0, "gloo", "P2PError"),
        (torch.distributed.DistBackendError("Connection reset by peer"), 0.0, "gloo", "P2PError"),
        (torch.distributed.DistBackendError("Watchdog caught collective operation timeout"), 0.06, "nccl", "P2PError"),
    ],
    ids=["deadline-passed", "deadline-passed-any-text", "early-failure-any-text", "lost-peer", "nccl-watchdog"],
)
def test_wait_tells_timeouts_by_the_rings_deadline_not_the_message(monkeypatch, error, seconds, backend, raised):
    """A wait that fails once the ring's timeout has passed is a `P2PTimeoutError`, one that fails before it a
    `P2PError`, whatever the backend's message says; on NCCL the watchdog's errors are `P2PError`s."""
    from bytescale_compile.runtime import p2p, ring_attention

    ring = ring_attention.make_ring(zigzag_layout([8], 1), [0], 0.05, None, None)
    monkeypatch.setattr(p2p.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(p2p.dist, "get_backend", lambda: backend)
    with pytest.raises(P2PError) as err:
        ring.wait([_FailingWork(error, seconds)], "a K/V block", (1,))
    assert type(err.value).__name__ == raised and "ring group [0]" in str(err.value)


@pytest.mark.parametrize("backend,timeout", [("gloo", datetime.timedelta(seconds=1)), ("nccl", None)])
def test_wait_blocks_the_cpu_only_off_nccl(monkeypatch, backend, timeout):
    """On NCCL the wait is stream-ordered (no CPU-blocking timeout); elsewhere it waits `timeout_s`."""
    from bytescale_compile.runtime import p2p, ring_attention

    ring = ring_attention.make_ring(zigzag_layout([8], 1), [0], 1.0, None, None)
    monkeypatch.setattr(p2p.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(p2p.dist, "get_backend", lambda: backend)
    work = _FailingWork(None)
    ring.wait([work], "a K/V block", (1,))
    assert work.timeouts == [timeout]
