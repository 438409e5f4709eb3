"""The job's own calibration of the cost model (train/calibrate.py) and what the simulator does with it:
ranks sharing one machine's cores, and the compute a ring adds; the links measured and the topology fitted
to them."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import bytescale_compile as bsc
from bytescale_compile.engine.mesh import TrainMesh
from bytescale_compile.models.llama import tiny
from bytescale_compile.planner import CostModel, Hardware, MicroBatch, Plan, plan
from bytescale_compile.planner.builder import micro_batch_time
from bytescale_compile.sim.simulator import simulate, step_time
from bytescale_compile.testing import run_distributed
from bytescale_compile.train.calibrate import (
    _fitted_topology,
    _layout,
    _link_probes,
    _links,
    _refit,
    calibrate,
    calibration_lengths,
)
from tests.helpers import hf_llama

LENGTHS = (16, 32, 64)


def _model(slots: float | None = None, ring_overhead: float = 0.0) -> CostModel:
    """1 s per token per layer, one layer, no ring bytes or latency worth counting."""
    hardware = Hardware(name="test", network_bandwidth=1e18, latency=1e-18, compute_slots=slots)
    return CostModel.from_terms(
        alpha1=0.0,
        beta1=1.0,
        gamma=0.0,
        alpha2=1.0,
        beta2=0.0,
        layers=1,
        kv_bytes_per_token=0,
        param_bytes=1.0,
        hardware=hardware,
        source="test",
        ring_overhead=ring_overhead,
    )


def _packed_plan(work: list[list[int]]) -> Plan:
    """Rank r runs one packed micro-batch per length in work[r]; est_time = its length (the model's T)."""
    mbs, schedule, lens = [], [], []
    for rank, lengths in enumerate(work):
        schedule.append([])
        for n in lengths:
            mbs.append(MicroBatch(len(mbs), (rank,), (len(lens),), 0.0, n, float(n)))
            schedule[-1].append(len(mbs) - 1)
            lens.append(n)
    return Plan("balance", len(work), 100, 1, lens, mbs, schedule)


def test_ranks_sharing_two_slots_run_at_half_speed_only_while_more_than_two_are_busy():
    equal = _packed_plan([[10], [10], [10], [10]])
    assert step_time(equal, _model()) == pytest.approx(10.0)
    assert step_time(equal, _model(slots=2)) == pytest.approx(20.0)
    assert step_time(equal, _model(slots=4)) == pytest.approx(10.0)
    # Rank 0's second micro-batch runs alone once the others are done: slowed while 4 are busy, then not.
    tail = _packed_plan([[10, 10], [10], [10], [10]])
    assert step_time(tail, _model(slots=2)) == pytest.approx(30.0, rel=0.02)
    spans = {s.micro_batch: s.end - s.start for s in simulate(tail, _model(slots=2)).spans if s.rank == 0}
    assert spans[0] == pytest.approx(20.0, rel=0.02) and spans[1] == pytest.approx(10.0, rel=0.02)


def test_ring_overhead_is_compute_per_token_held_layer_and_ring_step():
    base, costly = _model(), _model(ring_overhead=0.5)
    lens = torch.tensor([40]).numpy()
    assert micro_batch_time(base, lens, 4, 0.0) == pytest.approx(10.0)
    assert micro_batch_time(costly, lens, 4, 0.0) == pytest.approx(10.0 + 0.5 * 3 * 10)
    planned = plan([40], world_size=4, capacity=10, cost_model=costly, strategy="balance")
    assert [m.est_time for m in planned.micro_batches] == [pytest.approx(25.0)]
    assert step_time(planned, costly) == pytest.approx(25.0)


def test_compute_slots_and_ring_overhead_survive_save_and_load(tmp_path):
    model = _model(slots=2.5, ring_overhead=3e-6)
    model.save(tmp_path / "m.json")
    assert CostModel.load(tmp_path / "m.json") == model
    with pytest.raises(ValueError, match="compute_slots must be a positive number"):
        Hardware(compute_slots=0.0)


def test_the_refit_folds_the_head_loss_and_micro_batch_cost_into_the_layers_and_keeps_the_optimizer():
    """The calibration times whole micro-batches: what ran outside the layers is in the fit, and no optimizer ran."""
    base = _model().replace(beta_head=1e-3, beta_embed=1e-4, delta=0.2, omega=1e-9, sigma=0.3)
    lengths = [16, 32, 64]
    times = [2.0 * s + 0.5 for s in lengths]  # one layer: beta1 2 s per token, gamma 0.5 s
    fitted = _refit(base, lengths, times, float("inf"), 0.0, 1, None, topology=None)
    assert (fitted.beta_head, fitted.beta_embed, fitted.delta) == (0.0, 0.0, 0.0)
    assert (fitted.omega, fitted.sigma) == (1e-9, 0.3)
    for s, t in zip(lengths, times):
        assert fitted.micro_batch_time([s]) == pytest.approx(t)


def test_calibration_lengths_span_the_capacity():
    assert calibration_lengths(2048) == (256, 512, 1024, 2048)
    assert calibration_lengths(8) == (16, 32, 64)
    with pytest.raises(ValueError, match="at least 3 distinct lengths"):
        calibrate(bsc.Runtime(tiny(), torch.optim.SGD(tiny().parameters(), lr=0.1), capacity=64), lengths=[8, 8, 16])


@pytest.mark.parametrize("optimizer", ["sgd", None], ids=["sgd", "no-optimizer"])
def test_calibration_fits_the_whole_model_and_trains_nothing(optimizer):
    """With an optimizer or without one (the trainer's: calibration steps none)."""
    torch.manual_seed(0)
    model = hf_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sgd = torch.optim.SGD(model.parameters(), lr=0.1) if optimizer else None
    runtime = bsc.Runtime(model, sgd, capacity=64)
    result = calibrate(runtime, lengths=LENGTHS, repeats=1)
    fitted = result.cost_model
    assert result.world_size == 1 and result.shared_seconds is None
    assert fitted.hardware == runtime.cost_model.hardware and result.links is None, "one rank measures no link"
    assert (fitted.alpha2, fitted.layers, fitted.kv_bytes_per_token) == (
        runtime.cost_model.alpha2,
        runtime.cost_model.layers,
        runtime.cost_model.kv_bytes_per_token,
    )
    assert fitted.micro_batch_time([64]) >= fitted.micro_batch_time([16]) > 0
    assert fitted.micro_batch_time([64]) == pytest.approx(result.times[-1], rel=0.5)
    assert "calibrated" in fitted.source and "64 tokens" in result.summary()
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), f"calibration changed {name}"
    assert all(p.grad is None or not p.grad.any() for p in model.parameters()), "calibration left gradients"


