"""The trainer on a Hugging Face MoE config directory with `--tp`: a run cut at a checkpoint on one TP size and
resumed on another (the experts resharded by name and global shape, in either expert layout) gives the losses and
weights of one process trained throughout, and its `final/` loads with `from_pretrained`, holding the trainer's
weights. Bad MoE settings are refused before any work."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

from bytescale_compile.train.__main__ import main
from bytescale_compile.train.checkpoint import load_model_weights
from tests.helpers import rel_err
from tests.trainer_runs import Workspace, run_losses, run_trainer, train_args

transformers = pytest.importorskip("transformers")

STEPS = 3
SMALL = ("--global-tokens", "512", "--capacity", "512", "--max-len", "256", "--decay-steps", str(STEPS))
"""One micro-batch of a few short sequences a step: the MoE layers' routing, not the planner, is under test."""
WEIGHT_TOL = 1e-4
"""Three AdamW steps of lr 1e-3 after gradients summed in another order (TP's all-reduces): each step divides by the
moments' root, which turns a gradient's rounding into up to a step of the weight's own size where it is tiny."""


def _moe_dir(workspace: Workspace, name: str, experts: int) -> Workspace:
    """The workspace with a tiny Qwen3-MoE config directory (`experts` experts, top 2, the load-balancing loss on)."""
    path = workspace.model.parent / name
    transformers.Qwen3MoeConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=experts,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.1,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    ).save_pretrained(path)
    return dataclasses.replace(workspace, model=path)


@pytest.fixture(scope="module")
def moe(workspace: Workspace) -> Workspace:
    return _moe_dir(workspace, "qwen3_moe", 4)


@pytest.fixture(scope="module")
def one_process(moe: Workspace, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run every cut-and-resumed one must equal: tp 1 in one process, all the steps."""
    out = tmp_path_factory.mktemp("moe") / "one"
    assert main(train_args(moe, out, *SMALL, "--steps", str(STEPS))) == 0
    return out


def _train(ws: Workspace, out: Path, tp: int, *extra: str) -> str:
    """A run with `--tp tp` on tp processes (the trainer's own launcher; in this process for tp 1); its output."""
    args = train_args(ws, out, *SMALL, "--tp", str(tp), *extra)
    if tp == 1:
        assert main(args) == 0
        return ""
    return run_trainer([sys.executable, "-m", "bytescale_compile.train", "--nproc-per-node", str(tp), *args])


def _cut_and_resume(ws: Workspace, out: Path, before: int, after: int, layout: str) -> str:
    """Steps 1-2 on tp `before`, a checkpoint (the final/ of those steps checked against it), then step 3 resumed on
    tp `after`; the resume's output."""
    cut = ("--steps", "2", "--checkpoint-every", "2", "--expert-layout", layout)
    _train(ws, out, before, *cut)
    _assert_final_is_the_checkpoint(out, 2)
    return _train(ws, out, after, "--steps", str(STEPS), "--resume", "--expert-layout", layout)


def _final(run: Path) -> dict[str, object]:
    model = transformers.AutoModelForCausalLM.from_pretrained(run / "final", local_files_only=True)
    return dict(model.state_dict())


def _assert_resumed_like_one_process(run: Path, one_process: Path) -> None:
    np.testing.assert_allclose(run_losses(run), run_losses(one_process), rtol=1e-5, atol=0)
    final, reference = _final(run), _final(one_process)
    assert final.keys() == reference.keys()
    errors = {name: rel_err(final[name], reference[name]) for name in final}
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] <= WEIGHT_TOL, (worst, errors[worst])


def _assert_final_is_the_checkpoint(run: Path, step: int) -> None:
    """final/ (gathered from the TP shards by the trainer) holds the weights its last checkpoint holds (DCP, by
    name and global shape), exactly."""
    final = _final(run)
    config = transformers.AutoConfig.from_pretrained(run / "final", local_files_only=True)
    saved = transformers.AutoModelForCausalLM.from_config(config)
    load_model_weights(run / "checkpoints" / f"step_{step:08d}", saved)
    for name, tensor in saved.state_dict().items():
        assert (final[name] == tensor).all(), name


@pytest.mark.slow  # by default tests/distributed/test_tp_experts.py steps an MoE on TP 2 x HDP 2
@pytest.mark.parametrize("layout", ["ep", "tp"])
def test_moe_on_tp2_resumed_on_tp1_equals_one_process(moe, one_process, tmp_path, layout, capsys):
    """Cut on tp 2 (2 processes) with the experts in `layout`, its final/ gathered from the TP shards equal to its
    checkpoint, resumed on tp 1 (1 process)."""
    _cut_and_resume(moe, tmp_path / "run", 2, 1, layout)
    assert "tp: 2 -> 1 (topology: the checkpoint is resharded)" in capsys.readouterr().out
    _assert_resumed_like_one_process(tmp_path / "run", one_process)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final", local_files_only=True)
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape == (4, 64, 64)  # whole, not a shard


@pytest.mark.slow
def test_moe_on_tp1_resumed_on_tp2_equals_one_process(moe, one_process, tmp_path):
    """Cut on tp 1, resumed on tp 2 with every expert split (the strided gate/up loaded in place); the run's final/,
    gathered from the TP shards, is the weights of its last checkpoint."""
    output = _cut_and_resume(moe, tmp_path / "run", 1, 2, "tp")
    assert "tp: 1 -> 2 (topology: the checkpoint is resharded)" in output
    _assert_resumed_like_one_process(tmp_path / "run", one_process)
    _assert_final_is_the_checkpoint(tmp_path / "run", STEPS)


def _error(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(args) == 2
    return capsys.readouterr().err


def test_moe_tensor_parallel_settings_that_cannot_run_are_refused_before_any_work(
    workspace, moe, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "out"
    monkeypatch.setenv("WORLD_SIZE", "2")  # as the launcher sets it: the process count passes
    three = _moe_dir(workspace, "qwen3_moe_3", 3)
    err = _error(train_args(three, out, "--tp", "2", "--expert-layout", "ep"), capsys)
    assert "3 experts are not divisible by tp 2" in err and "--expert-layout tp" in err
    err = _error(train_args(moe, out, "--tp", "2", "--expert-layout", "all"), capsys)
    assert "expert_layout must be one of ['auto', 'ep', 'tp'], got 'all'" in err
    assert not out.exists()
