"""examples/train.py under torchrun: resuming from a checkpoint continues the run exactly, also after a crash."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
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


def _command(tmp: Path, steps: int, report: str | None, *extra: str, torchrun_args: tuple[str, ...] = ()) -> list[str]:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc_per_node=2", f"--master_port={free_port()}", *torchrun_args,
           str(ROOT / "examples/train.py"), "--model", "tiny", "--data", str(tmp / "corpus"), "--data-source", "none",
           "--strategy", "balance", "--steps", str(steps), "--global-tokens", "2K", "--capacity", "512",
           "--max-len", "1K", *extra]
    return cmd + ["--report-json", str(tmp / report)] if report else cmd


def _train(tmp: Path, steps: int, report: str | None, *extra: str) -> None:
    subprocess.run(_command(tmp, steps, report, *extra), check=True, cwd=ROOT, env=_ENV, timeout=600,
                   stdout=subprocess.DEVNULL)


_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _losses(path: Path) -> list[float]:
    return json.loads(path.read_text())[0]["losses"]


def _worker_pids(torchrun_pid: int) -> list[int]:
    """The training processes torchrun started (its children running train.py)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = stat.with_name("cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == torchrun_pid and b"train.py" in cmdline:
            pids.append(int(stat.parent.name))
    return sorted(pids)


@pytest.mark.slow
def test_resume_continues_with_the_same_losses(tmp_path):
    _corpus(tmp_path / "corpus")
    _train(tmp_path, 5, "full.json")
    _train(tmp_path, 2, None, "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2")
    _train(tmp_path, 5, "resumed.json", "--checkpoint-dir", str(tmp_path / "ckpt"), "--resume")
    full, resumed = _losses(tmp_path / "full.json"), _losses(tmp_path / "resumed.json")
    assert len(full) == 5 and len(resumed) == 5  # steps 1-2 come from the checkpoint's train state
    assert np.allclose(resumed, full, rtol=1e-6, atol=0), (resumed, full)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds torchrun's workers through /proc")
def test_killed_rank_restarts_from_the_last_checkpoint(tmp_path):
    """SIGKILL one rank mid-run: torchrun restarts both, they resume from the last complete checkpoint
    (ZeRO shards included) and the run ends with the losses of an uninterrupted one."""
    _corpus(tmp_path / "corpus")
    steps, ckpt = 8, tmp_path / "ckpt"
    _train(tmp_path, steps, "full.json", "--zero")
    cmd = _command(tmp_path, steps, "killed.json", "--zero", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2",
                   "--resume", torchrun_args=("--max-restarts=1",))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own process group: a failure below kills the workers too
    try:
        first = ckpt / "balance" / "step_00000002" / "COMPLETE"
        deadline = time.monotonic() + 300
        while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first.exists(), "no checkpoint at step 2"
        victims = _worker_pids(proc.pid)
        assert len(victims) == 2, victims
        os.kill(victims[1], signal.SIGKILL)
        output, _ = proc.communicate(timeout=600)
    finally:
        with contextlib.suppress(ProcessLookupError):  # nothing left of the group is fine
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, output
    assert "resumed from" in output, output
    assert (ckpt / "balance" / "step_00000002" / "COMPLETE").exists()  # nothing written before the kill is lost
    assert np.allclose(_losses(tmp_path / "killed.json"), _losses(tmp_path / "full.json"), rtol=1e-6, atol=0)


def test_missing_dataset_names_the_file(tmp_path):
    result = subprocess.run(
        [str(Path(sys.executable).with_name("torchrun")), "--nproc_per_node=1", f"--master_port={free_port()}",
         str(ROOT / "examples/train.py"), "--model", "tiny", "--data", str(tmp_path / "nothing"), "--data-source", "none",
         "--steps", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "nothing.json" in result.stderr


def test_tokens_outside_the_model_vocabulary_are_refused(tmp_path):
    write_dataset(tmp_path / "bytes", [bytes(range(256))], source="test")
    result = subprocess.run(
        [str(Path(sys.executable).with_name("torchrun")), "--nproc_per_node=1", f"--master_port={free_port()}",
         str(ROOT / "examples/train.py"), "--model", "tiny", "--data", str(tmp_path / "bytes"), "--data-source", "none",
         "--steps", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "token ids up to 255" in result.stderr and "vocabulary of 128" in result.stderr
