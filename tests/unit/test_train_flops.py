"""Model FLOPs, peaks and MFU (`train/flops.py`) against counts written out by hand."""

import numpy as np
import pytest
import torch

from bytescale_compile.models.llama import tiny
from bytescale_compile.planner.model_shape import ModelShape, model_shape
from bytescale_compile.train.flops import PEAK_TFLOPS, achieved, model_flops, peak_tflops

LENGTHS = [5, 100, 37]


def _hand_count(layers, hidden, heads, kv_heads, ffn, vocab, lengths, attention_layers, top_k=1):
    """Forward FLOPs term by term, 2 per multiply-add, times 3 for forward + backward."""
    head_dim = hidden // heads
    q = 2 * hidden * heads * head_dim
    k = 2 * hidden * kv_heads * head_dim
    v = 2 * hidden * kv_heads * head_dim
    o = 2 * heads * head_dim * hidden
    gate = up = down = 2 * hidden * ffn * top_k
    lm_head = 2 * hidden * vocab
    total = 0
    for s in lengths:
        dense = s * (layers * (q + k + v + o + gate + up + down) + lm_head)
        pairs = s * (s + 1) // 2  # causal: each token with itself and those before it
        scores = 2 * heads * head_dim * pairs  # QK^T
        weighted = 2 * heads * head_dim * pairs  # PV
        total += dense + attention_layers * (scores + weighted)
    return 3 * total


def test_tiny_llama_flops_equal_a_hand_count():
    shape = model_shape(tiny())  # 2 layers, hidden 64, 4 heads, 2 kv heads, ffn 128, vocab 128
    assert (shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.ffn, shape.vocab) == (2, 64, 4, 2, 128, 128)
    expected = _hand_count(2, 64, 4, 2, 128, 128, LENGTHS, attention_layers=2)
    assert model_flops(shape, LENGTHS) == expected
    assert model_flops(shape, np.array(LENGTHS)) == expected


def test_sequences_count_apart_and_mixer_layers_have_no_attention_term():
    shape = ModelShape("t", layers=4, hidden=48, heads=6, kv_heads=3, ffn=96, vocab=100, experts=8, top_k=2)
    assert model_flops(shape, [100, 37]) == model_flops(shape, [100]) + model_flops(shape, [37])
    assert model_flops(shape, LENGTHS, mixer_layers=1) == _hand_count(
        4, 48, 6, 3, 96, 100, LENGTHS, attention_layers=3, top_k=2
    )
    assert model_flops(shape, []) == 0.0
    with pytest.raises(ValueError, match="mixer_layers"):
        model_flops(shape, LENGTHS, mixer_layers=5)
    with pytest.raises(ValueError, match="lengths"):
        model_flops(shape, [3, 0])


def test_mfu_is_the_per_device_rate_over_the_peak():
    shape = model_shape(tiny())
    step_flops = _hand_count(2, 64, 4, 2, 128, 128, LENGTHS, attention_layers=2)
    per_device, mfu = achieved(model_flops(shape, LENGTHS), seconds=0.5, peak=312.0, devices=4)
    assert per_device == pytest.approx(step_flops / 0.5 / 4 / 1e12, rel=1e-12)
    assert mfu == pytest.approx(step_flops / 0.5 / 4 / 312e12, rel=1e-12)
    assert achieved(1e12, 1.0, None, 1) == (1.0, None)
    assert achieved(1e12, 0.0, 100.0, 1) == (0.0, 0.0)


def test_peak_override_wins_and_a_cpu_has_none():
    assert peak_tflops(torch.device("cpu"), "bf16", 123.0) == 123.0
    assert peak_tflops(torch.device("cpu"), "bf16") is None
    with pytest.raises(ValueError, match="> 0"):
        peak_tflops(torch.device("cpu"), "bf16", 0.0)
    with pytest.raises(ValueError, match="dtype"):
        peak_tflops(torch.device("cpu"), "int8")


@pytest.mark.parametrize(
    "name, dtype, expected",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.0),
        ("NVIDIA H100 PCIe", "bf16", 756.0),
        ("NVIDIA H200", "fp16", 989.0),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA A10G", "bf16", 125.0),
        ("NVIDIA GeForce RTX 4090", "bf16", 165.2),
        ("AMD Instinct MI300X", "bf16", 1307.4),
        ("NVIDIA H100 80GB HBM3", "fp32", 494.7),
        ("Some Future GPU", "bf16", None),
    ],
)
def test_peak_from_the_device_name(monkeypatch, name, dtype, expected):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert peak_tflops(torch.device("cuda", 0), dtype) == expected


def test_fp32_without_tf32_has_no_peak(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")
    assert peak_tflops(torch.device("cuda", 0), "fp32") is None


def test_specific_names_come_before_the_names_they_contain():
    for table in PEAK_TFLOPS.values():
        keys = list(table)
        for i, key in enumerate(keys):
            assert not any(key.lower() in later.lower() for later in keys[i + 1 :]), key
