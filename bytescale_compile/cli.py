"""`bytescale-compile`: inspect a model's compilation, plan and simulate HDP steps, profile a cost model,
predict a rank's memory and capacity, train a tokenizer, prepare token datasets from your own text and export
training checkpoints as Hugging Face models.

Usage errors print one line and exit with status 2; `bytescale-compile --debug COMMAND ...` shows the
traceback instead. torch and the compiler load only in the commands that need them (inspect, profile,
memory, export)."""

from __future__ import annotations

import argparse
import functools
import inspect as pyinspect
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from .models.factory import FactoryError, load_factory, resolve_factory
from .strategies import DEFAULT_SP, SP_MODES
from .units import parse_size

if TYPE_CHECKING:
    from torch import nn

__all__ = ["main"]


class CLIError(Exception):
    """A command-line argument that cannot be used, with what to pass instead."""


class UsageError(CLIError):
    """An argument the parser refused; `prog` is the (sub)command that refused it."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(f"{message} (see {prog} --help)")
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """Argument errors reach `main` as exceptions, to be printed in one line like the commands' own
    (argparse would print the usage first and exit)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(self.prog, message)


def _int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `low`, refused while parsing, before any work."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def _seconds_at_least_0(text: str) -> float:
    """An argparse type: a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _size(text: str) -> int:
    """An argparse type: one positive size such as 8K, 32M or 1000."""
    try:
        value = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a size >= 1, got {text!r}")
    return value


def _sizes(text: str) -> list[int]:
    """An argparse type: comma-separated positive sizes (256K,512K,1M)."""
    sizes = [_size(t) for t in text.split(",") if t.strip()]
    if not sizes:
        raise argparse.ArgumentTypeError(f"expected comma-separated sizes such as 256K,1M, got {text!r}")
    return sizes


def _output_file(path: str, option: str) -> Path:
    """Check a file the command writes before the work starts, so that a long run does not fail at its
    end: not an existing directory, not a read-only file, and a folder that exists or can be created."""
    target = Path(path)
    if target.is_dir():
        raise CLIError(f"{option} {path} is a directory; give a file path")
    if target.exists() and not os.access(target, os.W_OK):
        raise CLIError(f"{option} {path} exists and is not writable")
    _output_folder(target.parent, option, path)
    return target


def _output_folder(folder: Path, option: str, path: str) -> None:
    """Check that `folder`, where `option` writes `path`, exists or can be created: its nearest existing
    ancestor is a writable directory. Nothing is created yet (`_created`), so a refused run leaves no trace."""
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        raise CLIError(f"cannot write {option} {path}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CLIError(f"cannot write {option} {path}: the folder {existing} is not writable")


def _created(path: Path) -> Path:
    """`path`, with its missing parent folders created (checked by `_output_file` before the work)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _model(spec: str) -> nn.Module:
    """The model a MODULE:FACTORY spec builds; a spec that builds none is a usage error."""
    try:
        return load_factory(spec)
    except FactoryError as e:
        raise CLIError(str(e)) from e


def protocol_inputs(model: nn.Module, seq_len: int, vocab_size: int | None = None) -> dict[str, Any]:
    """One packed row of the causal-LM protocol; Hugging Face extras only where forward takes them."""
    import torch

    config = getattr(model, "config", None)
    vocab = vocab_size or getattr(config, "vocab_size", None)
    if vocab is None:
        raise CLIError("the model has no config.vocab_size: pass --vocab-size")
    ids = torch.randint(0, vocab, (1, seq_len))
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    inputs: dict[str, Any] = {
        "input_ids": ids,
        "position_ids": torch.arange(seq_len)[None],
        "shift_labels": labels,
        "num_items_in_batch": torch.tensor(seq_len - 1),
    }
    params = pyinspect.signature(model.forward).parameters
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    missing = [name for name in inputs if name not in params and not takes_kwargs]
    if missing:
        raise CLIError(
            f"{type(model).__name__}.forward does not take {missing}: inspect calls models with the "
            f"causal-LM protocol (input_ids, position_ids, shift_labels, num_items_in_batch)"
        )
    if "labels" in params:
        inputs["labels"] = labels
    if "use_cache" in params:
        inputs["use_cache"] = False
    return inputs


