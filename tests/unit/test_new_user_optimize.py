"""What a new user trips on first with `optimize()`: the README's call on a Hugging Face model, training one left in
eval mode, `torch.compile` of an optimized model, and the compile report's offload counts and module paths."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import bytescale_compile as bsc
from bytescale_compile.models.llama import LlamaConfig, LlamaForCausalLM, tiny
from bytescale_compile.passes.attention import NAME as ATTENTION
from bytescale_compile.passes.loss import NAME as FUSED_LOSS
from bytescale_compile.passes.offload import NAME as OFFLOAD
from bytescale_compile.passes.offload import OFFLOADED, RESIDENT
from tests.helpers import assert_matches_eager, hf_llama, loss_and_grads, protocol_batch, rel_err

VOCAB = 128
SEQ_LENS = [20, 12]


def _readme_call(model: nn.Module, batch: dict) -> object:
    """The README's call: the model protocol alone, no `labels`, no `use_cache`."""
    return model(**{name: batch[name] for name in ("input_ids", "position_ids", "shift_labels", "num_items_in_batch")})


def _hf_reference(eager: nn.Module) -> nn.Module:
    """`eager` called as Hugging Face documents it: with `labels` (= shift_labels) and `use_cache=False`."""

    class WithLabels(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = eager

        def forward(self, **batch: torch.Tensor) -> object:
            return self.model(**batch, labels=batch["shift_labels"], use_cache=False)

    return WithLabels()


@pytest.mark.parametrize("loaded", [False, True], ids=["from_config", "from_pretrained"])
def test_readme_example_returns_the_loss_of_a_hugging_face_model(tmp_path, loaded):
    """The README's call on `AutoModelForCausalLM` returned `loss=None`: labels and use_cache=False are filled in
    from shift_labels, and the loss and every gradient equal the eager model's called with them (with a cache, as
    the config asks, Hugging Face's mask would read the packed row as one sequence)."""
    transformers = pytest.importorskip("transformers")
    model = hf_llama()
    model.config.use_cache = True  # Hugging Face's default: a call that leaves use_cache unset builds a cache
    if loaded:
        model.save_pretrained(tmp_path)
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
        assert not model.training  # as from_pretrained leaves it
    eager = _hf_reference(copy.deepcopy(model)).train(model.training)
    optimized = bsc.optimize(model)
    batch = protocol_batch(SEQ_LENS, VOCAB)
    out = _readme_call(optimized, batch)
    assert isinstance(out.loss, torch.Tensor) and set(out.keys()) == {"loss", "logits"}  # no cache built
    loss, grads = loss_and_grads(optimized, batch)
    ref_loss, ref_grads = loss_and_grads(eager, batch)
    assert rel_err(loss, ref_loss) <= 1e-5
    assert {f"model.{name}" for name in grads} == ref_grads.keys()
    assert max(rel_err(grads[name], ref_grads[f"model.{name}"]) for name in grads) <= 1e-5


def test_backward_in_eval_mode_warns_once_that_the_loss_is_unfused(caplog):
    """A model left in eval mode trains with its loss unfused (the logits returned and their log-softmax saved), which
    only the report said: the first backward through such a loss warns, once per model, naming model.train()."""
    model = tiny().eval()
    eager = copy.deepcopy(model)
    optimized = bsc.optimize(model)
    batch = protocol_batch(SEQ_LENS, VOCAB)

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if "eval mode during a backward" in r.getMessage()]

    with caplog.at_level(logging.WARNING, logger="bytescale_compile.api"):
        optimized(**batch)  # no backward follows
        assert warnings() == []
        assert_matches_eager(optimized, eager, batch)  # a backward, and numerics as eager's
        loss_and_grads(optimized, batch)
        assert len(warnings()) == 1
        assert "loss is not fused" in warnings()[0] and "0.5 KiB per token for 128 logits" in warnings()[0]
        assert warnings()[0].endswith("call model.train() before training")
        loss_and_grads(bsc.optimize(tiny().eval()), batch)  # another model warns for itself
        assert len(warnings()) == 2
        optimized.train()
        eager.train()
        assert_matches_eager(optimized, eager, batch)
        assert len(warnings()) == 2
    assert optimized.report.rewrites(FUSED_LOSS)  # fused once in training mode


