import os

import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow") or os.environ.get("BYTESCALE_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: pass --runslow or set BYTESCALE_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A trainer workspace (tokenizer, prepared data, a Qwen2 config directory) shared by a module's runs."""
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from tests.trainer_runs import make_workspace

    return make_workspace(tmp_path_factory.mktemp("train"))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles from scratch, so compile counts and reports are its own."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def rel_err(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-6) -> float:
    """max |a - b| / max(max |b|, floor) in fp64: relative where b has a scale, absolute below `floor`.

    Every numerical comparison of the suite goes through here. Where b can be 0 in exact arithmetic (the
    dq of a lone token, a window of one), pass the problem's scale as `floor`: b then holds only rounding
    noise, 1.7e-16 on one CPU and 9e-17 on another, and must not be divided by.
    """
    a, b = a.detach().double(), b.detach().double()
    if not b.numel():
        return 0.0
    diff, scale = (a - b).abs().max().item(), b.abs().max().item()
    return diff / max(scale, floor)
