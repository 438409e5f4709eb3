"""The model a command is pointed at: MODULE:FACTORY (a callable building an `nn.Module`) or a directory with a
Hugging Face config.json. A target that builds nothing usable is a usage error naming the forms it may take."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..models.factory import FactoryError, load_factory, resolve_factory
from .arguments import CLIError

if TYPE_CHECKING:
    from torch import nn

__all__ = ["FORMS", "factory_model", "meta_model", "profile_target", "sample_inputs"]

FORMS = "a directory with a Hugging Face config.json, or MODULE:FACTORY (e.g. bytescale_compile.models.llama:small)"


def factory_model(spec: str) -> nn.Module:
    """The model a MODULE:FACTORY spec builds; a spec that builds none is a usage error."""
    try:
        return load_factory(spec)
    except FactoryError as e:
        raise CLIError(str(e)) from e


def _config_directory(target: str) -> Path | None:
    """`target` as a Hugging Face config directory, None when it is MODULE:FACTORY; anything else is refused."""
    path = Path(target)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CLIError(f"directory {target} has no config.json: give {FORMS}")
        return path
    if ":" not in target:
        raise CLIError(f"{target!r} is neither a directory nor MODULE:FACTORY: give {FORMS}")
    return None


def hf_directory_model(directory: str) -> nn.Module:
    """The causal LM of a Hugging Face directory as the trainer builds it (random init from its config.json
    with seed 0, or its weights); module-level, so the profiler's processes can unpickle a partial of it."""
    from ..train.models import load_model

    return load_model(directory, seed=0).module


def profile_target(target: str) -> str | Callable[[], nn.Module]:
    """MODULE:FACTORY as given (the profiler imports it), or a builder of a Hugging Face config directory's model."""
    if _config_directory(target) is not None:
        return functools.partial(hf_directory_model, target)
    try:
        resolve_factory(target)
    except FactoryError as e:
        raise CLIError(f"{e} (the target is {FORMS})") from e
    return target


def meta_model(target: str, dtype: str) -> tuple[nn.Module, int]:
    """The model MODEL names, on the meta device in the run's dtype, and its decoder layer count: a Hugging Face
    config directory cut to 2 layers, or what MODULE:FACTORY builds (whole)."""
    import torch

    from ..train.memory import TORCH_DTYPES, param_counts
    from ..train.memory import meta_model as config_meta_model

    path = _config_directory(target)
    if path is not None:
        from transformers import AutoConfig

        try:
            return config_meta_model(AutoConfig.from_pretrained(path, local_files_only=True), dtype)
        except (OSError, ValueError, KeyError) as e:
            raise CLIError(f"cannot build a causal LM from {target}: {e}") from e
    try:
        with torch.device("meta"):
            model = load_factory(target)
    except FactoryError as e:
        raise CLIError(f"{e} (the target is {FORMS})") from e
    except Exception as e:  # the user's factory: whatever it raises is a usage error
        raise CLIError(f"{target} failed building its model on the meta device: {type(e).__name__}: {e}") from e
    layers = param_counts(model).layers_present
    if layers == 0:
        raise CLIError(f"{target} built {type(model).__name__}, which has no numbered decoder layers (layers.N)")
    return model.to(TORCH_DTYPES[dtype]), layers


def sample_inputs(model: nn.Module, seq_len: int, vocab_size: int | None = None) -> dict[str, Any]:
    """One random row of the causal-LM protocol as the model's forward takes it (`model_inputs`), its vocabulary
    from --vocab-size or the model's config."""
    from ..engine.protocol import ModelProtocolError, model_inputs

    vocab = vocab_size or getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is None:
        raise CLIError("the model has no config.vocab_size: pass --vocab-size")
    try:
        return model_inputs(model, seq_len, vocab_size=vocab)
    except ModelProtocolError as e:
        raise CLIError(str(e)) from e
