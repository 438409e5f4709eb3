"""`bytescale-compile memory` on a tiny Hugging Face LLaMA config (compiled once, on the meta device), the
activation figures it reads from the compile report, and the errors it refuses with before compiling."""

from __future__ import annotations

import dataclasses
import io
import os
import subprocess
import sys
from contextlib import redirect_stdout

import pytest
import torch

from bytescale_compile import cli
from bytescale_compile.passes.report import CompileReport, GraphReport, SavedActivation
from bytescale_compile.planner.memory import DEVICE_HEADROOM, FRAGMENTATION, SEGMENT_GRANULES_BYTES, format_bytes
from bytescale_compile.planner.model_shape import ModelShape
from bytescale_compile.train import memory

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    ).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def run(config_dir):
    """One `memory` run (bf16, 4 HDP ranks, 64 MiB) and the model it compiled."""
    compiled, compile_on_meta = [], memory.compile_on_meta

    def capture(model, inputs):
        compiled.append(compile_on_meta(model, inputs))
        return compiled[-1]

    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(memory, "compile_on_meta", capture)
        with redirect_stdout(out):
            rc = cli.main(["memory", str(config_dir), "--dtype", "bf16", "--hdp", "4", "--device-memory", "64M"])
    return rc, out.getvalue(), compiled[0]


def test_memory_prints_the_breakdown_and_capacities(run):
    rc, out, optimized = run
    assert rc == 0
    assert "4 decoder layers" in out
    for part in ("weights", "gradients", "master", "optimizer", "buckets", "total", "workspace"):
        assert part in out
    assert "9.00 bytes/param" in out  # 6 + 12 / 4
    assert "C without offload:" in out and "C with offload:" in out and "longest per rank" in out
    assert next(p for p in optimized.parameters()).device.type == "meta"
    assert len({int(n.split(".")[2]) for n, _ in optimized.named_parameters() if ".layers." in n}) == 2


def test_activation_figures_are_the_sums_of_the_saved_activation_table(run):
    _, _, optimized = run
    report = CompileReport(graphs=optimized.compiled_graphs)
    per_layer, outside = report.activation_bytes_per_token()
    table = [a for a in report.saved_activations if a.alias_of is None]
    assert all(a.bytes_per_token is not None for a in table)
    assert set(per_layer) == {0, 1}
    for layer, total in per_layer.items():
        assert total == sum(a.bytes_per_token for a in table if a.layer == layer)
    assert outside == sum(a.bytes_per_token for a in table if a.layer is None)
    assert sum(per_layer.values()) + outside == sum(a.bytes_per_token for a in table)

    m = memory.memory_model(optimized, total_layers=4, hdp=4, dtype="bf16", budget=64 * 2**20)
    assert m.layer_bytes_per_token == pytest.approx(
        (3 * per_layer[0] + per_layer[1]) / 4
    )  # layer 1 stands for the last
    assert per_layer[0] <= per_layer[1]
    assert m.other_bytes_per_token == outside
    assert m.params == memory.param_counts(optimized).total(4)
    split = memory.memory_model(optimized, total_layers=4, hdp=4, dtype="bf16", tp=2, pp=2)
    assert m.layer_bytes_per_token / 2 < split.layer_bytes_per_token < m.layer_bytes_per_token
    assert (split.layers, split.in_flight) == (2, 2)
    assert split.params < m.params / 2 + memory.param_counts(optimized).embedding


