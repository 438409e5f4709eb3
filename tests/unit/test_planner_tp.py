"""Tensor parallelism in the cost model: T(s) charges an HDP rank's TP all-reduces on its devices'
intra-node links, nothing at TP 1, and the planner, simulator and CLI see it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bytescale_compile.cli import main
from bytescale_compile.planner import CostModel, Hardware, Plan, plan
from bytescale_compile.planner.equations import tp_all_reduce_time
from bytescale_compile.planner.model_shape import PRESETS
from bytescale_compile.sim.simulator import simulate

LENGTHS = np.array([1, 100, 4096, 32768, 1_000_000])
ABS = 1e-15
"""Seconds below which two times count as equal where the reference can be 0."""


def _compute_only(cost: CostModel, s: np.ndarray) -> np.ndarray:
    """The T(s) of the cost model before TP was charged: alpha1 s^2 + beta1 s + gamma."""
    return cost.alpha1 * s**2 + cost.beta1 * s + cost.gamma


def _hand_tp_seconds(tokens: float, hidden: int, tp: int, link: float) -> float:
    """4 ring all-reduces (2 forward, 2 backward) of tokens x hidden bf16 values over tp devices, each
    device sending 2 (tp - 1) / tp of the bytes on its own link."""
    all_reduce_bytes = tokens * hidden * 2
    return 4 * 2 * (tp - 1) / tp * all_reduce_bytes / link


@pytest.mark.parametrize("hardware", [None, "h100-nvlink", "l20"])
def test_tp_1_is_exactly_the_compute_only_time(hardware):
    cost = CostModel.preset("llama-7b", Hardware.preset(hardware, tp_size=1) if hardware else None)
    assert cost.tp_time_per_token == 0.0
    s = LENGTHS.astype(np.float64)
    assert np.array_equal(cost.layer_time(s), _compute_only(cost, s))
    # a sequence's work leaves the launches (gamma) to its micro-batch
    assert np.array_equal(cost.seq_time(s), cost.layers * (_compute_only(cost, s) - cost.gamma))


@pytest.mark.parametrize(("cluster", "tp", "link"), [("h100-nvlink", 4, 450e9), ("l20", 2, 32e9), ("l20", 4, 32e9)])
def test_tp_term_is_the_hand_formula(cluster, tp, link):
    cost = CostModel.preset("llama-7b", Hardware.preset(cluster, tp_size=tp))
    s = LENGTHS.astype(np.float64)
    expected = np.array([_hand_tp_seconds(t, 4096, tp, link) for t in s])
    assert cost.layer_time(s) - _compute_only(cost, s) == pytest.approx(expected, rel=1e-9, abs=ABS)
    assert tp_all_reduce_time(tp, 4096 * 2, link) == pytest.approx(_hand_tp_seconds(1, 4096, tp, link), rel=1e-12)


def test_tp_term_counts_one_devices_link_not_the_groups():
    """The all-reduce runs among the group's own devices: a wider group does not get a faster link."""
    t2 = CostModel.preset("llama-7b", Hardware.preset("h100-nvlink", tp_size=2)).tp_time_per_token
    t8 = CostModel.preset("llama-7b", Hardware.preset("h100-nvlink", tp_size=8)).tp_time_per_token
    assert t8 / t2 == pytest.approx((2 * 7 / 8) / (2 * 1 / 2))


@pytest.mark.parametrize("model", ["llama-7b", "llama-70b"])
@pytest.mark.parametrize(("cluster", "sizes"), [("h100-nvlink", (1, 2, 4, 8)), ("l20", (1, 2, 4))])
def test_more_tp_gives_a_larger_communication_share(model, cluster, sizes):
    s = 32768
    shares = []
    for tp in sizes:
        cost = CostModel.preset(model, Hardware.preset(cluster, tp_size=tp))
        total = float(cost.layer_time(s))
        shares.append((total - float(_compute_only(cost, s))) / total)
    assert shares[0] == pytest.approx(0.0, abs=1e-12)
    assert all(a < b for a, b in zip(shares, shares[1:])), shares


