"""capture/mixers.py: the adapted forwards of Hugging Face's mixer modules compute what the modules' torch paths
compute, one sequence per row, and keep the sequences packed in a row apart.

Every adapted class is checked on a tiny fp32 model: against the class's own forward (outputs and every gradient),
and on a row packing 3 sequences against the class's forward run on each sequence alone.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterator
from copy import deepcopy
from typing import Any

import pytest
import torch
from torch import nn

import bytescale_compile as bsc
from bytescale_compile.capture import mixers
from bytescale_compile.capture.mixers import ADAPTERS, adapt_mixers
from bytescale_compile.runtime.context import micro_batch
from tests.helpers import protocol_batch, rel_err
from tests.hf_models import HYBRID_BY_NAME, VOCAB, build_hybrid

tf = pytest.importorskip("transformers")

TOL = 1e-5
CU_SEQLENS = [0, 20, 21, 37]

_SMALL = dict(
    vocab_size=128,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    use_cache=False,
    pad_token_id=0,
)
_LINEAR = dict(
    head_dim=8,
    layer_types=["linear_attention", "full_attention"],
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
)


def _small(*drop: str, **overrides: Any) -> dict[str, Any]:
    return {**{k: v for k, v in _SMALL.items() if k not in drop}, **overrides}


# The hybrids of the architecture matrix, and the other classes the adapters cover, each with its mixers' paths.
EXTRA: dict[str, tuple[Callable[[], nn.Module], tuple[str, ...]]] = {
    "lfm2-moe": (
        lambda: tf.Lfm2MoeForCausalLM(
            tf.Lfm2MoeConfig(
                **_small(),
                layer_types=["conv", "full_attention"],
                conv_L_cache=3,
                num_experts=2,
                num_experts_per_tok=1,
                moe_intermediate_size=32,
                num_dense_layers=1,
            )
        ),
        ("model.layers.0.conv",),
    ),
    "mamba": (
        lambda: tf.MambaForCausalLM(
            tf.MambaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, state_size=8, use_cache=False)
        ),
        ("backbone.layers.0.mixer", "backbone.layers.1.mixer"),
    ),
    "qwen3.5": (
        lambda: tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**_small(), **_LINEAR)),
        ("model.layers.0.linear_attn",),
    ),
    "qwen3.5-moe": (
        lambda: tf.Qwen3_5MoeForCausalLM(
            tf.Qwen3_5MoeTextConfig(
                **_small(),
                **_LINEAR,
                num_experts=2,
                num_experts_per_tok=1,
                moe_intermediate_size=16,
                shared_expert_intermediate_size=16,
            )
        ),
        ("model.layers.0.linear_attn",),
    ),
}
MODELS = [*HYBRID_BY_NAME, *EXTRA]


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny tensors: intra-op threads only wait on each other, and on a busy 2-core machine a Mamba mixer's
    backward took seconds with 2 threads instead of 20 ms with one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(name: str) -> tuple[nn.Module, tuple[str, ...]]:
    if name in HYBRID_BY_NAME:
        return build_hybrid(name), HYBRID_BY_NAME[name].mixers
    build, paths = EXTRA[name]
    torch.manual_seed(0)
    return build().float().train(), paths


def _mixer(name: str) -> nn.Module:
    """The model's first mixer, adapted."""
    model, paths = _model(name)
    adapt_mixers(model)
    return model.get_submodule(paths[0])


def _hidden_size(module: nn.Module) -> int:
    proj = next(m for n, m in module.named_children() if n.startswith("in_proj"))
    assert isinstance(proj, nn.Linear)
    return proj.in_features


