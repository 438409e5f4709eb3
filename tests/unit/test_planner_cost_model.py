"""Cost model (paper Eq. 2) and profiler: presets, JSON, hand-checked D(s)/r cases, vectorised vs
scalar Eq. 2, max_sequence, and a profile of a tiny layer on CPU."""

from __future__ import annotations

import dataclasses
import json
import math
import pickle

import numpy as np
import pytest
import sympy
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from bytescale_compile.planner.builder import PlanBuilder, micro_batch_time
from bytescale_compile.planner.cost_model import ActivationBytes, CostModel, LayerTime
from bytescale_compile.planner.equations import CEIL_RTOL, RECOMPUTE_TIME, ULYSSES_BACKWARD_SETS, ulysses_kv_heads
from bytescale_compile.planner.hardware import Hardware
from bytescale_compile.planner.model_shape import PRESETS, ModelShape
from bytescale_compile.planner.profiler import fit_cost_model, profile_layer, profile_model
from bytescale_compile.planner.topology import Topology

# Round numbers for hand checks: Act(s) = s bytes, T(s) = s^2 / 1000 s, B = min(1, 2) = 1 byte/s, so
# r_overlap = T(s) B / Act(s) = s / 1000. With C = 100 and l = 10: l Act(C) = 1000 and
# r_low = min(1, 1000 / (8 s)).
HAND_HW = Hardware(name="hand", d2h_bandwidth=1.0, h2d_bandwidth=2.0)
HAND = CostModel.from_terms(
    alpha1=1e-3,
    beta1=0.0,
    gamma=0.0,
    alpha2=1.0,
    beta2=0.0,
    layers=10,
    kv_bytes_per_token=4,
    param_bytes=1000.0,
    hardware=HAND_HW,
    source="hand",
)
C = 100


def test_presets_load():
    for name in ("llama-7b", "llama-13b", "llama-30b", "llama-70b", "mistral-8x7b", "mistral-8x22b"):
        m = CostModel.preset(name)
        assert m.source == f"analytic:{name}" and m.layers == PRESETS[name].layers
        assert m.alpha1 > 0 and m.beta1 > 0 and m.alpha2 > 0 and m.param_bytes > 0
    # MoE: top_k = 2 doubles the FFN FLOPs per token against the dense model of the same shape.
    dense = CostModel.analytic(ModelShape("dense", 32, 4096, 32, 8, 14336, 32000))
    assert CostModel.preset("mistral-8x7b").beta1 > 1.5 * dense.beta1


def test_unknown_preset_lists_names():
    with pytest.raises(ValueError, match="llama-7b.*mistral-8x22b"):
        CostModel.preset("gpt-5")


def test_json_round_trip(tmp_path):
    for m in (
        CostModel.preset("mistral-8x7b", Hardware(name="h200", hbm_bytes=141e9)),
        HAND,
        HAND.replace(recompute=True),
    ):
        m.save(tmp_path / "cm.json")
        assert CostModel.load(tmp_path / "cm.json") == m


def test_load_errors_name_the_file(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError, match="nope.json"):
        CostModel.load(missing)
    garbled = tmp_path / "garbled.json"
    garbled.write_text("{not json")
    with pytest.raises(ValueError, match="garbled.json"):
        CostModel.load(garbled)
    HAND.save(garbled)
    data = json.loads(garbled.read_text())
    del data["coefficients"]["alpha2"]
    garbled.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="garbled.json.*alpha2"):
        CostModel.load(garbled)


