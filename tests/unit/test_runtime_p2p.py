"""P2P faults in one process (a peer already lost when posting), and the former `dist_attn` names. The waits'
timeouts and the multi-rank faults are in tests/distributed/test_runtime_ring_attention.py and
tests/e2e/test_faults.py."""

from __future__ import annotations

import importlib
import sys
from typing import Any

import pytest
import torch

from bytescale_compile.runtime import p2p, ring_attention
from bytescale_compile.runtime.layout import zigzag_layout
from bytescale_compile.runtime.p2p import P2PError


def test_posting_to_a_lost_peer_raises_ring_error(monkeypatch):
    """gloo refuses to post to a peer whose connection closed: that too is a `P2PError` naming the group."""

    def closed(ops: list[Any]) -> list[Any]:
        raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:45486")

    monkeypatch.setattr(p2p.dist, "P2POp", lambda op, tensor, peer: (op, tensor, peer))
    monkeypatch.setattr(p2p.dist, "batch_isend_irecv", closed)
    ring = ring_attention.make_ring(zigzag_layout([8], 1), [0], 1.0, None, None)
    with pytest.raises(
        P2PError,
        match=r"ring group \[0\]: rank 0 lost a peer while exchanging dK/dV rows: "
        r"\[pair.cc:553\] Connection closed by peer",
    ):
        ring.post(torch.zeros(2), 1, torch.zeros(2), 1, "dK/dV rows")


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("RingStats", "P2PStats"),
        ("RingError", "P2PError"),
        ("RingTimeoutError", "P2PTimeoutError"),
        ("Shapes", "Shapes"),
    ],
)
def test_the_former_dist_attn_names_warn_and_resolve_to_the_new_ones(monkeypatch, old, new):
    monkeypatch.delitem(sys.modules, "bytescale_compile.runtime.dist_attn", raising=False)
    with pytest.warns(
        DeprecationWarning, match=r"runtime\.dist_attn moved to bytescale_compile\.runtime\.ring_attention"
    ):
        dist_attn = importlib.import_module("bytescale_compile.runtime.dist_attn")
    assert dist_attn is ring_attention and dist_attn.packed_ring_attention is ring_attention.packed_ring_attention
    with pytest.warns(
        DeprecationWarning, match=rf"ring_attention\.{old} moved to bytescale_compile\.runtime\.p2p\.{new};"
    ):
        assert getattr(dist_attn, old) is getattr(p2p, new)
    with pytest.raises(AttributeError, match="no_such_name"):
        dist_attn.no_such_name  # noqa: B018
