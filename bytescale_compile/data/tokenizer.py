"""Tokenizers: train a byte-level BPE on users' text, and load any Hugging Face tokenizer directory.

A trained tokenizer is saved with `save_pretrained`, so `transformers.AutoTokenizer.from_pretrained(DIR)`
loads it. It defines two special tokens: `<|endoftext|>` (id 0, the EOS token `data prepare` appends to
every document) and `<|pad|>` (id 1, the pad token); it adds no BOS. Byte-level means every string
round-trips through encode/decode and no character is ever unknown.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from .dataset import TokenizerInfo
from .sources import SourceError, SourceStats, read_documents, resolve_inputs

__all__ = [
    "EOS_TOKEN",
    "PAD_TOKEN",
    "LoadedTokenizer",
    "TokenizerError",
    "TrainedTokenizer",
    "load_tokenizer",
    "train_tokenizer",
]

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
_SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN)
_BYTE_ALPHABET = 256
_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja")
"""Read by every tokenizer class besides its own vocabulary files: part of its identity."""


class TokenizerError(ValueError):
    """A tokenizer directory that cannot be loaded or used; names the directory."""


@dataclass(frozen=True)
class TrainedTokenizer:
    path: Path
    vocab_size: int
    """What training reached: at most the requested size (a small corpus runs out of merges)."""
    special_tokens: dict[str, int]
    sources: SourceStats

    def summary(self) -> str:
        specials = ", ".join(f"{t} = {i}" for t, i in self.special_tokens.items())
        return f"{self.sources.summary()}\ntokenizer: {self.path}, vocab {self.vocab_size} (special tokens {specials})"


def train_tokenizer(
    inputs: Sequence[str | Path],
    vocab_size: int,
    out: str | Path,
    *,
    text_field: str = "text",
    min_frequency: int = 2,
    overwrite: bool = False,
    progress: bool = False,
) -> TrainedTokenizer:
    """Train a byte-level BPE on the documents of `inputs` (formats as in `sources`) and save it to `out`.
    `progress`: the tokenizers library's bar on stderr, drawn only when stderr is a terminal."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    smallest = _BYTE_ALPHABET + len(_SPECIAL_TOKENS)
    if vocab_size < smallest:
        raise ValueError(
            f"vocab_size must be at least {smallest} (256 byte symbols + {len(_SPECIAL_TOKENS)} "
            f"special tokens), got {vocab_size}"
        )
    out = Path(out)
    existing = [p for p in (out / "tokenizer.json", out / "tokenizer_config.json") if p.exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{existing[0]} exists: pass overwrite (--overwrite) to replace the tokenizer in {out}")
    stats = SourceStats()
    documents = read_documents(resolve_inputs(inputs), text_field, stats)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        show_progress=progress and sys.stderr.isatty(),  # without a terminal the bar prints empty lines
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(documents, trainer)
    if stats.documents == 0:
        raise SourceError(f"no documents to train on in {[str(p) for p in inputs]}:\n{stats.summary()}")
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN).save_pretrained(out)
    specials = {token: cast(int, bpe.token_to_id(token)) for token in _SPECIAL_TOKENS}  # the trainer added each
    return TrainedTokenizer(out, bpe.get_vocab_size(), specials, stats)


@dataclass(frozen=True)
class LoadedTokenizer:
    tokenizer: Any
    """A `transformers` tokenizer (`PreTrainedTokenizerBase`)."""
    info: TokenizerInfo
    vocab_size: int
    """One past the largest id the tokenizer can produce, added tokens included."""


def load_tokenizer(path: str | Path) -> LoadedTokenizer:
    """A local tokenizer directory, through `AutoTokenizer` (never the Hub); it must define an EOS token."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise TokenizerError(
            f"tokenizer directory {path} does not exist (expected a directory saved with "
            f"save_pretrained, or one made by `bytescale-compile tokenizer train`)"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TokenizerError(f"cannot load a tokenizer from {path}: {e}") from e
    if tokenizer.eos_token_id is None:
        raise TokenizerError(
            f"the tokenizer in {path} defines no EOS token, which is appended to every document: "
            f"add one (tokenizer.add_special_tokens({{'eos_token': ...}}), then save_pretrained)"
        )
    vocab_size = max(len(tokenizer), max(tokenizer.get_vocab().values()) + 1)
    info = TokenizerInfo(str(path.resolve()), _sha256(path, tokenizer), int(tokenizer.eos_token_id))
    return LoadedTokenizer(tokenizer, info, vocab_size)


def _sha256(path: Path, tokenizer: Any) -> str:
    """Over the files the tokenizer reads (names and contents), not model weights saved beside them."""
    names = sorted(set(tokenizer.vocab_files_names.values()) | set(_CONFIG_FILES))
    digest = hashlib.sha256()
    for name in names:
        if (path / name).is_file():
            content = (path / name).read_bytes()
            digest.update(f"{name}\0{len(content)}\0".encode())
            digest.update(content)
    return digest.hexdigest()