def test_llama_7b_analytic_by_hand():
    m = CostModel.preset("llama-7b")
    # hidden 4096, 8 KV heads x 128 = 1024, ffn 11008; rate = 989e12 x 0.45 = 445.05e12 FLOP/s.
    # forward linear FLOPs per token = 2 (4096 (4096 + 2048) + 4096^2 + 3 x 4096 x 11008) = 354,418,688
    rate = 445.05e12
    assert m.beta1 == pytest.approx(3 * 354_418_688 / rate)  # 2.38907e-6 s per token
    assert m.alpha1 == pytest.approx(3 * 2 * 4096 / rate)  # 5.52208e-11 s per token^2
    assert m.gamma == pytest.approx(20 * 10e-6)
    # T(8192) = 5.52208e-11 x 8192^2 + 2.38907e-6 x 8192 + 2e-4 = 3.7058e-3 + 1.95713e-2 + 2e-4
    assert float(m.layer_time(8192)) == pytest.approx(0.0234771, rel=1e-5)
    # a sequence's work leaves gamma to its micro-batch, which pays it once per layer (analytic: no other term)
    assert float(m.seq_time(8192)) == pytest.approx(32 * (0.0234771 - 2e-4), rel=1e-5)
    assert m.micro_batch_time([8192]) == pytest.approx(32 * 0.0234771, rel=1e-5)
    # Act: 2 bytes x (6 x 4096 + 2 x 1024 + 3 x 11008) = 2 x 59,648 = 119,296 bytes per token
    assert float(m.act(8192)) == 119_296 * 8192
    assert m.kv_bytes_per_token == 2 * 8 * 128 * 2
    # params: 32 x (4096 x 6144 + 4096^2 + 3 x 4096 x 11008 + 2 x 4096) + 2 x 32000 x 4096 + 4096
    assert m.param_bytes == 2 * 5_933_109_248
    assert m.allreduce_time() == pytest.approx(2 * 2 * 5_933_109_248 / 25e9)
    assert float(m.flops(8192)) == pytest.approx(32 * 3 * (354_418_688 * 8192 + 2 * 8192**2 * 4096))


def test_exprs_are_eq2():
    s, r, c, l = sympy.symbols("s r C l", positive=True)
    assert set(HAND.exprs) >= {"T", "Act", "D", "r_overlap", "r_low"}
    assert float(HAND.exprs["r_overlap"].subs(s, 400)) == pytest.approx(0.4)
    assert float(HAND.exprs["r_low"].subs({s: 400, c: C, l: 10})) == pytest.approx(0.3125)
    assert HAND.exprs["D"].subs({s: 400, r: 0.4, c: C, l: 10}) == 3


def test_eq2_hand_cases():
    def one(s, **kw):
        d, r = HAND.ranks_and_ratio(np.array([s]), C, **kw)
        return int(d[0]), float(r[0])

    # s <= C: packed (Alg. 1 line 3), no ranks of its own.
    assert one(100) == (0, 0.0) and one(50) == (0, 0.0)
    # overlap caps r: s = 400, r_overlap = 0.4 >= r_low = 1000 / 3200 = 0.3125, so r = 0.4;
    # D = ceil((2 x 400 + 0.6 x 8 x 400) / 1000) = ceil(2.72) = 3 (4 without offload)
    d, r = one(400)
    assert d == 3 and r == pytest.approx(0.4)
    # D exactly an integer: s = 500, r = 0.5, D = ceil((1000 + 0.5 x 8 x 500) / 1000) = ceil(3.0) = 3
    d, r = one(500)
    assert d == 3 and r == pytest.approx(0.5)
    # r = 1: s = 2000, r_overlap = 2 capped at 1 (>= r_low = 0.0625); D = ceil(2 x 2000 / 1000) = 4
    assert one(2000) == (4, 1.0)
    # r_overlap < r_low: s = 150, r_overlap = 0.15 < r_low = min(1, 1000 / 1200) = 0.833: no offload,
    # D = ceil(Act(150) / Act(100)) = 2
    assert one(150) == (2, 0.0)
    # just past C, r_low = 1 (l / (l-2) > 1) and r_overlap = 0.101: no offload, D = ceil(1.01) = 2
    assert one(101) == (2, 0.0)
    # offload=False: D = ceil(2000 / 100) = 20
    assert one(2000, offload=False) == (20, 0.0)
    # layers_per_rank = 4: l Act(C) = 400, r_low = min(1, 400 / (2 x 2000)) = 0.1, r = 1,
    # D = ceil(2 x 2000 / 400) = 10
    assert one(2000, layers_per_rank=4) == (10, 1.0)
    # l <= 2 keeps every layer's activations anyway: r = 0, D = ceil(2000 / 100) = 20
    assert one(2000, layers_per_rank=2) == (20, 0.0) and one(2000, layers_per_rank=1) == (20, 0.0)
    # ranks_needed evaluates D(s, r) at a given r
    assert HAND.ranks_needed(np.array([400, 400, 50]), np.array([0.0, 1.0, 1.0]), C).tolist() == [4, 1, 0]


