"""What the analytic cost model charges an MoE layer under TP, by hand: the routed experts' FLOPs by top_k over
the TP group, one all-reduce pair for the experts (the dense MLP's), and the paper's MoE rows (TP 8 x PP 4 on
its L20 servers, whose TP group spans two PCIe switches) through `bytescale-compile simulate` and `plan`."""

from __future__ import annotations

import pytest

from bytescale_compile import cli
from bytescale_compile.planner import CostModel, Hardware
from bytescale_compile.planner.equations import TP_ALL_REDUCES_PER_LAYER

L20_TP8 = Hardware.preset("l20", tp_size=8)
MFU = 0.45


def test_expert_flops_are_top_k_experts_over_the_tp_groups_devices():
    """beta1 = 3 (fwd + bwd) x forward FLOPs per token / (8 L20s x 119.5 TFLOP/s x MFU): each device runs an
    eighth of the routed experts' work on average in either layout (E/tp experts, or 1/tp of each)."""
    cost = CostModel.preset("mistral-8x7b", L20_TP8)
    attention = 2 * 4096 * 4096 + 2 * 4096 * 1024
    experts = 2 * 3 * 4096 * 14336  # top_k = 2 of the 8 experts
    forward = 2 * (attention + experts)
    assert cost.beta1 == pytest.approx(3 * forward / (8 * 119.5e12 * MFU), rel=1e-12)


def test_the_experts_all_reduce_is_the_dense_mlps_one_pair_per_layer():
    """Per layer and token, forward: one all-reduce after attention's o_proj and one after the experts (in
    place of the dense MLP's down_proj); backward: one for each input gradient. Four ring all-reduces of a
    bf16 hidden state over 8 devices at 32 GB/s each, the same as the dense model of the same hidden size."""
    assert TP_ALL_REDUCES_PER_LAYER == 4
    by_hand = 4 * 2 * (8 - 1) / 8 * (4096 * 2) / 32e9
    moe = CostModel.preset("mistral-8x7b", L20_TP8)
    dense = CostModel.preset("llama-7b", L20_TP8)  # hidden 4096 too
    assert moe.tp_time_per_token == pytest.approx(by_hand, rel=1e-12)
    assert dense.tp_time_per_token == moe.tp_time_per_token
    wider = CostModel.preset("mistral-8x22b", L20_TP8)
    assert wider.tp_time_per_token == pytest.approx(4 * 2 * 7 / 8 * (6144 * 2) / 32e9, rel=1e-12)


def test_the_papers_tp_8_group_spans_two_pcie_switches():
    """An L20 server has 4 GPUs per PCIe switch: a TP group of 8 owns two switches, and their two uplinks (32
    GB/s each) carry its ring hops to other ranks of the node and its offload copies."""
    t = L20_TP8.topology
    assert (t.ranks_per_switch, t.ranks_per_node, t.rank_uplink) == (1, 2, 2 * 32e9)
    assert t.hop(0, 1) == [("dev", 0, 0), ("dev", 1, 1), ("up", 0, 0), ("up", 1, 1)]
    assert t.ring_bandwidth([0, 1]) == 2 * 32e9
    assert t.aligned_ring_bandwidth(2) == 2 * 32e9
    assert L20_TP8.d2h_bandwidth == L20_TP8.h2d_bandwidth == 2 * 32e9
    assert L20_TP8.tp_link == 32e9
    with pytest.raises(ValueError, match="must fit one switch of 4 devices or span whole switches"):
        Hardware.preset("l20", tp_size=6)
    with pytest.raises(ValueError, match="must fit one switch"):
        Hardware.preset("l20", tp_size=32)  # more than a node


@pytest.mark.parametrize("model", ["mistral-8x7b", "mistral-8x22b"])
def test_simulate_runs_the_papers_moe_rows(model, capsys):
    argv = ["simulate", "--model", model, "--tp", "8", "--pp", "4", "--hardware", "l20", "--ranks", "16"]
    argv += ["--context", "64K", "--global-tokens", "512K", "--capacity", "4K", "--strategies", "static,balance"]
    assert cli.main(argv) == 0
    row = capsys.readouterr().out.splitlines()[-1].split()
    assert row[0] == "64K" and len(row) == 5 and row[3] == "1.00x"


@pytest.mark.parametrize(
    "args, match",
    [
        (["--pp", "33"], "--pp 33 is larger than the model's 32 decoder layers"),
        (["--tp", "3"], "a TP group of 3 devices must fit one switch"),
        (["--tp", "8", "--hardware", ""], "--tp 8 needs --hardware"),
    ],
)
@pytest.mark.parametrize("command", ["simulate", "plan"])
def test_bad_moe_layouts_exit_2_naming_the_limit(command, args, match, capsys):
    argv = [command, "--model", "mistral-8x7b", "--tp", "8", "--hardware", "l20", "--ranks", "16", *args]
    assert cli.main(argv) == 2
    assert match in capsys.readouterr().err
