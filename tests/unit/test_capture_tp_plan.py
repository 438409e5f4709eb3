"""Tensor-parallel plans checked in one process: which plan a model has, and what is refused before any sharding."""

from __future__ import annotations

import re

import pytest
import torch

import bytescale_compile as bsc
from bytescale_compile import TensorParallelError
from bytescale_compile.capture.tp_plan import GradAllReduce, check_tensor_parallel, tp_plan_of
from bytescale_compile.models.llama import tiny
from tests.helpers import hf_llama
from tests.hf_models import build


def test_plans_come_from_hugging_face_configs_and_our_llama():
    hf = tp_plan_of(hf_llama())
    assert hf["model.layers.*.self_attn.q_proj"] == "colwise" and hf["lm_head"] == "colwise_gather_output"
    ours = check_tensor_parallel(tiny(), 2)
    assert type(ours["layers.1.self_attn.o_proj"]).__name__ == "RowwiseParallel"
    assert type(ours["lm_head"]).__name__ == "ColwiseParallel" and len(ours) == 2 * 7 + 1


def test_per_head_norms_are_marked_for_a_gradient_sum():
    styles = check_tensor_parallel(build("qwen3"), 2)
    assert isinstance(styles["model.layers.0.self_attn.q_norm"], GradAllReduce)
    assert isinstance(styles["model.layers.1.self_attn.k_norm"], GradAllReduce)


def test_what_cannot_be_split_evenly_is_refused_naming_the_layer_and_both_numbers():
    model = hf_llama()
    model.config.num_key_value_heads = 1
    with pytest.raises(
        TensorParallelError, match=re.escape("`model.layers.0.self_attn`: 1 KV heads are not divisible by tp 2")
    ):
        check_tensor_parallel(model, 2)
    with pytest.raises(TensorParallelError, match="4 attention heads are not divisible by tp 3"):
        check_tensor_parallel(hf_llama(), 3)
    with pytest.raises(TensorParallelError, match=r"module `mlp`: dimension 6 of its weight \(6, 4\) is not divisible"):
        check_tensor_parallel(torch.nn.ModuleDict({"mlp": torch.nn.Linear(4, 6)}), 4, plan={"mlp": "colwise"})
    with pytest.raises(TensorParallelError, match="Sequential has no known tensor-parallel plan"):
        check_tensor_parallel(torch.nn.Sequential(torch.nn.Linear(4, 4)), 2)
    with pytest.raises(
        TensorParallelError, match=r"experts `model.layers.0.mlp` \(LlamaMLP\): not a Hugging Face experts module"
    ):
        check_tensor_parallel(hf_llama(), 2, plan={"model.layers.*.mlp": "moe_tp_experts"})


def test_tied_embeddings_stay_replicated():
    model = build("gemma2")  # ties lm_head to the embedding
    assert model.lm_head.weight is model.model.embed_tokens.weight
    styles = check_tensor_parallel(model, 2, plan={**tp_plan_of(model), "lm_head": "colwise_gather_output"})
    assert "lm_head" not in styles and "model.layers.0.self_attn.q_proj" in styles


def test_a_model_sharded_by_hugging_faces_tp_plan_is_refused():
    model = hf_llama()
    model._tp_size = 2  # what from_pretrained(tp_plan="auto") sets
    with pytest.raises(TensorParallelError, match=r"sharded by Hugging Face's tp_plan \(tp_size 2\)"):
        bsc.optimize(model)
