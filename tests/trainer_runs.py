"""Runs of the trainer (`python -m bytescale_compile.train`) as a user starts them, shared by the trainer,
Ray-loader and GPU tests: a small workspace (tokenizer, prepared data, a Qwen2 config directory), the
command lines, and the metrics a run writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bytescale_compile.testing import free_port

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
WORDS = "def class return import self value none true false for while with yield lambda".split()
GLOBAL_TOKENS, MAX_LEN = 2048, 1024


@dataclass(frozen=True)
class Workspace:
    data: Path
    model: Path
    tokenizer: Path
    vocab_size: int


def make_workspace(root: Path) -> Workspace:
    """A BPE trained on a skewed synthetic corpus, the corpus prepared with it (10% held out), and a Qwen2
    config directory (no weights: random init) whose vocabulary holds the tokenizer's."""
    from bytescale_compile.data import prepare, train_tokenizer

    rng = np.random.default_rng(0)
    lengths = np.concatenate([rng.integers(5, 80, 200), rng.integers(400, 1200, 8)])
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": " ".join(rng.choice(WORDS, n))}) + "\n" for n in lengths))
    train_tokenizer([corpus], 300, root / "tok")
    report = prepare([corpus], root / "tok", root / "data", eval_fraction=0.1, max_len=MAX_LEN)
    qwen2_config(max_position_embeddings=MAX_LEN, tie_word_embeddings=False).save_pretrained(root / "qwen2")
    return Workspace(root / "data", root / "qwen2", root / "tok", report.train.vocab_size)


def qwen2_config(**overrides: object):
    """A tiny Qwen2 config (2 layers of width 64, vocabulary 320) for users' own model directories."""
    import transformers

    shape = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return transformers.Qwen2Config(**{**shape, **overrides})


def train_args(ws: Workspace, out: Path, *extra: str) -> list[str]:
    return [
        "--model",
        str(ws.model),
        "--data",
        str(ws.data),
        "--out",
        str(out),
        "--steps",
        "3",
        "--global-tokens",
        str(GLOBAL_TOKENS),
        "--capacity",
        "1K",
        "--max-len",
        str(MAX_LEN),
        "--lr",
        "1e-3",
        "--warmup",
        "1",
        "--no-calibrate",  # plans from the analytic cost model: the same on every run, so runs compare exactly
        *extra,
    ]


def torchrun_command(nproc: int, args: list[str], *torchrun_args: str) -> list[str]:
    torchrun = Path(sys.executable).with_name("torchrun")
    return [
        str(torchrun),
        f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}",
        *torchrun_args,
        "-m",
        "bytescale_compile.train",
        *args,
    ]


def run_trainer(command: list[str], **env: str) -> str:
    result = subprocess.run(command, cwd=ROOT, env={**ENV, **env}, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def cut_and_resume(
    ws: Workspace, out: Path, steps: int, before: tuple[int, tuple[str, ...]], after: tuple[int, tuple[str, ...]]
) -> str:
    """Steps 1..steps/2 on `before` (processes, flags), then the rest resumed on `after` from the checkpoint of
    step steps/2; returns the resume's output."""
    common = ("--decay-steps", str(steps), "--checkpoint-every", str(steps // 2))
    run_trainer(torchrun_command(before[0], train_args(ws, out, "--steps", str(steps // 2), *common, *before[1])))
    resume = train_args(ws, out, "--steps", str(steps), "--resume", *common, *after[1])
    return run_trainer(torchrun_command(after[0], resume))


def run_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run_losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in run_metrics(run_dir)]


def held_out_loss(model, dataset) -> float:
    """The trainer's evaluation, eagerly: the token-level next-token loss over the held-out batches a run
    evaluates on, one sequence at a time."""
    import torch
    import torch.nn.functional as F

    from bytescale_compile.data import eval_batches

    total, targets = 0.0, 0
    with torch.no_grad():
        for batch in eval_batches(dataset, GLOBAL_TOKENS, MAX_LEN, GLOBAL_TOKENS):
            for seq in range(len(batch.lengths)):
                ids = batch.tokens(seq)
                logits = model(input_ids=ids[None]).logits[0, :-1].double()
                total += F.cross_entropy(logits, ids[1:], reduction="sum").item()
                targets += len(ids) - 1
    return total / targets


def interrupt_after_first_step(command: list[str], out: Path, sig: int) -> tuple[int, str]:
    """Start `command` (a trainer writing to `out`) in its own process group, send `sig` to the whole group once
    step 1 is logged, as a terminal's Ctrl-C reaches every process; its exit status and stderr."""
    import signal as signals
    import time

    proc = subprocess.Popen(
        command, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        metrics, deadline = out / "metrics.jsonl", time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().strip()) and time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            time.sleep(0.02)
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signals.SIGKILL)
    return proc.returncode, stderr
