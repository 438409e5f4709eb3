"""Hugging Face MoE experts under tensor parallelism, checked without a process group: each layout's placements,
and what cannot be sharded refused by `check_tensor_parallel` (so a job refuses before any work), naming the fix.
The steps themselves: tests/distributed/test_tp_experts.py."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import bytescale_compile as bsc
from bytescale_compile import TensorParallelError
from bytescale_compile.capture.tp_experts import ExpertsStyle
from bytescale_compile.capture.tp_plan import check_tensor_parallel, tp_plan_of
from tests.hf_models import _common, build

transformers = pytest.importorskip("transformers")

EXPERTS = "model.layers.0.mlp.experts"


def _qwen3_moe(**overrides: int) -> nn.Module:
    """A 1-layer Qwen3-MoE (4 experts of intermediate size 32 unless overridden)."""
    torch.manual_seed(0)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, num_hidden_layers=1) | overrides
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**_common(head_dim=16, **moe)))


def _experts_styles(model: nn.Module, tp: int, layout: str) -> dict[str, ExpertsStyle]:
    styles = check_tensor_parallel(model, tp, expert_layout=layout)
    return {path: s for path, s in styles.items() if isinstance(s, ExpertsStyle)}


def _refused(model: nn.Module, tp: int, layout: str, message: str) -> None:
    """Refused by the check, and by `tensor_parallel` before anything is sharded (no process group is needed to
    get this error rather than the one asking for torchrun)."""
    with pytest.raises(TensorParallelError, match=message):
        check_tensor_parallel(model, tp, expert_layout=layout)
    with pytest.raises(TensorParallelError, match=message):
        bsc.tensor_parallel(model, tp, expert_layout=layout)
    assert not any(isinstance(p, DTensor) for p in model.parameters())


def test_expert_parallel_holds_whole_experts_and_tp_experts_split_gate_and_up_alike():
    model = _qwen3_moe()
    ep = _experts_styles(model, 2, "ep")[EXPERTS]
    assert ep.layout == "ep" and ep.num_experts == 4
    assert ep.placements == {"gate_up_proj": Shard(0), "down_proj": Shard(0)}
    split = _experts_styles(model, 2, "tp")[EXPERTS]
    assert split.layout == "tp"
    assert split.placements == {"gate_up_proj": _StridedShard(1, split_factor=2), "down_proj": Shard(2)}
    # gate_up_proj [E, 2I, H] is [gate; up] (the forward chunks it in 2): rank r holds gate and up rows r of each
    gate_up = model.get_submodule(EXPERTS).gate_up_proj.detach()
    gate, up = gate_up.chunk(2, dim=1)
    shards, _ = split.placements["gate_up_proj"]._split_tensor(gate_up, 2, with_padding=False)
    for rank, shard in enumerate(shards):
        assert torch.equal(shard, torch.cat([gate.chunk(2, dim=1)[rank], up.chunk(2, dim=1)[rank]], dim=1))
    # the rest of the layer as Hugging Face's plan has it: attention split by heads, the router replicated
    styles = check_tensor_parallel(model, 2, expert_layout="tp")
    assert "model.layers.0.self_attn.q_proj" in styles and "model.layers.0.mlp.gate" not in styles


def test_auto_layout_is_expert_parallel_where_tp_divides_the_experts_else_tp_experts():
    assert _experts_styles(_qwen3_moe(), 2, "auto")[EXPERTS].layout == "ep"
    assert _experts_styles(_qwen3_moe(num_key_value_heads=4), 4, "auto")[EXPERTS].layout == "ep"
    assert _experts_styles(_qwen3_moe(num_experts=3), 2, "auto")[EXPERTS].layout == "tp"
    assert _experts_styles(_qwen3_moe(num_experts=6, num_key_value_heads=4), 4, "auto")[EXPERTS].layout == "tp"


def test_experts_not_divisible_by_tp_are_refused_under_expert_parallel_suggesting_tp_experts():
    _refused(
        _qwen3_moe(num_experts=3),
        2,
        "ep",
        re.escape(f"experts `{EXPERTS}` (Qwen3MoeExperts): 3 experts are not divisible by tp 2")
        + ".*expert_layout='tp'",
    )


def test_tp_experts_with_an_intermediate_size_tp_does_not_divide_are_refused():
    _refused(
        _qwen3_moe(moe_intermediate_size=33),
        2,
        "tp",
        re.escape(f"experts `{EXPERTS}` (Qwen3MoeExperts): the experts' intermediate size 33 is not divisible by tp 2"),
    )


class _LoopExperts(nn.Module):
    """A user's experts: one nn.Linear pair per expert, which no fused layout shards."""

    def __init__(self, num_experts: int = 4, hidden: int = 64, intermediate: int = 32) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.up = nn.ModuleList(nn.Linear(hidden, intermediate) for _ in range(num_experts))
        self.down = nn.ModuleList(nn.Linear(intermediate, hidden) for _ in range(num_experts))


def test_experts_of_an_unknown_class_are_refused_naming_the_way_out():
    model = _qwen3_moe()
    model.model.layers[0].mlp.experts = _LoopExperts()
    _refused(
        model,
        2,
        "auto",
        re.escape(f"experts `{EXPERTS}` (_LoopExperts): not a Hugging Face experts module this compiler knows")
        + ".*shard it with your own plan or train without tp",
    )


@transformers.integrations.use_experts_implementation(has_post_expert_norm=True)
class _NormedExperts(nn.Module):
    """Fused experts with one norm after each expert's output (Hugging Face's `has_post_expert_norm`, MuseSpark's)."""

    def __init__(self, config: object, num_experts: int = 4, hidden: int = 64, intermediate: int = 32) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, hidden, intermediate))
        self.post_expert_norm = nn.RMSNorm(hidden)


def test_experts_with_a_norm_after_each_expert_are_refused_under_both_layouts():
    model = _qwen3_moe()
    model.model.layers[0].mlp.experts = _NormedExperts(model.config)
    for layout in ("ep", "tp"):
        _refused(
            model,
            2,
            layout,
            re.escape(f"experts `{EXPERTS}` (_NormedExperts): a norm after each expert (has_post_expert_norm)")
            + ".*train this model without tp",
        )


def test_gpt_oss_experts_come_from_the_expert_parallel_plan_and_are_expert_parallel_only():
    model = build("gpt-oss")
    assert tp_plan_of(model)["model.layers.*.mlp.experts"] == "moe_tp_experts"  # from its base_model_ep_plan
    styles = check_tensor_parallel(model, 2)
    ep = styles[EXPERTS]
    assert isinstance(ep, ExpertsStyle) and ep.layout == "ep"
    assert set(ep.placements) == {"gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"}
    assert all(p == Shard(0) for p in ep.placements.values())
    # its plan shards no attention: the sinks stay whole on every TP rank
    assert not any(".self_attn." in path for path in styles)
    _refused(
        model,
        2,
        "tp",
        re.escape(f"experts `{EXPERTS}` (GptOssExperts): TP experts need untransposed experts without biases")
        + ".*expert_layout='ep'",
    )


def test_an_unknown_expert_layout_is_refused():
    with pytest.raises(TensorParallelError, match=r"expert_layout 'expert' is not one of \('auto', 'ep', 'tp'\)"):
        check_tensor_parallel(_qwen3_moe(), 2, expert_layout="expert")
