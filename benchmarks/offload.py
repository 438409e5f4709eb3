"""Selective activation offload (paper §4.2): memory saved and time paid at ratios r = 0, 0.5, 1.

Each variant (one ratio r, or the pass switched off with `optimize(model, offload="off")`) runs a
freshly built and compiled LLaMA, by default in its own subprocess (this script with `--worker`) so
no allocator cache, host buffer pool or compiled graph carries over. A step is one forward + backward
of one micro-batch under `act_ctx = get_act_ctx(1, [r])` (paper Listing 1); one warm-up step compiles
and fills the host buffer pool, then `--repeats` measured steps follow. Figures are printed (and with
`--json` written), never asserted.

CPU mode (the default without CUDA): the example model `bytescale_compile.models.llama:small` (4 layers,
hidden 256, fp32) at `--tokens` (default 2048). Host and "device" are the same memory here, so the
figure that matters is the act_ctx's counter `peak_resident_bytes`: the most saved-activation bytes
on the device at any point of the micro-batch. It is printed next to Eq. 2's shape

    predicted = kept + (1 - r)(l - 2) · Act

with Act one middle layer's counted saved bytes (report rows routed through the act_ctx — decision
"offload…" or "resident (last…", "(outside…", "(read by…" — without aliases, bytes_per_token × T),
`kept` all other counted bytes (the last 2 layers, ~2·Act, and what lives outside the layers) and l
the number of layers. The step time shows what
the (synchronous, on CPU) copies cost; the peak RSS rise of one step is printed for completeness:
offloading cannot lower it on CPU, the host copies live in the same RAM.

CUDA mode (with CUDA, or `--device cuda`): a 1B-class LLaMA (hidden 2048, intermediate 5632, 22
layers, 32/4 heads, vocab 32000, bf16) at 16K and 64K tokens. Per variant: the peak of
`torch.cuda.max_memory_allocated` (reset before each measured step; weights and gradients included),
the step time (synchronized), the GiB offloaded, the overhead (t_r - t_0) / t_0 against r = 0, and the
share of the copy time hidden behind compute: overlap = 1 - (t_r - t_0) / copy_time, clamped to
[0, 1], where copy_time = offloaded / D2H bandwidth + reloaded / H2D bandwidth from a pinned-copy
probe. A size that runs out of device memory prints "OOM" and the run goes on.

Goals, from the paper: r = 0.5 saves 32% memory at 64K tokens with no throughput loss; r = 1.0 is
free (fully overlapped) at 256K tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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

from bytescale_compile.units import parse_size  # noqa: E402

RATIOS = (0.0, 0.5, 1.0)
OFF = "off"
"""The variant with the offload pass switched off (no act_ctx ops in the graphs)."""
COUNTED = ("offload", "resident (last", "resident (outside", "resident (read by")
"""Report decisions of the saved storages that go through the act_ctx (and so are in its counters)."""
MIB, GIB = 2**20, 2**30
PAPER = (
    "paper (§4.2, Fig. 13): r = 0.5 saves 32% memory at 64K tokens with no throughput loss; "
    "r = 1.0 costs nothing at 256K tokens"
)

MODEL_1B = {
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_layers": 22,
    "num_heads": 32,
    "num_kv_heads": 4,
}
"""A TinyLlama-1.1B-shaped config for the CUDA mode."""


@dataclass
class Setup:
    """What one worker measures: the model, the sequence length, the variant, the device."""

    device: str
    model: str
    """"small" (bytescale_compile.models.llama:small) or "1b" (MODEL_1B)."""
    dtype: str
    tokens: int
    variant: str
    """A ratio such as "0.5", or OFF."""
    repeats: int


# --- parsing ------------------------------------------------------------------------------------


def parse_sizes(text: str) -> list[int]:
    """'2048', '16K,64K', '1M' -> tokens (K = 1024), as the CLI reads sizes."""
    try:
        return [parse_size(t) for t in text.split(",") if t.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def size_label(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens % 1024 == 0 and tokens >= 1024 else str(tokens)


# --- one variant, in this process ---------------------------------------------------------------


def build_model(setup: Setup):
    """The model under test on its device, in its dtype, seeded so every variant starts alike."""
    import torch

    from bytescale_compile.models.llama import LlamaConfig, LlamaForCausalLM, small

    torch.manual_seed(0)
    with torch.device(setup.device):  # initialise in place: a 1B model is quick to build on the GPU
        model = small() if setup.model == "small" else LlamaForCausalLM(LlamaConfig(**MODEL_1B))
    return model.to(getattr(torch, setup.dtype))  # RoPE's frequencies are made in fp32 at every call


def make_batch(tokens: int, vocab: int, device: str) -> dict[str, Any]:
    """One packed row of one sequence in the model protocol (as tests/helpers.py `protocol_batch`)."""
    import torch

    from bytescale_compile.engine.protocol import packed_row

    gen = torch.Generator().manual_seed(0)
    seq = torch.randint(0, vocab, (tokens + 1,), generator=gen)
    return packed_row(seq[:-1], [tokens]).to(device).kwargs()


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _rss_kib() -> tuple[int, int]:
    """(current, peak) resident set size of this process in KiB, from /proc/self/status."""
    status = Path("/proc/self/status").read_text()
    return tuple(int(re.search(rf"{key}:\s+(\d+)", status).group(1)) for key in ("VmRSS", "VmHWM"))


def _reset_rss_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux `clear_refs` 5), so one step's peak can be read alone."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def step(opt, batch: dict[str, Any], ratio: float | None):
    """One forward + backward under a fresh act_ctx (none for OFF); the micro-batch's stats and the loss."""
    from bytescale_compile.runtime.offload import get_act_ctx

    opt.zero_grad(set_to_none=True)
    if ratio is None:
        loss = opt(**batch).loss
        loss.backward()
        return None, loss.detach()
    act_ctx = get_act_ctx(1, [ratio])
    act_ctx.update_micro_batch_id(0)
    with act_ctx:
        loss = opt(**batch).loss
    with act_ctx:
        loss.backward()
    if act_ctx.waiting(0):
        print(f"warning: {act_ctx.waiting(0)} saved storages were never reloaded", file=sys.stderr)
    return act_ctx.stats[0], loss.detach()


