"""The model protocol's inputs, built in one place for the engine, the CLI, the tests and the benchmarks.

A causal LM under the protocol is called with `input_ids [1, T]` (one packed row), `position_ids` restarting at
every packed sequence (what tells the attention where a sequence starts), `shift_labels` (each token's next token,
-100 at every sequence's last token: nothing follows it) and `num_items_in_batch` (the valid targets of the whole
global batch, so a summed loss divided by it is token-level across ranks and micro-batches). A Hugging Face forward
also reads `labels` (= `shift_labels`) and takes `use_cache`.

Every builder keeps the tensors on the device of the token ids it is given and draws no random numbers of its own
(`model_inputs`, which draws a row for a model, excepted): callers that draw tokens on a device or with their own
generator keep their exact draws.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "IGNORE_INDEX",
    "ModelProtocolError",
    "ProtocolInputs",
    "forward_kwargs",
    "model_inputs",
    "next_token_labels",
    "num_targets",
    "packed_row",
    "restarting_positions",
]

IGNORE_INDEX = -100
"""The target of a token that has no next token (a sequence's last): the loss skips it."""

PROTOCOL_NAMES = ("input_ids", "position_ids", "shift_labels", "num_items_in_batch")


class ModelProtocolError(TypeError):
    """The model does not take or return what the runtime's model protocol needs (see docs/design.md)."""


@dataclass(frozen=True)
class ProtocolInputs:
    """One packed row of the protocol: ids, positions and targets `[1, T]`, and the global batch's target count."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    shift_labels: torch.Tensor
    num_items_in_batch: torch.Tensor

    def kwargs(self, *, labels: bool = False) -> dict[str, torch.Tensor]:
        """The forward's keyword arguments; `labels` adds `labels` = `shift_labels` (where a Hugging Face forward
        reads its targets)."""
        kwargs = {name: getattr(self, name) for name in PROTOCOL_NAMES}
        return {**kwargs, "labels": self.shift_labels} if labels else kwargs

    def to(self, device: torch.device | str) -> ProtocolInputs:
        return ProtocolInputs(**{name: getattr(self, name).to(device) for name in PROTOCOL_NAMES})


def num_targets(lengths: Sequence[int] | np.ndarray) -> int:
    """Valid next-token targets of sequences of `lengths` tokens: every token but each sequence's last."""
    return int((np.asarray(lengths, dtype=np.int64) - 1).sum())


def next_token_labels(tokens: torch.Tensor, *, ends_sequence: bool = True) -> torch.Tensor:
    """The next-token targets of a piece of one sequence, along the last dimension of `tokens`.

    `ends_sequence`: the piece is its sequence's end, and its last target is `IGNORE_INDEX`. Otherwise `tokens`
    hold one token read past the piece (its last token's target, on the next piece or another rank's chunk),
    and the targets are one shorter than `tokens`."""
    labels = tokens[..., 1:]
    if not ends_sequence:
        return labels
    end = torch.full((*tokens.shape[:-1], 1), IGNORE_INDEX, dtype=tokens.dtype, device=tokens.device)
    return torch.cat([labels, end], dim=-1)


def restarting_positions(lengths: Sequence[int], *, device: torch.device | str | None = None) -> torch.Tensor:
    """`[T]` positions of a row packing sequences of `lengths` tokens: 0, 1, ... restarting at every sequence."""
    return torch.cat([torch.arange(n, device=device) for n in lengths])


def packed_row(input_ids: torch.Tensor, lengths: Sequence[int], *, num_items: int | None = None) -> ProtocolInputs:
    """The protocol's inputs of one row `input_ids` (`[T]` or `[1, T]`) packing whole sequences of `lengths` tokens,
    on the ids' device. `num_items` counts the global batch's targets (default: this row's, `num_targets(lengths)`)."""
    ids = input_ids.reshape(-1)
    lengths = [int(n) for n in lengths]
    if not lengths or min(lengths) < 1 or sum(lengths) != ids.numel():
        raise ValueError(
            f"a packed row of {ids.numel()} tokens cannot hold sequences of lengths {lengths}: give each "
            f"sequence's token count (>= 1), summing to the row's"
        )
    pieces = torch.split(ids, lengths)
    labels = torch.cat([next_token_labels(piece) for piece in pieces])
    count = num_targets(lengths) if num_items is None else num_items
    return ProtocolInputs(
        input_ids=ids[None],
        position_ids=restarting_positions(lengths, device=ids.device)[None],
        shift_labels=labels[None],
        num_items_in_batch=torch.tensor(count, device=ids.device),
    )


def forward_kwargs(model: nn.Module, row: ProtocolInputs) -> dict[str, Any]:
    """`row` as `model.forward` takes it: with `labels` and `use_cache=False` where the forward names them (a
    Hugging Face model). A forward that takes no protocol inputs is refused before it is called."""
    params = inspect.signature(model.forward).parameters
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    missing = [name for name in PROTOCOL_NAMES if name not in params and not takes_kwargs]
    if missing:
        raise ModelProtocolError(
            f"{type(model).__name__}.forward does not take {missing}: models are called with the causal-LM "
            f"protocol (input_ids, position_ids, shift_labels, num_items_in_batch)"
        )
    inputs: dict[str, Any] = row.kwargs(labels="labels" in params)
    if "use_cache" in params:
        inputs["use_cache"] = False
    return inputs


def model_inputs(model: nn.Module, seq_len: int, *, vocab_size: int | None = None) -> dict[str, Any]:
    """One row of one random sequence of `seq_len` tokens (torch's global generator) as `model.forward` takes it
    (`forward_kwargs`): what compiling a model for a report needs. The ids are drawn below `vocab_size`, by
    default the model's `config.vocab_size`."""
    vocab = vocab_size or getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is None:
        raise ModelProtocolError(f"{type(model).__name__} has no config.vocab_size: give vocab_size")
    ids = torch.randint(0, vocab, (1, seq_len))
    return forward_kwargs(model, packed_row(ids, [seq_len]))
