"""The mask proof reads HF's packed causal mask whichever way Dynamo records its operators: torch 2.13 records
`a == b` on tensors as `call_function operator.eq`, torch 2.11 as `call_method __eq__` (seen on the lent H100's
torch 2.11, where every site was left alone before `is_call` took dunder methods)."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import fx

from bytescale_compile.passes.graph import is_call
from bytescale_compile.passes.masks import prove_causal_mask
from tests.helpers import hf_llama

_DUNDERS = {
    operator.eq: "__eq__",
    operator.and_: "__and__",
    operator.le: "__le__",
    operator.gt: "__gt__",
    operator.ne: "__ne__",
    operator.sub: "__sub__",
}


def _mask_of_first_attention(model: torch.nn.Module, seq_lens: list[int]) -> fx.Node:
    """The attn_mask node of the first SDPA call in the graph Dynamo captures for a packed row."""
    captured: list[fx.GraphModule] = []

    def backend(gm: fx.GraphModule, example_inputs: list) -> object:
        captured.append(gm)
        return gm.forward

    ids = torch.randint(0, 128, (1, sum(seq_lens)))
    positions = torch.cat([torch.arange(n) for n in seq_lens])[None]
    torch._dynamo.reset()
    torch.compile(model, backend=backend)(input_ids=ids, position_ids=positions)
    sdpa = next(n for gm in captured for n in gm.graph.nodes if n.target is F.scaled_dot_product_attention)
    return sdpa.kwargs["attn_mask"]


def _as_methods(graph: fx.Graph) -> None:
    """Record every comparison, `&` and `-` as torch 2.11 does: call_method of the dunder."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _DUNDERS:
            with graph.inserting_before(node):
                method = graph.call_method(_DUNDERS[node.target], node.args, node.kwargs)
            node.replace_all_uses_with(method)
            graph.erase_node(node)


def test_dunder_methods_count_as_their_operators():
    graph = fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    assert is_call(graph.call_method("__eq__", (x, y)), operator.eq, torch.eq)
    assert is_call(graph.call_method("__and__", (x, y)), operator.and_)
    assert not is_call(graph.call_method("__eq__", (x, y)), torch.eq)  # only `operator` targets have dunders
    assert not is_call(graph.call_method("__rsub__", (x, 1)), operator.sub, torch.sub)  # operands swapped


def test_packed_causal_mask_is_proved_when_recorded_as_methods():
    pytest.importorskip("transformers")
    mask = _mask_of_first_attention(hf_llama(1).eval(), [5, 7, 4])
    assert prove_causal_mask(mask).positions is not None
    _as_methods(mask.graph)
    assert any(n.op == "call_method" and n.target == "__eq__" for n in mask.graph.nodes)
    mask = next(n for n in mask.graph.nodes if n.target is F.scaled_dot_product_attention).kwargs["attn_mask"]
    proved = prove_causal_mask(mask)
    assert proved.positions is not None and proved.window is None