def eq2_prediction(report, num_layers: int, tokens: int, ratio: float | None) -> dict[str, float] | None:
    """Eq. 2's peak of saved bytes on the device, from the report's rows: kept + (1-r)(l-2)·Act, where kept
    is everything that never leaves (the last 2 layers, ~2·Act, and what lives outside the layers)."""
    rows = [
        r
        for g in report.graphs
        for r in g.saved_activations
        if r.alias_of is None and r.decision.startswith(COUNTED) and r.bytes_per_token is not None
    ]
    if ratio is None or not rows:
        return None
    middle = max(1, (num_layers - 2) // 2)  # an offloaded layer away from layer 0's extras
    act = sum(r.bytes_per_token for r in rows if r.layer == middle) * tokens
    kept = sum(r.bytes_per_token for r in rows) * tokens - (num_layers - 2) * act
    return {"act_bytes": act, "kept_bytes": kept, "predicted_bytes": kept + (1 - ratio) * (num_layers - 2) * act}


def measure(setup: Setup) -> dict[str, Any]:
    """Build, compile (warm-up step), then time `repeats` steps; memory figures of those steps."""
    import torch

    import bytescale_compile as bsc

    cuda = setup.device.startswith("cuda")
    ratio = None if setup.variant == OFF else float(setup.variant)
    torch._dynamo.reset()  # in-process runs: no graph of the previous variant is reused
    model = build_model(setup)
    opt = bsc.optimize(model, offload=OFF) if ratio is None else bsc.optimize(model)
    batch = make_batch(setup.tokens, model.config.vocab_size, setup.device)
    step(opt, batch, ratio)  # compile, fill the host pool
    opt.zero_grad(set_to_none=True)
    _sync(setup.device)
    weights = torch.cuda.memory_allocated() if cuda else 0
    times, peaks, rss_rise = [], [], []
    for _ in range(setup.repeats):
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        rss_ok = _reset_rss_peak()
        rss_before = _rss_kib()[0]
        _sync(setup.device)
        start = time.perf_counter()
        stats, loss = step(opt, batch, ratio)
        _sync(setup.device)
        times.append(time.perf_counter() - start)
        peaks.append(torch.cuda.max_memory_allocated() if cuda else 0)
        if rss_ok:
            rss_rise.append((_rss_kib()[1] - rss_before) * 1024)
    figures: dict[str, Any] = {
        **asdict(setup),
        "ratio": ratio,
        "time_s": statistics.median(times),
        "times_s": times,
        "loss": loss.float().item(),
        "device_peak_bytes": max(peaks) if cuda else None,
        "weights_bytes": weights if cuda else None,
        "rss_rise_bytes": max(rss_rise) if rss_rise else None,
        "compilations": opt.compilations,
        "num_layers": model.config.num_layers,
    }
    if stats is not None:
        figures.update(
            offloaded_bytes=stats.offloaded_bytes,
            reloaded_bytes=stats.reloaded_bytes,
            peak_resident_bytes=stats.peak_resident_bytes,
        )
    figures["eq2"] = eq2_prediction(opt.report, model.config.num_layers, setup.tokens, ratio)
    return figures


def measure_guarded(setup: Setup) -> dict[str, Any]:
    """`measure`, with a device out-of-memory turned into an "oom" row instead of an exception."""
    import torch

    try:
        return measure(setup)
    except torch.OutOfMemoryError as e:
        oom = {**asdict(setup), "oom": True, "error": str(e).splitlines()[0]}
    torch.cuda.empty_cache()  # out of the except block: its traceback no longer pins the step's tensors
    return oom


def bandwidth_probe(device: str, nbytes: int = GIB, repeats: int = 5) -> dict[str, float]:
    """Pinned host <-> device copy bandwidth (bytes/s), median of `repeats` copies of `nbytes` each way."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    figures = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        dst.copy_(src, non_blocking=True)  # warm-up
        seconds = []
        for _ in range(repeats):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            seconds.append(begin.elapsed_time(end) / 1e3)
        figures[f"{name}_bytes_per_s"] = nbytes / statistics.median(seconds)
    del host, dev
    torch.cuda.empty_cache()  # in-process runs: leave the device memory to the variants
    return figures


# --- the parent: run every variant, derive, print ------------------------------------------------


def run_worker(payload: dict[str, Any], subprocess_per_variant: bool) -> dict[str, Any]:
    """A worker's figures: in a fresh interpreter (its last stdout line is JSON), or in this process."""
    if not subprocess_per_variant:
        if payload.get("probe"):
            return bandwidth_probe(payload["device"])
        return measure_guarded(Setup(**payload))
    python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(payload)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": python_path},
        check=False,
    )
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        return {**payload, "failed": f"rc={done.returncode}: {tail}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def add_derived(rows: list[dict[str, Any]], bandwidth: dict[str, float] | None) -> None:
    """Per row: memory saved, time overhead vs r = 0 of the same size, and (with a probe) the overlap."""
    base = {row["tokens"]: row for row in rows if row.get("ratio") == 0.0 and "time_s" in row}
    for row in rows:
        ref = base.get(row["tokens"])
        if "time_s" not in row or ref is None:
            continue
        row["overhead"] = (row["time_s"] - ref["time_s"]) / ref["time_s"]
        if row.get("device_peak_bytes") and ref.get("device_peak_bytes"):
            row["memory_saved"] = 1 - row["device_peak_bytes"] / ref["device_peak_bytes"]
        if bandwidth and row.get("offloaded_bytes"):
            copy_s = (
                row["offloaded_bytes"] / bandwidth["d2h_bytes_per_s"]
                + row["reloaded_bytes"] / bandwidth["h2d_bytes_per_s"]
            )
            row["copy_s"] = copy_s
            row["overlap"] = min(1.0, max(0.0, 1 - (row["time_s"] - ref["time_s"]) / copy_s))


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    """`value / scale` formatted by `spec`, or "-" padded to the spec's width when there is none."""
    if value is None:
        width = re.match(r"\D*(\d*)", spec).group(1)
        return "-".rjust(int(width or 1))
    return format(value / scale, spec)


def _status(row: dict[str, Any]) -> str | None:
    if row.get("oom"):
        return "OOM"
    return f"FAILED {row['failed']}" if "failed" in row else None


def _print_rows(rows: list[dict[str, Any]], body: Callable[[dict[str, Any], float | None], str]) -> None:
    """One line per row: size and variant, then OOM/FAILED or `body(row, Eq. 2's predicted bytes)`."""
    for row in rows:
        status = _status(row)
        eq2 = row["eq2"]["predicted_bytes"] if row.get("eq2") else None
        print(f"{size_label(row['tokens']):>7} {row['variant']:>7} {status if status is not None else body(row, eq2)}")


def print_cpu_table(rows: list[dict[str, Any]]) -> None:
    """CPU mode: the act_ctx's counted peak next to Eq. 2's, offloaded bytes, time, RSS rise."""
    print(
        f"{'tokens':>7} {'variant':>7} {'time s':>7} {'min s':>6} {'vs r=0':>7} {'peak saved MiB':>14} "
        f"{'Eq.2 MiB':>9} {'meas/pred':>9} {'offloaded MiB':>13} {'reloaded MiB':>12} {'RSS rise MiB':>12} {'loss':>9}"
    )

    def body(row: dict[str, Any], eq2: float | None) -> str:
        peak = row.get("peak_resident_bytes")
        ratio = f"{peak / eq2:.4f}" if peak is not None and eq2 else "-"
        return (
            f"{row['time_s']:>7.3f} {min(row['times_s']):>6.3f} {_fmt(row.get('overhead'), '+7.1%')} "
            f"{_fmt(peak, '14.2f', MIB)} {_fmt(eq2, '9.2f', MIB)} {ratio:>9} "
            f"{_fmt(row.get('offloaded_bytes'), '13.2f', MIB)} {_fmt(row.get('reloaded_bytes'), '12.2f', MIB)} "
            f"{_fmt(row.get('rss_rise_bytes'), '12.1f', MIB)} {row['loss']:>9.5f}"
        )

    _print_rows(rows, body)


def print_cuda_table(rows: list[dict[str, Any]]) -> None:
    """CUDA mode: device peak, saving and overhead vs r = 0, offloaded GiB, copy time and its hidden share."""
    print(
        f"{'tokens':>7} {'variant':>7} {'peak GiB':>9} {'saved':>7} {'time s':>7} {'overhead':>8} "
        f"{'offl GiB':>8} {'copy s':>7} {'overlap':>7} {'saved GiB (ctx)':>15} {'Eq.2 GiB':>8}"
    )

    def body(row: dict[str, Any], eq2: float | None) -> str:
        return (
            f"{_fmt(row.get('device_peak_bytes'), '9.2f', GIB)} {_fmt(row.get('memory_saved'), '7.1%')} "
            f"{row['time_s']:>7.3f} {_fmt(row.get('overhead'), '+8.1%')} "
            f"{_fmt(row.get('offloaded_bytes'), '8.2f', GIB)} {_fmt(row.get('copy_s'), '7.3f')} "
            f"{_fmt(row.get('overlap'), '7.0%')} {_fmt(row.get('peak_resident_bytes'), '15.2f', GIB)} "
            f"{_fmt(eq2, '8.2f', GIB)}"
        )

    _print_rows(rows, body)


def print_eq2_inputs(rows: list[dict[str, Any]]) -> None:
    """Act and kept bytes per size, so the prediction can be checked by hand."""
    shown = set()
    for row in rows:
        if row.get("eq2") and row["tokens"] not in shown:
            shown.add(row["tokens"])
            eq2 = row["eq2"]
            print(
                f"Eq. 2 inputs at {size_label(row['tokens'])}: l={row['num_layers']}, Act (one middle layer) "
                f"{eq2['act_bytes'] / MIB:.2f} MiB, kept (last 2 layers and outside them) {eq2['kept_bytes'] / MIB:.2f} MiB"
            )


def check_counters(rows: list[dict[str, Any]]) -> list[str]:
    """Counter inconsistencies worth a line: reloaded != offloaded, or bytes offloaded at r = 0."""
    notes = []
    for row in rows:
        if "offloaded_bytes" not in row:
            continue
        where = f"{size_label(row['tokens'])} r={row['variant']}"
        if row["reloaded_bytes"] != row["offloaded_bytes"]:
            notes.append(f"{where}: reloaded {row['reloaded_bytes']} B != offloaded {row['offloaded_bytes']} B")
        if row["ratio"] == 0.0 and row["offloaded_bytes"]:
            notes.append(f"{where}: {row['offloaded_bytes']} B offloaded at r = 0")
    losses = {}
    for row in rows:
        if "loss" in row:
            losses.setdefault(row["tokens"], set()).add(row["loss"])
    notes += [f"{size_label(t)}: losses differ between variants: {sorted(v)}" for t, v in losses.items() if len(v) > 1]
    return notes


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: cuda when available (the 1B model, bf16), else cpu (the small model, fp32)",
    )
    parser.add_argument(
        "--tokens",
        type=parse_sizes,
        help="comma-separated sizes, e.g. 2048 or 16K,64K (default: 2048 on CPU, 16K,64K on CUDA)",
    )
    parser.add_argument("--ratios", default=",".join(map(str, RATIOS)), help="comma-separated offload ratios")
    parser.add_argument(
        "--off",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run the variant with the pass switched off (default: on CPU only)",
    )
    parser.add_argument("--repeats", type=int, default=None, help="measured steps (default: 5 CPU, 3 CUDA)")
    parser.add_argument("--in-process", action="store_true", help="run every variant in this process")
    parser.add_argument("--json", type=Path, help="write every figure to this file")
    parser.add_argument("--worker", help="internal: measure one variant (JSON) here and print its figures")
    args = parser.parse_args()
    if args.worker:
        payload = json.loads(args.worker)
        figures = bandwidth_probe(payload["device"]) if payload.get("probe") else measure_guarded(Setup(**payload))
        print(json.dumps(figures))
        return

    device = args.device if args.device != "auto" else ("cuda" if _cuda_available() else "cpu")
    cuda = device == "cuda"
    model, dtype = ("1b", "bfloat16") if cuda else ("small", "float32")
    sizes = args.tokens or ([16 * 1024, 64 * 1024] if cuda else [2048])
    repeats = args.repeats or (3 if cuda else 5)
    with_off = args.off if args.off is not None else not cuda
    variants = [str(float(r)) for r in args.ratios.split(",")] + ([OFF] if with_off else [])
    print(
        f"{device.upper()} mode: model {model} ({dtype}), one sequence per step, fwd+bwd, warm-up then median of "
        f"{repeats}, {'one process per variant' if not args.in_process else 'all variants in one process'}",
        flush=True,
    )

    bandwidth = run_worker({"probe": True, "device": device}, not args.in_process) if cuda else None
    if bandwidth:
        print(
            f"pinned copy probe: D2H {bandwidth['d2h_bytes_per_s'] / GIB:.1f} GiB/s, "
            f"H2D {bandwidth['h2d_bytes_per_s'] / GIB:.1f} GiB/s",
            flush=True,
        )
    rows = []
    for tokens in sizes:
        for variant in variants:
            setup = Setup(device=device, model=model, dtype=dtype, tokens=tokens, variant=variant, repeats=repeats)
            rows.append(run_worker(asdict(setup), not args.in_process))
            print(f"  measured {size_label(tokens)} {variant}", file=sys.stderr, flush=True)
    add_derived(rows, bandwidth)
    (print_cuda_table if cuda else print_cpu_table)(rows)
    print_eq2_inputs(rows)
    for tokens in sizes:
        if not any(row["tokens"] == tokens and row.get("ratio") == 0.0 and "time_s" in row for row in rows):
            print(f"note: no r = 0 figures at {size_label(tokens)}: overhead, saving and overlap need them")
    for note in check_counters(rows):
        print(f"note: {note}")
    print(PAPER)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "device": device,
                    "model": model,
                    "dtype": dtype,
                    "repeats": repeats,
                    "bandwidth": bandwidth,
                    "rows": rows,
                    "paper": PAPER,
                },
                indent=2,
            )
        )
        print(f"figures written to {args.json}")


if __name__ == "__main__":
    main()
