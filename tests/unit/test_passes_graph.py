"""The clean-up after the passes never removes a mutation, in the top graph or in any graph it calls."""

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.utils.checkpoint import checkpoint

import bytescale_compile as bsc
from bytescale_compile.passes.graph import eliminate_dead_code
from tests.helpers import assert_matches_eager, eager_copy, protocol_batch, rel_err


class ScatterAddBackward(torch.autograd.Function):
    """PhiMoE's router estimator in small: the backward adds the output gradient at `index` in place."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        return x * 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (index,) = ctx.saved_tensors
        grad_x = grad * 2
        grad_x.scatter_add_(-1, index, grad)
        return grad_x, None


class ProjectAttend(nn.Module):
    """A projection, `body` on the heads, causal SDPA (which the attention pass rewrites) and a sum."""

    def __init__(self, body: str):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.body = body

    def forward(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        q = self.proj(x).view(1, -1, 2, 4).transpose(1, 2)
        if self.body == "autograd.Function":
            q = ScatterAddBackward.apply(q, index)
        else:
            q = checkpoint(self.scaled_in_place, q, use_reentrant=False)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True).sum()

    @staticmethod
    def scaled_in_place(q: torch.Tensor) -> torch.Tensor:
        y = q * 1.0
        y.mul_(3)
        return y


@pytest.mark.parametrize("body", ["autograd.Function", "checkpoint"])
def test_mutation_in_nested_graph_survives_clean_up(body):
    torch.manual_seed(0)
    model = ProjectAttend(body)
    eager = eager_copy(model)
    optimized = bsc.optimize(model)
    x, index = torch.randn(1, 6, 8), torch.randint(0, 4, (1, 2, 6, 1))
    optimized(x, index).backward()
    eager(x, index).backward()
    assert len(optimized.report.rewrites("attention")) == 1
    for (name, p), ref in zip(optimized.named_parameters(), eager.parameters()):
        assert rel_err(p.grad, ref.grad) <= 1e-5, name


def _graph_with_dead_mutations() -> tuple[fx.GraphModule, list[str]]:
    """Every in-place form whose result nothing reads, plus one dead pure op."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    buf = graph.call_function(torch.zeros, (4,))
    kept = [
        graph.call_method("add_", (buf, 1.0)),
        graph.call_function(torch.Tensor.mul_, (buf, 2.0)),
        graph.call_function(torch.ops.aten.add_.Tensor, (buf, x)),
        graph.call_function(operator.iadd, (buf, x)),
        graph.call_function(operator.setitem, (buf, 0, 5.0)),
        graph.call_method("__setitem__", (buf, 1, 6.0)),
        graph.call_function(torch.add, (x, x), {"out": buf}),
    ]
    graph.call_function(torch.neg, (x,))
    graph.output(buf)
    return fx.GraphModule(nn.Module(), graph), [n.name for n in kept]


def test_every_in_place_form_is_kept():
    gm, kept = _graph_with_dead_mutations()
    x = torch.arange(4.0)
    expected = gm(x)
    assert eliminate_dead_code(gm)
    names = [n.name for n in gm.graph.nodes]
    assert set(kept) <= set(names) and "neg" not in names
    assert torch.equal(gm(x), expected)


def test_unused_higher_order_op_with_pure_body_is_removed():
    """Keeping mutations must not keep everything: a dead HOP whose body is pure still goes."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    @torch.compile(backend=backend, fullgraph=True)
    def f(x):
        checkpoint(torch.sin, x, use_reentrant=False)
        return x + 1

    f(torch.randn(3, requires_grad=True))
    (gm,) = graphs
    hops = [n for n in gm.graph.nodes if isinstance(n.target, torch._ops.HigherOrderOperator)]
    assert hops and eliminate_dead_code(gm)
    assert not any(isinstance(n.target, torch._ops.HigherOrderOperator) for n in gm.graph.nodes)


def phimoe():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.PhimoeConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        max_position_embeddings=512,
        use_cache=False,
    )
    return transformers.PhimoeForCausalLM(cfg)


def same_expert_samples(module: nn.Module, args: tuple) -> None:
    """Training-mode PhiMoE samples its experts (Gumbel): both runs draw from the same seed."""
    torch.manual_seed(1)


@pytest.mark.slow
def test_phimoe_router_gradient_matches_eager():
    """The router's sparsemixer backward is an autograd.Function with an in-place scatter_add_."""
    model = phimoe()
    eager = eager_copy(model)
    optimized = bsc.optimize(model)
    for m in (optimized, eager):
        m.register_forward_pre_hook(same_expert_samples)
    assert_matches_eager(optimized, eager, protocol_batch([7, 5, 9], vocab=128, hf=True))
    assert len(optimized.report.rewrites("attention")) == 2
