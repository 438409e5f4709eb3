"""The training run's pieces that need no training: the TOML config and its writer, the command line, the
learning-rate schedule and AdamW's parameter groups."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch import nn

from bytescale_compile.engine.optim import LRSchedule, build_optimizer, param_groups
from bytescale_compile.models.llama import tiny
from bytescale_compile.train.__main__ import build_parser
from bytescale_compile.train.config import ConfigError, TrainConfig, check_resume_config, load_config, to_toml

REQUIRED = {"model": "tiny", "data": "corpus"}


def test_toml_round_trip(tmp_path):
    config = load_config(
        None,
        **REQUIRED,
        out='runs/"quoted" \\ näme',
        global_tokens="16K",
        lr=2e-5,
        decay_steps=7,
        resume=True,
        cost_model="c.json",
    )
    (tmp_path / "config.toml").write_text(to_toml(config))
    assert load_config(tmp_path / "config.toml") == replace(config, resume=False)  # a switch of one invocation
    assert config.global_tokens == 16384 and config.tokenizer is None


def test_command_line_overrides_the_file(tmp_path):
    (tmp_path / "run.toml").write_text('model = "tiny"\ndata = "corpus"\nsteps = 10\nlr = 1e-3\ncapacity = "2K"\n')
    args = vars(build_parser().parse_args(["--config", str(tmp_path / "run.toml"), "--steps", "3", "--zero"]))
    config = load_config(args.pop("config"), **args)
    assert (config.steps, config.lr, config.capacity, config.zero, config.resume) == (3, 1e-3, 2048, True, False)


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"data": ""}, "data is required"),
        ({"steps": 0}, "steps must be an integer >= 1, got 0"),
        ({"strategy": "fast"}, "strategy must be one of"),
        ({"dtype": "fp16"}, "dtype must be one of ['fp32', 'bf16']"),
        ({"lr": -1.0}, "lr must be a finite number > 0.0"),
        ({"beta2": 1.0}, "beta2 must be a finite number in [0.0, 1.0)"),
        ({"warmup": 5, "steps": 5}, "warmup (5) must be below decay_steps (5)"),
        ({"global_tokens": "lots"}, "global_tokens:"),
        ({"resume": "yes"}, 'resume must be true, false or "auto"'),
        ({"keep_last": -1}, "keep_last must be an integer >= 0"),
        ({"log_every": 0}, "log_every must be an integer >= 1"),
        ({"peak_tflops": 0.0}, "peak_tflops must be a finite number > 0.0"),
        ({"sp": "heads"}, "sp must be one of ['ring', 'ulysses', 'auto']"),
    ],
)
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        load_config(None, **{**REQUIRED, **overrides})


def test_config_file_problems(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    (tmp_path / "bad.toml").write_text("lr = \n")
    with pytest.raises(ConfigError, match="bad.toml: not valid TOML"):
        load_config(tmp_path / "bad.toml")
    (tmp_path / "tables.toml").write_text("[optimizer]\nlr = 1e-3\n")
    with pytest.raises(ConfigError, match=r"tables \['optimizer'\] are not used"):
        load_config(tmp_path / "tables.toml")


def test_every_field_is_an_option():
    options = {a.dest for a in build_parser()._actions} - {"help", "config", "nproc_per_node"}
    assert options == set(TrainConfig.__dataclass_fields__)


def test_schedule_warms_up_linearly_then_follows_the_cosine():
    schedule = LRSchedule(peak=1e-3, warmup=4, decay_steps=14, min_ratio=0.1)
    assert [schedule.lr(s) for s in (1, 2, 4)] == pytest.approx([2.5e-4, 5e-4, 1e-3])
    assert schedule.lr(5) == pytest.approx(1e-3)
    for step in range(5, 15):  # the cosine itself, from the peak at step 5 to the floor at step 14
        expected = 1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi * (step - 5) / 9))
        assert schedule.lr(step) == pytest.approx(expected)
    assert schedule.lr(14) == schedule.lr(100) == pytest.approx(1e-4)
    optimizer = torch.optim.AdamW(param_groups(tiny(), 0.1))
    assert schedule.apply(optimizer, 2) == pytest.approx(5e-4)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([5e-4, 5e-4])


def test_no_weight_decay_on_norms_and_biases():
    model = nn.Sequential(nn.Embedding(10, 4), nn.LayerNorm(4), nn.Linear(4, 3))
    decayed, plain = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in decayed["params"]) == ["0.weight", "2.weight"]
    assert sorted(names[id(p)] for p in plain["params"]) == ["1.bias", "1.weight", "2.bias"]
    assert (decayed["weight_decay"], plain["weight_decay"]) == (0.1, 0.0)
    llama = tiny()
    groups = build_optimizer(llama, 1e-3, 0.1, (0.9, 0.95)).param_groups
    norms = [p for n, p in llama.named_parameters() if "norm" in n]
    assert norms and all(any(p is q for q in groups[1]["params"]) for p in norms)
    assert groups[0]["betas"] == (0.9, 0.95)


@pytest.mark.parametrize(
    "argv,resume", [([], None), (["--resume"], True), (["--resume=auto"], "auto"), (["--no-resume"], False)]
)
def test_resume_takes_auto(argv, resume):
    assert build_parser().parse_args(argv).resume == resume


def test_resume_refuses_other_values(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--resume=yes"])
    assert "--resume takes no value or =auto, got 'yes'" in capsys.readouterr().err


def test_saved_config_holds_the_resolved_schedule_and_absolute_paths(tmp_path, monkeypatch):
    """A config.toml reads back the same from any directory, with the decay steps of the run that wrote it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    config = load_config(None, model="model", data="data/a:0.7,b:0.3", steps=12, cost_model="c.json")
    assert config.model == str(tmp_path / "model") and config.cost_model == str(tmp_path / "c.json")
    assert config.data == f"{tmp_path / 'data' / 'a'}:0.7,{tmp_path / 'b'}:0.3"
    assert load_config(None, model="tiny", data="d").model == "tiny"  # a preset is no path
    (tmp_path / "config.toml").write_text(to_toml(config))
    monkeypatch.chdir(tmp_path / "model")
    saved = load_config(tmp_path / "config.toml")
    assert saved.decay_steps == 12 and saved.model == config.model and saved.data == config.data


def test_a_resume_may_change_the_topology_and_nothing_else_without_allow_config_change() -> None:
    saved = TrainConfig(model="tiny", data="d", out="o")
    lines = check_resume_config(saved, replace(saved, pp=2, tp=2, zero=True), "config.toml")
    assert lines == [
        f"{key}: {before} -> {after} (topology: the checkpoint is resharded)"
        for key, before, after in (("zero", False, True), ("pp", 1, 2), ("tp", 1, 2))
    ]
    with pytest.raises(ConfigError, match=r"differ from config.toml:\n  lr: 0.0003 -> 0.0001\n  tp: 1 -> 2 \(topology"):
        check_resume_config(saved, replace(saved, tp=2, lr=1e-4), "config.toml")
    assert len(check_resume_config(saved, replace(saved, tp=2, lr=1e-4, allow_config_change=True), "c")) == 2
