"""`torchrun --nproc_per_node=N -m bytescale_compile.train [--config FILE.toml] [options]`

Trains a model (a Hugging Face directory or a preset) on a prepared token dataset with Hybrid Data
Parallelism: every rank plans each global batch identically (or, with `--loader ray`, one scheduler actor
plans it for all) and trains its own micro-batches. Options override the config file; the resolved config,
metrics.jsonl, checkpoints/ and (Hugging Face models) final/ go to --out. It trains one strategy: `python -m
bytescale_compile.train.compare` takes the same options and trains balance, naive, static and auto from the same
weights on the same batches to compare them (`--strategy all`). Without torchrun it runs as one process. gloo on
CPU, NCCL on GPU.

Unless PYTORCH_ALLOC_CONF (or the older PYTORCH_CUDA_ALLOC_CONF) is set, the trainer sets
PYTORCH_ALLOC_CONF=expandable_segments:True before torch touches CUDA (ranks it starts inherit it), so
micro-batches of different sizes do not strand each other's cached blocks (docs/memory.md).

Everything that can be known before step 1 is checked first, on every rank alike: a bad setting prints one
`error: ...` line (from rank 0) and exits 2. SIGTERM or Ctrl-C stops after the current step with a
checkpoint (exit 0 for SIGTERM, 130 for Ctrl-C); in one process, a second Ctrl-C stops at once. A checkpoint that
cannot be saved, at such a stop or any other step, prints the failing rank's traceback once and one `error: ...`
line naming the rank, the step and the cause, and exits 3.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, cast

from ..strategies import RUNTIME_STRATEGIES
from .config import ALL_STRATEGIES, DTYPES, LOADERS, RESUME_AUTO, SIZES, TrainConfig

if TYPE_CHECKING:
    import torch

    from .checkpoint import CheckpointSaveError
    from .inputs import RunInputs
    from .trainer import RunResult

PROG = "python -m bytescale_compile.train"
_ARG_TYPES = {"int": int, "int | None": int, "float": float, "float | None": float, "str": str, "str | None": str}
_CHOICES = {
    "strategy": (*RUNTIME_STRATEGIES, ALL_STRATEGIES),
    "dtype": DTYPES,
    "grad_reduce_dtype": DTYPES,
    "loader": LOADERS,
}
USAGE_EXIT = 2
ALLOC_CONF = "PYTORCH_ALLOC_CONF"
EXPANDABLE_SEGMENTS = "expandable_segments:True"
"""The allocator setting the trainer runs with unless the user set one (`ALLOC_CONF` or its older name)."""
HF_PROGRESS_BARS = "HF_HUB_DISABLE_PROGRESS_BARS"
"""Read by huggingface_hub and, through it, by transformers' progress bars when they load."""
TRANSFORMERS_VERBOSITY = "TRANSFORMERS_VERBOSITY"
"""transformers' logging level, read when it loads."""

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Entry:
    """A `python -m` entry point over the trainer: its name, what it trains once the inputs are checked, and what
    it prints at the end. Parsing, launching, the checks and every exit status are the same for all."""

    prog: str
    module: str
    """What `--nproc-per-node` starts on each rank."""
    description: str | None
    every_strategy: bool
    """Whether strategy = all is accepted (`setup`'s `every_strategy`)."""
    train: Callable[[RunInputs, torch.device], list[RunResult]]
    report: Callable[[RunInputs, list[RunResult]], None]


def _train_one(inputs: RunInputs, device: torch.device) -> list[RunResult]:
    from .trainer import run

    return [run(inputs, device)]


class _Parser(argparse.ArgumentParser):
    """A usage error in one line with a pointer to --help, from rank 0 like every other error (argparse prints
    the whole usage first, about 40 lines that bury the one that matters)."""

    def error(self, message: str) -> NoReturn:
        _error(f"{message} (see {self.prog} --help)", prog=self.prog)
        self.exit(USAGE_EXIT)