def _run(
    fn: Callable[..., torch.Tensor], module: nn.Module, x: torch.Tensor, w: torch.Tensor, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Output, input gradient and parameter gradients of `(fn(x) * w).sum()`."""
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out = fn(x, **kwargs)
    (out * w).sum().backward()
    grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in module.named_parameters()}
    assert x.grad is not None
    return out.detach(), x.grad, grads


def _assert_close(got: tuple, want: tuple) -> None:
    out, dx, grads = got
    ref_out, ref_dx, ref_grads = want
    assert rel_err(out, ref_out) <= TOL
    assert rel_err(dx, ref_dx, floor=1e-6) <= TOL
    errors = {n: rel_err(grads[n], ref_grads[n], floor=1e-6) for n in ref_grads}
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] <= TOL, (worst, errors[worst])


def _original(module: nn.Module, monkeypatch: pytest.MonkeyPatch) -> Callable[..., torch.Tensor]:
    """The class's own forward. The gated delta rule runs token by token there (Hugging Face's decode path, same
    rule and dtypes): its chunked torch path takes exp(cumsum_i - cumsum_j) in fp32, whose cancellation at the
    default decays (up to e^-20 a token) leaves the gradients of A_log and dt_bias ~1e-3 off the fp64 ones."""
    hf_module = sys.modules[type(module).__module__]
    if hasattr(hf_module, "torch_recurrent_gated_delta_rule"):
        monkeypatch.setattr(hf_module, "torch_chunk_gated_delta_rule", hf_module.torch_recurrent_gated_delta_rule)
    return lambda x, **kwargs: type(module).forward(module, x, **kwargs)


@pytest.mark.parametrize("name", MODELS)
def test_adapted_forward_matches_the_original_one_sequence_per_row(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    module = _mixer(name)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 37, _hidden_size(module), generator=g)
    w = torch.randn(2, 37, _hidden_size(module), generator=g)
    _assert_close(_run(module, module, x, w), _run(_original(module, monkeypatch), module, x, w))


@pytest.mark.parametrize("name", ["lfm2", "bamba", "jamba", "qwen3-next", "qwen3.5"])
def test_adapted_forward_masks_padding_as_the_original(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    module = _mixer(name)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 37, _hidden_size(module), generator=g)
    w = torch.randn(2, 37, _hidden_size(module), generator=g)
    mask = torch.ones(2, 37, dtype=torch.long)
    mask[1, :9] = 0
    want = _run(_original(module, monkeypatch), module, x, w, attention_mask=mask)
    _assert_close(_run(module, module, x, w, attention_mask=mask), want)


@pytest.mark.parametrize("name", MODELS)
def test_adapted_forward_keeps_packed_sequences_apart(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    module = _mixer(name)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 37, _hidden_size(module), generator=g)
    w = torch.randn(1, 37, _hidden_size(module), generator=g)
    with micro_batch(cu_seqlens=CU_SEQLENS):
        got = _run(module, module, x, w)
    original = _original(module, monkeypatch)
    pieces = [_run(original, module, x[:, lo:hi], w[:, lo:hi]) for lo, hi in zip(CU_SEQLENS[:-1], CU_SEQLENS[1:])]
    outs, dxs, grads = zip(*pieces)
    want = (torch.cat(outs, 1), torch.cat(dxs, 1), {n: sum(gr[n] for gr in grads) for n in grads[0]})
    _assert_close(got, want)


@pytest.mark.parametrize("name", MODELS)
def test_adapt_mixers_finds_every_mixer_once(name: str) -> None:
    model, paths = _model(name)
    adapted, refused = adapt_mixers(model)
    assert [a.path for a in adapted] == list(paths)
    assert refused == []
    assert all(
        a.pattern == ADAPTERS[a.cls].pattern and a.cls == type(model.get_submodule(a.path)).__name__ for a in adapted
    )
    forwards = [vars(model.get_submodule(p))["forward"] for p in paths]
    assert adapt_mixers(model) == (adapted, [])
    assert [vars(model.get_submodule(p))["forward"] for p in paths] == forwards
    assert model.state_dict().keys() == _model(name)[0].state_dict().keys()
    copy = deepcopy(model)
    assert all(vars(copy.get_submodule(p))["forward"].__self__ is copy.get_submodule(p) for p in paths)


@pytest.mark.parametrize(
    ("name", "cache"), [("bamba", "cache_params"), ("lfm2", "past_key_values"), ("qwen3-next", "cache")]
)
def test_a_cache_or_packing_kwargs_go_to_the_original_forward(
    name: str, cache: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Generation with a cache, or packing passed for the CUDA kernels: the class's own forward runs."""
    module = _mixer(name)
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(type(module), "forward", lambda self, *args, **kwargs: calls.append(kwargs) or "original")
    x = torch.randn(1, 5, _hidden_size(module))
    assert module(x, **{cache: object()}) == "original"
    assert module(x, seq_idx=torch.zeros(1, 5, dtype=torch.int32)) == "original"
    assert module(x, cu_seq_lens_q=torch.tensor([0, 2, 5])) == "original"
    assert len(calls) == 3
    assert isinstance(module(x, cu_seq_lens_q=None), torch.Tensor)