def eq2_scalar(m: CostModel, s: int, capacity: int, l: int, offload: bool) -> tuple[int, float]:
    """Eq. 2 for one sequence, in plain Python floats."""
    if s <= capacity:
        return 0, 0.0
    act_s, act_c = m.alpha2 * s + m.beta2, m.alpha2 * capacity + m.beta2
    t = m.alpha1 * s * s + m.beta1 * s + m.gamma
    bandwidth = min(m.hardware.d2h_bandwidth, m.hardware.h2d_bandwidth)
    r = 0.0
    if offload and l > 2:
        r_star = min(1.0, t * bandwidth / act_s)
        r_low = min(1.0, l * act_c / ((l - 2) * act_s))
        if r_star >= r_low:
            r = r_star
    d = math.ceil((2 * act_s + (1 - r) * (l - 2) * act_s) / (l * act_c) * (1 - CEIL_RTOL))
    return max(d, 1), r


@st.composite
def cost_models(draw) -> CostModel:
    hw = Hardware(d2h_bandwidth=draw(st.floats(1e3, 1e11)), h2d_bandwidth=draw(st.floats(1e3, 1e11)))
    return CostModel.from_terms(
        alpha1=draw(st.floats(0, 1e-6)),
        beta1=draw(st.floats(0, 1e-3)),
        gamma=draw(st.floats(0, 1e-2)),
        alpha2=draw(st.floats(1.0, 1e6)),
        beta2=draw(st.floats(0, 1e6)),
        layers=draw(st.integers(1, 96)),
        kv_bytes_per_token=4096,
        param_bytes=1e9,
        hardware=hw,
        source="hypothesis",
    )


@settings(max_examples=200)
@given(
    cost_models(),
    st.integers(1, 100_000),
    st.lists(st.integers(1, 10_000_000), min_size=1, max_size=50),
    st.one_of(st.none(), st.integers(1, 96)),
    st.booleans(),
)
def test_vectorised_matches_scalar(m, capacity, lengths, layers_per_rank, offload):
    d, r = m.ranks_and_ratio(np.array(lengths), capacity, layers_per_rank, offload)
    assert d.dtype == np.int64 and r.dtype == np.float64
    l = layers_per_rank or m.layers
    for s, di, ri in zip(lengths, d, r):
        want_d, want_r = eq2_scalar(m, s, capacity, l, offload)
        assert di == want_d and ri == pytest.approx(want_r, rel=1e-9, abs=0)


def test_max_sequence_by_hand():
    # W = 3: r = 0 holds s <= 300. Offloading works from r_overlap >= r_low (s^2 >= 125,000, s >= 354)
    # and keeps D <= 3 while s / 1000 >= 1 - (3000 / s - 2) / 8, i.e. s^2 - 1250 s + 375,000 >= 0:
    # s <= 500 or s >= 750; from s = 1000 on r = 1 and D = ceil(2 s / 1000) <= 3 up to s = 1500.
    d, _ = HAND.ranks_and_ratio(np.array([300, 301, 353, 354, 500, 501, 749, 750, 1500, 1501]), C)
    assert d.tolist() == [3, 4, 4, 3, 3, 4, 4, 3, 3, 4]
    assert HAND.max_sequence(3, C) == 1500
    assert HAND.max_sequence(3, C, offload=False) == 300
    # r_overlap = s / 10,000: offload never frees a rank below s = 1118, where it cannot reach D <= 3.
    slow = CostModel.from_terms(
        alpha1=1e-4,
        beta1=0.0,
        gamma=0.0,
        alpha2=1.0,
        beta2=0.0,
        layers=10,
        kv_bytes_per_token=4,
        param_bytes=1000.0,
        hardware=HAND_HW,
        source="hand",
    )
    assert slow.max_sequence(3, C) == 300
    # W = 1: D <= 1 with offload needs s^2 - 1250 s + 125,000 >= 0 (s <= 109 or s >= 1140) and r = 1
    # needs s <= 500; offloading starts at s = 354, so nothing longer than C fits on one rank.
    assert HAND.max_sequence(1, C) == C


def brute_max_sequence(m: CostModel, world: int, capacity: int, l: int, offload: bool) -> int:
    bound = world * max(l, 2) * (capacity + m.beta2 / m.alpha2) + 10
    s = np.arange(1, int(bound) + 1)
    d, _ = m.ranks_and_ratio(s, capacity, l, offload)
    return int(s[d <= world].max())


