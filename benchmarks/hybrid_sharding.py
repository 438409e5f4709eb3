"""One long sequence shared by CPU ranks (gloo) through the `Runtime`: a hybrid Bamba against attention only.

Two tiny Bamba models (4 layers, hidden 64, fp32, vocab 128; Mamba2 heads 8 x 16, d_state 16, 1 group, chunk
64) each train one step on one sequence of `--tokens` shared by `--ranks` ranks (naive plan without
offloading, capacity tokens / ranks), after one untimed warm-up step on a `--warmup-tokens` sequence: (a) the
hybrid, attention in layer 1 and Mamba2 in layers 0, 2, 3; (b) attention in every layer. Attention runs as a
packed zigzag ring whose K/V bytes grow with the tokens; the Mamba2 layers pass convolution halos and chunk
states (LASP-2 style), whose bytes do not.

Per model it prints the bytes each rank moved in the step (sent + received, mean over the ranks, from
`StepStats.p2p_bytes` and its share `mixer_bytes`: ring K/V, and the mixers' halos and states), the bytes each rank sent next to the
cost model's prediction (`runtime.cost_model.ring_bytes(tokens / ranks, ranks)`, its mixer fields filled
from the compile report), and the step time (`StepStats.time`). Figures are printed, never asserted. On a
2-core machine the ranks oversubscribe the cores: the times show the work, not the overlap of P2P with compute.

    python benchmarks/hybrid_sharding.py [--tokens 65536] [--ranks 4] [--warmup-tokens 4096]
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bytescale_compile as bsc  # noqa: E402
from bytescale_compile.planner import plan  # noqa: E402
from bytescale_compile.testing import run_distributed  # noqa: E402

log = logging.getLogger("hybrid_sharding")
VOCAB, LAYERS = 128, 4
MODELS = {"hybrid 1:3": [1], "attention only": [0, 1, 2, 3]}
"""Model name -> Bamba's `attn_layer_indices` (the other layers are Mamba2)."""
MIB = 2**-20


def bamba(attention_layers: list[int]) -> torch.nn.Module:
    """A tiny random Bamba with softmax attention in `attention_layers` and Mamba2 elsewhere, fp32, seeded."""
    import transformers

    torch.manual_seed(0)
    config = transformers.BambaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1 << 20,
        use_cache=False,
        pad_token_id=0,
        attn_layer_indices=attention_layers,
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_chunk_size=64,
        mamba_expand=2,
    )
    return transformers.BambaForCausalLM(config).float().train()


def _step(runtime: bsc.Runtime, tokens: int, world: int) -> bsc.StepStats:
    """One training step on one random sequence of `tokens` shared by all `world` ranks."""
    sequence = torch.randint(0, VOCAB, (tokens,), generator=torch.Generator().manual_seed(tokens))
    shared = plan(
        [tokens],
        world_size=world,
        capacity=math.ceil(tokens / world),
        cost_model=runtime.cost_model,
        strategy="naive",
        offload=False,
    )
    if [len(mb.ranks) for mb in shared.micro_batches] != [world]:
        raise RuntimeError(f"the plan does not share the sequence over all {world} ranks: {shared}")
    return runtime.step([sequence], plan=shared)


def _worker(rank: int, world: int, tokens: int, warmup_tokens: int) -> None:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format=f"rank {rank}: %(message)s")
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    rows = []
    for name, attention_layers in MODELS.items():
        model = bamba(attention_layers)
        runtime = bsc.Runtime(model, torch.optim.SGD(model.parameters(), lr=1e-3), capacity=tokens)
        _step(runtime, warmup_tokens, world)
        stats = _step(runtime, tokens, world)
        cost = runtime.cost_model
        log.info(
            "%s: step %.1f s, %d mixer layers of %d B per chunk boundary charged, %d compilations",
            name,
            stats.time,
            cost.mixer_layers,
            cost.mixer_state_bytes,
            runtime.model.compilations,
        )
        sent, mixer = stats.p2p_bytes / world, stats.mixer_bytes / world  # per rank; what all send, all receive
        predicted_mixer = float(cost.ring_bytes(0, world))
        predicted_kv = float(cost.ring_bytes(tokens / world, world)) - predicted_mixer
        layers = f"{len(attention_layers)}/{LAYERS - len(attention_layers)}"
        rows.append(
            f"| {name} | {layers} | {2 * (sent - mixer) * MIB:.2f} | {2 * mixer * MIB:.2f} "
            f"| {2 * sent * MIB:.2f} | {(sent - mixer) * MIB:.2f} + {mixer * MIB:.2f} "
            f"| {predicted_kv * MIB:.2f} + {predicted_mixer * MIB:.2f} | {stats.time:.1f} |"
        )
    if rank == 0:
        print(
            f"\nBamba (4 layers, hidden 64, fp32), one sequence of {tokens} tokens shared by {world} CPU ranks "
            f"(gloo), one step after a warm-up on {warmup_tokens} tokens. MiB per rank per step, mean over the "
            f"ranks (whose sends are their receives: sent = moved / 2). The cost model (analytic, from the config) "
            f"counts K/V at {cost.kv_bytes_per_token} B per token and attention layer (bf16); this fp32 run moves "
            f"twice that.\n"
        )
        print(
            "| model | layers (attention/mixer) | ring K/V moved | mixer halos+states moved | total moved "
            "| sent: K/V + mixer | predicted sent (`ring_bytes`): K/V + mixer | step s |"
        )
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        print("\n".join(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--warmup-tokens", type=int, default=4096)
    args = parser.parse_args()
    run_distributed(_worker, args.ranks, args.tokens, min(args.warmup_tokens, args.tokens))


if __name__ == "__main__":
    main()
