"""Every table of issue 18 on one CUDA GPU, in one command: `python benchmarks/gpu.py`.

1. End to end, Hugging Face Llama 1.1B (hidden 2048, intermediate 5632, 32/4 heads, vocab 32K,
   bf16), one packed row in 6 sequences, forward + backward: eager, `bsc.optimize()` (default,
   `partitioner="default"`, `fused_loss=False`) and `torch.compile`, at 16K tokens (16 layers) and
   64K tokens (8 layers). Per variant: median step ms, peak GiB (`max_memory_allocated`, weights
   and gradients included) and the first call's seconds (compilation). Each variant runs in its own
   subprocess (this script with `--worker`), so no allocator cache or compiled graph carries over;
   one that runs out of memory prints "out of memory".
2. Fused linear cross-entropy, bf16, H = 4096, V = 128K, T = 8K and 32K, forward + backward: ours
   (`bytescale::fused_linear_cross_entropy`), Liger-Kernel's FLCE and Cut Cross-Entropy when
   importable, and torch (`F.cross_entropy(F.linear(h, W).float(), t)`). Median ms
   (`triton.testing.do_bench`) and peak GiB above the inputs.
3. The kernels: `benchmarks/kernels.py` (cross-entropy and packed attention against torch/Liger/SDPA).
4. Offload: `benchmarks/offload.py --device cuda --tokens 16K,32K` (memory, overhead, overlap at r = 0.5, 1).
5. Pipeline stages (issue 16): the 16-layer Llama of table 1 split into pp = 1, 2, 4 stages
   (`split_stages`), each stage alone through `bsc.optimize()` on the GPU as its rank would hold it (the
   other stages' weights stay on the host), forward + backward of 16K tokens (a stage after the first
   fed random hidden states, its backward a random gradient): median ms, peak GiB, the attention sites
   the pass rewrote and whether the loss was fused. Each stage runs in its own subprocess.

Figures are printed, never asserted. Without CUDA it says so and exits 0; `--smoke` instead runs
tables 1, 2 and 5 with tiny shapes on the CPU, in this process, as a check that the script works.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

GIB = 2**30
E2E_RUNS = (  # (tokens, layers, variants)
    (16_384, 16, ("eager", "optimize", "optimize_default_partitioner", "optimize_no_fused_loss", "torch_compile")),
    (65_536, 8, ("eager", "torch_compile", "optimize")),
)
VARIANT_NAMES = {
    "eager": "eager",
    "optimize": "`bsc.optimize()` (min-cut on CUDA)",
    "optimize_default_partitioner": '`bsc.optimize(partitioner="default")`',
    "optimize_no_fused_loss": "`bsc.optimize(fused_loss=False)`",
    "torch_compile": "`torch.compile`",
}
N_SEQUENCES = 6
LOSS_HIDDEN, LOSS_VOCAB, LOSS_TOKENS = 4096, 131_072, (8192, 32_768)
SMOKE_E2E = (64, 2)
STAGE_RUN = (16_384, 16, (1, 2, 4))
"""Table 5: tokens, layers, pipeline sizes."""
SMOKE_LOSS = (32, 500, (48,))


@dataclass
class Figures:
    """One row of a table: median ms, peak GiB and first-call seconds (None where not measured)."""

    ms: float | None = None
    peak_gib: float | None = None
    first_s: float | None = None
    error: str | None = None


# --- end to end -----------------------------------------------------------------------------------


def llama(layers: int, smoke: bool) -> Any:
    """The 1.1B Hugging Face Llama (random weights, nothing downloaded), or a tiny one for `--smoke`."""
    import transformers

    if smoke:
        cfg = transformers.LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            use_cache=False,
        )
    else:
        cfg = transformers.LlamaConfig(
            vocab_size=32_000,
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=layers,
            num_attention_heads=32,
            num_key_value_heads=4,
            max_position_embeddings=65_536,
            use_cache=False,
        )
    return transformers.LlamaForCausalLM(cfg)


def packed_batch(tokens: int, vocab: int, device: str) -> dict[str, Any]:
    """One row of `tokens` tokens in N_SEQUENCES sequences: restarting positions, -100 at each end."""
    import torch

    lengths = [tokens // N_SEQUENCES] * (N_SEQUENCES - 1)
    lengths.append(tokens - sum(lengths))
    ids = torch.randint(0, vocab, (1, tokens), device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
    labels = ids.roll(-1, dims=1)
    labels[0, torch.tensor(lengths, device=device).cumsum(0) - 1] = -100
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


def wrap(model: Any, variant: str) -> Any:
    import torch

    import bytescale_compile as bsc

    options = {
        "optimize": {},
        "optimize_default_partitioner": {"partitioner": "default"},
        "optimize_no_fused_loss": {"fused_loss": False},
    }
    if variant in options:
        return bsc.optimize(model, **options[variant])
    return torch.compile(model) if variant == "torch_compile" else model


def timed_steps(step: Callable[[], None], repeats: int, device: str) -> Figures:
    """First call's seconds, then the median of `repeats` steps and the peak memory over them."""
    import torch

    def run() -> float:
        start = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    first = run()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = [run() for _ in range(repeats)]
    peak = torch.cuda.max_memory_allocated() / GIB if device == "cuda" else None
    return Figures(ms=1e3 * statistics.median(times), peak_gib=peak, first_s=first)


