"""Our small LLaMA, as `examples.models.llama:tiny` / `:small` for MODULE:FACTORY specs written before it moved
into the package (`bytescale_compile.models.llama`, which an installed wheel ships)."""

from bytescale_compile.models.llama import CausalLMOutput, LlamaConfig, LlamaForCausalLM, Rotary, small, tiny

__all__ = ["CausalLMOutput", "LlamaConfig", "LlamaForCausalLM", "Rotary", "small", "tiny"]
