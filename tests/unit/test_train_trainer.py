"""The trainer's setup: a resume's settings compared with the saved config.toml (refused, accepted with
--allow-config-change, never for the model). `saved_run` is in tests/conftest.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from bytescale_compile.train.checkpoint import COMPLETE_MARKER
from bytescale_compile.train.config import ConfigError, TrainConfig, load_config, to_toml
from bytescale_compile.train.inputs import CONFIG_FILE, setup


@pytest.fixture
def resumable(saved_run: TrainConfig) -> TrainConfig:
    """`saved_run` with a (marked complete) checkpoint to resume: what `setup` compares settings for."""
    marker = Path(saved_run.out) / "checkpoints" / "step_00000002" / COMPLETE_MARKER
    marker.parent.mkdir(parents=True)
    marker.write_text("step 2\n")
    return saved_run


def test_changed_settings_are_listed_and_refused(resumable: TrainConfig) -> None:
    saved_run = resumable
    changed = replace(saved_run, resume=True, global_tokens=512, seed=1, lr=2e-3)
    with pytest.raises(ConfigError) as info:
        setup(changed)
    message = str(info.value)
    for line in ("global_tokens: 256 -> 512", "seed: 0 -> 1", "lr: 0.001 -> 0.002"):
        assert line in message
    assert "--allow-config-change" in message and str(Path(saved_run.out) / CONFIG_FILE) in message


def test_allow_config_change_accepts_and_reports_them(resumable: TrainConfig) -> None:
    saved_run = resumable
    changed = replace(saved_run, resume=True, seed=1, allow_config_change=True)
    assert setup(changed).config_changes == ("seed: 0 -> 1",)
    assert "allow_config_change =" not in to_toml(changed)  # a switch of one invocation, never saved
    assert load_config(Path(saved_run.out) / CONFIG_FILE) == replace(saved_run, decay_steps=4)  # saved resolved
    longer = setup(replace(saved_run, resume=True, steps=8, checkpoint_every=2))
    assert longer.config_changes == () and longer.config.decay_steps == 4  # running further keeps the schedule
    with pytest.raises(ConfigError, match=r"decay_steps: 4 -> 8"):
        setup(replace(saved_run, resume=True, steps=8, decay_steps=8))  # a schedule set anew is a change


def test_model_change_is_refused_even_when_allowed(resumable: TrainConfig) -> None:
    saved_run = resumable
    other = replace(
        saved_run, resume=True, model="bytescale_compile.models.llama:tiny", seed=1, allow_config_change=True
    )
    with pytest.raises(
        ConfigError,
        match=r"cannot change model: 'tiny' -> 'bytescale_compile\.models\.llama:tiny'(.|\n)*"
        r"All differences:(.|\n)*seed: 0 -> 1",
    ):
        setup(other)
