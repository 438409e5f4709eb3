"""The per-rank memory model (`planner/memory.py`): static bytes by dtype, activations under offloading, the
capacity C a budget allows, and the budget errors. Pure arithmetic: exact on any CPU."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bytescale_compile.config import LOSS_MIN_CHUNK
from bytescale_compile.planner.memory import (
    BUCKET_BYTES,
    LossWorkspace,
    MemoryBudgetError,
    MemoryModel,
    ParallelLayout,
    format_bytes,
    shape_memory_model,
)
from bytescale_compile.planner.model_shape import PRESETS

GiB = 2**30
P = 8_030_261_248
"""LLaMA-3-8B's parameters."""


def model(**overrides) -> MemoryModel:
    fields = dict(
        params=P,
        hdp_size=4,
        dtype="bf16",
        layers=32,
        layer_bytes_per_token=140_000.0,
        other_bytes_per_token=9_000.0,
        workspace_bytes=2 * GiB,
    )
    return MemoryModel(**{**fields, **overrides})


@pytest.mark.parametrize("n", [1, 4, 64])
@pytest.mark.parametrize("params", [P, 1_000_003])
def test_bf16_is_the_distributed_optimizer(n, params):
    m = model(params=params, hdp_size=n)
    s = m.static
    padded = params + n * math.ceil(4 * params / BUCKET_BYTES)
    assert m.padded_params == padded
    assert (s.weights, s.gradients, s.buckets) == (2 * params, 4 * padded, 0)
    assert s.master == 4 * math.ceil(padded / n)
    assert s.optimizer == 8 * math.ceil(padded / n)
    assert 6 + 12 / n <= m.bytes_per_param <= 6 + 12 / n + 0.01


