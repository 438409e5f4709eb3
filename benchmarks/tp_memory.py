"""Per-rank bytes of parameters + gradients + AdamW state under tensor parallelism, from real (meta) tensors.

A Hugging Face LlamaForCausalLM of LLaMA-7B / LLaMA-70B shape is built on the `meta` device (no memory),
sharded by `bytescale_compile.tensor_parallel` over a fake process group of tp ranks (rank 0's view),
and each parameter's local shard is counted: fp32 weights, fp32 gradients and AdamW's two fp32
moments (16 bytes per local parameter), the layout tensor parallelism runs with today.

    python benchmarks/tp_memory.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import transformers
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

import bytescale_compile as bsc

SHAPES = {
    "llama-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32),
    "llama-70b": dict(
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8
    ),
}
BYTES_PER_PARAM = 4 + 4 + 8  # fp32 weight, fp32 gradient, AdamW exp_avg + exp_avg_sq


def local_params(name: str, tp: int) -> tuple[int, int]:
    """(parameters on rank 0, parameters in the model) of `name` sharded over `tp` ranks."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        config = transformers.LlamaConfig(vocab_size=32000, **SHAPES[name])
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
        bsc.tensor_parallel(model, tp)
        local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
        return local, sum(p.numel() for p in model.parameters())
    finally:
        dist.destroy_process_group()


def main() -> None:
    print("| model | tp | parameters per rank | of the model | params + grads + AdamW per rank |")
    print("|---|---|---|---|---|")
    for name in SHAPES:
        for tp in (1, 2, 4, 8):
            local, total = local_params(name, tp)
            print(
                f"| {name} | {tp} | {local / 1e9:.2f} B | {local / total:.1%} | {local * BYTES_PER_PARAM / 2**30:.1f} GiB |"
            )


if __name__ == "__main__":
    main()
