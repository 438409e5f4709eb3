"""Triton kernels on one GPU: fused softmax cross-entropy and packed segment-causal flash attention.

Cross-entropy, bf16 logits [T, V] (T = 8K, 32K; V = 32K, 128K), forward + backward to d(loss)/d(logits),
reduction "sum":
  - torch:  ``F.cross_entropy(logits.float(), target)`` and ``backward`` (what eager models run);
  - liger:  Liger-Kernel's ``LigerCrossEntropyLoss``, when ``liger_kernel`` is importable;
  - triton: ``cross_entropy_grad_``, which overwrites the logits with their gradient.
Time is ``triton.testing.do_bench``'s median; memory is the peak allocated during one call above what
was allocated before it (the logits and targets).

Attention, packed rows of 8K and 32K tokens holding sequences of halving lengths (T/2, T/4, ...,
down to 512, then the rest), Hq=32, Hkv=8, D=128, bf16, forward + backward:
  - sdpa:   ``scaled_dot_product_attention`` (flash backend) sequence by sequence, causal, on K/V
            expanded to Hq heads beforehand (the unpacked equivalent of the packed row);
  - triton: ``attention_fwd`` + ``attention_bwd`` once over the packed row with its cu_seqlens.
TFLOP/s count the causal work of both: 3.5 × (4 · Σ L²/2 · D · Hq) (backward = 2.5 × forward).
Each row also prints the largest error of the Triton result against the other one.

Skewed packing, same heads: one 16K sequence alone, then with 1,000 sequences of
16 tokens after it, forward + backward of the Triton kernels. The flat (segment, block) grid makes the
second cost about what its extra 16K tokens of tiny sequences cost (the former grid took 2.8×).

Without CUDA it prints that and exits 0; ``--cpu-smoke`` instead runs tiny shapes in Triton's
interpreter (fp32) and prints only the errors, as a check that the script itself works.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CE_SHAPES = [(8192, 32768), (8192, 131072), (32768, 32768), (32768, 131072)]
ATTN_TOKENS = [8192, 32768]
HQ, HKV, D = 32, 8, 128
SMOKE_CE_SHAPES = [(64, 500)]
SMOKE_ATTN_TOKENS = [96]
SMOKE_HQ, SMOKE_HKV, SMOKE_D = 4, 2, 16
SKEW = (16384, 1000, 16)
"""One long sequence, then this many short ones of this length."""
SMOKE_SKEW = (48, 3, 4)


def halving_lengths(total: int, smallest: int) -> list[int]:
    """T/2, T/4, ... while at least `smallest`, then the remainder as one last sequence."""
    lengths, left = [], total
    while left // 2 >= smallest:
        lengths.append(left // 2)
        left -= left // 2
    return lengths + [left]


def measure(fn: Callable[[], object], device: str) -> tuple[float, float]:
    """(median ms, peak MiB above the memory allocated before the call) of `fn`."""
    import torch
    import triton.testing

    if device != "cuda":
        fn()
        return float("nan"), float("nan")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return triton.testing.do_bench(fn), peak


def max_err(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


# --- cross-entropy --------------------------------------------------------------------------------


def bench_cross_entropy(tokens: int, vocab: int, dtype, device: str) -> list[tuple]:
    import torch
    import torch.nn.functional as F

    from bytescale_compile.kernels.cross_entropy_triton import cross_entropy_grad_

    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(tokens, vocab, generator=gen, device=device, dtype=dtype).requires_grad_()
    target = torch.randint(0, vocab, (tokens,), generator=gen, device=device)

    def eager():
        logits.grad = None
        F.cross_entropy(logits.float(), target, reduction="sum").backward()

    eager_ms, eager_mib = measure(eager, device)
    want, logits.grad = logits.grad, None
    logits = logits.detach()
    rows = [("torch (fp32 upcast)", eager_ms, eager_mib, float("nan"))]

    try:
        from liger_kernel.transformers import LigerCrossEntropyLoss
    except ImportError:
        LigerCrossEntropyLoss = None
    if LigerCrossEntropyLoss is not None and device == "cuda":
        liger_loss = LigerCrossEntropyLoss(reduction="sum")
        liger_leaf = logits.clone().requires_grad_()
        liger_ms, liger_mib = measure(lambda: liger_loss(liger_leaf, target).backward(), device)
        rows.append(("liger", liger_ms, liger_mib, float("nan")))
        del liger_leaf

    weight = torch.ones(1, device=device)
    cross_entropy_grad_(logits, target, -100, weight)  # first call on the real logits, for the error
    err = max_err(logits, want)
    del want
    # later calls overwrite gradients with their own gradients: the same work on finite values
    triton_ms, triton_mib = measure(lambda: cross_entropy_grad_(logits, target, -100, weight), device)
    rows.append(("triton (in place)", triton_ms, triton_mib, err))
    return rows


# --- attention ------------------------------------------------------------------------------------


def sdpa_per_sequence(q, k, v, grad, cu: list[int], scale: float, device: str) -> tuple[float, float, tuple]:
    """(ms, peak MiB, (out, dq, dk, dv)) of SDPA run sequence by sequence on K/V expanded to Hq heads."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    n_rep = q.shape[1] // k.shape[1]
    leaves = [x.clone().requires_grad_() for x in (q, k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1))]
    backends = [SDPBackend.FLASH_ATTENTION] if device == "cuda" else [SDPBackend.MATH]

    def sdpa():
        for x in leaves:
            x.grad = None
        with sdpa_kernel(backends):
            out = torch.cat(
                [
                    F.scaled_dot_product_attention(*(x[:, :, s:e] for x in leaves), is_causal=True, scale=scale)
                    for s, e in itertools.pairwise(cu)
                ],
                dim=2,
            )
        out.backward(grad)
        return out.detach()

    ms, mib = measure(sdpa, device)
    grads = (x.grad.unflatten(1, (k.shape[1], n_rep)).sum(2) for x in leaves[1:])
    return ms, mib, (sdpa(), leaves[0].grad, *grads)