def test_budget_below_static_bytes_exits_2_naming_the_budget(config_dir, capsys):
    rc = cli.main(["memory", str(config_dir), "--dtype", "bf16", "--hdp", "4", "--device-memory", "1M"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "budget of 1.00 MiB (1048576 bytes)" in err and "static bytes" in err and "more HDP ranks" in err


@pytest.mark.parametrize(
    "args, match",
    [
        (["--pp", "5"], "--pp 5 is larger than the model's 4 decoder layers"),
        (["--tp", "3"], "tp 3 does not divide the model's 4 attention heads"),
        (["--device-memory", "lots"], "expected a memory size"),
        (["--zero", "--dtype", "bf16"], "--zero applies to --dtype fp32"),
    ],
)
def test_bad_layouts_exit_2_naming_the_limit(config_dir, capsys, args, match):
    argv = ["memory", str(config_dir), "--device-memory", "80G", *args]
    assert cli.main(argv) == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize(
    "target, match",
    [
        ("bytescale_compile.units:parse_size", "failed building its model"),
        ("no_such_module_here:model", "cannot import module"),
        ("nothing", "neither a directory nor MODULE:FACTORY"),
    ],
)
def test_bad_targets_exit_2(capsys, target, match):
    assert cli.main(["memory", target, "--device-memory", "80G"]) == 2
    assert match in capsys.readouterr().err


def test_memory_sizes_and_devices():
    assert memory.parse_memory("80G") == memory.parse_memory("80GiB") == memory.parse_memory("80 GB") == 80 * 2**30
    assert memory.parse_memory("141g") == 141 * 2**30
    assert memory.parse_memory("1.5T") == 3 * 2**39
    assert memory.parse_memory("1000") == 1000
    with pytest.raises(ValueError, match="80G"):
        memory.parse_memory("80 gigs")
    with pytest.raises(ValueError, match="--memory-budget"):
        memory.device_memory("cpu")
    assert format_bytes(3 * 2**30) == "3.00 GiB"


def test_mean_layer_weighs_the_last_listed_layer_as_the_models_last():
    assert memory._mean_layer({0: 100.0, 1: 100.0, 2: 130.0}, 3) == pytest.approx(110.0)  # all listed: the mean
    assert memory._mean_layer({0: 100.0, 1: 130.0}, 31) == pytest.approx((30 * 100 + 130) / 31)
    assert memory._mean_layer({0: 100.0}, 8) == 100.0
    assert memory._mean_layer({}, 8) == 0.0


def test_fused_loss_workspace_counts_one_chunk_the_hidden_gradient_and_a_head_gradient_outside_the_buffer():
    vocab, hidden = 1000, 64
    bf16 = memory.loss_workspace(vocab, hidden, compute_bytes=2)
    # 4,096 tokens: T·H/V = 262.1, so the smallest chunk, 1,024 tokens of bf16 logits and their fp32 copy
    assert bf16.bytes(4096) == 1024 * vocab * (2 + 4) + 4096 * hidden * 2
    fp32 = memory.loss_workspace(vocab, hidden, compute_bytes=4, head_grad_bytes=vocab * hidden * 4, tp=2)
    assert fp32.bytes(4096) == 1024 * (vocab // 2) * 4 + 4096 * hidden * 4 + vocab * hidden * 4 // 2


def test_a_layers_backward_holds_four_mlp_intermediates_and_two_hidden_gradients():
    shape = ModelShape(name="s", layers=2, hidden=64, heads=4, kv_heads=2, ffn=176, vocab=1000)
    assert memory.layer_backward_bytes_per_token(shape, compute_bytes=2) == (4 * 176 + 2 * 64) * 2
    assert memory.layer_backward_bytes_per_token(shape, compute_bytes=4, tp=2) == (4 * 176 / 2 + 2 * 64) * 4
    moe = dataclasses.replace(shape, experts=8, top_k=2)
    assert memory.layer_backward_bytes_per_token(moe, compute_bytes=2) == (4 * 176 * 2 + 2 * 64) * 2


def test_the_budget_is_free_memory_plus_what_the_allocator_already_reserves(monkeypatch):
    """Read before the model is on the device, free memory (total less the context and other processes); after,
    the allocator's reserved bytes come back into it, so both readings give the same budget."""
    calls = []

    def mem_get_info(device):
        calls.append(device)
        return 100 * 2**30, 140 * 2**30

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 0)
    assert memory.device_memory("cuda:1") == 100 * 2**30
    assert calls == [torch.device("cuda:1")]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * 2**30, 140 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 40 * 2**30)
    assert memory.device_memory("cuda:1") == 100 * 2**30


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({}, False),
        ({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, True),
        ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:128, expandable_segments:true"}, True),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, True),
        (
            {"PYTORCH_ALLOC_CONF": "expandable_segments:False", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
            False,
        ),
    ],
)
def test_expandable_segments_is_read_from_the_allocator_settings(environ, expected):
    assert memory.expandable_segments(environ) is expected
    # a plan for a trainer's run: the trainer sets expandable segments when nothing is set
    assert memory.trainer_expandable_segments(environ) is (expected or not environ)


def test_the_allocator_terms_follow_the_device_and_expandable_segments():
    """Fragmentation and granules for a model planned for CUDA (meta), by expandable segments; none on the CPU."""
    hidden = SavedActivation("x", "(1, s0, 64)", "float32", 256, 0, "layers.0.norm", "resident")
    cpu = _with_graphs([GraphReport(0, saved_activations=[hidden])])
    m = memory.memory_model(cpu, total_layers=2, hdp=1, dtype="fp32", budget=2**30)
    assert (m.fragmentation, m.workspace_bytes) == (0.0, round(DEVICE_HEADROOM * 2**30))
    meta = _with_graphs([GraphReport(0, saved_activations=[hidden])]).to("meta")
    for expandable in (True, False):
        m = memory.memory_model(meta, total_layers=2, hdp=1, dtype="fp32", budget=2**30, expandable=expandable)
        assert m.fragmentation == FRAGMENTATION[expandable]
        assert m.workspace_bytes == round(DEVICE_HEADROOM * 2**30) + SEGMENT_GRANULES_BYTES


def test_models_with_quadratic_or_no_saved_activations_are_refused():
    def fake(*saved: SavedActivation, note: str = "") -> torch.nn.Module:
        return _with_graphs([GraphReport(0, saved_activations=list(saved), saved_activations_note=note)])

    scores = SavedActivation("softmax", "(1, 4, s0, s0)", "float32", None, 0, "layers.0.attn", "resident")
    hidden = SavedActivation("x", "(1, s0, 64)", "float32", 256, 0, "layers.0.norm", "resident")
    with pytest.raises(ValueError, match=r"square of the tokens \(`softmax` \(1, 4, s0, s0\)"):
        memory.memory_model(fake(hidden, scores), total_layers=2, hdp=1, dtype="fp32")
    with pytest.raises(ValueError, match="no saved activations .inference graph"):
        memory.memory_model(fake(note="inference graph"), total_layers=2, hdp=1, dtype="fp32")
    m = memory.memory_model(fake(hidden), total_layers=2, hdp=1, dtype="fp32")
    assert (m.layer_bytes_per_token, m.other_bytes_per_token, m.params) == (256, 0, 6)
    with pytest.raises(ValueError, match="has not been compiled"):
        memory.memory_model(_with_graphs([]), total_layers=2, hdp=1, dtype="fp32")
    with pytest.raises(ValueError, match="not an optimize"):
        memory.memory_model(torch.nn.Linear(2, 2), total_layers=2, hdp=1, dtype="fp32")


def _with_graphs(graphs: list[GraphReport]) -> torch.nn.Module:
    """A module with 6 parameters standing for a compiled model whose compile report is `graphs`."""
    module = torch.nn.Linear(2, 2)
    module.compiled_graphs = graphs
    return module


_ENTRY = """
import logging, os
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
from bytescale_compile.train.__main__ import main
try:
    main(["--no-such-option"])
except SystemExit:
    pass
print("PYTORCH_ALLOC_CONF=" + os.environ.get("PYTORCH_ALLOC_CONF", "-"))
"""


@pytest.mark.parametrize(
    "given, expected, logged",
    [
        ({}, "expandable_segments:True", True),
        ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:256"}, "max_split_size_mb:256", False),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, "-", False),
    ],
)
def test_the_trainer_sets_expandable_segments_unless_the_user_set_the_allocator(given, expected, logged):
    """In a fresh process (CUDA's state in this one is irrelevant): the entry point sets the variable before torch
    is imported, says so once at INFO, and leaves a user's setting (either name) alone."""
    env = {k: v for k, v in os.environ.items() if k not in memory.ALLOC_CONF_VARIABLES} | given
    done = subprocess.run([sys.executable, "-c", _ENTRY], env=env, capture_output=True, text=True, timeout=120)
    assert f"PYTORCH_ALLOC_CONF={expected}" in done.stdout, done.stdout + done.stderr
    said = "set PYTORCH_ALLOC_CONF=expandable_segments:True" in done.stderr
    assert said is logged, done.stderr
    assert memory.expandable_segments({"PYTORCH_ALLOC_CONF": expected}) is (expected == "expandable_segments:True")


def test_a_preset_is_counted_not_compiled_with_its_experts_split_over_tp(capsys, monkeypatch):
    """`memory mistral-8x7b --tp 8 --pp 4`: the paper's layout from the preset's counts; nothing is compiled."""
    monkeypatch.setattr(memory, "compile_on_meta", lambda *a: pytest.fail("a preset must not be compiled"))
    argv = ["memory", "mistral-8x7b", "--tp", "8", "--pp", "4", "--hdp", "384", "--dtype", "bf16"]
    assert cli.main([*argv, "--device-memory", "48G"]) == 0
    out = capsys.readouterr().out
    layer = (2 * 4096 * 4096 + 2 * 4096 * 1024 + 8 * 3 * 4096 * 14336) // 8 + 4096 * 8 + 2 * 4096
    assert f"{8 * layer + 32000 * 4096 // 8 + 4096:,} parameters per device" in out
    assert "experts: 1 whole expert (layout ep), router replicated, top-2 routing" in out
    assert "x 8 layers" in out and "4 micro-batches in flight" in out and "C with offload:" in out
    assert cli.main([*argv, "--expert-layout", "tp", "--device-memory", "48G"]) == 0
    assert "1/8 of each of 8 experts (layout tp)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, match",
    [
        (["mistral-8x7b", "--tp", "16", "--expert-layout", "ep"], "8 experts are not divisible by tp 16"),
        (["mistral-8x7b", "--pp", "33"], "pp 33 is larger than mistral-8x7b's 32 decoder layers"),
        (["mistral-8x7b", "--tp", "3"], "tp 3 does not divide its 32 attention heads"),
        (["llama-7b", "--tp", "2", "--expert-layout", "ep"], "'ep' needs an MoE model"),
        (["mistral-8x22b", "--tp", "8", "--pp", "4"], "does not hold this rank's static bytes"),
    ],
)
def test_bad_preset_layouts_exit_2_naming_the_fix(capsys, args, match):
    assert cli.main(["memory", *args, "--device-memory", "48G"]) == 2
    assert match in capsys.readouterr().err


def test_the_expert_layout_is_refused_for_a_compiled_model(config_dir, capsys):
    assert cli.main(["memory", str(config_dir), "--expert-layout", "tp", "--device-memory", "80G"]) == 2
    assert "--expert-layout applies to a preset shape" in capsys.readouterr().err


def test_a_compiled_moe_whose_experts_saved_nothing_says_so(tmp_path, capsys, run):
    """On the meta device the experts' data-dependent routing runs none of them: the figures would leave their
    activations out without a word. A dense model gets no note."""
    from transformers import MixtralConfig

    MixtralConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=128,
    ).save_pretrained(tmp_path)
    assert cli.main(["memory", str(tmp_path), "--dtype", "bf16", "--device-memory", "1G"]) == 0
    assert "note: 4 experts, top-2: the compile report lists no saved activation of the experts" in (
        capsys.readouterr().out
    )
    assert "note:" not in run[1]