@settings(max_examples=200)
@given(
    st.floats(0, 1e-2),
    st.floats(0, 1.0),
    st.floats(0, 10.0),
    st.floats(0.1, 10.0),
    st.floats(0, 10.0),
    st.integers(1, 12),
    st.integers(1, 8),
    st.integers(1, 50),
    st.booleans(),
)
def test_max_sequence_is_largest_fitting(a1, b1, g, a2, b2, l, world, capacity, offload):
    m = CostModel.from_terms(
        alpha1=a1,
        beta1=b1,
        gamma=g,
        alpha2=a2,
        beta2=b2,
        layers=l,
        kv_bytes_per_token=4,
        param_bytes=1.0,
        hardware=HAND_HW,
        source="hypothesis",
    )
    assert m.max_sequence(world, capacity, offload=offload) == brute_max_sequence(m, world, capacity, l, offload)


@pytest.mark.parametrize("d2h", [25e9, 2e9])
def test_max_sequence_llama_7b(d2h):
    m = CostModel.preset("llama-7b", Hardware(d2h_bandwidth=d2h))
    assert m.max_sequence(4, 8192) == brute_max_sequence(m, 4, 8192, 32, True)
    longest = m.max_sequence(1024, 8192)
    d, _ = m.ranks_and_ratio(np.array([longest, longest + 1]), 8192)
    assert d.tolist() == [1024, 1025]


def test_time_models_by_hand():
    # ring: 10 layers x 3 transfers x (4 - 1) steps x (100 tokens x 4 bytes / 25e9 + 10e-6 s)
    assert float(HAND.ring_time(100, 4)) == pytest.approx(90 * (400 / 25e9 + 10e-6))
    assert HAND.ring_time(np.array([100, 100]), np.array([1, 2])).tolist()[0] == 0.0
    # offload: 10 layers x Act(400) = 400 bytes x 0.5 at min(1, 2) bytes/s
    assert float(HAND.offload_time(400, 0.5)) == pytest.approx(2000.0)
    assert HAND.allreduce_time() == pytest.approx(2 * 1000 / 25e9)


def test_rejects_bad_inputs():
    with pytest.raises(ValueError, match="alpha2"):
        CostModel.from_terms(
            alpha1=1.0,
            beta1=1.0,
            gamma=0.0,
            alpha2=0.0,
            beta2=0.0,
            layers=10,
            kv_bytes_per_token=4,
            param_bytes=1.0,
            hardware=HAND_HW,
            source="bad",
        )
    with pytest.raises(ValueError, match="capacity"):
        HAND.ranks_and_ratio(np.array([10]), 0)
    with pytest.raises(ValueError, match="layers_per_rank"):
        HAND.ranks_and_ratio(np.array([10]), C, layers_per_rank=0)
    with pytest.raises(ValueError, match="mfu"):
        Hardware(mfu=1.5)


# --- profiler ------------------------------------------------------------------------------------
def test_saved_bytes_count_storages_not_parameters():
    # Linear saves its input (h), GELU its input (4h), the second Linear the GELU output (4h): 9h fp32
    # values per token; the weights, also saved, are parameters and do not count.
    h = 32
    result = profile_layer(
        nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h)), h, [64, 128, 256], repeats=1
    )
    assert result.act_bytes == tuple(9 * h * 4 * s for s in (64, 128, 256))
    assert result.alpha2 == pytest.approx(36 * h) and result.beta2 == pytest.approx(0, abs=1e-6)


