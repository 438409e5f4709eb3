"""One GPU check that fits one lease: `python benchmarks/gpu.py --check` (`--smoke` runs it on the CPU, tiny).

Every goal of the one-GPU work, measured on one card in one call, under a global deadline (`--deadline`, 540 s):
each section runs in a subprocess of its own with what is left of the deadline as its timeout, its figures are
saved (`--json DIR`, default `$OUT`) as soon as it ends, and the goals table is printed from whatever finished.

Sections, in order:
1. `tests`: the GPU tests (`GPU_TESTS`): the compiled path against eager on CUDA, each attention backend and the
   loss against their references, a step with no host sync between micro-batches.
2. `attention`: each attention backend that can serve the 64K Byted-like packing of the Llama-3-8B layer against
   torch's `varlen_attn`, fwd+bwd ms and the error of out and dq.
3. `loss`: the fused loss against Liger-Kernel and Cut Cross-Entropy at 8K, 32K and 128K tokens.
4. `trainer`: the trainer (`Runtime` as the trainer builds it) on the Byted-like and GitHub-like 64K batches and the
   Byted-like 128K one: tokens/s, peaks allocated and reserved, predicted step and predicted reserved peak.
5. `baseline`: HF + `varlen_attn` + `torch.compile` on the same batches.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]

GPU_TESTS = (
    "tests/e2e/test_gpu.py",
    "tests/unit/test_attention_dispatch.py",
    "tests/unit/test_train_optim.py",
    "tests/unit/test_ops_loss.py",
    "tests/distributed/test_train_executor.py",
    "-k",
    "not nccl and (cuda or gpu)",
)
"""pytest arguments: the tests that need CUDA (and their files' CPU tests, which take seconds), run first: the kernels the timings below use must be right before they count."""

CHECK_BATCHES = (("byted", 65_536), ("github", 65_536), ("byted", 131_072))
SMOKE_BATCHES = (("byted", 512), ("github", 512), ("byted", 1024))
LOSS_TOKENS = (8192, 32_768, 131_072)
ATTENTION_TOKENS = 65_536
VARLEN = "torch varlen_attn"


@dataclass(frozen=True)
class Section:
    name: str
    cap_s: float
    """At most this many seconds of the deadline (what is left, if less)."""
    smoke_cap_s: float


SECTIONS = (
    Section("tests", 75, 300),
    Section("attention", 40, 120),
    Section("loss", 50, 120),
    Section("trainer", 210, 300),
    Section("baseline", 150, 300),
)
MARGIN_S = 10
"""Kept back from the deadline for the goals table."""


@dataclass
class Goal:
    name: str
    verdict: str
    """PASS, FAIL, or `not measured`."""
    figures: str


def run_check(*, smoke: bool, deadline_s: float, layers: int | None, json_dir: str | None) -> int:
    """Every section within `deadline_s` seconds of now, then the goals: 0 when every measured goal passed."""
    began = time.monotonic()
    # The trainer's default allocator (train/__main__.py sets it before CUDA starts); the sections' subprocesses
    # inherit it, baselines too, so both sides run on the same allocator.
    os.environ.setdefault("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    results: dict[str, Any] = {}
    for section in SECTIONS:
        left = deadline_s - MARGIN_S - (time.monotonic() - began)
        cap = min(section.smoke_cap_s if smoke else section.cap_s, left)
        if cap < 5:
            results[section.name] = {"error": f"not run: {left:.0f} s of the deadline left"}
        else:
            results[section.name] = _run_section(section.name, smoke=smoke, layers=layers, timeout=cap)
        results[section.name]["section_s"] = round(time.monotonic() - began, 1)
        print(f"\n### {section.name} (at {results[section.name]['section_s']:.0f} s)\n", flush=True)
        print(json.dumps(results[section.name], indent=1, default=str)[:6000], flush=True)
        _save(json_dir, results)
    goals = evaluate(results)
    print("\n## Goals\n\n| goal | verdict | figures |\n|---|---|---|")
    for goal in goals:
        print(f"| {goal.name} | {goal.verdict} | {goal.figures} |")
    print(f"\nchecked in {time.monotonic() - began:.0f} s", flush=True)
    results["goals"] = [asdict(g) for g in goals]
    _save(json_dir, results)
    return 0 if all(g.verdict != "FAIL" for g in goals) else 1


def _run_section(name: str, *, smoke: bool, layers: int | None, timeout: float) -> dict[str, Any]:
    """Section `name` in a subprocess (in this process under `--smoke`, which has no GPU state to lose)."""
    if smoke:
        try:
            return SECTION_FUNCTIONS[name](smoke=True, layers=layers, timeout=timeout)
        except Exception as e:  # a broken section costs its row, as on the GPU
            return {"error": f"{type(e).__name__}: {e}"[:600]}
    cmd = [sys.executable, str(Path(__file__)), "--section", name, "--timeout", str(timeout)]
    if layers is not None:
        cmd += ["--layers", str(layers)]
    try:
        done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, check=False, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        partial = _last_json(e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or ""))
        return {**partial, "error": f"cut at {timeout:.0f} s"}
    found = _last_json(done.stdout)
    if done.returncode != 0 or not found:
        tail = (done.stderr or done.stdout).strip().splitlines()[-4:] or ["no output"]
        return {**found, "error": f"exit {done.returncode}: {' / '.join(tail)[:600]}"}
    return found


def _last_json(stdout: str) -> dict[str, Any]:
    """The last line of `stdout` that is a JSON object: a section prints its figures so far after each part."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            try:
                return dict(json.loads(line))
            except json.JSONDecodeError:
                continue
    return {}


def _emit(figures: dict[str, Any]) -> None:
    """Print the section's figures so far as one line of JSON (its parent keeps the last one, even if it is cut)."""
    print(json.dumps(figures, default=str), flush=True)


# --- sections ---------------------------------------------------------------------------------------


def tests_section(*, smoke: bool, layers: int | None, timeout: float) -> dict[str, Any]:
    """The GPU tests, by pytest node id; on the CPU they skip, which is what `--smoke` checks."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", *GPU_TESTS]
    try:
        done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, check=False, timeout=timeout - 2)
    except subprocess.TimeoutExpired:
        return {"error": f"pytest cut at {timeout - 2:.0f} s"}
    lines = done.stdout.strip().splitlines()
    return {"exit": done.returncode, "summary": lines[-1] if lines else "", "failures": lines[-25:-1]}


def attention_section(*, smoke: bool, layers: int | None, timeout: float) -> dict[str, Any]:
    """Each attention backend that can serve the 64K Byted-like packing of one Llama-3-8B layer (32 q heads, 8 kv
    heads, D 128) against torch's `varlen_attn`: fwd+bwd ms, and the error of out and dq relative to `varlen_attn`'s
    (the reference's on the CPU). The reference is left out on the GPU: it holds a segment's [T, T] scores."""
    import torch

    from benchmarks.gpu_models import global_batch
    from bytescale_compile.kernels import dispatch
    from bytescale_compile.kernels.attention_ref import AttentionMask

    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    tokens = 256 if smoke else ATTENTION_TOKENS
    heads, kv_heads, dim = (4, 2, 16) if smoke else (32, 8, 128)
    lengths = global_batch("byted", tokens, tokens // 2)
    bounds = [0, *itertools.accumulate(lengths)]
    torch.manual_seed(0)
    q = torch.randn(1, heads, tokens, dim, device=device, dtype=dtype)
    k, v = (torch.randn(1, kv_heads, tokens, dim, device=device, dtype=dtype) for _ in range(2))
    grad = torch.randn_like(q)
    scale = dim**-0.5
    call = dispatch.AttentionCall.of(
        q, k, v, mask=AttentionMask(True, None), softcap=None, bounds_q=tuple(bounds), bounds_k=tuple(bounds)
    )
    figures: dict[str, Any] = {"tokens": tokens, "sequences": len(lengths), "longest": max(lengths)}
    figures["chosen"] = dispatch.explain_attention(call).describe()

    def ours(backend: str) -> Callable[[], tuple[Any, Any]]:
        def run() -> tuple[Any, Any]:
            with dispatch.attention_backend(backend, source="gpu_check"):
                out, lse = dispatch.segment_causal_attention_fwd(q, k, v, bounds, scale)
                dq, _, _ = dispatch.segment_causal_attention_bwd(grad, q, k, v, out, lse, bounds, scale)
            return out, dq

        return run

    runs = {
        b.name: ours(b.name)
        for b in dispatch.ATTENTION_BACKENDS
        if b.unmet(call, True) is None and (smoke or b.name != "reference")
    }
    if not smoke:
        runs[VARLEN] = _varlen(
            q, k, v, torch.tensor(bounds, device=device, dtype=torch.int32), max(lengths), scale, grad
        )
    ref_out, ref_dq = runs[VARLEN if not smoke else "reference"]()
    for name, run in runs.items():
        try:
            out, dq = run()
            figures[name] = {"out_err": _rel(out, ref_out), "dq_err": _rel(dq, ref_dq), "ms": _bench(run, smoke)}
        except Exception as e:
            figures[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
        _emit(figures)
    return figures


def _varlen(q: Any, k: Any, v: Any, cu: Any, longest: int, scale: float, grad: Any) -> Callable[[], tuple[Any, Any]]:
    """torch's `varlen_attn` forward + backward on `[1, H, T, D]` q/k/v (GQA natively where the build takes
    `enable_gqa`, else k/v repeated), its out and dq returned heads-first."""
    import inspect

    import torch
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    gqa = "enable_gqa" in params
    options: dict[str, Any] = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if "scale" in params:
        options["scale"] = scale
    if gqa:
        options["enable_gqa"] = True
    tokens_first = [x[0].transpose(0, 1) for x in (q, k, v, grad)]

    def run() -> tuple[Any, Any]:
        qq, kk, vv = (x.detach().requires_grad_() for x in tokens_first[:3])
        kx, vx = (kk, vv) if gqa else (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (kk, vv))
        out = varlen_attn(qq, kx, vx, cu, cu, longest, longest, **options)
        (dq,) = torch.autograd.grad(out, qq, tokens_first[3])
        return out.detach().transpose(0, 1)[None], dq.transpose(0, 1)[None]

    return run


def _rel(a: Any, b: Any) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _bench(run: Callable[[], Any], smoke: bool) -> float | None:
    if smoke:
        return None
    import triton.testing

    return float(triton.testing.do_bench(run, warmup=50, rep=300, return_mode="median"))


def loss_section(*, smoke: bool, layers: int | None, timeout: float) -> dict[str, Any]:
    """The fused loss against Liger-Kernel and Cut Cross-Entropy (ms and GiB above inputs and gradients)."""
    from benchmarks.gpu import LOSS_HIDDEN, LOSS_VOCAB, SMOKE_LOSS, loss_candidates, loss_figures

    hidden, vocab, token_counts = SMOKE_LOSS if smoke else (LOSS_HIDDEN, LOSS_VOCAB, LOSS_TOKENS)
    keep = ("ours (dispatched)", "Liger-Kernel FLCE", "Cut Cross-Entropy")
    candidates = {name: step for name, step in loss_candidates().items() if name in keep}
    figures: dict[str, Any] = {"hidden": hidden, "vocab": vocab}
    for tokens in token_counts:
        figures[str(tokens)] = {}
        for name, step in candidates.items():
            figures[str(tokens)][name] = asdict(loss_figures(step, tokens, hidden, vocab, "cpu" if smoke else "cuda"))
            _emit(figures)
    return figures


def trainer_section(*, smoke: bool, layers: int | None, timeout: float) -> dict[str, Any]:
    """The trainer on `CHECK_BATCHES`: the figures of `gpu_trainer.trainer_rows`, which carry the predictions."""
    from benchmarks import gpu_trainer

    layers = layers or _default_layers(smoke)
    figures: dict[str, Any] = {"layers": layers}
    try:
        cost_model, figures["profile"] = gpu_trainer.profiled_cost_model(layers, smoke)
    except Exception as e:
        figures["profile"] = f"failed: {type(e).__name__}: {e}"[:600]
        cost_model = None
    _emit(figures)
    runtime, figures["chosen"] = gpu_trainer.build_runtime(layers, smoke, cost_model)
    _emit(figures)
    figures["trainer"] = []
    for dataset, tokens in SMOKE_BATCHES if smoke else CHECK_BATCHES:
        figures["trainer"] += gpu_trainer.trainer_rows(runtime, layers, smoke, [(dataset, tokens)], 32_768, 2, 3)
        _emit(figures)
    return figures


def baseline_section(*, smoke: bool, layers: int | None, timeout: float) -> dict[str, Any]:
    """HF + `varlen_attn` + `torch.compile` on `CHECK_BATCHES` (unavailable on the CPU, which `--smoke` reports)."""
    from benchmarks import gpu_baselines

    layers = layers or _default_layers(smoke)
    batches = list(SMOKE_BATCHES if smoke else CHECK_BATCHES)
    return {"layers": layers, **gpu_baselines.run("hf_varlen", layers, smoke, batches, 32_768, 2, 3)}


def _default_layers(smoke: bool) -> int:
    """8 layers of the 8B shape where more than 100 GB (an H200), else 4 (an H100); 2 tiny ones on the CPU."""
    if smoke:
        return 2
    import torch

    return 8 if torch.cuda.get_device_properties(0).total_memory > 100 * 2**30 else 4


SECTION_FUNCTIONS: dict[str, Callable[..., dict[str, Any]]] = {
    "tests": tests_section,
    "attention": attention_section,
    "loss": loss_section,
    "trainer": trainer_section,
    "baseline": baseline_section,
}


# --- goals --------------------------------------------------------------------------------------------


def evaluate(results: dict[str, Any]) -> list[Goal]:
    """PASS or FAIL for each goal from what the sections measured; `not measured` where a section gave nothing."""
    return [
        _tests_goal(results.get("tests", {})),
        *_trainer_goals(results.get("trainer", {}), results.get("baseline", {})),
        _loss_goal(results.get("loss", {})),
        _attention_goal(results.get("attention", {})),
    ]


def _tests_goal(tests: dict[str, Any]) -> Goal:
    if "exit" not in tests:
        return Goal("GPU tests pass", "not measured", tests.get("error", ""))
    summary = tests.get("summary", "")
    if tests["exit"] == 0 and " passed" not in summary:  # all skipped: no CUDA, nothing was checked
        return Goal("GPU tests pass", "not measured", summary)
    return Goal("GPU tests pass", "PASS" if tests["exit"] == 0 else "FAIL", summary)


def _rows(section: dict[str, Any], key: str) -> dict[tuple[str, int], dict[str, Any]]:
    return {(r["dataset"], r["tokens"]): r for r in section.get(key, []) if isinstance(r, dict)}


def _trainer_goals(trainer: dict[str, Any], baseline: dict[str, Any]) -> list[Goal]:
    ours, theirs = _rows(trainer, "trainer"), _rows(baseline, "rows")
    speed, oom, cost, memory = [], [], [], []
    for key, row in ours.items():
        label = f"{key[0]} {key[1]:,}"
        if row.get("error"):
            oom.append((label, False, row["error"][:80]))
            continue
        oom.append((label, True, f"peak reserved {_gib(row.get('reserved_gib'))}"))
        base = theirs.get(key, {})
        if base.get("tokens_per_s"):
            ratio = row["tokens_per_s"] / base["tokens_per_s"]
            peak_ok = (row.get("peak_gib") or 0) <= (base.get("peak_gib") or 0)
            speed.append(
                (
                    label,
                    ratio >= 1.0 and peak_ok,
                    f"{ratio:.2f}× ({row['tokens_per_s']:,.0f} vs "
                    f"{base['tokens_per_s']:,.0f} tokens/s), peak {_gib(row.get('peak_gib'))} vs {_gib(base.get('peak_gib'))}",
                )
            )
        extra = row.get("extra", {})
        if extra.get("predicted_s"):
            miss = extra["predicted_s"] / row["step_s"] - 1
            cost.append(
                (label, abs(miss) <= 0.10, f"{extra['predicted_s']:.3f} vs {row['step_s']:.3f} s ({miss:+.0%})")
            )
        if extra.get("predicted_reserved_gib") and row.get("reserved_gib"):
            miss = extra["predicted_reserved_gib"] / row["reserved_gib"] - 1
            memory.append(
                (
                    label,
                    abs(miss) <= 0.05,
                    f"{extra['predicted_reserved_gib']:.1f} vs {row['reserved_gib']:.1f} GiB ({miss:+.0%})",
                )
            )
    return [
        _combine("trainer ≥ 1.0× HF + varlen_attn + compile at no more peak", speed),
        _combine("no out-of-memory at --capacity auto", oom),
        _combine("predicted step within 10%", cost),
        _combine("predicted reserved peak within 5%", memory),
    ]


def _loss_goal(loss: dict[str, Any]) -> Goal:
    checks = []
    for tokens, row in loss.items():
        if not isinstance(row, dict) or "ours (dispatched)" not in row:
            continue
        ours, liger = row["ours (dispatched)"], row.get("Liger-Kernel FLCE", {})
        if ours.get("ms") and liger.get("ms"):
            checks.append((f"{int(tokens):,}", ours["ms"] <= liger["ms"], f"{ours['ms']:.1f} vs {liger['ms']:.1f} ms"))
    return _combine("loss ≤ Liger's time", checks)


def _attention_goal(attention: dict[str, Any]) -> Goal:
    """Information more than a goal: the chosen backend's fwd+bwd against `varlen_attn`'s."""
    name = attention.get("chosen", "").split(" ")[0]
    chosen, varlen = attention.get(name, {}), attention.get(VARLEN, {})
    if not (chosen.get("ms") and varlen.get("ms")):
        return Goal("attention (chosen backend) against varlen_attn", "not measured", attention.get("error", ""))
    ratio = chosen["ms"] / varlen["ms"]
    return Goal(
        "attention (chosen backend) against varlen_attn",
        "PASS" if ratio <= 1.05 else "FAIL",
        f"{name}: {chosen['ms']:.1f} vs {varlen['ms']:.1f} ms ({ratio:.2f}×), dq error {chosen.get('dq_err', 0):.1e}",
    )


def _combine(name: str, checks: list[tuple[str, bool, str]]) -> Goal:
    if not checks:
        return Goal(name, "not measured", "")
    verdict = "PASS" if all(ok for _, ok, _ in checks) else "FAIL"
    return Goal(name, verdict, "; ".join(f"{label}: {text}" for label, _, text in checks))


def _gib(x: float | None) -> str:
    return "–" if x is None else f"{x:.1f} GiB"


def _save(directory: str | None, results: dict[str, Any]) -> None:
    if directory:
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))


def section_main(name: str, *, layers: int | None, timeout: float) -> int:
    """`--section NAME`: one section on the GPU, its figures as JSON lines on stdout."""
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    _emit(SECTION_FUNCTIONS[name](smoke=False, layers=layers, timeout=timeout))
    return 0


if __name__ == "__main__":
    import argparse

    sys.path.insert(0, str(REPO_ROOT))
    parser = argparse.ArgumentParser()
    parser.add_argument("--section", choices=list(SECTION_FUNCTIONS), required=True)
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--layers", type=int)
    args = parser.parse_args()
    raise SystemExit(section_main(args.section, layers=args.layers, timeout=args.timeout))
