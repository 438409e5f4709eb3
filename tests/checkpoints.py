"""Checkpoints the fault tests save, damage and resume from, shared by the unit tests of `train.checkpoint`
and `train.trainer` and the trainer's end-to-end fault tests: a step of the tiny model, a byte flipped in a
shard, a saved run's settings."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from bytescale_compile.data import write_dataset
from bytescale_compile.train.config import TrainConfig, to_toml
from bytescale_compile.train.inputs import CONFIG_FILE

SHARD = "__0_0.distcp"
"""Rank 0's shard of a checkpoint."""


def tiny_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    """One optimizer step of `model` (a tiny preset: ids below 128) on random ids drawn from `seed`."""
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(seed))
    optimizer.zero_grad(set_to_none=True)
    model(input_ids=ids, shift_labels=torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)).loss.backward()
    optimizer.step()


def flip_byte(path: Path) -> None:
    """Flip one bit in the middle of the checkpoint `path`'s rank-0 shard."""
    data = bytearray((path / SHARD).read_bytes())
    data[len(data) // 2] ^= 0x01
    (path / SHARD).write_bytes(bytes(data))


def saved_tiny_run(root: Path) -> TrainConfig:
    """A run's config.toml as `run` writes it, over a small dataset of ids for the tiny preset."""
    rng = np.random.default_rng(0)
    write_dataset(
        root / "data", [rng.integers(0, 128, n) for n in rng.integers(5, 60, 50)], source="test", vocab_size=128
    )
    config = TrainConfig(
        model="tiny",
        data=str(root / "data"),
        out=str(root / "out"),
        steps=4,
        global_tokens=256,
        capacity=256,
        max_len=64,
        lr=1e-3,
        seed=0,
    )
    Path(config.out).mkdir()
    (Path(config.out) / CONFIG_FILE).write_text(to_toml(config))
    return config
