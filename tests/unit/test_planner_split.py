"""The u × r split of shared micro-batches (`planner/split.py`): the planner picks the Ulysses degree the cost model
predicts fastest, within the heads and the node, and `sp` forces or frees the choice.

Each case is built so that one side must win under the cost model (checked on `split_time` first), then the plan
must pick it. A model of 16 heads, 4 layers, hidden 2048: MHA (16 K/V heads), where the all-to-all moves fewer
bytes than the ring at D(s) = 8, or MQA (1 K/V head), where the ring moves far fewer."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from bytescale_compile.planner import CostModel, Hardware, ModelShape, Topology, plan
from bytescale_compile.planner.split import allowed_ulysses, choose_split, split_time

MHA = ModelShape("mha", layers=4, hidden=2048, heads=16, kv_heads=16, ffn=5504, vocab=32000)
MQA = dataclasses.replace(MHA, name="mqa", kv_heads=1)
SEQ = 65536
"""One sequence over 8 ranks of 8192 tokens: static's mesh row spans them all."""


def _hardware(link: float, per_node: int = 8, flops: float = 989e12) -> Hardware:
    """Nodes of `per_node` ranks on one switch (an NVSwitch), `link` bytes/s per device, rails of 10 GB/s."""
    topology = Topology(
        devices_per_node=per_node,
        devices_per_switch=per_node,
        tp_size=1,
        device_link=link,
        switch_uplink=link,
        nic_bandwidth=10e9,
        nics_per_node=per_node,
    )
    return Hardware(name=f"test-{link:g}", matmul_flops=flops, network_bandwidth=topology.rank_rail, topology=topology)


def _times(cost_model: CostModel, ranks: tuple[int, ...] = tuple(range(8))) -> dict[int, float]:
    lens = np.array([SEQ])
    return {u: split_time(cost_model, lens, ranks, 0.0, u) for u in allowed_ulysses(cost_model, ranks)}