def test_bf16_reduction_in_bf16_adds_one_bf16_bucket():
    fp32 = model(hdp_size=64)
    bf16 = model(hdp_size=64, grad_reduce_dtype="bf16")
    assert fp32.static.buckets == 0
    assert BUCKET_BYTES // 2 <= bf16.static.buckets <= BUCKET_BYTES // 2 + 2 * 64
    assert bf16.static.total - fp32.static.total == bf16.static.buckets
    # A bucket closes on the parameter that takes it past bucket_bytes: it can be that much larger.
    big = model(hdp_size=64, grad_reduce_dtype="bf16", largest_param=10**8)
    assert big.static.buckets >= 2 * (BUCKET_BYTES // 4 + 10**8)


@pytest.mark.parametrize("n", [1, 4, 64])
def test_fp32_is_sixteen_bytes_or_eight_plus_eight_over_n_with_zero(n):
    plain = model(dtype="fp32", hdp_size=n)
    zero = model(dtype="fp32", hdp_size=n, zero=True)
    flat = 0 if n == 1 else BUCKET_BYTES  # the all-reduce flattens one bucket at a time; nothing with one rank
    assert plain.static.parts() == dict(weights=4 * P, gradients=4 * P, master=0, optimizer=8 * P, buckets=flat)
    assert plain.static.total == 16 * P + flat
    assert zero.static.optimizer == 8 * math.ceil(P / n)
    assert zero.static.total == 8 * P + 8 * math.ceil(P / n) + flat
    assert zero.bytes_per_param == pytest.approx(8 + 8 / n, abs=0.01)


def test_fp32_flat_bucket_never_exceeds_the_gradients():
    tiny = model(dtype="fp32", params=1000, hdp_size=8)
    assert tiny.static.buckets == 4 * 1000


def test_activations_keep_the_last_two_layers_and_what_lies_outside():
    m = model(layers=10, layer_bytes_per_token=100.0, other_bytes_per_token=10.0)
    assert m.activation_bytes(1000, 0.0) == (10 * 100 + 10) * 1000
    assert m.activation_bytes(1000, 1.0) == (2 * 100 + 10) * 1000
    assert m.activation_bytes(1000, 0.5) == ((2 + 0.5 * 8) * 100 + 10) * 1000
    # offloading adds one layer's offloaded share while its copy is in flight: 0.5 x 100 bytes per token
    assert m.peak(1000, 0.5) == m.static.total + m.activation_bytes(1000, 0.5) + 0.5 * 100 * 1000 + m.workspace_bytes
    assert m.peak(1000, 0.0) == m.static.total + m.activation_bytes(1000, 0.0) + m.workspace_bytes
    two_stages = model(layers=10, layer_bytes_per_token=100.0, other_bytes_per_token=10.0, in_flight=2)
    assert two_stages.activation_bytes(1000, 1.0) == 2 * m.activation_bytes(1000, 1.0)


def test_a_checkpointed_backward_adds_one_recomputed_layer_once():
    """Gradient checkpointing: each layer saves its input, and one layer's activations are rebuilt at a time in
    the backward, whatever the micro-batches in flight; offloading never frees them."""
    m = model(layers=10, layer_bytes_per_token=10.0, other_bytes_per_token=5.0, recomputed_bytes_per_token=100.0)
    assert m.activation_bytes(1000, 0.0) == (10 * 10 + 5 + 100) * 1000
    assert m.activation_bytes(1000, 1.0) == (2 * 10 + 5 + 100) * 1000
    two_stages = dataclasses.replace(m, in_flight=2)
    assert two_stages.activation_bytes(1000, 0.0) == (2 * (10 * 10 + 5) + 100) * 1000
    budget = m.static.total + m.workspace_bytes + 2**30
    for offload in (False, True):
        c = m.capacity(budget, offload)
        assert m.worst_peak(c, offload) <= budget < m.worst_peak(c + 1, offload)
    assert m.capacity(budget, offload=False) == 2**30 // (10 * 10 + 5 + 100)
    assert "100 bytes/token of one recomputed layer" in m.describe()


@pytest.mark.parametrize("l", [1, 2])
def test_offload_frees_nothing_with_two_layers_or_fewer(l):
    m = model(layers=l, layer_bytes_per_token=100.0, other_bytes_per_token=10.0)
    assert m.activation_bytes(1000, 1.0) == m.activation_bytes(1000, 0.0) == (l * 100 + 10) * 1000
    budget = 100 * GiB
    assert m.capacity(budget, offload=True) == m.capacity(budget, offload=False) == m.longest_per_rank(budget)


@settings(max_examples=300)
@given(
    layers=st.integers(1, 96),
    layer=st.floats(1.0, 1e6),
    other=st.floats(0.0, 1e5),
    budget=st.integers(60 * GiB, 200 * GiB),
    n=st.sampled_from([1, 4, 64]),
    dtype=st.sampled_from(["fp32", "bf16"]),
    in_flight=st.integers(1, 4),
)
def test_capacity_fits_the_budget_and_is_the_largest_that_does(layers, layer, other, budget, n, dtype, in_flight):
    m = model(
        params=1_000_000_000,
        hdp_size=n,
        dtype=dtype,
        layers=layers,
        layer_bytes_per_token=layer,
        other_bytes_per_token=other,
        in_flight=in_flight,
    )
    c = m.capacity(budget, offload=False)
    assert m.peak(c) <= budget < m.peak(c + 1)
    c = m.capacity(budget, offload=True)
    longest = layers * c / 2 if layers > 2 else c
    assert m.peak(c, 0.0) <= budget  # a packed micro-batch of C tokens
    # fractional shares: the bytes of a share that fills the budget exactly may round 1 ulp above it
    rounding = budget * 1e-12
    assert m.peak(longest, 1.0) <= budget + rounding  # the largest share of a sequence D(s) allows at r = 1
    for r in (0.25, 0.5, 0.75):  # at any r, D(s) puts at most l C / (2 + (1 - r)(l - 2)) tokens on a rank
        share = layers * c / (2 + (1 - r) * (layers - 2)) if layers > 2 else c
        assert m.peak(share, r) <= budget + rounding
    bigger = layers * (c + 1) / 2 if layers > 2 else c + 1
    assert m.peak(bigger, 1.0) > budget
    assert m.longest_per_rank(budget) == (layers * c // 2 if layers > 2 else c)


def test_budget_below_the_static_bytes_is_refused_naming_both():
    m = model(dtype="fp32", hdp_size=1)
    budget = 80 * GiB
    with pytest.raises(MemoryBudgetError) as e:
        m.capacity(budget, offload=False)
    message = str(e.value)
    assert isinstance(e.value, ValueError)
    assert format_bytes(budget) in message and str(budget) in message
    assert format_bytes(m.static.total) in message and "16.00 bytes per parameter" in message
    assert "--zero" in message and "--dtype bf16" in message and "larger budget" in message


def test_budget_without_room_for_one_token_is_refused():
    m = model(layer_bytes_per_token=1e6, other_bytes_per_token=0.0)
    budget = m.static.total + m.workspace_bytes + 1000
    with pytest.raises(MemoryBudgetError, match="less than one token"):
        m.capacity(budget, offload=False)
    assert m.available(budget) == 1000


def test_static_only_model_checks_budgets_but_has_no_capacity():
    m = model(layer_bytes_per_token=0.0, other_bytes_per_token=0.0)
    assert m.available(80 * GiB) > 0
    with pytest.raises(ValueError, match="no capacity"):
        m.capacity(80 * GiB, offload=False)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(dtype="fp16"), "dtype"),
        (dict(dtype="fp32", grad_reduce_dtype="bf16"), "applies to bf16"),
        (dict(hdp_size=0), "hdp_size"),
        (dict(layer_bytes_per_token=-1.0), "layer_bytes_per_token"),
        (dict(workspace_bytes=-1), "workspace_bytes"),
        (dict(recomputed_bytes_per_token=math.inf), "recomputed_bytes_per_token"),
        (dict(backward_bytes_per_token=-1.0), "backward_bytes_per_token"),
        (dict(fragmentation=math.nan), "fragmentation"),
    ],
)
def test_bad_fields_are_refused(overrides, match):
    with pytest.raises(ValueError, match=match):
        model(**overrides)


