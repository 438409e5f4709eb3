"""Training data: tokenizers, data preparation from users' own text, the memory-mapped token dataset and
the global-batch sampler (`dataset.py`), data already tokenized elsewhere (Megatron-LM's indexed datasets,
`megatron.py`; Hugging Face `datasets`, `hf_datasets.py`; Parquet and JSON Lines, `token_files.py`), each
opened by what its path holds (`formats.py`), and mixtures of several datasets by weight (`mixture.py`).

`tokenizers`, `pyarrow`, `datasets` and `tqdm` (the `data` extra) are imported only when used.
"""

from .dataset import (
    DatasetError,
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
from .mixture import (
    MixedDataset,
    MixtureSampler,
    batch_sources,
    eval_spec,
    format_data_spec,
    open_data,
    parse_data_spec,
)
from .options import DataItem
from .prepare import LONG_DOC_POLICIES, PrepareReport, eval_prefix, prepare
from .sources import SourceError, SourceStats
from .tokenizer import (
    EOS_TOKEN,
    PAD_TOKEN,
    LoadedTokenizer,
    TokenizerError,
    TrainedTokenizer,
    load_tokenizer,
    train_tokenizer,
)

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