def _shared(cost_model: CostModel, sp: str = "auto", world_size: int = 8):
    """The one shared micro-batch of a static plan of SEQ over `world_size` ranks of SEQ / 8 tokens."""
    result = plan([SEQ], world_size=world_size, capacity=SEQ // 8, cost_model=cost_model, strategy="static", sp=sp)
    result.validate(heads=cost_model.heads, kv_heads=cost_model.kv_heads)
    (mb,) = result.micro_batches
    assert len(mb.ranks) == 8
    return mb


def test_exposed_ring_inside_an_nvlink_node_goes_ulysses():
    """NVLink (450 GB/s) but compute 20x an H100's: the ring's K/V cannot hide behind the blocks, and the
    all-to-all of an MHA model moves a quarter of the ring's bytes."""
    cm = CostModel.analytic(MHA, _hardware(450e9, flops=20e15))
    times = _times(cm)
    assert min(times, key=times.__getitem__) > 1 and min(times.values()) < 0.8 * times[1]
    mb = _shared(cm)
    assert mb.ulysses == min(times, key=times.__getitem__) > 1
    assert mb.est_time == pytest.approx(min(times.values()))


def test_slow_intra_node_link_keeps_the_ring():
    """A slow device link (10 GB/s) and an MQA model: the ring moves one K/V head and hides it behind compute,
    while the blocking all-to-all would move all 16 query heads."""
    cm = CostModel.analytic(MQA, _hardware(10e9))
    times = _times(cm)
    assert all(times[1] < t for u, t in times.items() if u > 1)
    assert _shared(cm).ulysses == 1


def test_the_choice_follows_the_link_bandwidth_alone():
    """The same MHA model and compute: on a 450 GB/s link the ring hides and the all-to-all would only add,
    on a 10 GB/s link the ring is exposed and Ulysses wins."""
    fast = CostModel.analytic(MHA, _hardware(450e9))
    slow = dataclasses.replace(fast, hardware=_hardware(10e9))
    assert _shared(fast).ulysses == 1
    assert _shared(slow).ulysses > 1


def test_a_split_over_nodes_keeps_each_ulysses_group_in_one_node():
    """Nodes of 4: a micro-batch of 8 ranks spans two, so u <= 4 and the ring among groups has r >= 2."""
    cm = CostModel.analytic(MHA, _hardware(10e9, per_node=4))
    assert allowed_ulysses(cm, tuple(range(8))) == [1, 2, 4]
    assert allowed_ulysses(cm, (2, 3, 4, 5)) == [1, 2]  # groups of 4 from rank 2 would straddle the nodes
    mb = _shared(cm)
    assert 1 < mb.ulysses <= 4 and mb.ring >= 2
    forced = _shared(cm, sp="ulysses")
    assert (forced.ulysses, forced.ring) == (4, 2)


def test_sp_forces_the_choice():
    cm = CostModel.analytic(MHA, _hardware(10e9))
    assert _shared(cm, sp="ring").ulysses == 1
    assert _shared(cm, sp="ulysses").ulysses == 8
    fast = CostModel.analytic(MHA, _hardware(450e9))
    assert _shared(fast, sp="ulysses").ulysses == 8  # forced even where the ring is faster
    with pytest.raises(ValueError, match="sp must be one of"):
        plan([SEQ], world_size=8, capacity=SEQ // 8, cost_model=cm, strategy="static", sp="tree")


def test_default_is_auto_and_the_ring_plan_is_the_planner_before_the_split():
    cm = CostModel.analytic(MHA, _hardware(10e9))
    default = plan([SEQ, 300, 200], world_size=8, capacity=SEQ // 8, cost_model=cm, strategy="balance")
    auto = plan([SEQ, 300, 200], world_size=8, capacity=SEQ // 8, cost_model=cm, strategy="balance", sp="auto")
    ring = plan([SEQ, 300, 200], world_size=8, capacity=SEQ // 8, cost_model=cm, strategy="balance", sp="ring")
    assert default == auto and default.sp == "auto"
    assert all(m.ulysses == 1 for m in ring.micro_batches) and ring.sp == "ring"


@pytest.mark.parametrize("strategy", ["balance", "naive", "static"])
def test_every_planner_splits_by_the_cost_model(strategy):
    """Balance and naive choose their ranks first (the least loaded), then the split on those ranks."""
    cm = CostModel.analytic(MHA, _hardware(10e9))
    lens = [SEQ, 40000, 3000, 2000, 1000]
    result = plan(lens, world_size=8, capacity=SEQ // 8, cost_model=cm, strategy=strategy, sp="auto")
    result.validate(heads=16, kv_heads=16)
    for m in result.micro_batches:
        u, seconds = choose_split(cm, np.array([lens[i] for i in m.sequences]), m.ranks, m.offload_ratio)
        assert m.ulysses == u and m.est_time == pytest.approx(seconds)
    assert any(m.ulysses > 1 for m in result.micro_batches)


def test_no_split_without_heads_or_with_mixers():
    cm = CostModel.analytic(MHA, _hardware(10e9))
    assert allowed_ulysses(cm.replace(heads=None, kv_heads=None), tuple(range(8))) == [1]
    assert allowed_ulysses(cm.replace(mixer_layers=1, mixer_state_bytes=1.0), tuple(range(8))) == [1]
    assert allowed_ulysses(cm.replace(heads=12, kv_heads=4), tuple(range(8))) == [1, 2, 4]
    assert allowed_ulysses(cm, (3,)) == [1]


def test_under_tensor_parallelism_u_splits_each_devices_heads():
    """TP 4 leaves each device 4 of the 16 query heads: u divides those. An MQA model's one K/V head then goes
    to every member of every device's all-to-all, so the TP group moves more K/V than one device of 16 heads."""
    cm = CostModel.analytic(MQA, _hardware(10e9))
    tp = cm.replace(tp_size=4)
    assert (cm.device_heads, tp.device_heads) == ((16, 1), (4, 1))
    assert allowed_ulysses(tp, tuple(range(8))) == [1, 2, 4]
    assert tp.ulysses_bytes(1024, 4) > cm.ulysses_bytes(1024, 4)
    assert _shared(tp, sp="ulysses").ulysses == 4
    mha = CostModel.analytic(MHA, _hardware(10e9))  # K/V heads divide evenly: the same bytes as without TP
    assert mha.replace(tp_size=4).ulysses_bytes(1024, 4) == mha.ulysses_bytes(1024, 4)
    with pytest.raises(ValueError, match="16 query heads cannot be split over 3 tensor-parallel devices"):
        cm.replace(tp_size=3)


def test_cli_plan_and_simulate_take_sp(capsys):
    from bytescale_compile.cli import main
    from bytescale_compile.planner import Plan

    common = ["--hardware", "h100-nvlink", "--ranks", "64", "--global-tokens", "2M"]
    args = ["plan", *common, "--strategy", "static", "--context", "256K"]
    assert main([*args, "--sp", "ulysses", "--json"]) == 0
    forced = Plan.from_json(capsys.readouterr().out)
    forced.validate(heads=32, kv_heads=8)  # llama-7b
    assert forced.sp == "ulysses" and all(m.ulysses == 8 for m in forced.micro_batches if len(m.ranks) >= 8)
    assert main([*args, "--sp", "ring"]) == 0
    assert "shared splits u x r (--sp ring): 1x32 100%" in capsys.readouterr().out
    assert main(["simulate", *common, "--strategies", "static", "--context", "256K", "--sp", "auto"]) == 0
    assert "256K" in capsys.readouterr().out
    assert main([*args, "--sp", "heads"]) == 2
    assert "invalid choice: 'heads'" in capsys.readouterr().err
