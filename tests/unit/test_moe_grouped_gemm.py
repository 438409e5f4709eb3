"""Hugging Face MoE experts compile to grouped GEMMs: in bf16 each MoE layer's experts are two
`aten._grouped_mm` calls in the forward graph (torch has no grouped GEMM in inductor for fp32, where Hugging
Face falls back to its own per-expert op), and the compiled step equals the eager one."""

from __future__ import annotations

import re

import torch

import bytescale_compile as bsc
from bytescale_compile.engine.protocol import packed_row
from tests.moe import batch, qwen3_moe

LENGTHS = [20, 12]


def _step(model: torch.nn.Module) -> tuple[float, dict[str, torch.Tensor]]:
    out = model(**packed_row(torch.cat(batch(LENGTHS)), LENGTHS).kwargs(labels=True))
    out.loss.backward()
    return float(out.loss), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


def _grouped_gemms(graph: str) -> int:
    return len(re.findall(r"torch\.ops\.aten\._grouped_mm\.default\(", graph))


def test_bf16_experts_compile_to_two_grouped_gemms_per_layer_and_equal_eager():
    eager = qwen3_moe().to(torch.bfloat16)
    compiled = bsc.optimize(qwen3_moe().to(torch.bfloat16))
    want_loss, want = _step(eager)
    loss, got = _step(compiled)
    gemms = sum(_grouped_gemms(g.forward_graph) for g in compiled.compiled_graphs)
    assert gemms == 2 * eager.config.num_hidden_layers  # gate_up and down of every MoE layer
    tolerance = 2e-2
    assert abs(loss - want_loss) <= tolerance * abs(want_loss)
    assert got.keys() == want.keys()
    for name, g in want.items():
        err = float((got[name] - g).norm() / g.norm().clamp_min(1e-6))
        assert err <= 5 * tolerance, (name, err)