def cmd_inspect(args: argparse.Namespace) -> int:
    import torch

    from .api import explain, optimize
    from .config import CompileConfig

    torch.manual_seed(0)
    model = _model(args.target)
    model.train(not args.eval)
    config = CompileConfig(attention=not args.no_attention, fused_loss=not args.no_fused_loss)
    inputs = protocol_inputs(model, args.seq_len, args.vocab_size)
    if args.pp > 1:
        return _inspect_stages(model, config, inputs, args)
    report = explain(optimize(model, config), **inputs)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.to_markdown(graphs=args.graphs))
    return 0


def _inspect_stages(model: nn.Module, config: Any, inputs: dict[str, Any], args: argparse.Namespace) -> int:
    """Each pipeline stage compiled alone through optimize(), as `--pp` training runs it, fed the previous
    stage's hidden states; one report per stage."""
    from .api import optimize
    from .train.stages import UnsupportedModelError, split_stages, stage_inputs, stage_spec

    try:
        stages = split_stages(model, args.pp)
    except (UnsupportedModelError, ValueError) as e:
        raise CLIError(f"--pp {args.pp}: {e}") from e
    kwargs = {name: value for name, value in inputs.items() if name != "use_cache"}
    hidden, reports = None, []
    for stage in stages:
        spec = stage_spec(stage)
        assert spec is not None  # every stage of a split into more than one has its spec
        optimized = optimize(stage, config)
        out = optimized(**stage_inputs(spec, kwargs, hidden))
        hidden = out.detach() if not spec.is_last else None
        reports.append((spec, optimized.report))
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "stage": spec.index,
                        "pp_size": spec.pp_size,
                        "layers": [spec.layers.start, spec.layers.stop],
                        "report": report.to_dict(),
                    }
                    for spec, report in reports
                ],
                indent=2,
            )
        )
        return 0
    for spec, report in reports:
        print(
            f"# Stage {spec.index} of {spec.pp_size}: decoder layers {spec.layers.start}-{spec.layers.stop - 1}"
            f"{', embedding' if spec.is_first else ''}{', final norm, lm_head and loss' if spec.is_last else ''}\n"
        )
        print(report.to_markdown(graphs=args.graphs))
    return 0


def _cost_model(name: str, hardware: str | None = None, tp: int = 1) -> Any:
    """A preset or profiled cost model; `hardware` puts its ranks on a cluster preset of TP `tp`, whose
    all-reduces T(s) charges on the cluster's intra-node links. TP > 1 without a cluster is refused: there
    is no link to charge them on, and ignoring --tp would plan a TP group as one GPU."""
    import dataclasses

    from .planner import CostModel, Hardware

    if tp > 1 and not hardware:
        raise CLIError(
            f"--tp {tp} needs --hardware (l20 | h100-nvlink): the cluster preset gives the TP group's devices "
            f"and the intra-node link its all-reduces run on"
        )
    try:
        cluster = Hardware.preset(hardware, tp_size=tp) if hardware else None
    except ValueError as e:
        raise CLIError(f"--hardware {hardware} --tp {tp}: {e}") from e
    try:
        cost = CostModel.load(name) if name.endswith(".json") else CostModel.preset(name, cluster)
    except (OSError, ValueError) as e:
        raise CLIError(str(e)) from e
    return dataclasses.replace(cost, hardware=cluster) if cluster and name.endswith(".json") else cost


def _strategy(name: str) -> str:
    """A strategy `run_strategy` knows, checked before any planning or output."""
    from .planner import STRATEGY_SPECS

    if name not in STRATEGY_SPECS:
        raise CLIError(f"unknown strategy {name!r}; strategies: {', '.join(STRATEGY_SPECS)}")
    return name