def test_adapt_mixers_reports_what_it_leaves_alone() -> None:
    jamba, _ = _model("jamba")
    jamba.config._is_quantized = True
    adapted, refused = adapt_mixers(jamba)
    assert adapted == []
    assert [path for path, _ in refused] == list(HYBRID_BY_NAME["jamba"].mixers)
    assert all("quantized" in reason for _, reason in refused)

    torch.manual_seed(0)
    gelu = tf.Mamba2ForCausalLM(
        tf.Mamba2Config(
            vocab_size=128, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16, hidden_act="gelu"
        )
    )
    adapted, refused = adapt_mixers(gelu)
    assert adapted == [] and len(refused) == 2 and "'gelu'" in refused[0][1]

    bamba, paths = _model("bamba")
    bamba.get_submodule(paths[0]).conv1d._hf_hook = object()
    bamba.get_submodule(paths[1]).forward = lambda *args, **kwargs: None
    remote = bamba.get_submodule(paths[2])
    remote.__class__ = type("BambaMixer", (type(remote),), {"__module__": "transformers_modules.bamba"})
    reasons = dict(adapt_mixers(bamba)[1])
    assert "accelerate" in reasons[paths[0]]
    assert "already replaced" in reasons[paths[1]]
    assert "not transformers" in reasons[paths[2]]

    mamba2, paths = _model("mamba2")
    older = mamba2.get_submodule(paths[0])
    cls = type(older)
    older.__class__ = type(cls.__name__, (cls,), {"__module__": cls.__module__, "forward": _older_forward})
    adapted, refused = adapt_mixers(mamba2)
    assert [a.path for a in adapted] == [paths[1]]
    assert refused[0][0] == paths[0] and "cache_position" in refused[0][1]


def _older_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    cache_params: Any = None,
    cache_position: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The signature of Mamba2's mixer in transformers 4.x."""
    raise NotImplementedError


def test_a_transformers_newer_than_the_checked_one_leaves_the_mixers_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A newer release may change a torch path behind the same signature: no adapter, and the report says why."""
    monkeypatch.setattr(mixers, "_transformers_version", lambda: "5.99.0.dev0")
    model, paths = _model("lfm2")
    adapted, refused = adapt_mixers(model)
    assert adapted == [] and [path for path, _ in refused] == list(paths)
    assert "transformers 5.99.0.dev0 is newer than" in refused[0][1]


def test_every_adapted_class_is_in_the_matrix() -> None:
    classes = set()
    for name in MODELS:
        model, paths = _model(name)
        classes |= {type(model.get_submodule(p)).__name__ for p in paths}
    assert classes == set(ADAPTERS)


def _forward(use_cache: bool | None = None, **kwargs: Any) -> None:
    """A causal LM's forward that takes use_cache by name."""


def _forward_kwargs(input_ids: torch.Tensor, **kwargs: Any) -> None:
    """One that takes it through **kwargs (GraniteMoeHybrid's)."""


def test_a_training_call_that_leaves_use_cache_unset_runs_without_a_cache() -> None:
    """Hugging Face configs default to use_cache=True, and the cache a training forward then builds would send every
    mixer call to the class's own forward. An explicit use_cache, an eval call and a forward without one keep theirs."""
    model = nn.Linear(1, 1).train()
    by_name, by_kwargs = inspect.signature(_forward), inspect.signature(_forward_kwargs)
    assert mixers.wants_no_cache(model, by_name, {})
    assert not mixers.wants_no_cache(model, by_name, {"use_cache": True})
    granite = build_hybrid("granite-moe-hybrid")
    assert "use_cache" not in inspect.signature(granite.forward).parameters
    assert mixers.wants_no_cache(granite, inspect.signature(granite.forward), {})
    granite.__class__ = type("Stage", (type(granite),), {"forward": _forward_kwargs})  # a pipeline stage's, say
    assert not mixers.wants_no_cache(granite, by_kwargs, {})  # not Hugging Face's forward: its **kwargs may differ
    assert not mixers.wants_no_cache(model, inspect.signature(lambda input_ids: None), {})
    assert not mixers.wants_no_cache(model.eval(), by_name, {})


def test_mixers_adapted_lists_the_mixers_whose_ops_reach_the_graph() -> None:
    """A module swapped but called with a cache (an eval call that asks for one) runs the class's
    forward: not adapted, with the reason, until a graph holds its ops (a training call: no cache by default)."""
    torch.manual_seed(0)
    config = tf.Lfm2Config(**_small("use_cache"), layer_types=["conv", "full_attention"], conv_L_cache=3)
    assert config.use_cache
    optimized = bsc.optimize(tf.Lfm2ForCausalLM(config).eval())
    path = "model.layers.0.conv"
    assert optimized.mixers_adapted == [] and optimized.mixers_not_adapted == []  # nothing captured yet
    batch = protocol_batch([12], VOCAB, hf=True)
    optimized(**batch, use_cache=True)
    assert optimized.mixers_adapted == [] and optimized.mixers_not_adapted == [(path, mixers.BYPASSED)]
    assert list(optimized.report.token_mixers_left_alone()) == [path]
    optimized.train()(**batch)
    assert [m.path for m in optimized.mixers_adapted] == [path] and optimized.mixers_not_adapted == []
    assert list(optimized.report.mixers_rewritten()) == [path]