def test_describe_lists_every_part_and_the_capacities():
    text = model(hdp_size=64).describe(80 * GiB)
    for word in ("weights", "gradients", "master", "optimizer", "buckets", "total", "bytes/param", "workspace"):
        assert word in text
    assert "C without offload" in text and "C with offload" in text and "longest per rank" in text


def test_the_loss_chunk_follows_the_data():
    """About T·H/V tokens per chunk, a power of two, at least 1,024, at most the cap and the tokens."""
    loss = LossWorkspace(vocab=128_256, hidden=4096, hidden_bytes=2, logit_bytes=6)
    assert loss.chunk(0) == 0
    assert loss.chunk(500) == 500  # fewer tokens than the smallest chunk: one chunk of them all
    assert loss.chunk(8192) == LOSS_MIN_CHUNK  # 8192 x 4096 / 128256 = 261.6
    assert loss.chunk(65_536) == 4096  # 2093.1 -> 4096
    assert loss.chunk(32_064) == 1024  # exactly 1024.0
    assert loss.chunk(131_072) == 8192  # 4186.2 -> 8192
    # a cap on the buffers' bytes: 2 GiB hold 2,790 rows of 128,256 logits at 6 bytes, 2,752 in whole tiles of 64
    assert dataclasses.replace(loss, max_buffer_bytes=2 * GiB).chunk(131_072) == 2752
    # under TP the rule reads this rank's 64,128 columns, as the kernel does: 1 GiB holds 2,790 of their rows
    assert dataclasses.replace(loss, max_buffer_bytes=GiB, tp=2).chunk(131_072) == 2752
    # the chunk's logits in bf16 plus their fp32 copy, d(hidden) of every token in bf16
    assert loss.bytes(65_536) == 4096 * 128_256 * 6 + 65_536 * 4096 * 2
    fp32_grad = dataclasses.replace(loss, head_grad_bytes=128_256 * 4096 * 4, tp=2)
    assert fp32_grad.bytes(8192) == 1024 * 64_128 * 6 + 8192 * 4096 * 2 + 128_256 * 4096 * 2
    with pytest.raises(ValueError, match="vocab"):
        LossWorkspace(vocab=0, hidden=1, hidden_bytes=2, logit_bytes=2)


def test_the_peak_adds_the_larger_transient_and_fragmentation_by_hand():
    """Loss buffers or one layer's backward, whichever is larger, plus the in-flight copy when offloading; all that
    changes with the tokens scaled by (1 + fragmentation); the static bytes and the workspace are not."""
    loss = LossWorkspace(vocab=1000, hidden=64, hidden_bytes=2, logit_bytes=6)
    m = model(
        layers=4,
        layer_bytes_per_token=100.0,
        other_bytes_per_token=10.0,
        backward_bytes_per_token=300.0,
        loss=loss,
        fragmentation=0.1,
    )
    # 10,000 tokens: chunk next_pow2(640) -> 1024; loss 1024 x 1000 x 6 + 10,000 x 64 x 2 = 7,424,000 bytes, over
    # the backward's 300 x 10,000 = 3,000,000
    assert m.transient_bytes(10_000) == 1024 * 1000 * 6 + 10_000 * 64 * 2
    activations = (4 * 100 + 10) * 10_000
    assert m.peak(10_000) == pytest.approx(
        m.static.total + 1.1 * (activations + 7_424_000) + m.workspace_bytes, rel=1e-15
    )
    # 100,000 tokens: chunk next_pow2(6400) -> 8192; loss 8192 x 6000 + 12.8e6 = 61,952,000 over 30,000,000
    assert m.transient_bytes(100_000) == 8192 * 6000 + 100_000 * 128
    # without a loss the backward's transient counts; at r = 0.5 with 4 layers, half a layer is in flight
    no_loss = dataclasses.replace(m, loss=None)
    assert no_loss.transient_bytes(10_000, 0.5) == 300 * 10_000 + 0.5 * 100 * 10_000
    assert dataclasses.replace(no_loss, layers=2).transient_bytes(10_000, 0.5) == 300 * 10_000