def test_override_and_validation():
    cost = CostModel.preset("llama-7b", Hardware.preset("l20", tp_size=2))
    assert cost.tp_time_per_token > 0
    uncharged = cost.replace(tp_comm_time=0.0)
    assert np.array_equal(uncharged.layer_time(LENGTHS), _compute_only(cost, LENGTHS.astype(np.float64)))
    assert cost.flops(4096) == uncharged.flops(4096)  # FLOPs are compute only
    with pytest.raises(ValueError, match="tp_comm_time must be None or a finite number >= 0"):
        cost.replace(tp_comm_time=-1.0)


def test_saved_models_round_trip_and_old_files_default_to_the_hardware(tmp_path):
    cost = CostModel.preset("llama-7b", Hardware.preset("h100-nvlink", tp_size=2))
    cost.save(tmp_path / "tp.json")
    loaded = CostModel.load(tmp_path / "tp.json")
    assert loaded == cost and loaded.tp_time_per_token == cost.tp_time_per_token
    data = json.loads((tmp_path / "tp.json").read_text())
    del data["coefficients"]["tp_comm_time"]  # written before TP was charged
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert CostModel.load(tmp_path / "old.json").tp_time_per_token == cost.tp_time_per_token
    flat = CostModel.preset("llama-7b")  # no topology: one device per rank
    flat.save(tmp_path / "flat.json")
    assert CostModel.load(tmp_path / "flat.json").tp_time_per_token == 0.0


def test_simulator_charges_the_tp_term():
    cost = CostModel.preset("llama-7b", Hardware.preset("l20", tp_size=2))
    uncharged = cost.replace(tp_comm_time=0.0)
    one = np.array([4096])  # one packed micro-batch on one rank, no gradient all-reduce
    extra = (
        simulate(plan(one, world_size=1, capacity=8192, cost_model=cost), cost).step_time
        - simulate(plan(one, world_size=1, capacity=8192, cost_model=uncharged), uncharged).step_time
    )
    assert extra == pytest.approx(cost.layers * _hand_tp_seconds(4096, 4096, 2, 32e9), rel=1e-9)
    shared = plan(
        np.array([200_000]), world_size=32, capacity=8192, cost_model=cost, strategy="naive", offload=False
    )  # a ring of ranks
    (m,) = shared.micro_batches
    assert m.shared
    # with a topology the simulator times a shared micro-batch from the cost model it is given; here its
    # compute outlasts the ring, so the TP term of every rank's share shows in the step
    extra = simulate(shared, cost).step_time - simulate(shared, uncharged).step_time
    assert extra == pytest.approx(cost.layers * _hand_tp_seconds(200_000 / len(m.ranks), 4096, 2, 32e9), rel=1e-9)


def test_every_preset_has_a_tp_term_on_a_tp_group():
    hw = Hardware.preset("h100-nvlink", tp_size=2)
    for name, shape in PRESETS.items():
        cost = CostModel.preset(name, hw)
        assert cost.tp_time_per_token == pytest.approx(_hand_tp_seconds(1, shape.hidden, 2, 450e9), rel=1e-12)


SMALL = ["--dataset", "byted", "--global-tokens", "1M", "--ranks", "16", "--capacity", "8K"]


def test_cli_plan_and_simulate_take_tp(capsys):
    assert main(["plan", *SMALL, "--context", "128K", "--hardware", "l20", "--tp", "2"]) == 0
    assert "16 HDP ranks x TP 2 (32 GPUs)" in capsys.readouterr().out
    assert main(["plan", *SMALL, "--context", "128K", "--hardware", "h100-nvlink", "--tp", "4", "--json"]) == 0
    Plan.from_json(capsys.readouterr().out).validate()
    argv = ["simulate", *SMALL, "--context", "64K", "--strategies", "balance", "--hardware", "h100-nvlink"]
    assert main([*argv, "--tp", "2"]) == 0
    assert "balance tok/s" in capsys.readouterr().out


def test_cli_refuses_tp_groups_that_do_not_fit(capsys):
    assert main(["plan", *SMALL, "--hardware", "h100-nvlink", "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert "--tp 3" in err and "3 devices" in err and "8 devices" in err
    assert main(["simulate", *SMALL, "--hardware", "l20", "--tp", "3"]) == 2  # 8 spans two switches of 4
    err = capsys.readouterr().err
    assert "3 devices" in err and "switch of 4 devices" in err
    assert main(["plan", *SMALL, "--tp", "2"]) == 2
    assert "--tp 2 needs --hardware" in capsys.readouterr().err
