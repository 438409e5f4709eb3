"""The simulator runs the u × r split each micro-batch of the plan names, timed by the planner's own `split_time`."""

from __future__ import annotations

import numpy as np
import pytest

from bytescale_compile.planner import CostModel, Hardware, MicroBatch, ModelShape, Plan, Topology
from bytescale_compile.planner.plan import split_tokens
from bytescale_compile.planner.split import split_time
from bytescale_compile.sim.simulator import p2p_bytes, simulate, step_time, ulysses_bytes

MHA = ModelShape("mha", layers=4, hidden=2048, heads=16, kv_heads=16, ffn=5504, vocab=32000)
TOPOLOGY = Topology(
    devices_per_node=8,
    devices_per_switch=8,
    tp_size=1,
    device_link=10e9,
    switch_uplink=10e9,
    nic_bandwidth=10e9,
    nics_per_node=8,
)
LENS = [65536, 32768, 16384, 4096]
SPLITS = [(0, 8, 1), (1, 8, 2), (2, 8, 8), (3, 1, 1)]
"""(sequence, ranks, u): a plain ring, a 2 x 4 split, all Ulysses, and one packed on rank 0."""


def _mixed_plan(cost_model: CostModel) -> Plan:
    mbs = []
    for seq, d, u in SPLITS:
        ranks = tuple(range(d))
        lens = np.array([LENS[seq]])
        mbs.append(
            MicroBatch(
                id=seq,
                ranks=ranks,
                sequences=(seq,),
                offload_ratio=0.0,
                tokens_per_rank=split_tokens(lens, d, u),
                est_time=split_time(cost_model, lens, ranks, 0.0, u),
                ulysses=u,
            )
        )
    schedule = [[0, 1, 2, 3]] + [[0, 1, 2]] * 7
    return Plan("balance", 8, 8192, 1, LENS, mbs, schedule)


@pytest.mark.parametrize("topology", [TOPOLOGY, None], ids=["topology", "private-links"])
def test_a_step_of_mixed_splits_takes_the_sum_of_their_times(topology):
    hardware = Hardware(name="test", network_bandwidth=10e9, topology=topology)
    cm = CostModel.analytic(MHA, hardware)
    step = _mixed_plan(cm)
    step.validate(heads=16, kv_heads=16)
    expected = (
        sum(split_time(cm, np.array([LENS[seq]]), tuple(range(d)), 0.0, u) for seq, d, u in SPLITS)
        + len(SPLITS) * cm.micro_batch_overhead  # rank 0 runs them all, each paying every layer's launches
        + cm.allreduce_time()
    )
    assert step_time(step, cm) == pytest.approx(expected, rel=1e-12)
    assert simulate(step, cm).step_time == pytest.approx(expected, rel=1e-12)
    # each split is charged its own terms: the all-Ulysses one moves no ring bytes, the ring no all-to-all bytes
    assert ulysses_bytes(step, cm) == pytest.approx(
        sum(d * float(cm.ulysses_bytes(split_tokens([LENS[s]], d, u), u)) for s, d, u in SPLITS if u > 1)
    )
    assert p2p_bytes(step, cm) > 0
