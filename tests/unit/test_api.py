"""The contracts of optimize(), CompileConfig and the CLI."""

import inspect
import json

import pytest
import torch
from torch import nn

import bytescale_compile as bsc
from bytescale_compile.cli import main
from bytescale_compile.models.llama import LlamaForCausalLM, tiny
from tests.helpers import rel_err


def test_optimize_rejects_non_modules():
    with pytest.raises(TypeError, match="nn.Module instance or subclass.*got str"):
        bsc.optimize("not a module")


@pytest.mark.parametrize(
    "field,value,allowed",
    [
        ("partitioner", "greedy", "default"),
        ("loss_workspace_bytes", 0, ">= 1"),
        ("attention", "yes", "True or False"),
    ],
)
def test_config_validation_names_field_and_allowed_values(field, value, allowed):
    with pytest.raises(ValueError, match=f"CompileConfig.{field}.*{allowed}"):
        bsc.CompileConfig(**{field: value})


def test_unknown_override_lists_known_fields():
    with pytest.raises(ValueError, match="unknown CompileConfig field.*'attentoin'.*allowed"):
        bsc.optimize(tiny(), attentoin=False)


def test_optimized_module_shares_parameters_state_dict_and_signature():
    model = tiny()
    opt = bsc.optimize(model)
    assert isinstance(opt, nn.Module)
    assert [id(p) for p in opt.parameters()] == [id(p) for p in model.parameters()]
    assert list(opt.state_dict()) == list(model.state_dict())
    assert inspect.signature(opt) == inspect.signature(model.forward)
    assert opt.config is model.config  # attributes of the model stay reachable
    other = tiny()
    opt.load_state_dict(other.state_dict())
    assert torch.equal(model.lm_head.weight, other.lm_head.weight)
    opt.eval()
    assert not model.training and not opt.training


def test_decorator_forms():
    @bsc.optimize
    class Plain(LlamaForCausalLM):
        pass

    @bsc.optimize(bsc.CompileConfig(fused_loss=False))
    class WithConfig(LlamaForCausalLM):
        pass

    @bsc.optimize(attention=False)
    class WithOverride(LlamaForCausalLM):
        pass

    cfg = tiny().config
    assert isinstance(Plain, type) and issubclass(Plain, LlamaForCausalLM) and Plain.__name__ == "Plain"
    assert isinstance(Plain(cfg), bsc.OptimizedModule)
    assert WithConfig(cfg).compile_config.fused_loss is False
    assert WithOverride(cfg).compile_config.attention is False
    assert list(inspect.signature(Plain).parameters) == ["cfg"]


@pytest.mark.slow
def test_many_optimized_instances_of_one_class():
    """Every optimize() compiles anew; more than Dynamo's default limit of 8 must still work."""
    for _ in range(9):
        model = tiny()
        optimized = bsc.optimize(model)
        ids = torch.randint(0, 128, (1, 9))
        logits = optimized(ids).logits
        assert optimized.compilations == 1 and logits.shape == (1, 9, 128)
        assert rel_err(logits, model(ids).logits) <= 1e-5


def test_cli_inspect_prints_report(capsys):
    assert main(["inspect", "bytescale_compile.models.llama:tiny", "--seq-len", "64"]) == 0
    out = capsys.readouterr().out
    assert "Pass `attention`: 2 rewritten" in out and "Pass `fused_loss`: 1 rewritten" in out


def test_cli_inspect_json(capsys):
    assert main(["inspect", "bytescale_compile.models.llama:tiny", "--seq-len", "32", "--json", "--no-fused-loss"]) == 0
    report = json.loads(capsys.readouterr().out)
    passes = report["graphs"][0]["passes"]
    assert passes[1]["disabled"] == "CompileConfig.fused_loss=False"


@pytest.mark.parametrize("target", ["bytescale_compile.models.llama:tiny", "tests.helpers:hf_llama"])
def test_cli_inspect_reports_every_pipeline_stage(target, capsys):
    """--pp 2: one compiled stage per decoder layer; each rewrites its own attention, the last fuses the loss."""
    assert main(["inspect", target, "--seq-len", "32", "--pp", "2"]) == 0
    out = capsys.readouterr().out
    first, last = out.split("# Stage 1 of 2")
    assert first.startswith("# Stage 0 of 2: decoder layers 0-0, embedding")
    assert last.startswith(": decoder layers 1-1, final norm, lm_head and loss")
    assert "Pass `attention`: 1 rewritten" in first and "Pass `attention`: 1 rewritten" in last
    assert "Pass `fused_loss`: 1 rewritten" in last and "Pass `fused_loss`: 1 rewritten" not in first
    assert main(["inspect", target, "--pp", "3"]) == 2
    assert "--pp 3: pp_size 3 is larger than the model's 2 decoder layers" in capsys.readouterr().err


@pytest.mark.parametrize(
    "spec,message",
    [
        ("bytescale_compile.models.llama", "MODULE:FACTORY"),
        ("no_such_module:f", "cannot import module"),
        ("bytescale_compile.models.llama:nothing", "no callable"),
    ],
)
def test_cli_bad_target(spec, message, capsys):
    assert main(["inspect", spec]) == 2
    assert message in capsys.readouterr().err


def test_cli_rejects_models_outside_the_protocol(capsys):
    assert main(["inspect", "torch.nn:Identity", "--vocab-size", "10"]) == 2
    assert "does not take" in capsys.readouterr().err


def test_cli_plan_json_is_a_valid_plan(capsys):
    from bytescale_compile.planner import Plan

    assert (
        main(
            [
                "plan",
                "--dataset",
                "github",
                "--global-tokens",
                "2M",
                "--ranks",
                "64",
                "--capacity",
                "8K",
                "--context",
                "256K",
                "--json",
            ]
        )
        == 0
    )
    plan = Plan.from_json(capsys.readouterr().out)
    plan.validate()
    assert plan.strategy == "balance" and plan.world_size == 64


def test_cli_plan_too_long_for_the_cluster(capsys):
    assert main(["plan", "--dataset", "byted", "--global-tokens", "8M", "--ranks", "2", "--capacity", "1K"]) == 2
    assert "more than the" in capsys.readouterr().err


def test_cli_simulate_writes_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    plot, timeline = tmp_path / "t.png", tmp_path / "tl.png"
    assert (
        main(
            [
                "simulate",
                "--dataset",
                "github",
                "--global-tokens",
                "2M",
                "--ranks",
                "64",
                "--context",
                "128K,256K",
                "--strategies",
                "static,balance",
                "--plot",
                str(plot),
                "--timeline",
                str(timeline),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "256K" in out and plot.stat().st_size > 0 and timeline.stat().st_size > 0


def test_cli_profile_writes_a_loadable_cost_model(tmp_path, capsys):
    from bytescale_compile.planner import CostModel

    out = tmp_path / "cost.json"
    assert (
        main(
            [
                "profile",
                "bytescale_compile.models.llama:tiny",
                "--lengths",
                "32,64,128",
                "--min-time",
                "0",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert CostModel.load(out).source == "profiled"


def test_position_ids_of_another_length_than_input_ids_are_refused_before_compiling():
    optimized = bsc.optimize(tiny())
    with pytest.raises(ValueError, match="position_ids has 12 tokens per row but input_ids has 9"):
        optimized(input_ids=torch.zeros(1, 9, dtype=torch.long), position_ids=torch.arange(12)[None])
    assert optimized.compilations == 0