def cmd_plan(args: argparse.Namespace) -> int:
    from .planner import AUTO, PlanError
    from .sim.experiments import run_strategy
    from .sim.lengths import sample_global_batch

    tokens, capacity, context, strategy = args.global_tokens, args.capacity, args.context, _strategy(args.strategy)
    cost_model = _cost_model(args.model, args.hardware, args.tp)
    lens = sample_global_batch(args.dataset, tokens, seed=args.seed, max_len=context)
    try:
        outcome = run_strategy(strategy, lens, args.ranks, capacity, cost_model, context, args.pp, args.sp)
        outcome.plan.validate()
    except (PlanError, ValueError) as e:
        raise CLIError(str(e)) from e
    if args.json:
        print(outcome.plan.to_json())
        return 0
    mbs = outcome.plan.micro_batches
    shared = [m for m in mbs if m.shared]
    where = f"{args.ranks} HDP ranks" + (f" x TP {args.tp} ({args.ranks * args.tp} GPUs)" if args.tp > 1 else "")
    print(f"{args.strategy}: {len(lens)} sequences, {int(lens.sum())} tokens over {where} (C={capacity})")
    print(
        f"  micro-batches: {len(mbs)} ({len(shared)} shared, largest group {max((len(m.ranks) for m in shared), default=1)})"
    )
    print(f"  per-rank micro-batches: {min(map(len, outcome.plan.schedule))}..{max(map(len, outcome.plan.schedule))}")
    if shared:
        splits = outcome.plan.splits()
        print(
            f"  shared splits u x r (--sp {args.sp}): "
            + ", ".join(f"{k} {n / len(shared):.0%}" for k, n in splits.items())
        )
    print(
        f"  planned in {outcome.plan_seconds * 1e3:.1f} ms; simulated step {outcome.step_time:.3f} s, "
        f"{outcome.tokens_per_second:,.0f} tokens/s, busy spread {outcome.busy_spread:.2f}"
    )
    if AUTO in outcome.plan.meta:
        report = outcome.plan.meta[AUTO]
        over_static = report["speedup_over_static"]
        print(
            f"  auto chose {report['chosen']}: "
            + (f"{over_static:.2f}x static, " if over_static is not None else "static cannot plan this batch, ")
            + f"{report['speedup_over_runner_up']:.3f}x the runner-up; simulated step per candidate: "
            + ", ".join(f"{k} {v:.3f} s" for k, v in report["step_time"].items())
        )
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from .planner import PlanError
    from .sim.experiments import run_strategy
    from .sim.lengths import sample_global_batch
    from .sim.timeline import plot_throughput, plot_timelines

    plot = _output_file(args.plot, "--plot") if args.plot else None
    timeline = _output_file(args.timeline, "--timeline") if args.timeline else None
    tokens, capacity, contexts = args.global_tokens, args.capacity, args.context
    strategies = [_strategy(s) for s in args.strategies.split(",") if s]
    cost_model = _cost_model(args.model, args.hardware, args.tp)
    table: dict[str, list[float]] = {s: [] for s in strategies}
    print(f"{'context':>8} " + " ".join(f"{s + ' tok/s':>22}" for s in strategies) + "   speedup over first")
    last = []
    for context in contexts:
        lens = sample_global_batch(args.dataset, tokens, seed=args.seed, max_len=context)
        try:
            last = [
                run_strategy(s, lens, args.ranks, capacity, cost_model, context, args.pp, args.sp) for s in strategies
            ]
        except (PlanError, ValueError) as e:
            raise CLIError(str(e)) from e
        for o in last:
            table[o.name].append(o.tokens_per_second)
        speedups = " ".join(f"{o.tokens_per_second / last[0].tokens_per_second:.2f}x" for o in last)
        print(f"{context // 1024:>7}K " + " ".join(f"{o.tokens_per_second:>22,.0f}" for o in last) + f"   {speedups}")
    if plot:
        plot_throughput(contexts, table, str(_created(plot)), title=f"{args.model}, {args.dataset}, {args.ranks} ranks")
        print(f"throughput plot: {plot}")
    if timeline and last:
        plot_timelines(
            [o.timeline for o in last],
            str(_created(timeline)),
            title=f"{args.model}, {args.dataset}, context {contexts[-1] // 1024}K, {args.ranks} ranks",
        )
        print(f"timelines: {timeline}")
    return 0


def _hf_directory_model(directory: str) -> nn.Module:
    """The causal LM of a Hugging Face directory as the trainer builds it (random init from its config.json
    with seed 0, or its weights); module-level, so the profiler's processes can unpickle a partial of it."""
    from .train.models import load_model

    return load_model(directory, seed=0).module


