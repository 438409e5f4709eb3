"""The model a run trains: a Hugging Face model directory, one of our presets, or MODULE:FACTORY.

A directory needs a `config.json`; with weights beside it (`save_pretrained` output) they are loaded,
otherwise the model is initialised from the config with the run's seed, identically on every rank.
Parameters are fp32 either way: they are the master weights, whatever `--dtype` computes in. Nothing is
ever fetched from the Hub.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..models.factory import FactoryError, load_factory
from .config import MODEL_PRESETS

__all__ = ["LoadedModel", "ModelSourceError", "enable_gradient_checkpointing", "load_model"]

_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


class ModelSourceError(ValueError):
    """`--model` names nothing that can be loaded; says what it accepts."""


@dataclass(frozen=True)
class LoadedModel:
    module: nn.Module
    spec: str
    """What `--model` said."""
    vocab_size: int
    hf_directory: Path | None
    """The Hugging Face directory it came from (`save_pretrained` applies); None for presets and factories."""
    pretrained: bool
    """Weights were loaded (not initialised from the seed)."""


def load_model(spec: str, seed: int) -> LoadedModel:
    """Build the model `spec` names in fp32; random initialisation draws from `seed`."""
    torch.manual_seed(seed)
    if spec in MODEL_PRESETS or (":" in spec and not Path(spec).exists()):
        return _from_factory(spec)
    return _from_directory(Path(spec))


def _from_factory(spec: str) -> LoadedModel:
    try:
        module = load_factory(MODEL_PRESETS[spec][0] if spec in MODEL_PRESETS else spec)
    except FactoryError as e:
        raise ModelSourceError(f"model {spec!r}: {e}") from e
    return LoadedModel(module.float(), spec, _vocab_size(module, spec), None, False)


def _from_directory(path: Path) -> LoadedModel:
    if not path.exists():
        raise ModelSourceError(
            f"model {str(path)!r} is neither a directory nor a preset ({', '.join(MODEL_PRESETS)}) nor MODULE:FACTORY"
        )
    if not (path / "config.json").is_file():
        raise ModelSourceError(
            f"model directory {path} has no config.json: pass a directory written by "
            f"save_pretrained (or holding just a Hugging Face config.json for random init)"
        )
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        pretrained = any((path / name).is_file() for name in _WEIGHT_FILES)
        if pretrained:
            module = AutoModelForCausalLM.from_pretrained(
                path, config=config, local_files_only=True, dtype=torch.float32
            )
        else:
            module = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except (OSError, ValueError, KeyError) as e:
        raise ModelSourceError(f"cannot build a causal LM from {path}: {e}") from e
    module.config.use_cache = False  # training: no KV cache
    return LoadedModel(module, str(path), _vocab_size(module, str(path)), path, pretrained)


def enable_gradient_checkpointing(model: LoadedModel) -> None:
    """Hugging Face's switch (`activation_checkpointing_enable`, before 5.x `gradient_checkpointing_enable`),
    non-reentrant, torch's recommended form."""
    module = model.module
    if not getattr(module, "supports_gradient_checkpointing", False):
        raise ModelSourceError(
            f"--gradient-checkpointing: model {model.spec!r} ({type(module).__name__}) has no Hugging Face "
            "gradient checkpointing (supports_gradient_checkpointing); train it without, or lower --capacity"
        )
    kwargs: Any = {"use_reentrant": False}
    enable: Any = getattr(module, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        enable = getattr(module, "gradient_checkpointing_enable")  # noqa: B009 (typed as a Tensor otherwise)
        enable(gradient_checkpointing_kwargs=kwargs)


def _vocab_size(module: nn.Module, spec: str) -> int:
    vocab = getattr(getattr(module, "config", None), "vocab_size", None)
    if not isinstance(vocab, int):
        raise ModelSourceError(
            f"model {spec!r} ({type(module).__name__}) has no integer config.vocab_size, which "
            f"the run checks the data's token ids against"
        )
    return vocab
