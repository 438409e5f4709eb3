"""Training data: tokenizers, data preparation from users' own text, the memory-mapped token dataset and
the global-batch sampler (`dataset.py`), data already tokenized elsewhere (Megatron-LM's indexed datasets,
`megatron.py`; Hugging Face `datasets`, `hf_datasets.py`; Parquet and JSON Lines, `token_files.py`), each
opened by what its path holds (`formats.py`), and mixtures of several datasets by weight (`mixture.py`).

`tokenizers`, `pyarrow`, `datasets` and `tqdm` (the `data` extra) are imported only when used, and the public
names load on first use (PEP 562): the trainer reads `--data` (`spec.py`) before torch loads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_getattr

if TYPE_CHECKING:
    from .dataset import (
        DatasetWriter,
        GlobalBatch,
        GlobalBatchSampler,
        OutOfVocabulary,
        SequenceSource,
        TokenDataset,
        TokenizerInfo,
        eval_batches,
        python_source_files,
        write_dataset,
    )
    from .formats import open_dataset
    from .hf_datasets import HFDataset
    from .megatron import MegatronDataset
    from .mixture import MixedDataset, MixtureSampler, batch_sources, eval_spec, open_data
    from .preparation import LONG_DOC_POLICIES, PrepareReport, eval_prefix, prepare
    from .sources import SourceError, SourceStats
    from .spec import DataItem, DatasetError, format_data_spec, parse_data_spec
    from .tokenizer import (
        EOS_TOKEN,
        PAD_TOKEN,
        LoadedTokenizer,
        TokenizerError,
        TrainedTokenizer,
        load_tokenizer,
        train_tokenizer,
    )

_EXPORTS = {
    "DatasetWriter": ".dataset",
    "GlobalBatch": ".dataset",
    "GlobalBatchSampler": ".dataset",
    "OutOfVocabulary": ".dataset",
    "SequenceSource": ".dataset",
    "TokenDataset": ".dataset",
    "TokenizerInfo": ".dataset",
    "eval_batches": ".dataset",
    "python_source_files": ".dataset",
    "write_dataset": ".dataset",
    "open_dataset": ".formats",
    "HFDataset": ".hf_datasets",
    "MegatronDataset": ".megatron",
    "MixedDataset": ".mixture",
    "MixtureSampler": ".mixture",
    "batch_sources": ".mixture",
    "eval_spec": ".mixture",
    "open_data": ".mixture",
    "LONG_DOC_POLICIES": ".preparation",
    "PrepareReport": ".preparation",
    "eval_prefix": ".preparation",
    "prepare": ".preparation",
    "SourceError": ".sources",
    "SourceStats": ".sources",
    "DataItem": ".spec",
    "DatasetError": ".spec",
    "format_data_spec": ".spec",
    "parse_data_spec": ".spec",
    "EOS_TOKEN": ".tokenizer",
    "PAD_TOKEN": ".tokenizer",
    "LoadedTokenizer": ".tokenizer",
    "TokenizerError": ".tokenizer",
    "TrainedTokenizer": ".tokenizer",
    "load_tokenizer": ".tokenizer",
    "train_tokenizer": ".tokenizer",
}
"""Public name -> the module that defines it."""

__all__ = [
    "DataItem",
    "DatasetError",
    "DatasetWriter",
    "EOS_TOKEN",
    "GlobalBatch",
    "GlobalBatchSampler",
    "OutOfVocabulary",
    "HFDataset",
    "LONG_DOC_POLICIES",
    "PAD_TOKEN",
    "LoadedTokenizer",
    "MegatronDataset",
    "MixedDataset",
    "MixtureSampler",
    "PrepareReport",
    "SourceError",
    "SequenceSource",
    "SourceStats",
    "TokenDataset",
    "TokenizerError",
    "TokenizerInfo",
    "TrainedTokenizer",
    "batch_sources",
    "eval_batches",
    "eval_prefix",
    "eval_spec",
    "format_data_spec",
    "load_tokenizer",
    "open_data",
    "open_dataset",
    "parse_data_spec",
    "prepare",
    "python_source_files",
    "train_tokenizer",
    "write_dataset",
]

__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