def build_parser(prog: str = PROG, description: str | None = __doc__) -> argparse.ArgumentParser:
    """--config plus one option per TrainConfig field (None when not given, so the file's value stands); each
    help ends with the field's default."""
    parser = _Parser(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--config",
        metavar="FILE.toml",
        help="settings as a flat TOML table (keys as below, with underscores); options given here override it",
    )
    parser.add_argument(
        "--nproc-per-node",
        type=_at_least_1,
        metavar="N",
        help="start N ranks on this machine itself, as torchrun --standalone --nproc_per_node=N would, printing "
        "only the ranks' own lines (not under torchrun)",
    )
    for f in fields(TrainConfig):
        flag, help_text = "--" + f.name.replace("_", "-"), f.metadata["help"]
        if f.default not in (None, ""):
            help_text += f" (default: {_shown(f.default)})"
        if f.name == "resume":
            parser.add_argument(
                flag, nargs="?", const=True, default=None, type=_resume, metavar=RESUME_AUTO, help=help_text
            )
            parser.add_argument("--no-resume", dest="resume", action="store_false", help="start a new run")
        elif f.type in ("bool", "bool | None"):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            kind = str if f.name in SIZES else _ARG_TYPES[cast(str, f.type)]  # annotations are strings there
            parser.add_argument(flag, type=kind, default=None, choices=_CHOICES.get(f.name), help=help_text)
    return parser


def _shown(default: object) -> str:
    return str(default).lower() if isinstance(default, bool) else str(default)


def _at_least_1(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return int(text)


def _resume(text: str) -> bool | str:
    if text == RESUME_AUTO:
        return RESUME_AUTO
    raise argparse.ArgumentTypeError(f"--resume takes no value or ={RESUME_AUTO}, got {text!r}")


def _without_nproc(argv: list[str]) -> list[str]:
    """`argv` less --nproc-per-node and its value, which the ranks must not see."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc-per-node":
            skip = True
        elif not arg.startswith("--nproc-per-node="):
            kept.append(arg)
    return kept


def _rank() -> int:
    """This process's rank under torchrun (0 without it), known before the process group exists."""
    return int(os.environ.get("RANK", "0"))


def _error(message: str, rank0_only: bool = True, *, prog: str = PROG) -> None:
    """One line on stderr: from rank 0 for what every rank finds alike, else naming the rank that failed."""
    if not rank0_only and "WORLD_SIZE" in os.environ:
        print(f"{prog}: error on rank {_rank()}: {message}", file=sys.stderr, flush=True)
    elif _rank() == 0:
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)


def allocator_defaults(environ: MutableMapping[str, str]) -> str | None:
    """Set `ALLOC_CONF` to `EXPANDABLE_SEGMENTS` in `environ` unless it or PYTORCH_CUDA_ALLOC_CONF is set; return
    what was set (None: the user's setting stands). Call it before torch initialises CUDA, which reads it once."""
    if any(environ.get(name) for name in (ALLOC_CONF, "PYTORCH_CUDA_ALLOC_CONF")):
        return None
    environ[ALLOC_CONF] = EXPANDABLE_SEGMENTS
    logger.info("set %s=%s (the user set no allocator settings)", ALLOC_CONF, EXPANDABLE_SEGMENTS)
    return EXPANDABLE_SEGMENTS


def quiet_libraries(environ: MutableMapping[str, str], *, rank: int, terminal: bool) -> list[str]:
    """Turn off Hugging Face's progress bars (`Loading weights`, `Writing model shards`) on ranks > 0, which would
    each draw the bar rank 0 draws, and without a terminal, where a bar is noise in a log; and their info and
    warnings on ranks > 0, which rank 0 prints once. Settings the user made stand. Call it before transformers
    and huggingface_hub load: both read these once. Returns the names set."""
    wanted = {}
    if rank > 0 or not terminal:
        wanted[HF_PROGRESS_BARS] = "1"
    if rank > 0:
        wanted[TRANSFORMERS_VERBOSITY] = "error"
    set_now = [name for name, value in wanted.items() if environ.setdefault(name, value) == value]
    if HF_PROGRESS_BARS in set_now and "transformers" in sys.modules:  # loaded already (in-process callers)
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    return set_now


