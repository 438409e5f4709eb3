"""`bytescale::router_balance_weights` and `bytescale::count_experts`: an MoE router's load-balancing loss per
sequence, and the expert counts of aux-loss-free balancing.

Hugging Face's `load_balancing_loss_func` (Switch Transformer eqs. 4-6, the same function in every MoE causal LM
of transformers 5.24 that has one) takes the router logits of the L MoE layers over the T rows of one call:

    LB = E * sum_i f_i P_i,   f_i = C_i / (L T),   P_i = sum_{l,t} p_{l,t,i} / (L T)

with C_i the top-k assignments to expert i (no gradient) and p the softmax of the logits. Called per micro-batch,
it mixes whatever sequences a plan packed together and sees only a rank's part of a shared one. LB is linear in
p, LB = sum_{l,t,i} p_{l,t,i} W_{t,i} with W_{t,i} = E C_i / (L T)^2, so the op returns the constant W, read from
the micro-batch context at run time, and the graph multiplies it into the probabilities (autograd sees a plain
product). Per sequence s of S_s tokens and n_s = S_s - 1 targets, N targets in the global batch:

    W_{t,i} = (n_s / N) E C_{s,i} / (L S_s)^2   for every token t of s,

weighted like the sequence's token-level cross-entropy. A shared sequence's counts C_{s,i} are summed over the
ranks of its ring or Ulysses group first (one small exchange): each rank's sum over its own tokens is then its
part of the sequence's loss and gradient. Without a context, or one that packs nothing, the call's rows are one
segment of weight 1: Hugging Face's function.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from bytescale_compile.runtime.context import ContextError, current_context, innermost
from bytescale_compile.runtime.expert_load import RouterTally
from bytescale_compile.runtime.p2p import P2PStats, Peers, make_peers

__all__ = ["router_balance_weights", "count_experts"]


@dataclass(frozen=True)
class _Segments:
    """Which sequence each of a call's tokens belongs to, each sequence's whole length and weight, and the peers
    holding the rest of a shared sequence (None: every sequence is whole here)."""

    seq_of_token: Tensor
    lengths: list[int]
    weights: list[float]
    peers: Peers | None


def _segments(tokens: int) -> _Segments:
    ctx = current_context()
    if ctx is None or not (ctx.is_ring or ctx.cu_seqlens is not None):
        return _Segments(torch.zeros(tokens, dtype=torch.long), [tokens], [1.0], None)
    if ctx.num_items is None:
        raise ContextError(
            f"micro-batch {ctx.micro_batch_id}: the router's load-balancing loss of packed or shared sequences "
            f"weighs each sequence by its share of the global batch's targets, but the context has no num_items; "
            f"pass MicroBatchContext(num_items=...) (the Runtime does)"
        )
    peers = None
    if ctx.is_ring:
        assert ctx.group is not None and ctx.layout is not None
        peers = make_peers(ctx.group, len(ctx.group), ctx.ring_timeout_s, P2PStats(), "ring group")
        lengths = list(ctx.layout.seq_lens)
        pieces = ctx.split_layout.rank(peers.index).pieces
        seq_of_token = torch.full((tokens,), -1, dtype=torch.long)
        for piece in pieces:
            seq_of_token[piece.offset : piece.offset + piece.length] = piece.seq
        if sum(p.length for p in pieces) != tokens or bool((seq_of_token < 0).any()):
            raise ContextError(
                f"micro-batch {ctx.micro_batch_id}: the router logits cover {tokens} tokens, not this rank's tokens "
                f"of the shared sequences"
            )
    else:
        ctx.check_tokens(tokens)
        lengths = ctx.seq_lens
        seq_of_token = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return _Segments(seq_of_token, lengths, [(n - 1) / ctx.num_items for n in lengths], peers)


@torch.library.custom_op("bytescale::router_balance_weights", mutates_args=())
def router_balance_weights(selected: Tensor, probs: Tensor, num_experts: int) -> Tensor:
    """W [T, E] (float32) such that sum(p * W) over p [L, T, E] is the call's load-balancing loss.

    `selected` [L, T, k]: each token's top-k experts in each MoE layer; `probs` (no gradient) only tallies the loss
    and the expert counts into an ambient `RouterTally`.
    """
    layers, tokens, _ = selected.shape
    device = selected.device
    seg = _segments(tokens)
    seq = seg.seq_of_token.to(device)
    flat = (seq[None, :, None] * num_experts + selected).reshape(-1)
    counts = torch.zeros(len(seg.lengths) * num_experts, dtype=torch.float64, device=device)
    counts.index_add_(0, flat, torch.ones(flat.numel(), dtype=torch.float64, device=device))
    counts = counts.view(len(seg.lengths), num_experts)
    if seg.peers is not None:
        others = [i for i in range(seg.peers.size) if i != seg.peers.index]
        got = seg.peers.exchange(
            {i: counts for i in others},
            {i: (tuple(counts.shape), counts.dtype) for i in others},
            "the router's expert counts",
            device,
        )
        counts = counts + sum(got.values())
    lengths = torch.tensor(seg.lengths, dtype=torch.float64, device=device)
    scale = torch.tensor(seg.weights, dtype=torch.float64, device=device) * num_experts / (layers * lengths) ** 2
    weights = (counts * scale[:, None]).to(torch.float32)[seq]
    tally = innermost(RouterTally)
    if tally is not None:
        tally.add_aux_loss((probs.float() * weights).sum())
        if not tally.counted_by_routers:
            per_layer = torch.zeros(layers, num_experts, dtype=torch.float64, device=device)
            index = selected.reshape(layers, -1)
            per_layer.scatter_add_(1, index, torch.ones(index.shape, dtype=torch.float64, device=device))
            tally.add_counts(0, per_layer)
    return weights


@router_balance_weights.register_fake
def _(selected: Tensor, probs: Tensor, num_experts: int) -> Tensor:
    return selected.new_empty((selected.shape[1], num_experts), dtype=torch.float32)


@torch.library.custom_op("bytescale::count_experts", mutates_args=())
def count_experts(indices: Tensor, layer: int, num_experts: int) -> Tensor:
    """`indices` (a router's top-k experts per token) as they are, counted into row `layer` of an ambient
    `RouterTally`: what aux-loss-free balancing updates the expert bias from."""
    tally = innermost(RouterTally)
    if tally is not None:
        counts = torch.bincount(indices.reshape(-1), minlength=num_experts).to(torch.float64)
        tally.add_counts(layer, counts[None])
    return indices.clone()


@count_experts.register_fake
def _(indices: Tensor, layer: int, num_experts: int) -> Tensor:
    return torch.empty_like(indices)
