"""Every GPU table in one command: `python benchmarks/gpu.py` (CUDA; `--smoke` checks it on the CPU).

Variable-length training on one GPU against what Hugging Face users run today:
1. The whole trainer (`gpu_trainer.py`): a Llama-3-8B shape (fewer layers than 32: `--layers`), Byted-like and
   GitHub-like global batches of 64K and 128K tokens with sequences capped at `--max-len` (and at the C the memory
   model fits), through `Runtime` with the default strategy, offload "auto", bf16 and the distributed optimizer.
   Tokens/s, MFU (model FLOPs, causal attention per sequence), peak memory, and the shares of one profiled step in
   attention, the loss, copies and compute-stream idle time.
2. The same batches through the baselines (`gpu_baselines.py`): HF + flex_attention + `torch.compile` (packed),
   HF + SDPA one sequence per forward + `torch.compile`, HF + Liger-Kernel (when importable), HF + torch's
   `varlen_attn` (when the build has it).
3. The fused linear cross-entropy at T = 8K / 32K / 128K, H = 4096, V = 128K: ours by token chunks and by
   vocabulary slices, Liger-Kernel's FLCE and Cut Cross-Entropy when importable, and torch.
4. End to end at 64K tokens: HF Llama 1.1B (8 layers), one packed row, `bsc.optimize()` against `torch.compile`.
5. The longest trainable sequence: peaks at two lengths at offload r = 0, 0.5, 1 and under torch's activation
   checkpointing, extrapolated to the device's memory.
6. The cost model on the GPU: `bytescale-compile profile` fits it here; the simulator's predicted step for the
   batches of table 1 beside the measured one.

`--check` is the short form that fits one lease (`benchmarks/gpu_check.py`): every goal measured once on one card
within `--deadline` seconds, PASS or FAIL per goal. The full tables are for longer leases.

Each trainer and baseline job runs in its own subprocess (`--job`), so no allocator cache or compiled graph carries
over, and a crash or an out-of-memory costs one row. `--json DIR` (default `$OUT` when set) keeps every job's
figures. Figures are printed, never asserted. `--only kernels|offload|stages` runs the older tables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.gpu_baselines import BASELINES  # noqa: E402  (after the path above)

GIB = 2**30
E2E_RUNS = (  # (tokens, layers, variants)
    (16_384, 16, ("eager", "optimize", "optimize_default_partitioner", "optimize_no_fused_loss", "torch_compile")),
    (65_536, 8, ("torch_compile", "optimize")),
)
VARIANT_NAMES = {
    "eager": "eager",
    "optimize": "`bsc.optimize()` (min-cut on CUDA)",
    "optimize_default_partitioner": '`bsc.optimize(partitioner="default")`',
    "optimize_no_fused_loss": "`bsc.optimize(fused_loss=False)`",
    "torch_compile": "`torch.compile`",
}
N_SEQUENCES = 6
LOSS_HIDDEN, LOSS_VOCAB, LOSS_TOKENS = 4096, 131_072, (8192, 32_768, 131_072)
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

    from bytescale_compile.engine.protocol import packed_row

    lengths = [tokens // N_SEQUENCES] * (N_SEQUENCES - 1)
    lengths.append(tokens - sum(lengths))
    row = packed_row(torch.randint(0, vocab, (1, tokens), device=device), lengths)
    return {"input_ids": row.input_ids, "position_ids": row.position_ids, "labels": row.shift_labels}


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
    from bytescale_compile.engine.stages import split_stages, stage_inputs

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


LossStep = Callable[[Any, Any, Any], Any]
"""(hidden, weight, target) -> what one forward + backward leaves (the gradients), kept until the next call."""


def loss_candidates() -> dict[str, LossStep]:
    """name -> one forward + backward, for every implementation importable here."""
    import torch
    import torch.nn.functional as F

    from bytescale_compile.config import DEFAULT_LOSS_WORKSPACE_BYTES
    from bytescale_compile.kernels import dispatch

    def kernel(fn: Callable[..., Any]) -> LossStep:
        # The kernels compute the gradients in the forward (the op's backward only scales them), outside autograd.
        def step(h: Any, w: Any, t: Any) -> Any:
            with torch.no_grad():
                return fn(h, w, None, t, -100, "mean", True, DEFAULT_LOSS_WORKSPACE_BYTES, 1.0, None)

        return step

    def autograd(loss: LossStep) -> LossStep:
        def step(h: Any, w: Any, t: Any) -> Any:
            loss(h, w, t).backward()
            return h.grad, w.grad

        return step

    found: dict[str, LossStep] = {
        "ours (dispatched)": kernel(dispatch.linear_cross_entropy),
        "ours, token chunks": kernel(dispatch.linear_cross_entropy_token_chunks),
        "ours, vocabulary slices": kernel(dispatch.linear_cross_entropy_vocab_slices),
    }
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        found["Liger-Kernel FLCE"] = autograd(lambda h, w, t: liger(w, h, t))
    except ImportError:
        pass
    try:
        from cut_cross_entropy import linear_cross_entropy

        found["Cut Cross-Entropy"] = autograd(lambda h, w, t: linear_cross_entropy(h, w, t))
    except ImportError:
        pass
    found["torch"] = autograd(lambda h, w, t: F.cross_entropy(F.linear(h, w).float(), t))
    return found


def loss_figures(step: LossStep, tokens: int, hidden: int, vocab: int, device: str) -> Figures:
    """Forward + backward of `step`: median ms and the peak above the inputs and their gradients."""
    import torch

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    h = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    w = (torch.randn(vocab, hidden, device=device, dtype=dtype) * hidden**-0.5).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), device=device)
    kept: list[Any] = []

    def run() -> None:
        h.grad = w.grad = None
        kept.clear()
        kept.append(step(h, w, t))

    if device != "cuda":
        run()
        return Figures()
    import triton.testing

    try:
        run()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()  # inputs and one call's gradients
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / GIB
        return Figures(ms=triton.testing.do_bench(run, return_mode="median"), peak_gib=peak)
    except torch.OutOfMemoryError:
        return Figures(error="out of memory")
    finally:
        h.grad = w.grad = None
        kept.clear()
        torch.cuda.empty_cache()


def loss_table(smoke: bool) -> dict[str, Any]:
    hidden, vocab, token_counts = SMOKE_LOSS if smoke else (LOSS_HIDDEN, LOSS_VOCAB, LOSS_TOKENS)
    device = "cpu" if smoke else "cuda"
    candidates = loss_candidates()
    print(
        f"\n## 3. Fused linear cross-entropy, fwd+bwd, H = {hidden}, V = {vocab} (ms, GiB above inputs and gradients)\n"
    )
    print("| T | " + " | ".join(candidates) + " |\n|---|" + "---|" * len(candidates), flush=True)
    figures: dict[str, Any] = {}
    for tokens in token_counts:
        row = {name: loss_figures(fn, tokens, hidden, vocab, device) for name, fn in candidates.items()}
        figures[str(tokens)] = {name: asdict(f) for name, f in row.items()}
        print(f"| {tokens} | " + " | ".join(_cells(f) for f in row.values()) + " |", flush=True)
    missing = {"Liger-Kernel FLCE", "Cut Cross-Entropy"} - candidates.keys()
    if missing:
        print(f"\n(not installed: {', '.join(sorted(missing))})")
    return figures


# --- the trainer against the baselines ------------------------------------------------------------


@dataclass(frozen=True)
class Shapes:
    """What tables 1, 2 and 5 run: layers of the 8B shape, the batches, the context length, steps."""

    layers: int
    batches: tuple[tuple[str, int], ...]
    max_len: int
    warmup: int
    steps: int
    smoke: bool


def shapes_for(args: argparse.Namespace) -> Shapes:
    """The run's shapes; without `--layers`, as many as leave room for activations on this device's memory."""
    if args.smoke:
        return Shapes(2, (("byted", 512), ("github", 1024)), 256, 1, 2, True)
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    layers = args.layers or (8 if total > 100 * GIB else 4)
    tokens = args.tokens or (65_536, 131_072)
    batches = tuple((dataset, n) for n in tokens for dataset in ("byted", "github"))
    return Shapes(layers, batches, args.max_len, args.warmup, args.steps, False)


def run_job(job: dict[str, Any], timeout: float | None, smoke: bool) -> dict[str, Any]:
    """`job` in this process (`--smoke`) or in a subprocess of its own; its JSON, or why there is none."""
    if smoke:
        return do_job(job)
    cmd = [sys.executable, __file__, "--job", json.dumps(job)]
    try:
        done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, check=False, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:] or ["no output"]
        return {"error": f"exit {done.returncode}: {' / '.join(tail)[:400]}"}
    return cast(dict[str, Any], json.loads(lines[-1]))


def do_job(job: dict[str, Any]) -> dict[str, Any]:
    from benchmarks import gpu_baselines, gpu_trainer

    shapes = Shapes(**{k: tuple(map(tuple, v)) if k == "batches" else v for k, v in job["shapes"].items()})
    common = (shapes.layers, shapes.smoke)
    if job["kind"] == "trainer":
        return gpu_trainer.run(*common, list(shapes.batches), shapes.max_len, shapes.warmup, shapes.steps)
    if job["kind"] == "checkpointing":
        return gpu_baselines.checkpointing_longest(*common, LONGEST_SMOKE if shapes.smoke else LONGEST_LENGTHS)
    return gpu_baselines.run(job["kind"], *common, list(shapes.batches), shapes.max_len, shapes.warmup, shapes.steps)


LONGEST_LENGTHS = (16_384, 32_768)
LONGEST_SMOKE = (64, 128)


def trainer_tables(
    shapes: Shapes, baselines: tuple[str, ...], timeout: float | None, ours: bool, json_dir: str | None
) -> dict[str, Any]:
    """Tables 1, 2, 5 and 6 (without ours: 2 alone), printed as each job ends."""
    results: dict[str, Any] = {}
    print(
        f"\n## 1-2. Llama-3-8B shape with {shapes.layers} layers, bf16, sequences capped at {shapes.max_len}, "
        f"{shapes.steps} steps after {shapes.warmup} warm-ups\n",
        flush=True,
    )
    jobs = [*((name, name) for name in baselines)]
    if ours:
        jobs = [("trainer", "trainer"), *jobs, ("checkpointing", "checkpointing")]
    for key, kind in jobs:
        began = time.perf_counter()
        results[key] = run_job({"kind": kind, "shapes": asdict(shapes)}, timeout, shapes.smoke)
        results[key]["job_s"] = time.perf_counter() - began
        print_job(key, results[key])
        _save(json_dir, "trainer", results)  # after each job: a run cut short keeps what it measured
    return results


def print_job(key: str, result: dict[str, Any]) -> None:
    if "error" in result or "unavailable" in result:
        print(f"- {key}: {result.get('error') or result.get('unavailable')}", flush=True)
        return
    if key == "checkpointing":
        print(f"- activation checkpointing: {json.dumps(result)}", flush=True)
        return
    rows = result.get("trainer") or result.get("rows") or []
    if key == "trainer":
        print(f"- ours, chosen: {json.dumps(result.get('chosen'))}\n- profile: {result.get('profile')}")
    print(
        "\n| path | dataset | tokens | step s | tokens/s | MFU | peak GiB | shares | details |\n|---|---|---|---|---|---|---|---|---|"
    )
    for r in rows:
        if r.get("error"):
            print(f"| {key} | {r['dataset']} | {r['tokens']} | {r['error']} | | | | | |")
            continue
        shares = ", ".join(f"{k} {v:.0%}" for k, v in r["shares"].items())
        mfu = "–" if r["mfu"] is None else f"{r['mfu']:.1%}"
        peak = "–" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        print(
            f"| {key} | {r['dataset']} | {r['tokens']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {mfu} | "
            f"{peak} | {shares} | {json.dumps(r['extra'])} |"
        )
    for r in result.get("longest", []):
        print(f"- longest at r = {r['ratio']}: {json.dumps(r)}")
    print(f"- job took {result.get('job_s', 0):.0f} s", flush=True)


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


TABLES = ("loss", "trainer", "e2e", "kernels", "offload", "stages")
DEFAULT_TABLES = ("loss", "trainer", "e2e")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, in this process")
    parser.add_argument("--check", action="store_true", help="every goal once, within --deadline (gpu_check.py)")
    parser.add_argument("--deadline", type=float, default=540.0, help="seconds --check may take, all sections")
    parser.add_argument("--only", choices=TABLES, action="append", help=f"run only these (default {DEFAULT_TABLES})")
    parser.add_argument("--baselines", default=",".join(BASELINES), help="table 2's baselines, comma-separated")
    parser.add_argument("--skip-ours", action="store_true", help="table 2's baselines alone (no trainer job)")
    parser.add_argument("--layers", type=int, help="layers of the 8B shape (default: 8 on >100 GB, else 4)")
    parser.add_argument("--tokens", type=lambda s: tuple(int(x) for x in s.split(",")), help="global batch sizes")
    parser.add_argument("--max-len", type=int, default=32_768, help="context length the batches are capped at")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--job-timeout", type=float, default=None, help="seconds per trainer or baseline job")
    parser.add_argument("--repeats", type=int, default=5, help="measured steps per end-to-end variant (table 4)")
    parser.add_argument("--e2e-tokens", type=int, choices=[run[0] for run in E2E_RUNS], default=65_536)
    parser.add_argument("--json", default=os.environ.get("OUT"), help="directory for the figures as JSON")
    parser.add_argument("--job", help="internal: one trainer or baseline job (JSON), printed as JSON")
    parser.add_argument("--worker", help="internal: VARIANT:TOKENS:LAYERS, measured here, printed as JSON")
    parser.add_argument("--stage-worker", help="internal: PP:STAGE:TOKENS:LAYERS, measured here, printed as JSON")
    args = parser.parse_args(argv)
    if args.job:
        print(json.dumps(do_job(json.loads(args.job))))
        return 0
    if args.stage_worker:
        pp, index, tokens, layers = (int(x) for x in args.stage_worker.split(":"))
        print(json.dumps(stage_variant(pp, index, tokens, layers, False, args.repeats)))
        return 0
    if args.worker:
        variant, tokens, layers = args.worker.split(":")
        print(json.dumps(asdict(e2e_variant(variant, int(tokens), int(layers), False, args.repeats))))
        return 0

    import torch

    if args.check and (args.smoke or torch.cuda.is_available()):
        from benchmarks.gpu_check import run_check

        return run_check(smoke=args.smoke, deadline_s=args.deadline, layers=args.layers, json_dir=args.json)
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA GPU here: these tables need one (`--smoke` checks the script on the CPU)")
        return 0
    tables = set(args.only or DEFAULT_TABLES)
    if args.smoke:
        tables &= {"e2e", "loss", "stages", "trainer"}
    else:
        print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    figures: dict[str, Any] = {}
    if "loss" in tables:
        figures["loss"] = loss_table(args.smoke)
        _save(args.json, "loss", figures["loss"])
    if "trainer" in tables:
        baselines = tuple(b for b in args.baselines.split(",") if b)
        figures["trainer"] = trainer_tables(
            shapes_for(args), baselines, args.job_timeout, not args.skip_ours, args.json
        )
    if "e2e" in tables:
        e2e_tables(args.smoke, args.repeats, args.e2e_tokens if not args.smoke else None)
    if "kernels" in tables:
        run_script("Kernels", ["benchmarks/kernels.py"])
    if "offload" in tables:
        run_script("Offload", ["benchmarks/offload.py", "--device", "cuda", "--tokens", "16K,32K"])
    if "stages" in tables:
        stage_table(args.smoke, args.repeats)
    return 0


def _save(directory: str | None, name: str, figures: dict[str, Any]) -> None:
    if directory:
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / f"gpu_{name}.json").write_text(json.dumps(figures, indent=1, default=str))


if __name__ == "__main__":
    raise SystemExit(main())