def bench_attention(tokens: int, heads: tuple[int, int, int], dtype, device: str, smallest: int) -> list[tuple]:
    import torch

    from bytescale_compile.kernels.attention_triton import attention_bwd, attention_fwd

    hq, hkv, d = heads
    lengths = halving_lengths(tokens, smallest)
    cu = [0, *itertools.accumulate(lengths)]
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, h, tokens, d, generator=gen, device=device, dtype=dtype) for h in (hq, hkv, hkv))
    grad = torch.randn_like(q)
    scale = d**-0.5
    flops = 3.5 * sum(4 * n * n / 2 * d * hq for n in lengths)
    sdpa_ms, sdpa_mib, want = sdpa_per_sequence(q, k, v, grad, cu, scale, device)

    def fused():
        out, lse = attention_fwd(q, k, v, scale, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
        return (out, *attention_bwd(grad, q, k, v, out, lse, scale, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu))

    triton_ms, triton_mib = measure(fused, device)
    err = max(max_err(a, b) for a, b in zip(fused(), want))
    tflops = [flops / (ms * 1e-3) / 1e12 for ms in (sdpa_ms, triton_ms)]
    return [
        ("sdpa (flash, per sequence)", sdpa_ms, sdpa_mib, tflops[0], float("nan")),
        ("triton (packed)", triton_ms, triton_mib, tflops[1], err),
    ]


def bench_skew(skew: tuple[int, int, int], heads: tuple[int, int, int], dtype, device: str) -> list[tuple]:
    """(packing, ms) of the long sequence alone and with the short ones after it."""
    import torch

    from bytescale_compile.kernels.attention_triton import attention_bwd, attention_fwd

    long, n_short, short = skew
    hq, hkv, d = heads
    rows = []
    for name, lengths in ((f"{long} alone", [long]), (f"{long} + {n_short} x {short}", [long] + [short] * n_short)):
        tokens, cu = sum(lengths), [0, *itertools.accumulate(lengths)]
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(1, h, tokens, d, generator=gen, device=device, dtype=dtype) for h in (hq, hkv, hkv))
        grad = torch.randn_like(q)

        def fused(q=q, k=k, v=v, grad=grad, cu=cu):
            out, lse = attention_fwd(q, k, v, d**-0.5, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
            attention_bwd(grad, q, k, v, out, lse, d**-0.5, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)

        rows.append((name, measure(fused, device)[0]))
    return rows


# --- main -----------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="tiny shapes in Triton's interpreter on CPU: checks the script, times nothing",
    )
    args = parser.parse_args()
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before torch, which imports triton
    import torch

    if args.cpu_smoke:
        device, dtype = "cpu", torch.float32
        ce_shapes, attn_tokens, heads, smallest = SMOKE_CE_SHAPES, SMOKE_ATTN_TOKENS, (SMOKE_HQ, SMOKE_HKV, SMOKE_D), 16
        skew = SMOKE_SKEW
    elif torch.cuda.is_available():
        device, dtype = "cuda", torch.bfloat16
        ce_shapes, attn_tokens, heads, smallest = CE_SHAPES, ATTN_TOKENS, (HQ, HKV, D), 512
        skew = SKEW
    else:
        print("benchmarks/kernels.py needs a CUDA GPU (none found); run with --cpu-smoke for an interpreter check.")
        return

    print(f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu (interpreter)'}, {dtype}")
    print(
        f"\ncross-entropy forward+backward, reduction sum\n{'T':>6} {'V':>7} {'variant':<22} {'ms':>9} "
        f"{'peak MiB':>9} {'max err':>9}"
    )
    for tokens, vocab in ce_shapes:
        for name, ms, mib, err in bench_cross_entropy(tokens, vocab, dtype, device):
            print(f"{tokens:>6} {vocab:>7} {name:<22} {ms:>9.3f} {mib:>9.0f} {err:>9.2e}")
    print(
        f"\nattention forward+backward, Hq={heads[0]} Hkv={heads[1]} D={heads[2]}, causal within each sequence\n"
        f"{'T':>6} {'variant':<27} {'ms':>9} {'peak MiB':>9} {'TFLOP/s':>8} {'max err':>9}"
    )
    for tokens in attn_tokens:
        for name, ms, mib, tflops, err in bench_attention(tokens, heads, dtype, device, smallest):
            print(f"{tokens:>6} {name:<27} {ms:>9.3f} {mib:>9.0f} {tflops:>8.1f} {err:>9.2e}")
    print(f"\nskewed packing, attention forward+backward (Triton)\n{'packing':<24} {'ms':>9} {'× alone':>8}")
    rows = bench_skew(skew, heads, dtype, device)
    for name, ms in rows:
        print(f"{name:<24} {ms:>9.3f} {ms / rows[0][1]:>8.2f}")


if __name__ == "__main__":
    main()
