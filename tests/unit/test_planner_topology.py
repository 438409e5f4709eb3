"""The cluster topology: which links a ring hop crosses, the cost model's ring term on it, and the
simulator sharing a link among the rings that overlap on it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from bytescale_compile.planner import CostModel, Hardware, MicroBatch, Plan
from bytescale_compile.sim.simulator import simulate

L20 = Hardware.preset("l20", tp_size=2)
H100 = Hardware.preset("h100-nvlink", tp_size=1)


def test_l20_preset_is_the_papers_server():
    t = L20.topology
    assert (t.devices_per_node, t.devices_per_switch, t.nics_per_node) == (16, 4, 8)
    assert (t.ranks_per_switch, t.ranks_per_node) == (2, 8)
    assert t.rank_link == 2 * 32e9  # two GPUs' PCIe x16, 64 GB/s bidirectional each
    assert t.rank_rail == 2 * 8 * 50e9 / 16  # 8 x 400 Gbps over 16 GPUs
    assert L20.matmul_flops == 2 * 119.5e12 and L20.hbm_bytes == 2 * 48e9


def test_hops_cross_the_links_between_them():
    t = L20.topology
    assert t.hop(0, 1) == [("dev", 0, 0), ("dev", 1, 1)]  # same PCIe switch
    assert t.hop(1, 2) == [("dev", 1, 0), ("dev", 2, 1), ("up", 0, 0), ("up", 1, 1)]  # next switch
    assert t.hop(7, 8) == [("dev", 7, 0), ("dev", 8, 1), ("rail", 7, 0), ("rail", 8, 1)]  # next node


def test_ring_bandwidth_by_hand():
    t = L20.topology
    assert t.ring_bandwidth([0, 1]) == 64e9
    assert t.ring_bandwidth([0, 2, 4]) == 32e9  # each switch uplink carries one hop each way
    assert t.ring_bandwidth([0, 2, 1, 3]) == 16e9  # switch 0's uplink carries 0->2 and 1->3 out
    assert t.ring_bandwidth([0, 8]) == 50e9  # the NIC rails
    assert t.ring_bandwidth([5]) == float("inf")


@pytest.mark.parametrize("hardware", [L20, H100], ids=["l20", "h100"])
def test_aligned_closed_form_matches_the_hops(hardware):
    t = hardware.topology
    sizes = np.arange(2, 41)
    expected = [t.ring_bandwidth(list(range(d))) for d in sizes]
    assert t.aligned_ring_bandwidth(sizes).tolist() == expected


def test_cost_model_ring_term_sees_intra_node_rings_as_faster():
    cost = CostModel.preset("llama-7b", L20)
    steps = cost.layers * 3
    for d, bandwidth in ((2, 64e9), (4, 32e9), (64, 32e9)):
        expected = steps * (d - 1) * (1000 * cost.kv_bytes_per_token / bandwidth + cost.latency)
        assert float(cost.ring_time(1000, d)) == pytest.approx(expected)
    h100 = CostModel.preset("llama-7b", H100)
    for d, bandwidth in ((8, 450e9), (9, 50e9)):  # NVLink within the node, then the NIC rails
        expected = steps * (d - 1) * (1000 * h100.kv_bytes_per_token / bandwidth + h100.latency)
        assert float(h100.ring_time(1000, d)) == pytest.approx(expected)


def test_no_topology_keeps_private_links():
    cost = CostModel.preset("llama-7b")
    assert float(cost.ring_time(1000, 300)) == pytest.approx(
        cost.layers * 3 * 299 * (1000 * cost.kv_bytes_per_token / 25e9 + cost.latency)
    )


def test_hardware_round_trips_through_json(tmp_path):
    cost = CostModel.preset("llama-7b", L20)
    cost.save(tmp_path / "m.json")
    assert CostModel.load(tmp_path / "m.json") == cost


def test_bad_topologies_name_the_field():
    with pytest.raises(ValueError, match="tp_size must divide devices_per_switch"):
        Hardware.preset("l20", tp_size=6)
    with pytest.raises(ValueError, match="devices_per_node 10 is not a multiple"):
        dataclasses.replace(L20.topology, devices_per_node=10)
    with pytest.raises(ValueError, match="switch_uplink must be a positive number"):
        dataclasses.replace(L20.topology, switch_uplink=0.0)
    with pytest.raises(ValueError, match="unknown hardware preset 'tpu'; presets: l20, h100-nvlink"):
        Hardware.preset("tpu")


def _ring_model() -> CostModel:
    """Negligible compute, so a micro-batch's time is its ring P2P."""
    return CostModel.from_terms(
        alpha1=1e-18,
        beta1=1e-15,
        gamma=0.0,
        alpha2=1.0,
        beta2=0.0,
        layers=1,
        kv_bytes_per_token=1000,
        param_bytes=1.0,
        hardware=L20,
        source="hand",
    )


def _two_rings(ranks_a: tuple[int, ...], ranks_b: tuple[int, ...], tokens: int) -> Plan:
    mbs = [MicroBatch(i, ranks, (i,), 0.0, tokens // 2, 0.0) for i, ranks in enumerate((ranks_a, ranks_b))]
    schedule = [[m.id for m in mbs if r in m.ranks] for r in range(8)]
    return Plan("balance", 8, tokens, 1, [tokens, tokens], mbs, schedule)


def test_simulator_shares_an_uplink_between_overlapping_rings():
    cost, tokens = _ring_model(), 2_000_000
    apart = simulate(_two_rings((0, 2), (4, 6), tokens), cost)  # switches 0-1 and 2-3: no shared link
    shared = simulate(_two_rings((0, 2), (1, 3), tokens), cost)  # both cross switch 0 <-> 1
    ring = float(cost.ring_bytes(tokens // 2, 2))
    sync = cost.allreduce_time()
    assert apart.step_time == pytest.approx(ring / 32e9 + 3 * cost.latency + sync)
    assert shared.step_time == pytest.approx(ring / 16e9 + 3 * cost.latency + sync)


def test_cli_plans_auto_on_the_l20_cluster(capsys):
    from bytescale_compile.cli import main

    assert (
        main(
            [
                "plan",
                "--dataset",
                "byted",
                "--global-tokens",
                "2M",
                "--ranks",
                "32",
                "--capacity",
                "8K",
                "--context",
                "128K",
                "--hardware",
                "l20",
                "--tp",
                "2",
                "--strategy",
                "auto",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "auto chose" in out and "static" in out
    assert main(["plan", "--hardware", "tpu"]) == 2
    assert "unknown hardware preset 'tpu'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "hardware",
    [Hardware.preset("h100-nvlink", tp) for tp in (1, 2, 8)] + [Hardware.preset("l20", tp) for tp in (1, 2, 4, 8)],
    ids=lambda h: h.name,
)
def test_aligned_split_rings_in_closed_form_match_their_hops(hardware):
    """The planner's group-size search reads the u rings' bandwidth of every adjacent group size in closed form; it
    is the hop-by-hop count of `split_ring_bandwidth` on those ranks, for every u that tiles the switches."""
    topology = hardware.topology
    per_switch, per_node = topology.ranks_per_switch, topology.ranks_per_node
    for u in (1, 2, 4, 8, 16):
        if per_node % u or (per_switch % u and u % per_switch):
            continue
        for d in range(u, 100, u):
            closed = topology.aligned_split_ring_bandwidth(d, u)
            assert closed == pytest.approx(topology.split_ring_bandwidth(tuple(range(d)), u)), (u, d)