def _profile_target(target: str) -> str | Callable[[], nn.Module]:
    """MODULE:FACTORY as given (the profiler imports it), or a builder of a Hugging Face config directory's model."""
    forms = "a directory with a Hugging Face config.json, or MODULE:FACTORY (e.g. bytescale_compile.models.llama:small)"
    path = Path(target)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CLIError(f"directory {target} has no config.json: give {forms}")
        return functools.partial(_hf_directory_model, target)
    if ":" not in target:
        raise CLIError(f"{target!r} is neither a directory nor MODULE:FACTORY: give {forms}")
    try:
        resolve_factory(target)
    except FactoryError as e:
        raise CLIError(f"{e} (the target is {forms})") from e
    return target


def cmd_profile(args: argparse.Namespace) -> int:
    """Training steps of the compiled model cut to 1 and 2 layers (`train/profiling.py`); with
    --ranks-per-device > 1, one eager layer as that many ranks sharing the CPU run it (T(s) and Act(s) only)."""
    from .planner.profiler import profile_model
    from .train.profiling import profile_steps

    out = _output_file(args.out, "--out")
    target = _profile_target(args.target)
    try:
        if args.ranks_per_device > 1:
            result: Any = profile_model(
                target, args.lengths, _created(out), repeats=args.repeats, ranks_per_device=args.ranks_per_device
            )
        else:
            result = profile_steps(target, args.lengths, _created(out), min_time=args.min_time)
    except ValueError as e:
        raise CLIError(str(e)) from e
    print(result.summary())
    print(f"cost model of {result.device} written to {out}")
    return 0


_PROBE_TOKENS = 32
"""Tokens of the row the memory command compiles its meta-device copy on: the report is per token, so any
short length does (the token dimension is compiled dynamic)."""


def _meta_model(target: str, dtype: str) -> tuple[nn.Module, int]:
    """The model MODEL names, on the meta device in the run's dtype, and its decoder layer count: a Hugging Face
    config directory cut to 2 layers, or what MODULE:FACTORY builds (whole)."""
    import torch

    from .train.memory import TORCH_DTYPES, meta_model, param_counts

    forms = "a directory with a Hugging Face config.json, or MODULE:FACTORY (e.g. bytescale_compile.models.llama:small)"
    path = Path(target)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CLIError(f"directory {target} has no config.json: give {forms}")
        from transformers import AutoConfig

        try:
            return meta_model(AutoConfig.from_pretrained(path, local_files_only=True), dtype)
        except (OSError, ValueError, KeyError) as e:
            raise CLIError(f"cannot build a causal LM from {target}: {e}") from e
    if ":" not in target:
        raise CLIError(f"{target!r} is neither a directory nor MODULE:FACTORY: give {forms}")
    try:
        with torch.device("meta"):
            model = load_factory(target)
    except FactoryError as e:
        raise CLIError(f"{e} (the target is {forms})") from e
    except Exception as e:  # the user's factory: whatever it raises is a usage error
        raise CLIError(f"{target} failed building its model on the meta device: {type(e).__name__}: {e}") from e
    layers = param_counts(model).layers_present
    if layers == 0:
        raise CLIError(f"{target} built {type(model).__name__}, which has no numbered decoder layers (layers.N)")
    return model.to(TORCH_DTYPES[dtype]), layers