def _calibrate_worker(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = tiny()
    runtime = bsc.Runtime(model, torch.optim.SGD(model.parameters(), lr=0.1), capacity=64)
    result = calibrate(runtime, lengths=LENGTHS, repeats=1)
    fitted = result.cost_model
    assert result.shared_length == world * 64 // 2 and result.shared_seconds > 0
    assert fitted.hardware.network_bandwidth == result.p2p_bandwidth
    links, topology = result.links, fitted.hardware.topology
    assert (links.hosts, links.ranks_per_node, links.inter_p2p, links.preset) == (1, world, None, None)
    assert links.intra_p2p == result.p2p_bandwidth, "on one host the ring over the node is the ring over all"
    assert topology.ranks_per_node == world and topology.tp_size == 1
    assert topology.ring_bandwidth(range(world)) == pytest.approx(links.intra_p2p)
    assert topology.all_to_all_bandwidth(range(world), world) == pytest.approx(links.all_to_all)
    assert topology.rank_rail == topology.rank_link, "one host: the rails are set to the link measured"
    assert "across nodes: not measured (one node): set to the link inside a node" in result.summary()
    assert fitted.ring_overhead >= 0
    slots = fitted.hardware.compute_slots
    assert slots is None or slots < world
    mine = torch.tensor(
        [fitted.alpha1, fitted.beta1, fitted.gamma, fitted.ring_overhead, result.p2p_bandwidth, topology.device_link]
        + [topology.all_to_all_link],
        dtype=torch.float64,
    )
    first = mine.clone()
    torch.distributed.broadcast(first, 0)
    assert torch.equal(mine, first), "every rank must plan with the same cost model"
    unshardable = tiny()
    runtime = bsc.Runtime(
        bsc.optimize(unshardable, attention=False), torch.optim.SGD(unshardable.parameters(), lr=0.1), capacity=64
    )
    result = calibrate(runtime, lengths=LENGTHS, repeats=1)
    assert result.shared_seconds is None and result.cost_model.ring_overhead == 0.0, "such a model never rings"


@pytest.mark.slow
def test_calibration_on_two_ranks_measures_the_ring_and_agrees_on_every_rank():
    run_distributed(_calibrate_worker, 2)


def _links_worker(rank: int, world: int) -> None:
    """Two nodes of two ranks: rings inside and across them and the all-to-all of a node; then the ranks laid
    out round robin: nodes of one rank, only the ring across them. Hosts are faked (every rank is on this
    machine); each rank fits its own measurements."""
    for hosts in (["a", "a", "b", "b"], ["a", "b", "a", "b"]):
        with mock.patch("socket.gethostname", return_value=hosts[rank]):
            layout = _layout(TrainMesh.of_world())
        assert layout.hosts == tuple(hosts)
        measured = _link_probes(TrainMesh.of_world(), torch.device("cpu"), layout, repeats=1)
        links = _links(layout, measured, Hardware())
        topology = _fitted_topology(links, 1, None)
        n = links.ranks_per_node
        assert topology.ranks_per_node == n == (2 if hosts[1] == "a" else 1) and links.hosts == 2
        assert topology.ring_bandwidth(layout.across_nodes) == pytest.approx(min(links.inter_p2p, topology.rank_link))
        if n == 1:
            assert links.intra_p2p is None and links.all_to_all is None
            assert topology.rank_link == topology.rank_rail == pytest.approx(links.inter_p2p)
        else:
            assert topology.ring_bandwidth(range(n)) == pytest.approx(links.intra_p2p)
            assert topology.all_to_all_bandwidth(range(n), n) == pytest.approx(links.all_to_all)
            assert topology.rank_rail == pytest.approx(links.inter_p2p)


@pytest.mark.slow
def test_links_measured_on_four_ranks_fit_a_topology_that_reproduces_them():
    run_distributed(_links_worker, 4)
