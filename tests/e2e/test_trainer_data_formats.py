"""The trainer on data tokenized elsewhere: the workspace's tokens written as Megatron-LM's `.bin`/`.idx` train
to the losses of the same tokens prepared by us (the readers themselves: tests/unit/test_data_*.py), and ids past
the model's vocabulary refused before step 1."""

from __future__ import annotations

import numpy as np
import pytest

from bytescale_compile.data import TokenDataset, eval_prefix
from bytescale_compile.train.__main__ import main
from tests.trainer_runs import qwen2_config, run_losses, train_args
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


def test_ids_past_the_model_vocabulary_are_refused_before_step_1(tmp_path, capsys):
    """Ids up to 1999 declared as ?vocab_size=1000 and fed to a vocab-1024 model: one error line naming the
    dataset, the sequence, the id and the vocabulary, exit 2 (the embedding's IndexError otherwise)."""
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, 1000, int(n)) for n in rng.integers(20, 200, 60)]
    sequences[0][7] = 1999
    prefix = write_megatron(tmp_path / "text_document", sequences)
    qwen2_config(vocab_size=1024).save_pretrained(tmp_path / "model")
    spec = f"{prefix}?vocab_size=1000"
    args = ["--model", str(tmp_path / "model"), "--data", spec, "--out", str(tmp_path / "out"), "--eval-every", "0"]
    assert main([*args, "--steps", "2", "--global-tokens", "1024", "--capacity", "1K", "--no-calibrate"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1, captured
    assert captured.err.startswith(f"python -m bytescale_compile.train: error: dataset {spec} (Megatron"), captured.err
    assert "sequence 0 holds token id 1999 at position 7, outside model " in captured.err
    assert "vocabulary of 1024 (ids 0 to 1023; the dataset declares vocab_size 1000)" in captured.err
    assert not (tmp_path / "out").exists()
