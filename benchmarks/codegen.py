"""`CompileConfig(codegen=...)` against eager and `torch.compile` alone: step time, first-call time, kernels.

For each model (an HF Qwen2: hidden 256, 4 layers (`qwen2-8`: 8), vocab 32K; our `small` LLaMA), one
packed row of `--tokens` tokens in `--sequences` sequences, fwd+bwd, in one process:
  - first-call time of each compiled path (compile + one step); run the script twice with the same
    `--cache-dir` for cold (empty Inductor cache) and warm figures;
  - median fwd+bwd time over `--repeats` rounds, the paths alternating so load drift hits all alike;
  - the kernels Inductor generated for our graphs (forward / backward) and the nodes they fuse.
The load average is printed with the figures: on a shared machine the ratios are what to read.
`--paths "bsc codegen=inductor layers-once" --repeats 0`, one path per process, each with a fresh
cache, measures the cold first call of `CompileConfig(compile_layers_once=True)` against the whole-model compile.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def qwen2(layers: int = 4) -> torch.nn.Module:
    import transformers

    cfg = transformers.Qwen2Config(
        vocab_size=32000,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        use_cache=False,
    )
    return transformers.Qwen2ForCausalLM(cfg)


def llama_small() -> torch.nn.Module:
    from bytescale_compile.models.llama import small

    return small()


MODELS: dict[str, tuple[Callable[[], torch.nn.Module], bool]] = {
    "qwen2": (qwen2, True),
    "qwen2-8": (lambda: qwen2(layers=8), True),
    "llama-small": (llama_small, False),
}
"""name -> (factory, whether it is a Hugging Face model taking `labels`)."""
PATHS = (
    "eager",
    "torch.compile",
    "bsc codegen=none",
    "bsc codegen=inductor",
    "bsc codegen=none layers-once",
    "bsc codegen=inductor layers-once",
)
"""The last two: `CompileConfig(compile_layers_once=True)` (regional compilation)."""


def packed_row(tokens: int, sequences: int, vocab: int, hf: bool) -> dict[str, torch.Tensor]:
    """One row of `sequences` equal sequences, positions restarting, -100 at each sequence's last label."""
    from bytescale_compile.engine.protocol import packed_row as protocol_row

    g = torch.Generator().manual_seed(0)
    n = tokens // sequences
    ids = torch.randint(0, vocab, (sequences, n + 1), generator=g)
    return protocol_row(ids[:, :-1].reshape(-1), [n] * sequences).kwargs(labels=hf)


def fwd_bwd(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> float:
    start = time.perf_counter()
    model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def kernels_line(model: torch.nn.Module) -> str:
    parts = []
    for code in (c for g in model.report.graphs for c in g.generated):
        fused = [len(k.fused_nodes) for k in code.kernels]
        parts.append(
            f"{code.graph}: {len(code.kernels)} kernels ({sum(fused)} nodes, max {max(fused, default=0)}"
            f" per kernel), {len(code.extern_calls)} extern calls{', cache hit' if code.cache_hit else ''}"
        )
    return "; ".join(parts)


def build_path(label: str, eager: torch.nn.Module) -> torch.nn.Module:
    import bytescale_compile as bsc

    if label == "eager":
        return eager
    if label == "torch.compile":
        return torch.compile(copy.deepcopy(eager), dynamic=True)
    codegen = label.split("=")[1].split()[0]
    return bsc.optimize(copy.deepcopy(eager), codegen=codegen, compile_layers_once=label.endswith("layers-once"))


def run_model(name: str, tokens: int, sequences: int, repeats: int, labels: list[str]) -> None:
    factory, hf = MODELS[name]
    torch.manual_seed(0)
    eager = factory().train()
    batch = packed_row(tokens, sequences, eager.config.vocab_size, hf)
    paths = {label: build_path(label, eager) for label in ["eager", *labels]}
    print(
        f"\n## {name}: {sum(p.numel() for p in eager.parameters()) / 1e6:.1f}M parameters, 1 row of {tokens} tokens "
        f"in {sequences} sequences"
    )
    first = {label: fwd_bwd(model, batch) for label, model in paths.items()}
    times: dict[str, list[float]] = {label: [] for label in paths}
    for _ in range(repeats):
        for label, model in paths.items():
            times[label].append(fwd_bwd(model, batch))
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print("| path | fwd+bwd (median) | vs eager | first call |\n|---|---|---|---|")
    for label in paths:
        if not repeats:
            print(f"| {label} | - | - | {first[label]:.1f} s |")
            continue
        t, base = statistics.median(times[label]), statistics.median(times["eager"])
        print(f"| {label} | {t * 1e3:.0f} ms | {t / base:.2f}× | {first[label]:.1f} s |")
    for label in (label for label in paths if "inductor" in label):
        print(f"Inductor for our graphs ({label}): {kernels_line(paths[label])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="qwen2,llama-small")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--paths",
        default=",".join(PATHS[1:4]),
        help=f"compiled paths to run besides eager, of {PATHS[1:]}; one per process for cold first calls",
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="Inductor cache directory (TORCHINDUCTOR_CACHE_DIR); default: a fresh one (cold)",
    )
    args = parser.parse_args()
    cache = args.cache_dir or tempfile.mkdtemp(prefix="inductor-cache-")
    warm = Path(cache).exists() and any(Path(cache).iterdir())
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    print(f"Inductor cache {cache}: {'warm' if warm else 'cold'}")
    for name in args.models.split(","):
        run_model(name, args.tokens, args.sequences, args.repeats, args.paths.split(","))


if __name__ == "__main__":
    main()