def test_capacity_with_transients_is_the_largest_that_fits():
    """The peak is not linear in C (the loss's chunk doubles in steps): C is still the largest that fits, and a
    model with transients gets less C than one without."""
    loss = LossWorkspace(vocab=128_256, hidden=4096, hidden_bytes=2, logit_bytes=6)
    m = model(params=2 * 10**9, hdp_size=1, layers=8, backward_bytes_per_token=131_072.0, loss=loss, fragmentation=0.02)
    budget = 140 * GiB
    for offload in (False, True):
        c = m.capacity(budget, offload)
        assert m.worst_peak(c, offload) <= budget < m.worst_peak(c + 1, offload)
        bare = dataclasses.replace(m, backward_bytes_per_token=0.0, loss=None, fragmentation=0.0)
        assert c < bare.capacity(budget, offload)
    # the figures the capacity leaves room for, by hand at C: static + 1.02 (8 x 140,000 + 9,000 + 131,072) C, the
    # backward's transient above the loss's (a chunk of 4,096 tokens: 3.15 GB of logits and 0.7 GB of d(hidden))
    c = m.capacity(budget, offload=False)
    assert 80_000 < c < 90_000 and loss.chunk(c) == 4096
    assert loss.bytes(c) < 131_072 * c
    by_hand = m.static.total + 1.02 * (8 * 140_000 + 9_000 + 131_072) * c + m.workspace_bytes
    assert m.peak(c) == pytest.approx(by_hand, rel=1e-12)
    assert "transients: 131,072 bytes/token" in m.describe() and "fragmentation: 2%" in m.describe()


# --- from a shape's counts (`shape_memory_model`) --------------------------------------------------------------


def test_a_mixtral_device_at_tp_8_pp_4_holds_an_eighth_of_its_experts_by_hand():
    """Mixtral-8x7B on the paper's TP 8 x PP 4, bf16 over 384 HDP ranks: 8 layers per stage, each with 1/8 of
    its attention and experts and the whole router, one 32000 x 4096 end over 8 and the final norm."""
    m = shape_memory_model(
        PRESETS["mistral-8x7b"], ParallelLayout(tp=8, pp=4, hdp=384), dtype="bf16", budget=48 * GiB, expandable=True
    )
    layer = (2 * 4096 * 4096 + 2 * 4096 * 1024 + 8 * 3 * 4096 * 14336) // 8 + 4096 * 8 + 2 * 4096
    params = 8 * layer + 32000 * 4096 // 8 + 4096
    assert m.params == params == 1_467_944_960
    padded = params + 384 * math.ceil(4 * params / BUCKET_BYTES)
    assert (m.static.weights, m.static.gradients) == (2 * params, 4 * padded)
    assert m.static.master + m.static.optimizer == 12 * math.ceil(padded / 384)
    assert (m.layers, m.in_flight, m.largest_param) == (8, 4, 2 * 14336 * 4096)
    # ep: each device runs 1 of the 8 experts, so a quarter of a token's 2 routed copies (module docstring)
    assert m.layer_bytes_per_token == 2 * (5 * 4096 + 512 + 256 + 3 * 14336 * 2 / 8 + 2 * 2 * 4096 / 8) + 32
    assert m.backward_bytes_per_token == 2 * (4 * 14336 * 2 / 8 + 2 * 4096)
    assert m.loss is not None and m.loss.tp == 8 and m.loss.head_grad_bytes == 2 * 32000 * 4096 * 2


def test_a_shape_memory_model_refuses_what_cannot_split():
    mixtral = PRESETS["mistral-8x7b"]
    with pytest.raises(ValueError, match="pp 33 is larger than mistral-8x7b's 32 decoder layers"):
        shape_memory_model(mixtral, ParallelLayout(pp=33), dtype="bf16")
    with pytest.raises(ValueError, match="not divisible by tp 16.*'tp' expert layout"):
        shape_memory_model(mixtral, ParallelLayout(tp=16, expert_layout="ep"), dtype="bf16")
