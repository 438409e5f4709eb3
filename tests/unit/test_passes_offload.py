"""Selective activation offload: the pass, the act_ctx, its counters, and exactness at every ratio."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import bytescale_compile as bsc
from bytescale_compile.models.llama import LlamaConfig, LlamaForCausalLM
from bytescale_compile.passes.offload import NAME as OFFLOAD
from bytescale_compile.runtime.context import ContextError
from bytescale_compile.runtime.offload import get_act_ctx
from tests.helpers import hf_llama, protocol_batch

LAYERS = 6  # 4 offloadable layers, 2 kept
OUTSIDE = (
    "resident (outside the transformer layers)",
    "resident (read by layers 0-",
    "resident (its storage is also a graph input or output: a copy would free nothing)",
)


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=LAYERS, num_heads=4, num_kv_heads=2
        )
    )


def _run(opt: torch.nn.Module, batches: list[dict], ratios: list[float] | None):
    """Forward of every micro-batch, then every backward (paper Listing 1); losses, grads, act_ctx."""
    opt.zero_grad(set_to_none=True)
    act_ctx = get_act_ctx(len(batches), ratios) if ratios is not None else None
    losses = []
    for i, batch in enumerate(batches):
        if act_ctx is None:
            losses.append(opt(**batch).loss)
            continue
        act_ctx.update_micro_batch_id(i)
        with act_ctx:
            losses.append(opt(**batch).loss)
    for i, loss in enumerate(losses):
        if act_ctx is None:
            loss.backward()
            continue
        act_ctx.update_micro_batch_id(i)
        with act_ctx:
            loss.backward()
    grads = {n: p.grad.clone() for n, p in opt.named_parameters()}
    return [loss.detach() for loss in losses], grads, act_ctx


@pytest.fixture(scope="module")
def reference():
    """Losses and gradients with the pass switched off."""
    torch._dynamo.reset()
    opt = bsc.optimize(_model(), offload="off")
    return _run(opt, [protocol_batch([40, 24], vocab=128)], None)[:2]


@pytest.mark.parametrize(
    "ratio", [pytest.param(0.0, marks=pytest.mark.slow), 0.3, 0.5, pytest.param(1.0, marks=pytest.mark.slow)]
)
def test_losses_and_gradients_are_bit_identical(reference, ratio):
    opt = bsc.optimize(_model())
    losses, grads, act_ctx = _run(opt, [protocol_batch([40, 24], vocab=128)], [ratio])
    ref_losses, ref_grads = reference
    assert torch.equal(losses[0], ref_losses[0])
    for name, grad in grads.items():
        assert torch.equal(grad, ref_grads[name]), name
    stats = act_ctx.stats[0]
    assert stats.reloaded_bytes == stats.offloaded_bytes and (stats.offloaded_bytes > 0) == (ratio > 0)
    assert act_ctx.waiting(0) == 0


def _offloaded_bytes_per_token(report) -> int:
    rows = [r for g in report.graphs for r in g.saved_activations]
    return sum(r.bytes_per_token for r in rows if r.decision.startswith("offload") and r.alias_of is None)


def test_ratios_per_micro_batch_without_recompiling():
    model = _model()
    batches = [
        protocol_batch([30], vocab=128, seed=1),
        protocol_batch([20, 37], vocab=128, seed=2),
        protocol_batch([50], vocab=128, seed=3),
    ]
    ref_losses, ref_grads, _ = _run(bsc.optimize(copy.deepcopy(model), offload="off"), batches, None)
    torch._dynamo.reset()
    opt = bsc.optimize(model)
    ratios = [0.5, 0.0, 1.0]
    losses, grads, act_ctx = _run(opt, batches, ratios)
    compilations = opt.compilations
    _run(opt, batches, [1.0, 0.3, 0.0])
    assert opt.compilations == compilations  # r is read at run time
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert all(torch.equal(grads[n], ref_grads[n]) for n in grads)
    per_token = _offloaded_bytes_per_token(opt.report)
    for stats, batch, r in zip(act_ctx.stats, batches, ratios):
        tokens = batch["input_ids"].shape[1]
        assert stats.offloaded_bytes == math.floor(r * tokens) * per_token, (r, tokens)


def test_peak_resident_bytes_fall_as_act_predicts():
    """Eq. 2: 2 layers + (1 - r)(l - 2) layers of Act(s) stay resident (plus what lives outside the layers)."""
    opt = bsc.optimize(_model())
    batch = protocol_batch([64], vocab=128)
    peaks = {r: _run(opt, [batch], [r])[2].stats[0].peak_resident_bytes for r in (0.0, 0.5, 1.0)}
    counted = ("offload", "resident (last", "resident (outside", "resident (read by")  # through the act_ctx
    rows = [
        r
        for g in opt.report.graphs
        for r in g.saved_activations
        if r.alias_of is None and r.decision.startswith(counted)
    ]
    tokens = batch["input_ids"].shape[1]
    per_layer = [sum(r.bytes_per_token for r in rows if r.layer == k) * tokens for k in range(LAYERS)]
    act = per_layer[1]  # one layer's Act(s)
    assert per_layer[: LAYERS - 2] == [act] * (LAYERS - 2)  # the offloadable layers: (l - 2) Act(s)
    assert peaks[0.0] == sum(r.bytes_per_token for r in rows) * tokens
    for r, peak in peaks.items():
        predicted = peaks[0.0] - r * (LAYERS - 2) * act
        assert predicted <= peak <= predicted + 0.01 * act, (r, peak, predicted)


def test_report_lists_every_decision():
    opt = bsc.optimize(_model())
    _run(opt, [protocol_batch([16], vocab=128)], [0.5])
    rows = [r for g in opt.report.graphs for r in g.saved_activations]
    lse = [row for row in rows if row.decision.startswith("resident (its storage is not token-major")]
    assert {row.source.rsplit(".", 1)[-1] for row in lse} == {"self_attn"} and all(r.bytes_per_token <= 16 for r in lse)
    for row in set(rows) - set(lse):  # attention's LSE [B, H, T] has T innermost: no token prefix of it is contiguous
        if row.layer is None:
            assert row.decision.startswith(OUTSIDE), row
        elif row.layer >= LAYERS - 2:
            assert row.decision.startswith("resident (last 2 layers stay"), row
        else:
            assert row.decision.startswith("offload first ⌊r·T⌋ tokens"), row
    assert any("with" in row.decision for row in rows if row.alias_of)  # views go with their storage
    result = opt.report.pass_results(OFFLOAD)[0]
    assert result.rewrites and "offload" in opt.report.to_markdown()


def test_backward_without_its_forward_context_raises():
    """No act_ctx, or the wrong micro-batch selected: a clear error, never stale buffers."""
    opt = bsc.optimize(_model())
    act_ctx = get_act_ctx(2, [0.5, 0.5])

    def forward() -> torch.Tensor:
        act_ctx.update_micro_batch_id(0)
        with act_ctx:
            return opt(**protocol_batch([24], vocab=128)).loss

    loss = forward()
    with pytest.raises(ContextError, match=r"inside `with act_ctx:`"):
        loss.backward()
    loss = forward()
    act_ctx.update_micro_batch_id(1)
    with act_ctx, pytest.raises(ContextError, match=r"update_micro_batch_id\(0\)"):
        loss.backward()
    loss = forward()
    with act_ctx:
        loss.backward()


def test_without_an_act_ctx_nothing_is_offloaded(reference):
    opt = bsc.optimize(_model())
    losses, grads, _ = _run(opt, [protocol_batch([40, 24], vocab=128)], None)
    assert torch.equal(losses[0], reference[0][0])
    assert all(torch.equal(g, reference[1][n]) for n, g in grads.items())


@pytest.mark.parametrize("bad", ["sometimes", 1.5, -0.1, True])
def test_config_rejects_bad_offload(bad):
    with pytest.raises(ValueError, match="CompileConfig.offload"):
        bsc.CompileConfig(offload=bad)


def test_act_ctx_rejects_bad_ratios():
    with pytest.raises(ValueError, match="2 micro-batches but 1"):
        get_act_ctx(2, [0.5])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        get_act_ctx(1, [1.2])
    with pytest.raises(ValueError, match="out of range"):
        get_act_ctx(1, [0.2]).update_micro_batch_id(1)


@pytest.mark.slow  # the runtime's offload: every default runtime test runs it with the plan's ratios
def test_runtime_passes_a_fixed_ratio_and_counts_it():
    model = _model()
    reference = copy.deepcopy(model)
    batch = [torch.randint(0, 128, (n,)) for n in (50, 30, 12)]
    stats = bsc.Runtime(
        bsc.optimize(model, offload=0.5), torch.optim.SGD(model.parameters(), lr=0.1), capacity=64
    ).step(batch)
    ref = bsc.Runtime(
        bsc.optimize(reference, offload="off"), torch.optim.SGD(reference.parameters(), lr=0.1), capacity=64
    ).step(batch)
    assert stats.offloaded_bytes > 0 and ref.offloaded_bytes == 0
    assert stats.peak_saved_bytes[0] < ref.peak_saved_bytes[0] or ref.peak_saved_bytes[0] == 0
    assert stats.loss == ref.loss
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))


def test_hugging_face_llama_offloads_exactly():
    model = hf_llama(num_layers=4)
    batch = protocol_batch([30, 21], vocab=128, hf=True)
    ref_losses, ref_grads, _ = _run(bsc.optimize(copy.deepcopy(model), offload="off"), [batch], None)
    torch._dynamo.reset()
    opt = bsc.optimize(model)
    losses, grads, act_ctx = _run(opt, [batch], [0.5])
    assert torch.equal(losses[0], ref_losses[0])
    assert all(torch.equal(grads[n], ref_grads[n]) for n in grads)
    rows = [r for g in opt.report.graphs for r in g.saved_activations]
    assert {r.layer for r in rows if r.decision.startswith("offload")} == {0, 1}
    assert act_ctx.stats[0].offloaded_bytes > 0 and act_ctx.waiting(0) == 0
