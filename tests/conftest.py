import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# Property tests run without a deadline (compilation and a loaded machine make timings noise). With `CI` set
# (`.ci/run` sets it) every run draws the same cases, with no example database and no health check on slow
# generation, so a CI result depends on the code alone; elsewhere each run draws new cases and replays the
# failures saved in `.hypothesis/`. A test sets only its own `max_examples`.
_DEFAULT = settings.get_profile("default")
"""Hypothesis' own defaults, not its built-in "ci" profile, which it loads by itself wherever `CI` is set."""
settings.register_profile("dev", _DEFAULT, deadline=None)
settings.register_profile(
    "ci",
    _DEFAULT,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.load_profile("ci" if os.environ.get("CI", "").lower() not in ("", "0", "false") else "dev")


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


@pytest.fixture
def saved_run(tmp_path):
    """A run's config.toml as `run` writes it, over a small dataset of ids for the tiny preset."""
    from tests.checkpoints import saved_tiny_run

    return saved_tiny_run(tmp_path)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles from scratch, so compile counts and reports are its own."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()