def e2e_variant(variant: str, tokens: int, layers: int, smoke: bool, repeats: int) -> Figures:
    """Build, wrap and step one variant; an out-of-memory error becomes a row that says so."""
    import torch

    device = "cpu" if smoke else "cuda"
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: a 1.1B model's CPU init takes longer than its steps
        model = llama(layers, smoke).to(torch.float32 if smoke else torch.bfloat16)
    batch = packed_batch(tokens, model.config.vocab_size, device)
    wrapped = wrap(model, variant)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        wrapped(**batch).loss.backward()

    try:
        return timed_steps(step, repeats, device)
    except torch.OutOfMemoryError:
        return Figures(error="out of memory")


def e2e_in_subprocess(variant: str, tokens: int, layers: int, repeats: int) -> Figures:
    cmd = [sys.executable, __file__, "--worker", f"{variant}:{tokens}:{layers}", "--repeats", str(repeats)]
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return Figures(error="out of memory" if "out of memory" in done.stderr else f"failed: {tail[0][:120]}")
    return Figures(**json.loads(lines[-1]))


def e2e_tables(smoke: bool, repeats: int, tokens_only: int | None) -> None:
    runs = ((SMOKE_E2E[0], SMOKE_E2E[1], E2E_RUNS[0][2]),) if smoke else E2E_RUNS
    runs = tuple(run for run in runs if tokens_only in (None, run[0]))
    for tokens, layers, variants in runs:
        print(f"\n## End to end: Llama, {tokens} tokens in {N_SEQUENCES} sequences, {layers} layers, fwd+bwd\n")
        print("| path | ms | peak GiB | first call |\n|---|---|---|---|")
        for variant in variants:
            row = (
                e2e_variant(variant, tokens, layers, smoke, repeats)
                if smoke
                else e2e_in_subprocess(variant, tokens, layers, repeats)
            )
            print(f"| {VARIANT_NAMES[variant]} | {_cells(row, first=True)} |")


# --- pipeline stages ------------------------------------------------------------------------------


