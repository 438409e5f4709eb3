"""The pieces of `benchmarks/gpu.py` that decide what every path trains: the global batches, the rows a packing
baseline forms, the packed row's targets and offsets, and the extrapolation of the longest sequence. The GPU
tables themselves need CUDA; `python benchmarks/gpu.py --smoke` runs them on the CPU (slow set below)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.gpu_models import global_batch, pack_rows, packed_row
from benchmarks.gpu_trainer import fit_longest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("dataset", ["byted", "github"])
def test_global_batch_sums_to_the_tokens_and_respects_the_cap(dataset):
    lengths = global_batch(dataset, 65_536, max_len=8192)
    assert sum(lengths) == 65_536 and max(lengths) <= 8192 and min(lengths) >= 1
    assert global_batch(dataset, 65_536, max_len=8192) == lengths  # the same batch for every path


def test_pack_rows_places_every_sequence_once_within_the_row():
    lengths = [700, 300, 300, 250, 200, 100, 1000, 50]
    rows = pack_rows(lengths, 1000)
    assert sorted(n for row in rows for n in row) == sorted(lengths)
    assert all(sum(row) <= 1000 for row in rows)
    assert len(rows) == 3  # first-fit decreasing: [1000], [700, 300], [300, 250, 200, 100, 50]


def test_pack_rows_refuses_a_sequence_longer_than_the_row():
    with pytest.raises(ValueError, match="1001 tokens does not fit a row of 1000"):
        pack_rows([10, 1001], 1000)


def test_packed_row_restarts_positions_and_ignores_each_sequence_end():
    row = packed_row([3, 2], vocab=50, device="cpu")
    assert row["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    ids, targets = row["input_ids"][0], row["shift_labels"][0]
    assert targets.tolist() == [ids[1], ids[2], -100, ids[4], -100]
    assert row["cu_seq_lens_q"].tolist() == [0, 3, 5] and row["max_length_q"] == 3


def test_fit_longest_extrapolates_the_line_through_two_peaks(monkeypatch):
    class Props:
        total_memory = 100 * 2**20

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: Props())
    got = fit_longest((1000, 2000), [40 * 2**20, 60 * 2**20], smoke=False)
    assert got["bytes_per_token"] == 20 * 2**20 / 1000
    assert got["longest"] == 1000 + int(60 * 2**20 / (20 * 2**20 / 1000))  # 4000 tokens
    assert "longest" not in fit_longest((1000, 2000), [40, None], smoke=False)


@pytest.mark.slow
def test_smoke_runs_every_table_on_the_cpu(tmp_path):
    """The script end to end on tiny shapes: ours trains (losses fall), the baselines the CPU has run, the rest
    say why not; the JSON holds it all."""
    cmd = [
        sys.executable,
        "benchmarks/gpu.py",
        "--smoke",
        "--only",
        "trainer",
        "--only",
        "loss",
        "--json",
        str(tmp_path),
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    trainer = json.loads((tmp_path / "gpu_trainer.json").read_text())
    rows = trainer["trainer"]["trainer"]
    assert [r["error"] for r in rows] == [None, None]
    assert all(r["extra"]["losses"][-1] < r["extra"]["losses"][0] for r in rows)
    assert [r["error"] for r in trainer["hf_sdpa_per_sequence"]["rows"]] == [None, None]
    assert {"hf_flex", "hf_liger", "hf_varlen"} <= {k for k, v in trainer.items() if "unavailable" in v}
    assert set(json.loads((tmp_path / "gpu_loss.json").read_text())["48"]) >= {"ours (dispatched)", "torch"}