def cmd_memory(args: argparse.Namespace) -> int:
    import torch

    from .planner.memory import MemoryBudgetError, format_bytes
    from .train.memory import compile_on_meta, device_memory, memory_model, parse_memory, trainer_expandable_segments

    if args.device_memory is None and not torch.cuda.is_available():
        raise CLIError("no CUDA device here to read the memory of: pass --device-memory SIZE (e.g. 80G)")
    try:
        budget = parse_memory(args.device_memory) if args.device_memory else device_memory("cuda")
    except ValueError as e:
        raise CLIError(f"--device-memory: {e}") from e
    if args.zero and args.dtype != "fp32":
        raise CLIError("--zero applies to --dtype fp32 (bf16's distributed optimizer always shards)")
    if args.grad_reduce_dtype != "fp32" and args.dtype != "bf16":
        raise CLIError("--grad-reduce-dtype bf16 applies to --dtype bf16")
    model, total_layers = _meta_model(args.target, args.dtype)
    if args.pp > total_layers:
        raise CLIError(f"--pp {args.pp} is larger than the model's {total_layers} decoder layers")
    layout = functools.partial(
        memory_model,
        total_layers=total_layers,
        hdp=args.hdp,
        dtype=args.dtype,
        pp=args.pp,
        tp=args.tp,
        zero=args.zero,
        grad_reduce_dtype=args.grad_reduce_dtype,
        budget=budget,
        expandable=trainer_expandable_segments(),
    )
    inputs = protocol_inputs(model, _PROBE_TOKENS)
    try:
        layout(model, activations=False).available(budget)  # budget and tp refused before compiling
        memory = layout(compile_on_meta(model, inputs))
    except MemoryBudgetError as e:
        raise CLIError(f"--device-memory: {e}") from e
    except ValueError as e:
        raise CLIError(str(e)) from e
    except Exception as e:  # compiling someone's model on the meta device: name what failed, not a traceback
        raise CLIError(f"compiling {args.target} on the meta device failed: {type(e).__name__}: {e}") from e
    where = f"tp {args.tp}, pp {args.pp}, {args.hdp} HDP ranks"
    print(f"{args.target}: {total_layers} decoder layers, {args.dtype}, {where}, budget {format_bytes(budget)}")
    print(memory.describe())
    modes = [args.offload] if args.offload is not None else [False, True]
    try:
        for offload in modes:
            c = memory.capacity(budget, offload)
            peak = memory.peak(memory.layers * c / 2, 1.0) if offload and memory.layers > 2 else memory.peak(c)
            print(f"C {'with' if offload else 'without'} offload: {c:,} tokens (peak {format_bytes(peak)})")
        if True in modes:
            print(f"longest per rank with offload (r = 1): {memory.longest_per_rank(budget):,} tokens")
    except MemoryBudgetError as e:
        raise CLIError(f"--device-memory: {e}") from e
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from .train.export import ExportError, export_checkpoint

    _output_folder(Path(args.out), "--out", args.out)
    try:
        result = export_checkpoint(args.checkpoint, args.out, args.tokenizer, args.overwrite)
    except ExportError as e:
        raise CLIError(str(e)) from e
    print(result.summary())
    return 0


_DATA_ERRORS = (OSError, ValueError)
"""What the tokenizer and data commands report as usage errors: missing, unreadable or existing paths,
bad inputs (SourceError, TokenizerError and DatasetError are ValueErrors) and bad options; each names
the path or option to fix."""


def cmd_tokenizer_train(args: argparse.Namespace) -> int:
    from .data import train_tokenizer

    if Path(args.out).is_file():
        raise CLIError(f"--out {args.out} is a file; give the tokenizer directory to write")
    _output_folder(Path(args.out), "--out", args.out)
    try:
        trained = train_tokenizer(
            args.input,
            args.vocab_size,
            args.out,
            text_field=args.text_field,
            min_frequency=args.min_frequency,
            overwrite=args.overwrite,
            progress=True,
        )
    except _DATA_ERRORS as e:
        raise CLIError(str(e)) from e
    print(trained.summary())
    return 0


def cmd_data_prepare(args: argparse.Namespace) -> int:
    from .data import prepare

    _output_folder(Path(args.out).parent, "--out", args.out)
    try:
        report = prepare(
            args.input,
            args.tokenizer,
            args.out,
            text_field=args.text_field,
            workers=args.workers,
            max_len=args.max_len,
            long_docs=args.long_docs,
            eval_fraction=args.eval_fraction,
            seed=args.seed,
            overwrite=args.overwrite,
            progress=True,
        )
    except _DATA_ERRORS as e:
        raise CLIError(str(e)) from e
    print(report.summary())
    return 0


def cmd_data_check(args: argparse.Namespace) -> int:
    from .data import MixedDataset, open_data

    try:
        vocab, of = _checked_vocabulary(args.vocab_size, args.model)
        data, _ = open_data(args.data)
        for part in data.parts if isinstance(data, MixedDataset) else (data,):
            low, high = part.id_range()
            if vocab is None and (low < 0 or high >= part.vocab_size):
                part.check_tokens()  # names the file and byte of the first id outside its declared vocabulary
            elif vocab is not None and (low < 0 or high >= vocab):
                found = part.first_outside(vocab)
                assert found is not None  # id_range saw one
                raise CLIError(
                    f"{part.spec}: sequence {found.sequence} holds token id {found.token} at position "
                    f"{found.position} (ids {low} to {high} in all), outside the vocabulary of {vocab} ({of}; the "
                    f"dataset declares vocab_size {part.vocab_size}): give the vocabulary the data was tokenized "
                    "with (PATH?vocab_size=N or PATH?tokenizer=DIR) and a model whose vocab_size covers it"
                )
            tokenizer = "none" if part.tokenizer is None else part.tokenizer.name_or_path
            below = f"{vocab} ({of}; the dataset declares {part.vocab_size})" if vocab else str(part.vocab_size)
            print(
                f"{part.spec}: {len(part)} sequences, {int(part.lengths.sum())} tokens ({part.dtype}), max id {high}, "
                f"every id below vocab_size {below}; tokenizer {tokenizer}; {part.source}"
            )
    except _DATA_ERRORS as e:
        raise CLIError(str(e)) from e
    return 0


