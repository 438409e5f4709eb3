"""The fused-loss pass on what models put between lm_head and cross-entropy: scales, soft-caps, returned
logits, graph breaks. Fused models equal eager (loss and every gradient); the rest say why they stay eager."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import bytescale_compile as bsc
from tests.helpers import assert_matches_eager, eager_copy, protocol_batch, rel_err

LOSS = "fused_loss"
V, H = 128, 64


def _hf_model(name: str) -> nn.Module:
    """A tiny random Hugging Face causal LM (nothing downloaded), dropout off so eager is deterministic."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    llama_like = dict(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        use_cache=False,
    )
    if name == "granite":
        return transformers.GraniteForCausalLM(transformers.GraniteConfig(**llama_like, logits_scaling=4.0))
    if name == "cohere":
        return transformers.CohereForCausalLM(transformers.CohereConfig(**llama_like, logit_scale=0.3))
    if name == "gemma2":
        return transformers.Gemma2ForCausalLM(
            transformers.Gemma2Config(**llama_like, head_dim=16, final_logit_softcapping=3.0)
        )
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                vocab_size=V,
                n_embd=H,
                n_layer=2,
                n_head=4,
                n_positions=512,
                use_cache=False,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                bos_token_id=0,
                eos_token_id=0,
            )
        )
    if name == "opt":  # without biases: k_proj's has a zero gradient (softmax ignores it), rounding noise to compare
        return transformers.OPTForCausalLM(
            transformers.OPTConfig(
                vocab_size=V,
                hidden_size=H,
                word_embed_proj_dim=H,
                ffn_dim=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=512,
                dropout=0.0,
                attention_dropout=0.0,
                enable_bias=False,
                use_cache=False,
            )
        )
    raise ValueError(name)


# model -> what the fused loss's report detail must say
HF_CASES = {
    "granite": "logit scale=0.25",  # logits / 4
    "cohere": "logit scale=0.3",  # logits * 0.3
    "gemma2": "final soft-cap=3",  # tanh(logits / 3) * 3
    "gpt2": "returned logits",  # past HF's logger.warning_once, which used to break the graph
    "opt": "returned logits (`logits`)",  # lm_head(...).contiguous() is returned
}


SLOW_HF = {"granite", "cohere", "gemma2"}  # 10-17 s each on 2 cores; the Head cases below fold the same patterns fast


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_HF else n for n in HF_CASES])
def test_hf_loss_fused_and_matches_eager(name: str) -> None:
    model = _hf_model(name).train()
    eager = eager_copy(model)
    optimized = bsc.optimize(model)
    assert_matches_eager(optimized, eager, protocol_batch([13, 1, 10], vocab=V, hf=True))
    report = optimized.report
    assert len(report.graphs) == 1, report.to_markdown()
    [rewrite] = report.rewrites(LOSS)
    assert HF_CASES[name] in rewrite.detail, rewrite.detail
    assert not report.skipped(LOSS)


class Head(nn.Module):
    """lm_head + a model-specific `epilogue` on the logits + cross-entropy, HF's way (`.float()`, view)."""

    def __init__(self, epilogue) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lm_head = nn.Linear(8, 12)
        self.register_buffer("cap", torch.tensor(2.0))
        self.epilogue = epilogue

    def forward(self, h: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = self.epilogue(self, self.lm_head(h))
        return F.cross_entropy(logits.float().view(-1, 12), target.view(-1), reduction="sum")


def _graph_break(m: Head, x: torch.Tensor) -> torch.Tensor:
    torch._dynamo.graph_break()
    return x


def _peek(m: Head, x: torch.Tensor) -> torch.Tensor:
    m.peek = x.mean()  # another use of the logits, returned by the graph as a side effect
    return x * 0.5


FUSED = {  # epilogue -> (scale, softcap) it folds to
    "negated half": (lambda m, x: -x / 2, "logit scale=-0.5"),
    "cap 4, inner 1/2": (lambda m, x: torch.tanh(x / 2.0) * 4.0, "logit scale=2, final soft-cap=4"),
    "scaled after a negative cap": (lambda m, x: 3 * (-1.5 * x.tanh()), "logit scale=-4.5, final soft-cap=4.5"),
}
LEFT_EAGER = {  # epilogue -> the reason the report must give
    "scaled by a parameter": (lambda m, x: x * m.lm_head.bias.sum(), "logits scaled by a tensor `"),
    "tensor cap": (lambda m, x: torch.tanh(x / m.cap) * m.cap, "logits soft-capped with a non-constant cap"),
    "two tanh": (lambda m, x: torch.tanh(torch.tanh(x)), "logits go through tanh 2 times"),
    "cast down": (lambda m, x: x.to(torch.float16), "casts the logits from torch.float32 to torch.float16"),
    "softmax": (lambda m, x: x.softmax(-1), "(`.softmax()`); the fused loss takes the lm_head linear through"),
    "used elsewhere": (_peek, "are also used by ['mean'], so they must be materialised"),
    "graph break": (
        _graph_break,
        "split from the loss by a graph break (Call to `torch._dynamo.graph_break()`, at "
        f"{__file__}:{_graph_break.__code__.co_firstlineno + 1} in _graph_break)",
    ),
}


def _run(epilogue) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """Loss and gradients of the optimized and eager `Head(epilogue)`; the optimized module."""
    h, target = torch.randn(1, 7, 8), torch.randint(0, 12, (1, 7))
    target[0, 3] = -100
    model = Head(epilogue)
    optimized, eager = bsc.optimize(model), eager_copy(model)
    for m in (optimized, eager):
        m.zero_grad()
        m(h, target).backward()
    for (name, got), want in zip(model.named_parameters(), eager.parameters()):
        assert rel_err(got.grad, want.grad) <= 1e-5, name
    return optimized, optimized(h, target), eager(h, target)


@pytest.mark.parametrize("name", list(FUSED))
def test_constant_epilogues_fold_into_the_op(name: str) -> None:
    epilogue, detail = FUSED[name]
    optimized, loss, want = _run(epilogue)
    assert rel_err(loss, want) <= 1e-5
    [rewrite] = optimized.report.rewrites(LOSS)
    assert detail in rewrite.detail, rewrite.detail


@pytest.mark.parametrize("name", list(LEFT_EAGER))
def test_unfusable_epilogues_name_what_the_model_does(name: str) -> None:
    epilogue, reason = LEFT_EAGER[name]
    optimized, loss, want = _run(epilogue)
    assert rel_err(loss, want) <= 1e-5
    report = optimized.report
    assert not report.rewrites(LOSS)
    reasons = [s.reason for s in report.skipped(LOSS)]
    assert any(reason in r for r in reasons), reasons
    assert not any(re.search("not a linear layer", r) for r in reasons)
