"""How long a training step waits for a checkpoint: a synchronous save against an async one, on this CPU.

For each model (the demo's LLaMA, and the width of a 1B LLaMA), fp32 weights and AdamW state after one step:

- sync: `save_checkpoint`, the whole save (DCP write, sha256 of every file, commit);
- async: `Checkpointer.save_async` until it returns (the copy to host memory: what the step waits; the first
  save allocates the host copy, later ones copy into it again), then the background write and commit, measured while the main thread keeps running fp32 matmuls of a training-like
  size, whose slowdown against the same matmuls alone is the async save's cost to the steps it overlaps.

One process, files on this machine's disk (`--dir`, default a temp directory).

    python benchmarks/checkpoint_stall.py
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from bytescale_compile.train.checkpoint import Checkpointer, save_checkpoint

SHAPES = {
    "demo (examples/configs/llama-demo)": "examples/configs/llama-demo",
    "1B width, 4 of 22 layers": dict(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=4,
        num_attention_heads=32,
        num_key_value_heads=4,
    ),
}
"""A whole 1B LLaMA in fp32 with AdamW (16 bytes a parameter) and one host copy of its state needs ~30 GB, more
than this 24 GB machine; 4 layers keep the width (and the embedding) of one, and the figures scale with bytes."""


@dataclass
class Stall:
    model: str
    params: int
    state_bytes: int
    sync_s: float
    first_stall_s: float
    async_stall_s: float
    async_background_s: float
    overlap_slowdown: float


def _model(shape: str | dict) -> torch.nn.Module:
    config = (
        transformers.AutoConfig.from_pretrained(shape) if isinstance(shape, str) else transformers.LlamaConfig(**shape)
    )
    return transformers.AutoModelForCausalLM.from_config(config).float()


def _stepped(model: torch.nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    model.zero_grad(set_to_none=True)
    return optimizer


def _work(seconds_of_matmuls: int) -> float:
    """Seconds for a fixed count of 1024² fp32 matmuls (a stand-in for the next training steps)."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    began = time.perf_counter()
    for _ in range(seconds_of_matmuls):
        a = (a @ b).tanh_()
    return time.perf_counter() - began


def measure(name: str, shape: str | dict, root: Path, repeats: int) -> Stall:
    torch.manual_seed(0)
    model = _model(shape)
    optimizer = _stepped(model)
    params = sum(p.numel() for p in model.parameters())
    sync, stall, background = [], [], []
    for i in range(repeats):
        began = time.perf_counter()
        save_checkpoint(root / name / "sync", i + 1, model, optimizer, {"step": i + 1}, keep_last=1)
        sync.append(time.perf_counter() - began)
    alone = _work(200)
    overlapped, saver = [], Checkpointer()
    for i in range(repeats):
        began = time.perf_counter()
        pending = saver.save_async(root / name / "async", i + 1, model, optimizer, {"step": i + 1}, keep_last=1)
        stall.append(time.perf_counter() - began)
        overlapped.append(_work(200))
        pending.result()
        background.append(time.perf_counter() - began - stall[-1])
    return Stall(
        name,
        params,
        params * 12,
        min(sync),
        stall[0],
        min(stall[1:]),
        min(background),
        min(overlapped) / alone,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="where to write the checkpoints")
    parser.add_argument("--repeats", type=int, default=3, help="saves of each kind (at least 2)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        rows = [measure(name, shape, Path(tmp), args.repeats) for name, shape in SHAPES.items()]
    print(f"CPU, {torch.get_num_threads()} threads, torch {torch.__version__}; best of {args.repeats}")
    print(
        "| model | parameters | weights + AdamW | sync save: step waits | async, first save: step waits | "
        "async, later saves: step waits | async: background write | matmuls during it |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.model} | {r.params / 1e6:.1f} M | {r.state_bytes / 2**30:.2f} GiB | {r.sync_s:.2f} s | "
            f"{r.first_stall_s:.2f} s | {r.async_stall_s:.2f} s | {r.async_background_s:.2f} s | "
            f"{r.overlap_slowdown:.2f}x |"
        )


if __name__ == "__main__":
    main()
