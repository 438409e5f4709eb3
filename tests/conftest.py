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
