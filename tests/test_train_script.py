"""examples/train.py under torchrun: resuming from a checkpoint continues the run exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bytescale_compile.runtime.data import write_dataset
from bytescale_compile.runtime.spawn import free_port

ROOT = Path(__file__).resolve().parents[1]


def _corpus(prefix: Path) -> None:
    rng = np.random.default_rng(0)
    lengths = np.concatenate([rng.integers(20, 200, 60), rng.integers(600, 1500, 6)])
    write_dataset(prefix, (rng.integers(32, 127, n, dtype=np.uint8).tobytes() for n in lengths), source="test")


def _train(tmp: Path, steps: int, report: str | None, *extra: str) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc_per_node=2", f"--master_port={free_port()}", str(ROOT / "examples/train.py"),
           "--model", "tiny", "--data", str(tmp / "corpus"), "--data-source", "none", "--strategy", "balance",
           "--steps", str(steps), "--global-tokens", "2K", "--capacity", "512", "--max-len", "1K", *extra]
    if report:
        cmd += ["--report-json", str(tmp / report)]
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600,
                   stdout=subprocess.DEVNULL)


@pytest.mark.slow
def test_resume_continues_with_the_same_losses(tmp_path):
    _corpus(tmp_path / "corpus")
    _train(tmp_path, 5, "full.json")
    _train(tmp_path, 2, None, "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2")
    _train(tmp_path, 5, "resumed.json", "--checkpoint-dir", str(tmp_path / "ckpt"), "--resume")
    full = json.loads((tmp_path / "full.json").read_text())[0]["losses"]
    resumed = json.loads((tmp_path / "resumed.json").read_text())[0]["losses"]
    assert len(full) == 5 and len(resumed) == 3
    assert np.allclose(resumed, full[2:], rtol=1e-6, atol=0), (resumed, full)


def test_missing_dataset_names_the_file(tmp_path):
    result = subprocess.run(
        [str(Path(sys.executable).with_name("torchrun")), "--nproc_per_node=1", f"--master_port={free_port()}",
         str(ROOT / "examples/train.py"), "--model", "tiny", "--data", str(tmp_path / "nothing"), "--data-source", "none",
         "--steps", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "nothing.json" in result.stderr
