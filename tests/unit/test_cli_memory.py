"""`bytescale-compile memory` on a tiny Hugging Face LLaMA config (compiled once, on the meta device), the
activation figures it reads from the compile report, and the errors it refuses with before compiling."""

from __future__ import annotations

import io
from contextlib import redirect_stdout

import pytest
import torch

from bytescale_compile import cli
from bytescale_compile.passes.report import CompileReport, GraphReport, SavedActivation
from bytescale_compile.planner.memory import format_bytes
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


def test_fused_loss_workspace_counts_the_head_gradient_and_one_chunk():
    vocab, hidden = 1000, 64
    expected = vocab * hidden * (4 + 2) + 2 * 1024 * vocab * 4
    assert memory.loss_workspace_bytes(vocab, hidden, weight_bytes=2) == expected
    assert memory.loss_workspace_bytes(vocab, hidden, weight_bytes=2, tp=2) == expected // 2


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
