"""`torchrun --nproc_per_node=N -m bytescale_compile.train [--config FILE.toml] [options]`

Trains a model (a Hugging Face directory or a preset) on a prepared token dataset with Hybrid Data
Parallelism: every rank plans each global batch identically (or, with `--loader ray`, one scheduler actor
plans it for all) and trains its own micro-batches. Options
override the config file; the resolved config, metrics.jsonl, checkpoints/ and (Hugging Face models)
final/ go to --out. `--strategy all` trains balance, naive, static and auto from the same weights on the
same batches, compares them, and prints the simulator's projection of the same model and data at 512
ranks. Without torchrun it runs as one process. gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import fields
from typing import cast

import torch
import torch.distributed as dist

from ..planner import RUNTIME_STRATEGIES, PlanError
from ..planner.model_shape import ModelConfigError
from .checkpoint import CheckpointError
from .compare import comparison, summarize
from .config import ALL_STRATEGIES, DTYPES, LOADERS, SIZES, TrainConfig, load_config
from .launch import init_distributed, local_device
from .metrics import METRICS_FILE, echo
from .projection import project_run
from .remote import DataServerError
from .trainer import RunInputs, RunResult, run, setup

PROG = "python -m bytescale_compile.train"
_ARG_TYPES = {"int": int, "int | None": int, "float": float, "str": str, "str | None": str}
_CHOICES = {"strategy": (*RUNTIME_STRATEGIES, ALL_STRATEGIES), "dtype": DTYPES, "loader": LOADERS}
_SETUP_ERRORS = (OSError, ValueError)
"""Reported as one line, not a traceback: missing or unreadable files (FileNotFoundError names them), and
ConfigError, VocabularyError, ModelSourceError, TokenizerError, DatasetError (all ValueErrors)."""
_RUN_ERRORS = (PlanError, CheckpointError, DataServerError)
"""Raised on every rank alike during a run: a batch the capacity cannot hold, a checkpoint that does not fit, a
data server of --loader ray that died for good."""


def build_parser() -> argparse.ArgumentParser:
    """--config plus one option per TrainConfig field (None when not given, so the file's value stands)."""
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--config",
        metavar="FILE.toml",
        help="settings as a flat TOML table (keys as below, with underscores); options given here override it",
    )
    for f in fields(TrainConfig):
        flag, help_text = "--" + f.name.replace("_", "-"), f.metadata["help"]
        if f.type == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            kind = str if f.name in SIZES else _ARG_TYPES[cast(str, f.type)]  # annotations are strings there
            parser.add_argument(flag, type=kind, default=None, choices=_CHOICES.get(f.name), help=help_text)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    try:
        # every rank checks the same inputs before any communication, so all fail alike
        inputs = setup(load_config(args.pop("config"), **args))
    except _SETUP_ERRORS as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    launched = "WORLD_SIZE" in os.environ  # torchrun sets it
    device = init_distributed().device if launched else local_device()
    if device.type == "cpu":  # ranks on one machine share its cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    try:
        results = run(inputs, device)
    except _RUN_ERRORS as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    finally:
        if launched:
            dist.destroy_process_group()
    rank0 = not launched or int(os.environ["RANK"]) == 0
    report(results, rank0)
    if rank0 and inputs.config.strategy == ALL_STRATEGIES:
        echo("\n" + projection(inputs, int(os.environ.get("WORLD_SIZE", "1"))), rank0)
    return 0


def report(results: list[RunResult], enabled: bool) -> None:
    """The comparison table, the held-out loss and where everything went."""
    ran = [r for r in results if r.records]
    if ran:
        echo("\n" + comparison([summarize(r.records, r.eval_loss) for r in ran]), enabled)
    for r in results:
        lines = [f"[{r.strategy}] metrics: {r.run_dir / METRICS_FILE}"]
        if r.eval_loss is not None:
            lines.append(f"final eval loss {r.eval_loss:.4f}")
        if r.final_dir is not None:
            lines.append(f"final model: {r.final_dir} (AutoModelForCausalLM.from_pretrained)")
        echo(", ".join(lines), enabled)


def projection(inputs: RunInputs, world_size: int) -> str:
    """The simulated 512-rank projection of the run's model and data, or why there is none."""
    try:
        return project_run(inputs.config, inputs.model.module, inputs.train_data.lengths, world_size).report()
    except ModelConfigError as e:
        return f"no simulated projection: {e}"


if __name__ == "__main__":
    sys.exit(main())