def _checked_vocabulary(vocab_size: int | None, model: str | None) -> tuple[int | None, str]:
    """The vocabulary size `data check` holds the ids against, and where it comes from: --vocab-size, the
    `vocab_size` of --model's config.json, or (None) each dataset's own."""
    if vocab_size is not None:
        return vocab_size, "--vocab-size"
    if model is None:
        return None, "the dataset's"
    path = Path(model) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise CLIError(f"--model {model}: cannot read {path} ({e}): give a Hugging Face model directory") from e
    vocab = config.get("vocab_size", config.get("text_config", {}).get("vocab_size"))
    if not isinstance(vocab, int) or vocab < 1:
        raise CLIError(f"--model {model}: {path} has no vocab_size: pass --vocab-size")
    return vocab, f"model {model}"


def _add_data_commands(sub: Any) -> None:
    inputs = "JSONL/JSON/Parquet/text files, directories of them, or `datasets` directories (save_to_disk)"
    tokenizer = sub.add_parser("tokenizer", help="train a tokenizer on your own text").add_subparsers(
        dest="action", required=True
    )
    p = tokenizer.add_parser(
        "train",
        help="train a byte-level BPE; AutoTokenizer.from_pretrained(OUT) loads it "
        "(special tokens: <|endoftext|> = EOS, <|pad|> = pad)",
    )
    p.add_argument("--input", nargs="+", required=True, metavar="PATH", help=inputs)
    p.add_argument("--vocab-size", type=int, required=True, help="at most this many tokens (>= 258)")
    p.add_argument("--out", required=True, metavar="DIR", help="the tokenizer directory to write")
    p.add_argument("--text-field", default="text", help="the record field holding the text (default text)")
    p.add_argument(
        "--min-frequency", type=_int_at_least(1), default=2, help="merge only pairs seen this often (default 2)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace a tokenizer already in DIR")
    p.set_defaults(func=cmd_tokenizer_train)

    data = sub.add_parser("data", help="prepare token datasets from your own text, check any").add_subparsers(
        dest="action", required=True
    )
    p = data.add_parser(
        "prepare",
        help="tokenize text into PREFIX.{bin,idx,json} (training) and PREFIX_eval.{bin,idx,json} (held-out split)",
    )
    p.add_argument("--input", nargs="+", required=True, metavar="PATH", help=inputs)
    p.add_argument("--tokenizer", required=True, metavar="DIR", help="a Hugging Face tokenizer directory with an EOS")
    p.add_argument("--out", required=True, metavar="PREFIX", help="dataset prefix; the eval split goes to PREFIX_eval")
    p.add_argument("--text-field", default="text", help="the record field holding the text (default text)")
    p.add_argument("--workers", type=_int_at_least(1), default=1, help="tokenizing processes (default 1)")
    p.add_argument("--max-len", type=int, default=None, help="tokens per document at most, EOS included")
    p.add_argument(
        "--long-docs",
        choices=("split", "drop"),
        default="split",
        help="what happens to documents over --max-len (default split)",
    )
    p.add_argument(
        "--eval-fraction",
        type=float,
        default=0.01,
        help="share of documents held out for evaluation (default 0.01; 0: no eval split)",
    )
    p.add_argument("--seed", type=_int_at_least(0), default=0, help="draws the eval split (default 0)")
    p.add_argument("--overwrite", action="store_true", help="replace existing datasets at PREFIX and PREFIX_eval")
    p.set_defaults(func=cmd_data_prepare)
    p = data.add_parser(
        "check",
        help="open --data as training does (converting Parquet/JSON Lines once) and check every token id against "
        "the vocabulary",
    )
    p.add_argument(
        "--data",
        required=True,
        metavar="SPEC",
        help="as training's --data: PREFIX, PATH?vocab_size=N, PATH?tokenizer=DIR, or a mixture a:0.7,b:0.3",
    )
    against = p.add_mutually_exclusive_group()
    against.add_argument(
        "--vocab-size",
        type=_int_at_least(1),
        default=None,
        help="hold every id against this vocabulary (a model's embedding rows) instead of the dataset's own",
    )
    against.add_argument(
        "--model", metavar="DIR", default=None, help="hold every id against the vocab_size of DIR/config.json"
    )
    p.set_defaults(func=cmd_data_check)


