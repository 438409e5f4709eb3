"""The contracts of optimize() and CompileConfig."""

import inspect

import pytest
import torch
from torch import nn

import bytescale_compile as bsc
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


def test_position_ids_of_another_length_than_input_ids_are_refused_before_compiling():
    optimized = bsc.optimize(tiny())
    with pytest.raises(ValueError, match="position_ids has 12 tokens per row but input_ids has 9"):
        optimized(input_ids=torch.zeros(1, 9, dtype=torch.long), position_ids=torch.arange(12)[None])
    assert optimized.compilations == 0


def test_optimize_of_none_is_an_error_not_a_decorator():
    with pytest.raises(TypeError, match="got NoneType None"):
        bsc.optimize(None)
    assert callable(bsc.optimize()) and callable(bsc.optimize(fused_loss=False))


def test_every_public_name_still_imports_from_the_package():
    for name in bsc.__all__:
        assert getattr(bsc, name) is not None
    from bytescale_compile import CompileConfig, optimize  # noqa: F401

    assert set(bsc.__all__) <= set(dir(bsc))
    with pytest.raises(AttributeError, match="no_such_name"):
        bsc.no_such_name  # noqa: B018