def test_profile_llama_layer_on_cpu():
    from bytescale_compile.models.llama import tiny

    torch.manual_seed(0)
    model = tiny()
    hidden = model.config.hidden_size

    def make_inputs(s):
        x = torch.randn(1, s, hidden, requires_grad=True)
        return (x, *model.rotary(torch.arange(s)[None], x.dtype)), {}

    lengths = [256, 512, 1024, 2048, 4096]  # long enough that the work, not a busy machine's noise, sets T(s)
    result = profile_layer(model.layers[0], hidden, lengths, make_inputs=make_inputs)
    coeffs = (result.alpha1, result.beta1, result.gamma, result.alpha2, result.beta2)
    assert all(c >= 0 for c in coeffs) and result.alpha2 > 0 and result.alpha1 + result.beta1 > 0
    assert np.all(np.diff(result.layer_time(np.array(lengths))) > 0)
    assert len({a // s for a, s in zip(result.act_bytes, lengths)}) == 1  # flash attention: linear in s
    assert "T(s)" in result.summary() and "4096" in result.summary()
    m = fit_cost_model(result, layers=2, kv_bytes_per_token=256, param_bytes=1e6)
    assert m.source == "profiled" and float(m.layer_time(512)) == pytest.approx(float(result.layer_time(512)))


def hf_tiny():
    """A two-layer Hugging Face LLaMA for `profile_model`'s HF path."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg)


@pytest.mark.parametrize("spec", ["bytescale_compile.models.llama:tiny", "tests.unit.test_planner_cost_model:hf_tiny"])
def test_profile_model_saves_json(spec, tmp_path):
    if "hf" in spec:
        pytest.importorskip("transformers")
    result = profile_model(spec, [64, 128, 256, 512], tmp_path / "profiled.json", device="cpu", repeats=1)
    m = CostModel.load(tmp_path / "profiled.json")
    # 2 layers; K/V: 2 x 2 KV heads x 16 x 4 bytes (fp32)
    assert (m.source, m.layers, m.kv_bytes_per_token) == ("profiled", 2, 256)
    assert m.alpha2 == pytest.approx(result.alpha2) and m.alpha2 > 0


def test_profile_model_bad_spec(tmp_path):
    with pytest.raises(ValueError, match="module:factory"):
        profile_model("bytescale_compile.models.llama", [64, 128, 256], tmp_path / "x.json")


def test_profile_as_ranks_sharing_the_cpu(tmp_path):
    """Two processes at once, each on its share of the cores: the times the demo's ranks will see."""
    result = profile_model(
        "bytescale_compile.models.llama:tiny",
        [64, 128, 256],
        tmp_path / "shared.json",
        device="cpu",
        repeats=1,
        ranks_per_device=2,
    )
    assert result.device.startswith("cpu, 2 processes") and all(t > 0 for t in result.times)
    assert CostModel.load(tmp_path / "shared.json").layers == 2
    with pytest.raises(ValueError, match="ranks_per_device must be >= 1"):
        profile_model("bytescale_compile.models.llama:tiny", [64, 128, 256], tmp_path / "x.json", ranks_per_device=0)


def test_a_hybrid_moves_kv_for_its_attention_layers_and_fixed_state_bytes_for_its_mixers(tmp_path):
    """1 attention : 3 scan layers: K/V bytes of a quarter of the layers, plus state bytes whatever the tokens."""
    base = CostModel.preset("llama-7b")
    hybrid = base.replace(mixer_layers=3 * base.layers // 4, mixer_state_bytes=1e6)
    assert hybrid.ring_layers == base.layers // 4
    tokens = np.array([1000.0, 100000.0])
    kv = base.layers // 4 * 3 * 3 * tokens * base.kv_bytes_per_token
    assert np.allclose(hybrid.ring_bytes(tokens, 4), kv + 6 * 3 * 1e6)
    assert np.allclose(hybrid.ring_bytes(tokens, 1), 0.0) and float(hybrid.ring_latency(1)) == 0.0
    transfers = base.layers // 4 * 3 * 3 + 3 * hybrid.mixer_layers
    assert math.isclose(float(hybrid.ring_latency(4)), transfers * base.latency)
    hybrid.save(tmp_path / "hybrid.json")
    assert CostModel.load(tmp_path / "hybrid.json") == hybrid
    with pytest.raises(ValueError, match="mixer_layers must be an int in"):
        base.replace(mixer_layers=base.layers + 1)


def test_the_planners_scalar_shortcut_charges_mixers_like_the_cost_model():
    base = CostModel.preset("llama-7b")
    hybrid = base.replace(mixer_layers=24, mixer_state_bytes=5e7)
    lens = np.array([300000, 2000])
    builder = PlanBuilder("balance", lens, 8, 16384, hybrid)
    for d in (2, 4, 8):
        scalar = builder.time_of([0], d, 0.0)
        assert math.isclose(scalar, micro_batch_time(hybrid, lens[[0]], d, 0.0), rel_tol=1e-9)


# --- Ulysses all-to-alls -------------------------------------------------------------------------
# 2 attention layers, H = 4 query heads, H_kv = 2 K/V heads of head_dim 4 in bf16: 8 bytes a head and token,
# kv_bytes_per_token = 2 x 2 x 8 = 32. Two nodes of 4 ranks: device links 10 bytes/s, rails 1 byte/s.
A2A_TOPOLOGY = Topology(
    devices_per_node=4,
    devices_per_switch=4,
    tp_size=1,
    device_link=10.0,
    switch_uplink=10.0,
    nic_bandwidth=1.0,
    nics_per_node=4,
)
A2A = HAND.replace(
    layers=2,
    kv_bytes_per_token=32,
    heads=4,
    kv_heads=2,
    hardware=Hardware(name="a2a", latency=0.5, topology=A2A_TOPOLOGY),
)


def test_ulysses_bytes_by_hand():
    assert A2A.head_bytes_per_token == 8
    assert [ulysses_kv_heads(4, 2, u) for u in (1, 2, 4)] == [2, 2, 4]  # u > H_kv: replicated to u
    assert float(A2A.ulysses_bytes(100, 1)) == 0.0
    # u = 2: per token q + out at 4 heads, k + v at 2: (2 x 4 + 2 x 2) x 8 = 96 bytes; a rank sends half of them,
    # once forward and ULYSSES_BACKWARD_SETS = 2 times backward, in each of 2 layers: 2 x 3 x 0.5 x 100 x 96.
    assert ULYSSES_BACKWARD_SETS == 2
    assert float(A2A.ulysses_bytes(100, 2)) == pytest.approx(28800)
    # u = 4: k and v replicated to 4 heads, (8 + 8) x 8 = 128 bytes a token, 3/4 of them sent.
    assert float(A2A.ulysses_bytes(100, 4)) == pytest.approx(2 * 3 * 0.75 * 100 * 128)
    # the ring among the groups moves the K/V of the rank's heads only: H_kv / u = 1 of 2 at u = 2
    assert float(A2A.split_ring_bytes(100, 2, 2)) == pytest.approx(float(A2A.ring_bytes(100, 2)) / 2)
    assert float(A2A.split_ring_bytes(100, 1, 4)) == float(A2A.ring_bytes(100, 4))


def test_ulysses_time_charges_the_link_the_group_spans():
    hw = A2A.hardware
    inside = hw.all_to_all_bandwidth((0, 1), 2)
    across = hw.all_to_all_bandwidth((3, 4), 2)  # ranks 3 and 4 sit on different nodes
    assert inside == 10.0 and across == 1.0
    # 4 all-to-alls per attention layer, each one latency: 2 x 4 x 0.5 = 4 s
    assert float(A2A.ulysses_time(100, 2, inside)) == pytest.approx(28800 / 10 + 4)
    assert float(A2A.ulysses_time(100, 2, across)) == pytest.approx(28800 / 1 + 4)
    # a group of 4 on two nodes: each rank sends 2 of its 3 shares over its rail, 3/4 of (3/4 x bytes) / 1 ...
    assert hw.all_to_all_bandwidth((2, 3, 4, 5), 4) == pytest.approx(3 / 2)
    # ... while without a topology every rank has its own network link
    assert Hardware(name="flat", network_bandwidth=7.0).all_to_all_bandwidth((0, 1), 2) == 7.0


def test_heads_survive_json_and_old_files_load_without_them(tmp_path):
    path = tmp_path / "cm.json"
    A2A.save(path)
    assert CostModel.load(path) == A2A
    data = json.loads(path.read_text())
    del data["heads"], data["kv_heads"]
    path.write_text(json.dumps(data))
    old = CostModel.load(path)
    assert old.heads is None and old.kv_heads is None
    assert CostModel.preset("llama-7b").heads == 32 and CostModel.preset("llama-7b").kv_heads == 8
    with pytest.raises(ValueError, match="heads 4 and kv_heads 3"):
        A2A.replace(kv_heads=3)


def test_recompute_runs_each_layer_forward_twice():
    """Gradient checkpointing: T(s) is (2 fwd + bwd) / (fwd + bwd) = 4/3 of itself with bwd = 2 fwd, launches
    included, the TP all-reduces 6/4 (the forward's 2 again); the forward's ring transfer and all-to-alls are
    sent twice; Act(s) and the model FLOPs (what MFU counts) do not change."""
    assert RECOMPUTE_TIME == pytest.approx(4 / 3)
    plain = A2A.replace(gamma=0.01, beta1=1e-4, tp_comm_time=1e-3)
    again = plain.replace(recompute=True)
    s = np.array([100.0, 1000.0])
    compute = plain.alpha1 * s**2 + plain.beta1 * s + plain.gamma
    np.testing.assert_allclose(again.layer_time(s), 4 / 3 * compute + 1.5 * 1e-3 * s)
    np.testing.assert_allclose(plain.layer_time(s), compute + 1e-3 * s)
    np.testing.assert_array_equal(again.act(s), plain.act(s))
    np.testing.assert_array_equal(again.flops(s), plain.flops(s))
    # ring: 4 transfers per step and layer instead of 3 (K/V forward twice, K/V and their gradients backward)
    assert float(again.ring_bytes(100, 4)) == pytest.approx(4 / 3 * float(plain.ring_bytes(100, 4)))
    assert float(again.ring_latency(4)) == pytest.approx(4 / 3 * float(plain.ring_latency(4)))
    assert float(again.split_ring_bytes(100, 2, 2)) == pytest.approx(4 / 3 * float(plain.split_ring_bytes(100, 2, 2)))
    # Ulysses: q, k, v and the output twice forward, ULYSSES_BACKWARD_SETS backward; 6 all-to-alls a layer
    assert float(again.ulysses_bytes(100, 2)) == pytest.approx(28800 * 4 / 3)
    assert again.ulysses_latency(2) == pytest.approx(plain.ulysses_latency(2) * 6 / 4)
    # a hybrid's mixer layers: halos and states forward twice
    mixers = plain.replace(mixer_layers=1, mixer_state_bytes=10.0)
    assert float(mixers.replace(recompute=True).ring_bytes(0, 2)) == pytest.approx(4 * 2 * 10.0)
    assert not HAND.recompute
    with pytest.raises(ValueError, match="recompute must be a bool"):
        HAND.replace(recompute=1)


def test_cost_models_written_before_devices_were_recorded_still_load(tmp_path):
    path = tmp_path / "old.json"
    CostModel.preset("llama-7b").save(path)
    data = json.loads(path.read_text())
    del data["device"]
    path.write_text(json.dumps(data))
    assert CostModel.load(path) == CostModel.preset("llama-7b")
    assert CostModel.load(path).device is None


def test_terms_read_by_name_from_the_records_holding_them():
    m = CostModel.preset("llama-7b", Hardware.preset("l20", 2))
    for record in ("time", "memory", "comm", "step", "model"):
        for f in dataclasses.fields(getattr(m, record)):
            if f.name != "tp_size":  # resolved: the hardware's TP degree until the runtime sets its own
                assert getattr(m, f.name) == getattr(getattr(m, record), f.name), f.name
    assert (m.tp_size, m.model.tp_size) == (2, None)
    with pytest.raises(AttributeError, match="no attribute 'alpha3'"):
        m.alpha3  # noqa: B018
    assert pickle.loads(pickle.dumps(m)) == m  # a Ray scheduler receives it pickled


def test_from_terms_and_replace_route_each_term_to_its_record():
    m = CostModel.from_terms(
        alpha1=1.0, beta1=2.0, gamma=3.0, alpha2=4.0, beta2=5.0, layers=6, kv_bytes_per_token=7, param_bytes=8.0,
        hardware=HAND_HW, source="hand", omega=9.0, tp_size=1, ring_overhead=0.5,
    )  # fmt: skip
    assert m.time == LayerTime(1.0, 2.0, 3.0, ring_overhead=0.5) and m.memory == ActivationBytes(4.0, 5.0)
    assert (m.comm.kv_bytes_per_token, m.model.layers, m.model.param_bytes, m.step.omega) == (7, 6, 8.0, 9.0)
    changed = m.replace(gamma=0.0, recompute=True, source="changed")
    assert (changed.time.gamma, changed.time.alpha1, changed.model.recompute, changed.source) == (
        0.0,
        1.0,
        True,
        "changed",
    )
    assert m.time.gamma == 3.0
    with pytest.raises(TypeError, match="no term"):
        m.replace(gama=1.0)
    with pytest.raises(ValueError, match="gamma must be a finite number"):
        m.replace(gamma=-1.0)


def test_head_shards_is_the_former_name_of_tp_size(tmp_path):
    m = CostModel.analytic(PRESETS["llama-7b"])
    with pytest.warns(DeprecationWarning, match="head_shards moved to CostModel"):
        sharded = m.replace(head_shards=4)
    assert sharded.model.tp_size == 4 and sharded.device_heads == (8, 2)
    with pytest.warns(DeprecationWarning, match="head_shards moved to CostModel"):
        assert sharded.head_shards == 4
    path = tmp_path / "cost.json"
    m.save(path)
    path.write_text(json.dumps({**json.loads(path.read_text()), "head_shards": 4}))
    assert CostModel.load(path) == sharded