def stage_variant(pp: int, index: int, tokens: int, layers: int, smoke: bool, repeats: int) -> dict[str, Any]:
    """Stage `index` of `pp` on the device alone, optimized, one forward + backward per step."""
    import torch

    import bytescale_compile as bsc
    from bytescale_compile.train.stages import split_stages, stage_inputs

    device = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else torch.bfloat16
    torch.manual_seed(0)
    model = llama(layers, smoke).to(dtype)
    stage = split_stages(model, pp)[index].to(device)
    batch = packed_batch(tokens, model.config.vocab_size, device)
    kwargs = {**batch, "shift_labels": batch["labels"], "num_items_in_batch": torch.tensor(tokens - N_SEQUENCES)}
    last = pp == 1 or stage.spec.is_last
    if pp > 1:
        hidden = (
            None
            if stage.spec.is_first
            else torch.randn(1, tokens, model.config.hidden_size, device=device, dtype=dtype, requires_grad=True)
        )
        kwargs = stage_inputs(stage.spec, kwargs, hidden)
    wrapped = bsc.optimize(stage)
    grad = None if last else torch.randn(1, tokens, model.config.hidden_size, device=device, dtype=dtype)

    def step() -> None:
        stage.zero_grad(set_to_none=True)
        out = wrapped(**kwargs)
        if last:
            out.loss.backward()
        else:
            out.backward(grad)

    try:
        figures = asdict(timed_steps(step, repeats, device))
    except torch.OutOfMemoryError:
        figures = asdict(Figures(error="out of memory"))
    return {
        **figures,
        "attention": len(wrapped.report.rewrites("attention")),
        "fused_loss": bool(wrapped.report.rewrites("fused_loss")),
    }


def stage_table(smoke: bool, repeats: int) -> None:
    tokens, layers, sizes = (SMOKE_E2E[0], 4, (1, 2)) if smoke else STAGE_RUN
    print(
        f"\n## Pipeline stages: Llama, {layers} layers, {tokens} tokens in {N_SEQUENCES} sequences, fwd+bwd, "
        f"each stage alone\n"
    )
    print(
        "| pp | stage | ms | peak GiB | first call | attention sites rewritten | loss fused |\n|---|---|---|---|---|---|---|"
    )
    for pp in sizes:
        for index in range(pp):
            if smoke:
                row = stage_variant(pp, index, tokens, layers, True, repeats)
            else:
                cmd = [
                    sys.executable,
                    __file__,
                    "--stage-worker",
                    f"{pp}:{index}:{tokens}:{layers}",
                    "--repeats",
                    str(repeats),
                ]
                done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, check=False)
                lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
                tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
                row = json.loads(lines[-1]) if lines else {"error": f"failed: {tail[0][:120]}"}
            extra = {k: row.pop(k) for k in ("attention", "fused_loss") if k in row}
            print(
                f"| {pp} | {index} | {_cells(Figures(**row), first=True)} | {extra.get('attention', '–')} | "
                f"{extra.get('fused_loss', '–')} |",
                flush=True,
            )


# --- fused loss -----------------------------------------------------------------------------------


def loss_candidates() -> dict[str, Callable[[Any, Any, Any], Any]]:
    """name -> loss(hidden, weight, target) for every implementation importable here."""
    import torch.nn.functional as F

    from bytescale_compile.ops.loss import fused_linear_cross_entropy

    found: dict[str, Callable[[Any, Any, Any], Any]] = {
        "ours": lambda h, w, t: fused_linear_cross_entropy(h, w, t),
    }
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        found["Liger-Kernel FLCE"] = lambda h, w, t: liger(w, h, t)
    except ImportError:
        pass
    try:
        from cut_cross_entropy import linear_cross_entropy

        found["Cut Cross-Entropy"] = lambda h, w, t: linear_cross_entropy(h, w, t)
    except ImportError:
        pass
    found["torch"] = lambda h, w, t: F.cross_entropy(F.linear(h, w).float(), t)
    return found


def loss_figures(fn: Callable[[Any, Any, Any], Any], tokens: int, hidden: int, vocab: int, device: str) -> Figures:
    """Forward + backward of `fn`: median ms and the peak above the inputs."""
    import torch

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    h = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    w = (torch.randn(vocab, hidden, device=device, dtype=dtype) * hidden**-0.5).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), device=device)

    def step() -> None:
        h.grad = w.grad = None
        fn(h, w, t).backward()

    if device != "cuda":
        step()
        return Figures()
    import triton.testing

    try:
        step()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / GIB
        return Figures(ms=triton.testing.do_bench(step), peak_gib=peak)
    except torch.OutOfMemoryError:
        return Figures(error="out of memory")
    finally:
        h.grad = w.grad = None
        torch.cuda.empty_cache()


