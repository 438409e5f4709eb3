"""The per-sequence load-balancing loss against Hugging Face's, and what a Runtime refuses for MoE routers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bytescale_compile.capture.routers import RouterLossError, adapt_load_balancing
from bytescale_compile.engine.routing import RouterTraining
from bytescale_compile.runtime.context import ContextError, MicroBatchContext, enter, leave, micro_batch
from bytescale_compile.runtime.expert_load import RouterTally
from bytescale_compile.train.metrics import StepRecord
from tests.moe import deepseek_v3, qwen3_moe

modeling = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
EXPERTS, TOP_K, LAYERS = 4, 2, 3


def _per_sequence_fn():
    adapt_load_balancing(qwen3_moe())
    fn = modeling.load_balancing_loss_func
    return fn, fn.__wrapped__


def _logits(tokens: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(tokens, EXPERTS, generator=g, requires_grad=True) for _ in range(LAYERS))


def _grads(loss: torch.Tensor, logits: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, logits))


def test_without_context_it_is_hugging_faces_loss():
    ours, hf = _per_sequence_fn()
    logits = _logits(20)
    got, want = ours(logits, EXPERTS, TOP_K), hf(logits, EXPERTS, TOP_K)
    assert abs(float(got.detach()) - float(want.detach())) <= 1e-6 * float(want.detach())
    for g, w in zip(_grads(got, logits), _grads(want, logits)):
        assert torch.allclose(g, w, rtol=1e-5, atol=1e-8)


def test_packed_row_is_each_sequences_loss_weighted_by_its_targets():
    ours, hf = _per_sequence_fn()
    lengths, num_items = [5, 8, 7], 40  # the global batch holds more targets than this row
    logits = _logits(sum(lengths), seed=1)
    with micro_batch(ctx=MicroBatchContext(cu_seqlens=torch.tensor([0, 5, 13, 20]), num_items=num_items)):
        got = ours(logits, EXPERTS, TOP_K)
    want = torch.zeros(())
    start = 0
    for n in lengths:
        want = want + (n - 1) / num_items * hf(tuple(g[start : start + n] for g in logits), EXPERTS, TOP_K)
        start += n
    assert abs(float(got.detach()) - float(want.detach())) <= 1e-6 * float(want.detach())
    for g, w in zip(_grads(got, logits), _grads(want, logits)):
        assert torch.allclose(g, w, rtol=1e-5, atol=1e-9)


def test_tally_holds_the_loss_and_each_layers_expert_counts():
    ours, _ = _per_sequence_fn()
    logits = _logits(12, seed=2)
    tally = RouterTally()
    enter(tally)
    try:
        loss = ours(logits, EXPERTS, TOP_K)
    finally:
        leave(tally)
    assert tally.aux_loss is not None and abs(float(tally.aux_loss) - float(loss.detach())) <= 1e-6
    assert tally.counts is not None and tally.counts.shape == (LAYERS, EXPERTS)
    assert tally.counts.sum(dim=1).tolist() == [12.0 * TOP_K] * LAYERS


def test_packed_context_without_the_batchs_targets_is_refused():
    ours, _ = _per_sequence_fn()
    with micro_batch(cu_seqlens=[0, 6, 12]), pytest.raises(ContextError, match="has no num_items"):
        ours(_logits(12), EXPERTS, TOP_K)


def test_unknown_load_balancing_form_is_refused(monkeypatch):
    def load_balancing_loss_func(gate_logits, num_experts=None, top_k=2, attention_mask=None):
        return sum(g.logsumexp(-1).square().mean() for g in gate_logits)  # not the Switch-Transformer loss

    monkeypatch.setattr(modeling, "load_balancing_loss_func", load_balancing_loss_func)
    with pytest.raises(RouterLossError, match=r"not the Switch-Transformer loss .*output_router_logits=False"):
        RouterTraining.of(qwen3_moe(), pp_size=1)


def test_aux_loss_scopes_that_cannot_be_exact_are_refused():
    with pytest.raises(RouterLossError, match="global-batch loss"):
        RouterTraining.of(qwen3_moe(), pp_size=1, scope="global")
    with pytest.raises(RouterLossError, match="depend on the plan"):
        RouterTraining.of(qwen3_moe(), pp_size=1, scope="micro_batch")


def test_aux_loss_under_pipelines_is_refused():
    with pytest.raises(RouterLossError, match=r"pipeline stages \(pp_size 2\).*output_router_logits=False"):
        RouterTraining.of(qwen3_moe(), pp_size=2)


def test_aux_loss_free_balancing_needs_an_expert_bias():
    with pytest.raises(RouterLossError, match="Qwen3MoeForCausalLM has none"):
        RouterTraining.of(qwen3_moe(), pp_size=1, bias_update=0.01)
    training = RouterTraining.of(deepseek_v3(), pp_size=1, bias_update=0.01)
    assert len(training.routers) == 1 and training.aux_coef == 0.0


def test_dense_model_has_no_router_figures():
    tf = pytest.importorskip("transformers")
    from tests.hf_models import _common

    training = RouterTraining.of(tf.LlamaForCausalLM(tf.LlamaConfig(**_common())), pp_size=1)
    assert not training.active
    with training.tally() as tally:
        assert tally is None


def test_metrics_carry_cross_entropy_aux_loss_and_expert_load_apart():
    from tests.unit.test_train_metrics import COST_MODEL, _stats

    moe = dataclasses.replace(_stats(), loss=2.5, aux_loss=0.5, expert_load=[1.25, 1.5])
    record = StepRecord.from_stats(moe, 1e-3, COST_MODEL)
    line = record.to_dict()
    assert (line["ce_loss"], line["aux_loss"], line["expert_load"]) == (2.0, 0.5, [1.25, 1.5])
    assert record.scalars()["expert_load/layer1"] == 1.5
    assert "cross-entropy 2.0000 + aux 0.5000" in record.summary()
    dense = StepRecord.from_stats(_stats(), 1e-3, COST_MODEL).to_dict()
    assert not {"ce_loss", "aux_loss", "expert_load"} & dense.keys()