def _add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    """plan's and simulate's cluster: --ranks counts HDP ranks (the planner's world size), each a TP group of
    --tp GPUs of the --hardware preset, as `Hardware.preset` builds one rank, holding C tokens."""
    p.add_argument(
        "--ranks",
        type=_int_at_least(1),
        default=1024,
        help="HDP ranks, the planner's world size; each is a TP group of --tp GPUs, so ranks x tp GPUs in all",
    )
    p.add_argument(
        "--hardware",
        default=None,
        help="cluster preset for the ranks: l20 | h100-nvlink (default: private 25 GB/s links per rank)",
    )
    p.add_argument(
        "--tp",
        type=_int_at_least(1),
        default=1,
        help="GPUs per HDP rank on the --hardware cluster (needed when > 1; must divide the GPUs per switch): "
        "each layer's TP all-reduces are charged on their intra-node links",
    )
    p.add_argument("--capacity", type=_size, default="8K", help="tokens per HDP rank (its TP group's), C")
    p.add_argument(
        "--sp",
        choices=SP_MODES,
        default=DEFAULT_SP,
        help="how a sequence shared by D(s) ranks splits them u x r: ring (u = 1), ulysses (the largest u: an "
        "all-to-all over heads in groups of u ranks inside a node, the ring between the groups), auto (per "
        f"micro-batch, the split the cost model predicts fastest; default {DEFAULT_SP})",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="bytescale-compile", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one line")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="compile a model on one sequence and print what every pass did")
    p.add_argument("target", help="MODULE:FACTORY returning an nn.Module, e.g. bytescale_compile.models.llama:small")
    p.add_argument(
        "--seq-len",
        type=_int_at_least(2),
        default=512,
        help="tokens in the sample row, at least 2: a token and its target (default 512)",
    )
    p.add_argument("--vocab-size", type=_int_at_least(1), default=None, help="when the model has no config.vocab_size")
    p.add_argument("--eval", action="store_true", help="compile in eval mode (the loss is not fused)")
    p.add_argument("--no-attention", action="store_true", help="switch the attention pass off")
    p.add_argument("--no-fused-loss", action="store_true", help="switch the fused-loss pass off")
    p.add_argument("--graphs", action="store_true", help="append the graphs before/after as text")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--pp",
        type=_int_at_least(1),
        default=1,
        help="split into this many pipeline stages at decoder layers and report each stage's compilation",
    )
    p.set_defaults(func=cmd_inspect)

    datasets = ("byted", "github", "python")
    p = sub.add_parser("plan", help="plan one global batch and print a summary or the plan JSON")
    p.add_argument("--dataset", choices=datasets, default="byted")
    p.add_argument("--global-tokens", type=_size, default="32M")
    _add_cluster_arguments(p)
    p.add_argument("--strategy", default="balance", help="the planner's strategy (an unknown name lists them)")
    p.add_argument("--model", default="llama-7b", help="cost-model preset or a profiled JSON file")
    p.add_argument(
        "--context", type=_size, default=None, help="context length (truncates longer samples; the static mesh's row)"
    )
    p.add_argument("--pp", type=_int_at_least(1), default=1, help="pipeline stages per HDP rank")
    p.add_argument("--seed", type=_int_at_least(0), default=0)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("simulate", help="simulate strategies over context lengths and print tokens/s")
    p.add_argument("--model", default="llama-7b", help="cost-model preset or a profiled JSON file")
    p.add_argument("--dataset", choices=datasets, default="github")
    p.add_argument("--context", type=_sizes, default="256K,512K,1M,2M")
    _add_cluster_arguments(p)
    p.add_argument("--global-tokens", type=_size, default="32M")
    p.add_argument(
        "--strategies",
        default="static,naive,balance",
        help="comma-separated planner strategies (an unknown name lists them)",
    )
    p.add_argument("--pp", type=_int_at_least(1), default=1)
    p.add_argument("--seed", type=_int_at_least(0), default=0)
    p.add_argument("--plot", default=None, help="write a throughput-vs-context PNG here (missing folders are created)")
    p.add_argument("--timeline", default=None, help="write per-rank timelines of the last context here (PNG)")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser(
        "profile",
        help="fit the cost model to training steps of the compiled model cut to 1 and 2 layers on this device",
    )
    p.add_argument(
        "target",
        help="MODULE:FACTORY, e.g. bytescale_compile.models.llama:small, or a directory with a Hugging Face "
        "config.json (random init from it, as the trainer builds --model)",
    )
    p.add_argument(
        "--lengths",
        type=_sizes,
        default="256,512,1K,2K",
        help="at least 3 distinct sequence lengths; shorter ones are also packed into rows of the longest",
    )
    p.add_argument(
        "--min-time",
        type=_seconds_at_least_0,
        default=1.0,
        help="seconds of repeated steps timed per point, at least (GPU clocks settle in about one)",
    )
    p.add_argument("--repeats", type=_int_at_least(1), default=3, help="timed calls per length, --ranks-per-device > 1")
    p.add_argument("--out", default="cost_model.json", help="the cost-model JSON to write (records the device)")
    p.add_argument(
        "--ranks-per-device",
        type=_int_at_least(1),
        default=1,
        help="CPU: profile one eager layer as this many ranks sharing the cores would run it (that many processes "
        "at once; T(s) and Act(s) only)",
    )
    p.set_defaults(func=cmd_profile)
    _add_data_commands(sub)

    p = sub.add_parser(
        "memory",
        help="predict one rank's memory (static bytes, activations per token, workspace) and the capacity C a "
        "device budget allows, from a meta-device compilation: no weights, no device memory",
    )
    p.add_argument(
        "target",
        metavar="MODEL",
        help="a directory with a Hugging Face config.json (compiled as a 2-layer copy), or MODULE:FACTORY",
    )
    p.add_argument("--tp", type=_int_at_least(1), default=1, help="tensor-parallel degree (default 1)")
    p.add_argument("--pp", type=_int_at_least(1), default=1, help="pipeline stages (default 1)")
    p.add_argument(
        "--hdp", type=_int_at_least(1), default=1, help="HDP ranks, N: what gradients and sharded state span"
    )
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="training dtype (default fp32)")
    p.add_argument("--zero", action="store_true", help="fp32: shard the Adam moments over the HDP ranks (ZeRO-1)")
    p.add_argument(
        "--grad-reduce-dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="bf16: reduce-scatter gradients in fp32 in place (default) or as a bf16 copy of each bucket",
    )
    p.add_argument(
        "--device-memory",
        "--memory-budget",
        dest="device_memory",
        default=None,
        metavar="SIZE",
        help="memory of one device, binary units: 80G, 141GiB (default: this machine's CUDA device)",
    )
    p.add_argument(
        "--offload",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the C with (--offload) or without (--no-offload) activation offloading (default: both)",
    )
    p.set_defaults(func=cmd_memory)

    p = sub.add_parser(
        "export",
        help="write a training checkpoint as a Hugging Face model directory (save_pretrained in fp32, with the "
        "tokenizer), as final/ is written at the end of a run",
    )
    p.add_argument(
        "checkpoint",
        metavar="CHECKPOINT",
        help="a checkpoint directory (RUN/checkpoints/step_N), or a run's --out: its newest checkpoint that "
        "verifies against its sha256 manifest",
    )
    p.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="the directory to write; AutoModelForCausalLM.from_pretrained loads it",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="the tokenizer to save with it (default: the run's --tokenizer, else the one its data was prepared with)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="write into a DIR that holds files (same names are replaced)"
    )
    p.set_defaults(func=cmd_export)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; a usage error prints `bytescale-compile COMMAND: error: ...` and returns 2 (with
    --debug, the traceback of a command's error is shown instead; argparse's own errors name the nested
    command, `bytescale-compile data prepare: error: ...`, as they always did)."""
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:
        print(f"{e.prog}: error: {e}", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except CLIError as e:
        if args.debug:
            raise
        print(f"bytescale-compile {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
