"""The trainer with `--sp ulysses`: shared micro-batches run u × r (all-to-all over heads, the ring between the
groups) on 4 ranks and give one process's losses."""

from __future__ import annotations

import numpy as np
import pytest

from bytescale_compile.train.__main__ import main
from tests.trainer_runs import run_metrics, run_trainer, torchrun_command, train_args

pytest.importorskip("transformers")


@pytest.mark.slow
def test_ulysses_on_4_ranks_equals_one_process(workspace, tmp_path):
    run_trainer(torchrun_command(4, train_args(workspace, tmp_path / "sp", "--sp", "ulysses", "--capacity", "512")))
    assert main(train_args(workspace, tmp_path / "one")) == 0  # C = 1K: every sequence fits one process
    ran, reference = run_metrics(tmp_path / "sp"), run_metrics(tmp_path / "one")
    np.testing.assert_allclose([r["loss"] for r in ran], [r["loss"] for r in reference], rtol=1e-4)
    assert sum(r["p2p_bytes"] for r in ran) > 0, "no sequence was shared"
    splits = [split for r in ran for split in r.get("splits", {})]
    assert any(not split.startswith("1x") for split in splits), splits  # some shared micro-batch ran Ulysses
    for r in ran:  # the all-to-all's bytes predicted and counted
        assert r["p2p_bytes"] == pytest.approx(r["predicted_p2p_bytes"], rel=0.2), r
