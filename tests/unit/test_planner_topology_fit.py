"""The topology fitted to the links a job measured (`fit_topology`, `train/calibrate.py`): each measured class
is reproduced by the topology's own ring and all-to-all arithmetic, the classes not measured come from the
preset (or the class measured), and the all-to-all link survives the cost model's JSON."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from bytescale_compile.cli import main
from bytescale_compile.planner import CostModel, Hardware, Topology
from bytescale_compile.planner.topology import fit_topology
from bytescale_compile.sim.experiments import run_strategy
from bytescale_compile.sim.lengths import sample_global_batch
from bytescale_compile.train.calibrate import Calibration, Links, _Layout, _refit, ranks_per_node

GB = 1e9


def _across(nodes: int, per_node: int) -> list[int]:
    """A ring whose every hop crosses nodes: the k-th rank of each node in turn."""
    return [node * per_node + k for k in range(per_node) for node in range(nodes)]


def test_two_classes_reproduce_the_measured_rings_and_all_to_all():
    t = fit_topology(ranks_per_node=4, tp_size=1, intra_p2p=40 * GB, inter_p2p=5 * GB, all_to_all=30 * GB)
    assert (t.devices_per_node, t.devices_per_switch, t.nics_per_node, t.ranks_per_node) == (4, 4, 4, 4)
    assert t.ring_bandwidth(range(4)) == 40 * GB
    assert t.ring_bandwidth(_across(2, 4)) == 5 * GB
    assert list(t.aligned_ring_bandwidth([4, 8])) == [40 * GB, 5 * GB]
    assert t.all_to_all_bandwidth(range(4), 4) == pytest.approx(30 * GB)
    assert t.all_to_all_bandwidth(range(8), 2) == pytest.approx(30 * GB)  # every pair inside a node
    assert t.all_to_all_bandwidth([3, 4], 2) == 5 * GB  # a pair across nodes pays the rail


def test_a_faster_inter_node_ring_is_bounded_by_the_device_link():
    t = fit_topology(ranks_per_node=2, tp_size=1, intra_p2p=4 * GB, inter_p2p=6 * GB)
    assert t.rank_rail == 6 * GB
    assert t.ring_bandwidth(_across(2, 2)) == 4 * GB  # min(device link, rail): the hops leave by the device link


def test_tp_ranks_measure_per_device_and_the_rank_holds_tp_of_them():
    t = fit_topology(ranks_per_node=2, tp_size=2, intra_p2p=10 * GB, inter_p2p=2 * GB, all_to_all=6 * GB)
    assert (t.devices_per_node, t.ranks_per_node, t.device_link) == (4, 2, 10 * GB)
    assert (t.rank_link, t.rank_rail) == (20 * GB, 4 * GB)
    assert t.ring_bandwidth([0, 1]) == 20 * GB and t.ring_bandwidth(_across(2, 2)) == 4 * GB
    assert t.all_to_all_bandwidth([0, 1], 2) == pytest.approx(12 * GB)
    assert Hardware(topology=t).tp_link == 10 * GB  # what the TP all-reduces would run on


def test_one_host_keeps_the_presets_rails_or_sets_them_to_the_intra_node_link():
    alone = fit_topology(ranks_per_node=4, tp_size=2, intra_p2p=100 * GB, inter_p2p=None, all_to_all=80 * GB)
    assert alone.rank_rail == alone.rank_link == 200 * GB
    h100 = Hardware.preset("h100-nvlink", tp_size=2).topology
    kept = fit_topology(ranks_per_node=4, tp_size=2, intra_p2p=100 * GB, inter_p2p=None, base=h100)
    assert kept.rank_rail == h100.rank_rail and kept.rank_link == 200 * GB
    assert kept.devices_per_switch == 8 and kept.all_to_all_link is None


def test_one_rank_per_node_keeps_the_presets_device_links_or_the_rails():
    alone = fit_topology(ranks_per_node=1, tp_size=1, intra_p2p=None, inter_p2p=5 * GB)
    assert alone.rank_link == alone.rank_rail == 5 * GB and alone.ring_bandwidth([0, 1]) == 5 * GB
    l20 = Hardware.preset("l20", tp_size=4).topology
    kept = fit_topology(ranks_per_node=1, tp_size=4, intra_p2p=None, inter_p2p=5 * GB, base=l20)
    assert (kept.device_link, kept.rank_rail) == (l20.device_link, 4 * 5 * GB)


def test_the_presets_switches_are_kept_and_scaled_to_the_ring_over_a_node():
    base = Topology(16, 4, 1, 64 * GB, 16 * GB, 50 * GB, 8)  # uplinks a quarter of the device links
    t = fit_topology(ranks_per_node=16, tp_size=1, intra_p2p=8 * GB, inter_p2p=None, base=base)
    assert (t.devices_per_switch, t.device_link, t.switch_uplink) == (4, 32 * GB, 8 * GB)
    assert t.ring_bandwidth(range(16)) == 8 * GB
    assert t.rank_rail == base.rank_rail
    other = fit_topology(ranks_per_node=8, tp_size=1, intra_p2p=8 * GB, inter_p2p=None, base=base)
    assert other.devices_per_switch == 8, "a node of another size: one switch per node"


def test_the_fit_refuses_what_was_not_measured_or_cannot_be():
    with pytest.raises(ValueError, match="neither the ring inside a node nor the one across nodes"):
        fit_topology(ranks_per_node=2, tp_size=1, intra_p2p=None, inter_p2p=None)
    with pytest.raises(ValueError, match="one rank per node"):
        fit_topology(ranks_per_node=1, tp_size=1, intra_p2p=1 * GB, inter_p2p=None)
    with pytest.raises(ValueError, match="inter_p2p must be a positive number"):
        fit_topology(ranks_per_node=2, tp_size=1, intra_p2p=1 * GB, inter_p2p=float("inf"))
    with pytest.raises(ValueError, match="all_to_all_link must be a positive number"):
        Topology(8, 8, 1, 1 * GB, 1 * GB, 1 * GB, 8, all_to_all_link=0.0)


def test_an_all_to_all_link_at_the_device_link_changes_nothing_and_below_it_slows_only_the_device_links():
    l20 = Hardware.preset("l20", tp_size=2).topology
    same = dataclasses.replace(l20, all_to_all_link=l20.device_link)
    slower = dataclasses.replace(l20, all_to_all_link=0.8 * l20.device_link)  # 51.2 GB/s per rank, rails 50
    for ranks, u in [((0, 1), 2), (tuple(range(8)), 4), (tuple(range(8)), 8), ((7, 8), 2)]:
        assert same.all_to_all_bandwidth(ranks, u) == l20.all_to_all_bandwidth(ranks, u)
    assert slower.all_to_all_bandwidth((0, 1), 2) == pytest.approx(0.8 * l20.all_to_all_bandwidth((0, 1), 2))
    assert slower.all_to_all_bandwidth((7, 8), 2) == l20.all_to_all_bandwidth((7, 8), 2) == 50 * GB, "rails slower"
    assert slower.ring_bandwidth(range(8)) == l20.ring_bandwidth(range(8)), "rings keep the P2P links"


def _calibrated_model() -> CostModel:
    topology = fit_topology(ranks_per_node=4, tp_size=1, intra_p2p=40 * GB, inter_p2p=5 * GB, all_to_all=30 * GB)
    cost = CostModel.preset("llama-7b")
    return cost.replace(hardware=dataclasses.replace(cost.hardware, name="h100, calibrated", topology=topology))


def test_the_fitted_topology_survives_save_and_load_and_old_files_load_without_the_field(tmp_path):
    model = _calibrated_model()
    model.save(tmp_path / "m.json")
    assert CostModel.load(tmp_path / "m.json") == model
    old = json.loads((tmp_path / "m.json").read_text())
    del old["hardware"]["topology"]["all_to_all_link"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    loaded = CostModel.load(tmp_path / "old.json")
    assert loaded.hardware.topology == dataclasses.replace(model.hardware.topology, all_to_all_link=None)


def test_ranks_per_node_reads_consecutive_ranks_on_one_host(caplog):
    assert ranks_per_node(["a"] * 4) == 4
    assert ranks_per_node(["a", "a", "b", "b"]) == 2
    assert not caplog.records
    with caplog.at_level(logging.WARNING):
        assert ranks_per_node(["a", "a", "b", "b", "a", "a"]) == 2
        assert ranks_per_node(["a", "b", "a", "b"]) == 1
    assert len(caplog.records) == 2 and "node after node" in caplog.records[0].getMessage()


def test_the_ring_across_nodes_crosses_hosts_on_every_hop():
    assert _Layout(("a", "a", "b", "b"), 2).across_nodes == (0, 2, 1, 3)
    assert _Layout(("a", "b", "a", "b"), 1).across_nodes == (0, 1, 2, 3)
    assert _Layout(("a", "b", "a"), 1).across_nodes is None, "the last hop back would stay on a"
    assert _Layout(("a", "a"), 2).across_nodes is None


def test_the_refit_keeps_the_fitted_topology_and_charges_no_tp_all_reduce_twice():
    base = CostModel.preset("llama-7b", Hardware.preset("h100-nvlink", tp_size=2))
    assert base.tp_time_per_token > 0
    topology = fit_topology(ranks_per_node=4, tp_size=2, intra_p2p=100 * GB, inter_p2p=20 * GB)
    fitted = _refit(base, [16, 32, 64], [1.0, 2.0, 4.0], 30 * GB, 1e-5, 8, None, topology=topology)
    assert fitted.hardware.topology == topology and fitted.hardware.network_bandwidth == 30 * GB
    assert fitted.tp_time_per_token == 0.0, "the measured T(s) holds the TP all-reduces"


def test_the_summary_names_what_was_measured_and_what_was_kept():
    model = _calibrated_model()
    links = Links(hosts=1, ranks_per_node=4, intra_p2p=20 * GB, inter_p2p=None, all_to_all=15 * GB, preset="l20-tp1")
    calibration = Calibration(
        lengths=(16, 32, 64),
        times=(1.0, 2.0, 4.0),
        p2p_bandwidth=20 * GB,
        p2p_latency=1e-5,
        allreduce_seconds=0.1,
        world_size=4,
        shared_length=0,
        shared_seconds=None,
        links=links,
        cost_model=model,
    )
    text = calibration.summary()
    assert "1 host, 4 ranks per node" in text
    assert "inside a node: P2P 20 GB/s, all-to-all 15 GB/s" in text
    assert "across nodes: not measured (one node): kept from l20-tp1" in text
    assert "4 ranks per node, 1 switch per node; link 40 GB/s, rail 5 GB/s, all-to-all 30 GB/s" in text


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_cli_plans_and_simulates_on_a_calibrated_json(tmp_path, capsys, command):
    model = _calibrated_model()
    model.save(tmp_path / "calibrated.json")
    cluster = ["--ranks", "16", "--capacity", "8K", "--global-tokens", "512K", "--dataset", "github"]
    context = ["--context", "64K"]
    assert main([command, "--model", str(tmp_path / "calibrated.json"), *cluster, *context]) == 0
    out = capsys.readouterr()
    assert "note:" not in out.err
    if command == "plan":
        lens = sample_global_batch("github", 512 * 1024, seed=0, max_len=64 * 1024)
        expected = run_strategy("balance", lens, 16, 8 * 1024, model, context_length=64 * 1024)
        assert f"simulated step {expected.step_time:.3f} s" in out.out
    assert main([command, "--model", str(tmp_path / "calibrated.json"), *cluster, *context, "--hardware", "l20"]) == 0
    assert "note: --hardware l20 replaces the hardware saved in" in capsys.readouterr().err
