"""Hugging Face models built from the config directories under examples/configs (random init, nothing
downloaded), as MODULE:FACTORY targets for `bytescale-compile profile` and `inspect`:

    bytescale-compile profile examples.models.hf:llama_demo --ranks-per-device 4 --out cost.json
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

__all__ = ["CONFIGS", "llama_demo"]

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def llama_demo() -> nn.Module:
    """The LLaMA `make demo` trains (examples/configs/llama-demo: 4 layers, hidden 256, vocab 4096)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(CONFIGS / "llama-demo"))