def main(argv: Sequence[str] | None = None, entry: Entry | None = None) -> int:
    entry = entry or TRAIN
    allocator_defaults(os.environ)  # before anything imports torch; ranks started below inherit it
    argv = list(sys.argv[1:] if argv is None else argv)
    args = vars(build_parser(entry.prog, entry.description).parse_args(argv))
    nproc = args.pop("nproc_per_node")
    if nproc is not None and "WORLD_SIZE" in os.environ:
        _error("--nproc-per-node starts the ranks itself: run it without torchrun", prog=entry.prog)
        return USAGE_EXIT
    from .config import absolute_data, check_one_strategy, check_processes, read_config

    try:  # the TOML, the settings and the number of processes, before torch loads or any rank starts
        config = read_config(args.pop("config"), **args)
        if not entry.every_strategy:
            check_one_strategy(config)
        check_processes(config, nproc or int(os.environ.get("WORLD_SIZE", "1")), launcher=nproc is not None)
        if nproc is None:
            config = absolute_data(config)  # --data's spec parsed (torch loads); the ranks started below do it
    except (FileNotFoundError, ValueError) as e:
        _error(str(e), prog=entry.prog)
        return USAGE_EXIT
    if nproc is not None:
        from .launch import launch_local

        return launch_local(nproc, entry.module, _without_nproc(argv))
    quiet_libraries(os.environ, rank=_rank(), terminal=sys.stderr.isatty())
    # torch loads only now, so that --help and the settings' errors are instant
    from .checkpoint import CheckpointError
    from .inputs import setup

    _warnings_once(entry.prog)
    alike = (FileNotFoundError, ValueError, CheckpointError)
    """Found by every rank alike before anything runs: missing files (FileNotFoundError names them) and
    ConfigError, VocabularyError, ModelSourceError, TokenizerError, DatasetError (ValueErrors)."""
    try:
        inputs = setup(config, every_strategy=entry.every_strategy)
    except alike as e:
        _error(str(e), prog=entry.prog)
        return USAGE_EXIT
    except OSError as e:  # permissions, I/O: possibly this rank's alone, so it says so itself
        _error(str(e), rank0_only=False, prog=entry.prog)
        return USAGE_EXIT
    except KeyboardInterrupt:
        return _interrupted("before training started")
    return _train(inputs, entry)


def _train(inputs: RunInputs, entry: Entry) -> int:
    import torch
    import torch.distributed as dist

    from ..engine.batch import BatchError
    from ..planner import PlanError
    from ..planner.memory import MemoryBudgetError
    from .checkpoint import CheckpointError, CheckpointSaveError
    from .config import ConfigError
    from .launch import init_distributed, local_device
    from .remote import DataServerError
    from .signals import SAVE_FAILED_EXIT, Stopped

    alike = (ConfigError, PlanError, MemoryBudgetError, CheckpointError, DataServerError)
    """Raised on every rank alike during a run: a pre-flight check, a batch the capacity cannot hold, a plan
    over the memory budget, a checkpoint that does not fit, a data server of --loader ray that died for good."""
    launched = "WORLD_SIZE" in os.environ  # torchrun sets it
    device = init_distributed().device if launched else local_device()
    if device.type == "cpu":  # ranks on one machine share its cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    try:
        results = entry.train(inputs, device)
    except Stopped as e:
        if isinstance(e.save_error, CheckpointSaveError):
            _save_failed(str(e), e.save_error, entry.prog)
        elif _rank() == 0:
            print(str(e), file=sys.stderr, flush=True)
        return e.exit_code
    except CheckpointSaveError as e:
        _save_failed(str(e), e, entry.prog)
        return SAVE_FAILED_EXIT
    except alike as e:
        _error(str(e), prog=entry.prog)
        return USAGE_EXIT
    except BatchError as e:  # this rank's data only (an id past the vocabulary the sampled check missed)
        _error(str(e), rank0_only=False, prog=entry.prog)
        return USAGE_EXIT
    except KeyboardInterrupt:
        return _interrupted("at once (a second signal), without a checkpoint")
    except Exception as e:
        if launched and _peer_lost(e):  # another rank failed first and says why; this one only lost it
            return 1
        _error(f"{type(e).__name__}: {e}", rank0_only=False, prog=entry.prog)
        raise
    finally:
        if launched and dist.is_initialized():
            dist.destroy_process_group()
    entry.report(inputs, results)
    return 0


