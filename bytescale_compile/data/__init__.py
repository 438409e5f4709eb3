"""Training data: tokenizers, data preparation from users' own text, the memory-mapped token dataset and
the global-batch sampler (`dataset.py`), and mixtures of several datasets by weight (`mixture.py`).

`tokenizers`, `pyarrow`, `datasets` and `tqdm` (the `data` extra) are imported only when used.
"""

from .dataset import (
    DatasetError,
    DatasetWriter,
    GlobalBatch,
    GlobalBatchSampler,
    SequenceSource,
    TokenDataset,
    TokenizerInfo,
    eval_batches,
    python_source_files,
    write_dataset,
)
from .mixture import (
    MixedDataset,
    MixtureSampler,
    batch_sources,
    eval_spec,
    format_data_spec,
    open_data,
    parse_data_spec,
)
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
    "DatasetError",
    "DatasetWriter",
    "EOS_TOKEN",
    "GlobalBatch",
    "GlobalBatchSampler",
    "LONG_DOC_POLICIES",
    "PAD_TOKEN",
    "LoadedTokenizer",
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
    "parse_data_spec",
    "prepare",
    "python_source_files",
    "train_tokenizer",
    "write_dataset",
]
