"""The trainer on data tokenized elsewhere: the workspace's tokens written as Megatron-LM's `.bin`/`.idx` train
to the losses of the same tokens prepared by us (the readers themselves: tests/unit/test_data_*.py)."""

from __future__ import annotations

import numpy as np
import pytest

from bytescale_compile.data import TokenDataset, eval_prefix
from bytescale_compile.train.__main__ import main
from tests.trainer_runs import run_losses, train_args
from tests.unit.test_data_megatron import write_megatron

pytest.importorskip("transformers")


@pytest.mark.slow
def test_megatron_files_train_to_the_losses_of_our_format(workspace, tmp_path):
    for split, prefix in (("train", workspace.data), ("eval", eval_prefix(workspace.data))):
        ours = TokenDataset.open(prefix)
        name = "text_document" if split == "train" else "text_document_eval"
        write_megatron(tmp_path / name, [ours.tokens(i).numpy() for i in range(len(ours))])
    megatron = f"{tmp_path / 'text_document'}?tokenizer={workspace.tokenizer}"
    common = ("--eval-every", "3")
    assert main(train_args(workspace, tmp_path / "ours", *common)) == 0
    args = train_args(workspace, tmp_path / "megatron", *common)
    args[args.index("--data") + 1] = megatron
    assert main(args) == 0
    np.testing.assert_array_equal(run_losses(tmp_path / "megatron"), run_losses(tmp_path / "ours"))
    assert (tmp_path / "megatron" / "final" / "tokenizer.json").exists()