def test_torch_compile_of_an_optimized_model_is_one_compile_with_its_passes():
    """`torch.compile(bsc.optimize(m))` failed inside Dynamo on the token dimension's dynamic mark: the outer compile
    now runs the optimized model as it is, compiled once by our backend, with the loss and every gradient of eager."""
    model = tiny()
    eager = copy.deepcopy(model)
    optimized = bsc.optimize(model)
    compiled = torch.compile(optimized)
    for seed, lengths in enumerate(([20, 12], [30, 9])):
        batch = protocol_batch(lengths, VOCAB, seed=seed)
        loss, grads = loss_and_grads(compiled, batch)
        ref_loss, ref_grads = loss_and_grads(eager, batch)
        assert rel_err(loss, ref_loss) <= 1e-5
        assert {f"_orig_mod.{name}" for name in ref_grads} == grads.keys()
        assert max(rel_err(grads[f"_orig_mod.{name}"], ref_grads[name]) for name in ref_grads) <= 1e-5
    assert optimized.compilations == 1  # both lengths by one dynamic graph, ours
    assert len(optimized.report.rewrites(ATTENTION)) == 2 and optimized.report.rewrites(FUSED_LOSS)


def test_torch_compile_fullgraph_of_an_optimized_model_says_it_already_compiles():
    compiled = torch.compile(bsc.optimize(tiny()), fullgraph=True)
    with pytest.raises(Exception, match=r"optimize\(\) already compiles the model with its own backend"):
        compiled(**protocol_batch(SEQ_LENS, VOCAB))


@pytest.mark.parametrize(("layers", "offloaded"), [(2, False), (4, True)])
def test_offload_report_counts_what_it_offloads(layers, offloaded):
    """The offload pass said "39 rewritten" when every decision was resident: it counts the storages it offloads
    apart from those it routes through its ops only to count them (the last two layers, those outside any)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=layers, num_heads=4, num_kv_heads=2
    )
    report = bsc.explain(LlamaForCausalLM(config), **protocol_batch(SEQ_LENS, VOCAB))
    (result,) = report.pass_results(OFFLOAD)
    owners = {r.node: r.detail for r in result.rewrites}
    moving = [node for node, detail in owners.items() if detail.startswith("offload first")]
    assert result.counts == {OFFLOADED: len(moving), RESIDENT: len(owners) - len(moving)}
    assert bool(moving) is offloaded
    header = f"### Pass `{OFFLOAD}`: {len(moving)} offloaded, {len(owners) - len(moving)} resident, "
    assert header + f"{len(result.skipped)} left alone" in report.to_markdown()


class _Wrapper(nn.Module):
    """A model whose forward names its first argument `s`, not `self` (Dynamo then roots paths at `L['s']`)."""

    def __init__(s) -> None:  # noqa: N805
        super().__init__()
        s.inner = tiny()

    def forward(s, input_ids, position_ids, shift_labels, num_items_in_batch):  # noqa: N805
        return s.inner(
            input_ids=input_ids,
            position_ids=position_ids,
            shift_labels=shift_labels,
            num_items_in_batch=num_items_in_batch,
        )


def test_report_module_paths_whatever_the_forward_calls_itself():
    """A forward naming itself `s` gave paths like `L['s.inner.layers.0.self_attn` (an unbalanced bracket)."""
    model = _Wrapper()
    eager = copy.deepcopy(model)
    optimized = bsc.optimize(model)
    assert_matches_eager(optimized, eager, protocol_batch(SEQ_LENS, VOCAB))
    report = optimized.report
    assert [r.source for r in report.rewrites(ATTENTION)] == ["inner.layers.0.self_attn", "inner.layers.1.self_attn"]
    assert [r.source for r in report.rewrites(FUSED_LOSS)] == ["inner"]
    sources = [r.source for g in report.graphs for p in g.passes for r in (*p.rewrites, *p.skipped)]
    sources += [a.source for a in report.saved_activations]
    assert sources and not [s for s in sources if "[" in s or "'" in s]
    assert "L['" not in report.to_markdown()