def loss_table(smoke: bool) -> None:
    hidden, vocab, token_counts = SMOKE_LOSS if smoke else (LOSS_HIDDEN, LOSS_VOCAB, LOSS_TOKENS)
    device = "cpu" if smoke else "cuda"
    candidates = loss_candidates()
    print(f"\n## Fused linear cross-entropy, fwd+bwd, H = {hidden}, V = {vocab}\n")
    print("| T | " + " | ".join(candidates) + " |\n|---|" + "---|" * len(candidates))
    for tokens in token_counts:
        cells = [_cells(loss_figures(fn, tokens, hidden, vocab, device)) for fn in candidates.values()]
        print(f"| {tokens} | " + " | ".join(cells) + " |")
    missing = {"Liger-Kernel FLCE", "Cut Cross-Entropy"} - candidates.keys()
    if missing:
        print(f"\n(not installed: {', '.join(sorted(missing))})")


# --- the other benchmarks, and the command line ----------------------------------------------------


def run_script(title: str, args: list[str]) -> None:
    print(f"\n## {title}: `python {' '.join(args)}`\n", flush=True)
    subprocess.run([sys.executable, *args], cwd=REPO_ROOT, check=False)


def _cells(row: Figures, first: bool = False) -> str:
    if row.error:
        return f"{row.error} | – | –" if first else row.error
    ms = "–" if row.ms is None else f"{row.ms:,.1f}"
    gib = "–" if row.peak_gib is None else f"{row.peak_gib:.2f}"
    if first:
        return f"{ms} | {gib} | {'–' if row.first_s is None else f'{row.first_s:.0f} s'}"
    return f"{ms} ms, {gib} GiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (tables 1, 2 and 5 only)")
    parser.add_argument("--repeats", type=int, default=5, help="measured steps per end-to-end variant")
    parser.add_argument(
        "--only",
        choices=("e2e", "loss", "kernels", "offload", "stages"),
        action="append",
        help="run only these tables (repeatable)",
    )
    parser.add_argument(
        "--e2e-tokens",
        type=int,
        choices=[run[0] for run in E2E_RUNS],
        help="only this end-to-end table (each takes minutes)",
    )
    parser.add_argument("--worker", help="internal: VARIANT:TOKENS:LAYERS, measured here, printed as JSON")
    parser.add_argument("--stage-worker", help="internal: PP:STAGE:TOKENS:LAYERS, measured here, printed as JSON")
    args = parser.parse_args(argv)
    if args.stage_worker:
        pp, index, tokens, layers = (int(x) for x in args.stage_worker.split(":"))
        print(json.dumps(stage_variant(pp, index, tokens, layers, False, args.repeats)))
        return 0
    if args.worker:
        variant, tokens, layers = args.worker.split(":")
        print(json.dumps(asdict(e2e_variant(variant, int(tokens), int(layers), False, args.repeats))))
        return 0

    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA GPU here: these tables need one (`--smoke` checks the script on the CPU)")
        return 0
    tables = set(args.only or ("e2e", "loss", "kernels", "offload", "stages"))
    if args.smoke:
        tables &= {"e2e", "loss", "stages"}
    else:
        print(f"# issue 18 on {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if "e2e" in tables:
        e2e_tables(args.smoke, args.repeats, args.e2e_tokens)
    if "loss" in tables:
        loss_table(args.smoke)
    if "kernels" in tables:
        run_script("Kernels", ["benchmarks/kernels.py"])
    if "offload" in tables:
        run_script("Offload", ["benchmarks/offload.py", "--device", "cuda", "--tokens", "16K,32K"])
    if "stages" in tables:
        stage_table(args.smoke, args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