def report_runs(inputs: RunInputs, results: list[RunResult]) -> None:
    """Rank 0's end of a run: the table of each strategy's steady steps, measured and (where the cost model is of
    this device) predicted, and where its metrics, held-out loss and final model are."""
    from .metrics import METRICS_FILE, echo
    from .summary import comparison, summarize

    rank0 = _rank() == 0
    ran = [r for r in results if r.records]
    if ran:
        why = next((r.unpredicted for r in ran if r.unpredicted is not None), None)
        echo("\n" + comparison([summarize(r.records, r.eval_loss) for r in ran], why), rank0)
    for r in results:
        lines = [f"[{r.strategy}] metrics: {r.run_dir / METRICS_FILE}"]
        if r.eval_loss is not None:
            lines.append(f"final eval loss {r.eval_loss:.4f}")
        if r.final_dir is not None:
            lines.append(f"final model: {r.final_dir} (AutoModelForCausalLM.from_pretrained)")
        echo(", ".join(lines), rank0)


TRAIN = Entry(PROG, "bytescale_compile.train", __doc__, False, _train_one, report_runs)
"""`python -m bytescale_compile.train`: one strategy."""


def _save_failed(message: str, error: CheckpointSaveError, prog: str) -> None:
    """A failed save, which every rank raises alike with each failing rank's cause: rank 0 prints the first failing
    rank's traceback and then one `error:` line."""
    if _rank() == 0:
        print(error.failures[0].traceback, end="", file=sys.stderr, flush=True)
        _error(message, prog=prog)


def _interrupted(when: str) -> int:
    if _rank() == 0:
        print(f"interrupted {when}", file=sys.stderr, flush=True)
    return 128 + 2  # SIGINT, as shells report it


def _peer_lost(error: BaseException) -> bool:
    """A collective failed because another rank's process went away (it reports its own failure)."""
    text = str(error)
    return any(sign in text for sign in ("Connection closed by peer", "Connection reset by peer", "Broken pipe"))


def _warnings_once(prog: str) -> None:
    """Warnings as one `warning: ...` line each, without the source line Python shows by default (the message
    says what to do; a line of our code does not), and a CostModelWarning once per run however many strategies
    and resumes compare their steps with the cost model. Only rank 0 prints them: every rank runs the same code
    on the same settings, and N copies of a library's warning read as N problems. Another library's warning
    names it (`warning (torch): ...`), so that it is not read as ours."""
    from ..engine.runtime import CostModelWarning

    shown: set[object] = set()

    def show(message: Any, category: type[Warning], filename: str, *args: Any, **kwargs: Any) -> None:
        key = category if issubclass(category, CostModelWarning) else (category, str(message))
        if key not in shown and _rank() == 0:
            shown.add(key)
            origin = _library(filename)
            print(f"{prog}: warning{f' ({origin})' if origin else ''}: {message}", file=sys.stderr, flush=True)

    warnings.showwarning = show


def _library(filename: str) -> str | None:
    """The installed package a warning was raised in (`torch`, `transformers`), or None for ours and for code
    outside any installed package (a user's script)."""
    parts = Path(filename).parts
    for folder in ("site-packages", "dist-packages"):
        if folder in parts[:-1]:
            name = parts[parts.index(folder) + 1].removesuffix(".py")
            return None if name == __package__.partition(".")[0] else name
    return None


def exit_with(status: int) -> NoReturn:
    """Exit an entry point with `status`; a rank records it first, for `launch_local` to read the statuses of
    ranks a signal stopped."""
    if "WORLD_SIZE" in os.environ:
        from .launch import record_exit_status

        record_exit_status(status)
    sys.exit(status)


if __name__ == "__main__":
    exit_with(main())
