"""Megatron-Core's hybrid context-parallel schedule beside our balance planner, both timed by our simulator.

Megatron-Core 0.19.2 schedules hybrid DP x CP with `BalancedCPScheduler` (`megatron/core/pipeline_parallel/
hybrid_cp_schedule.py`): it splits a global batch into groups, and per group and GPU lists the samples that GPU
runs, in order; a sample's CP size is the number of GPUs of its group listing it (a power of two of at least
s / max_seq_len_per_rank, so its tokens per rank fit C). `hybrid_context_parallel_forward_backward` runs the
groups one after another with a barrier at the end of each, and reduces the gradients once after the last.

Here each group becomes one `Plan` (every sample its own micro-batch, a plain zigzag ring over the GPUs listing
it, no offloading, each GPU's micro-batches in Megatron's order), and the step "as executed" is the sum of the
groups' makespans on our simulator, plus the gradient all-reduce and the optimizer step once. The barriers
themselves are not charged (a few microseconds each), which can only favour Megatron.

Megatron-Core needs Python >= 3.12, so its scheduler is not installed: the one file is read from the wheel
(`--megatron-wheel`, by default the one in `CACHE_DIR`) and run with stand-ins for the few Megatron modules it
imports and for the process group it only asks the size of. Nothing of Megatron's is copied into this
repository.

Prints, on LLaMA-7B (h100-nvlink), C = 8K, 32K tokens per rank, seed 0, for each of `BATCHES`: Megatron's step,
its groups and planning time, balance's step and planning time, balance / Megatron, both over the lower bound,
and the group size each gives the longest sequence; then the median and the largest balance / Megatron against
the goals (median <= 0.6, every batch <= 0.8).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import statistics
import sys
import time
import types
import zipfile
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bytescale_compile.planner import NAIVE, CostModel, Hardware, Plan, PlanError  # noqa: E402
from bytescale_compile.planner.builder import PlanBuilder  # noqa: E402
from bytescale_compile.sim.experiments import run_strategy  # noqa: E402
from bytescale_compile.sim.lengths import sample_global_batch  # noqa: E402
from bytescale_compile.sim.simulator import lower_bound, simulate, step_time  # noqa: E402
from bytescale_compile.sim.timeline import format_tokens  # noqa: E402
from bytescale_compile.strategies import SP_RING  # noqa: E402

K, M = 2**10, 2**20
MEGATRON_VERSION = "0.19.2"
SCHEDULE_FILE = "megatron/core/pipeline_parallel/hybrid_cp_schedule.py"
SCHEDULER_CLASS = "BalancedCPScheduler"
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bytescale"
"""Where the benchmark looks for the Megatron-Core wheel when `--megatron-wheel` is not given."""
WHEEL_GLOB = f"megatron_core-{MEGATRON_VERSION}-*.whl"
STUB_MODULES = ("megatron", "megatron.core", "megatron.core.parallel_state", "megatron.core.rerun_state_machine")
"""What the schedule file imports at module level besides torch; none of it is used by the scheduler."""

MODEL, HARDWARE = "llama-7b", "h100-nvlink"
CAPACITY = 8 * K
"""C, which is also Megatron's max_seq_len_per_rank."""
TOKENS_PER_RANK = 32 * K
GOAL_MEDIAN, GOAL_EACH = 0.6, 0.8
"""Balance's step over Megatron's: the median over `BATCHES`, and every batch."""
MICRO_BATCH_KINDS = ("packed", "shared")
"""Timeline spans that are micro-batches (the others are the all-reduce and the optimizer step)."""


def download_command(directory: Path | None = None) -> str:
    """The pip command that fetches the wheel into `directory` (`CACHE_DIR`) without installing it: it needs
    Python >= 3.12, and we only read it."""
    directory = CACHE_DIR if directory is None else directory
    return (
        f"python -m pip download --no-deps --python-version 3.12 --only-binary=:all: "
        f"megatron-core=={MEGATRON_VERSION} -d {directory}"
    )


class WheelNotFoundError(FileNotFoundError):
    """The Megatron-Core wheel is not where the benchmark looked; the message says how to fetch it."""


def find_wheel(path: Path | None = None) -> Path:
    """`path` when given, else the newest matching wheel in `CACHE_DIR`."""
    if path is not None:
        if not path.is_file():
            raise WheelNotFoundError(f"--megatron-wheel {path}: no such file; fetch it with: {download_command()}")
        return path
    found = sorted(glob.glob(str(CACHE_DIR / WHEEL_GLOB)))
    if not found:
        raise WheelNotFoundError(
            f"no {WHEEL_GLOB} in {CACHE_DIR}; fetch it with:\n  {download_command()}\nor pass --megatron-wheel PATH"
        )
    return Path(found[-1])


class _GroupOfSize:
    """Stands in for the DP x CP process group: the scheduler only asks its size."""

    def __init__(self, world_size: int) -> None:
        self._world_size = world_size

    def size(self) -> int:
        return self._world_size


@contextlib.contextmanager
def _stub_megatron() -> Iterator[None]:
    """Empty modules for the Megatron imports the schedule file makes at load time, removed afterwards; a real
    Megatron already imported is used as it is."""
    if "megatron" in sys.modules:
        yield
        return
    stubs = {name: types.ModuleType(name) for name in STUB_MODULES}
    stubs["megatron"].__dict__["core"] = stubs["megatron.core"]
    stubs["megatron.core"].__dict__["parallel_state"] = stubs["megatron.core.parallel_state"]
    stubs["megatron.core.rerun_state_machine"].__dict__["RerunDataIterator"] = type("RerunDataIterator", (), {})
    sys.modules.update(stubs)
    try:
        yield
    finally:
        for name in stubs:
            sys.modules.pop(name, None)


def load_scheduler(wheel: Path) -> type:
    """`BalancedCPScheduler`, from the schedule file read out of the wheel (never installed, never copied)."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            source = archive.read(SCHEDULE_FILE).decode()
    except (zipfile.BadZipFile, KeyError) as e:
        raise WheelNotFoundError(
            f"{wheel}: not a Megatron-Core wheel holding {SCHEDULE_FILE} ({e}); fetch it with: {download_command()}"
        ) from e
    name = SCHEDULE_FILE.removesuffix(".py").replace("/", ".")
    module = types.ModuleType(name)
    module.__file__ = f"{wheel}/{SCHEDULE_FILE}"
    with _stub_megatron():
        exec(compile(source, module.__file__, "exec"), module.__dict__)
    scheduler = getattr(module, SCHEDULER_CLASS, None)
    if not isinstance(scheduler, type):
        raise WheelNotFoundError(f"{wheel}: {SCHEDULE_FILE} defines no class {SCHEDULER_CLASS}")
    return scheduler


def megatron_groups(scheduler_cls: type, lens: np.ndarray, *, world_size: int, capacity: int) -> list[list[list[int]]]:
    """Megatron's schedule of `lens` (sample i has length lens[i]): per group, per GPU, the sample ids it runs
    in order. max_seq_len_per_rank is `capacity`."""
    scheduler = scheduler_cls(capacity, _GroupOfSize(world_size))
    samples = [(i, int(n)) for i, n in enumerate(np.asarray(lens).tolist())]
    _, sample_id_groups = scheduler.get_groups_and_subsamples(samples, None)
    return [[list(map(int, ids)) for ids in group] for group in sample_id_groups]


def group_sample_ids(group: Sequence[Sequence[int]]) -> list[int]:
    """The samples one group runs, ascending: its plan's sequence i is sample `group_sample_ids(group)[i]`."""
    return sorted({s for ids in group for s in ids})


def check_coverage(sample_id_groups: Sequence[Sequence[Sequence[int]]], samples: int) -> None:
    """Every sample of the batch runs in exactly one group (a sample runs on all its GPUs in one group)."""
    groups_of: dict[int, list[int]] = defaultdict(list)
    for g, group in enumerate(sample_id_groups):
        for s in group_sample_ids(group):
            groups_of[s].append(g)
    outside = sorted(s for s in groups_of if not 0 <= s < samples)
    if outside:
        raise PlanError(f"Megatron's schedule names sample {outside[0]}, outside the batch's [0, {samples})")
    for s in range(samples):
        if len(groups_of[s]) != 1:
            where = f"groups {groups_of[s]}" if groups_of[s] else "no group"
            raise PlanError(f"sample {s} runs in {where} of Megatron's schedule, must run in exactly one")


def _group_plan(
    group: Sequence[Sequence[int]], lens: np.ndarray, *, world_size: int, capacity: int, cost_model: CostModel
) -> Plan:
    """One group as a Plan: each sample a micro-batch on the GPUs listing it (a plain ring, no offload), each
    GPU's micro-batches in Megatron's order. Validated: a sample listed twice on a GPU, over too few GPUs for
    C, or in orders that would deadlock raises PlanError."""
    if len(group) != world_size:
        raise PlanError(f"a group of Megatron's schedule lists {len(group)} GPUs, the world has {world_size}")
    ids = group_sample_ids(group)
    ranks_of: dict[int, list[int]] = defaultdict(list)
    for gpu, samples in enumerate(group):
        for s in samples:
            ranks_of[s].append(gpu)
    builder = PlanBuilder(NAIVE, np.asarray(lens)[ids], world_size, capacity, cost_model, sp=SP_RING)
    micro_batch_of = {s: builder.add(ranks_of[s], [i]).id for i, s in enumerate(ids)}
    plan = builder.build([[micro_batch_of[s] for s in samples] for samples in group])
    plan.validate()
    return plan


def megatron_plans(
    sample_id_groups: Sequence[Sequence[Sequence[int]]],
    lens: np.ndarray,
    *,
    world_size: int,
    capacity: int,
    cost_model: CostModel,
) -> list[Plan]:
    """One validated Plan per group of Megatron's schedule, in its order (`group_sample_ids` maps a plan's
    sequences back to the batch's samples); every sample must run in exactly one group."""
    check_coverage(sample_id_groups, len(lens))
    return [
        _group_plan(group, lens, world_size=world_size, capacity=capacity, cost_model=cost_model)
        for group in sample_id_groups
    ]


def group_makespan(plan: Plan, cost_model: CostModel) -> float:
    """When the group's last micro-batch ends on the simulator (without the step's all-reduce and optimizer)."""
    spans = simulate(plan, cost_model).spans
    return max((s.end for s in spans if s.kind in MICRO_BATCH_KINDS), default=0.0)


def megatron_step_time(plans: Sequence[Plan], cost_model: CostModel) -> float:
    """The step as Megatron executes it: the groups one after another, each ending at a barrier, then one
    gradient all-reduce and the optimizer step. The last group's simulated step carries those two, so it is
    the other groups' makespans plus the last one's step time."""
    if not plans:
        raise ValueError("megatron_step_time needs at least one group plan")
    return sum(group_makespan(p, cost_model) for p in plans[:-1]) + step_time(plans[-1], cost_model)


@dataclass(frozen=True)
class Batch:
    """One global batch of the comparison: `TOKENS_PER_RANK` x ranks tokens, lengths cut at `context`."""

    dataset: str
    context: int
    ranks: int

    @property
    def tokens(self) -> int:
        return TOKENS_PER_RANK * self.ranks

    @property
    def label(self) -> str:
        return f"{self.dataset} {format_tokens(self.context)} x{self.ranks}"

    def lengths(self) -> np.ndarray:
        return sample_global_batch(self.dataset, self.tokens, seed=0, max_len=self.context)


BATCHES = [
    *(
        Batch(dataset, context, ranks)
        for ranks in (64, 1024)
        for context in (256 * K, 2 * M)
        for dataset in ("byted", "github")
    ),
    Batch("github", M, 1024),
]
"""Byted- and GitHub-like at 256K and 2M context, 64 and 1,024 ranks, and GitHub-like 1M at 1,024."""


@dataclass(frozen=True)
class Comparison:
    """One batch under both schedules: steps in seconds, planning times in seconds."""

    batch: Batch
    megatron_step: float
    megatron_groups: int
    megatron_plan_seconds: float
    megatron_longest_ranks: int
    balance_step: float
    balance_plan_seconds: float
    balance_longest_ranks: int
    bound: float

    @property
    def ratio(self) -> float:
        """Balance's step over Megatron's (below 1: balance is faster)."""
        return self.balance_step / self.megatron_step


def _group_size(plan: Plan, sequence: int) -> int:
    """The ranks of the micro-batch of `plan` that runs its sequence `sequence`."""
    return next(len(m.ranks) for m in plan.micro_batches if sequence in m.sequences)


def _megatron_group_size(groups: list[list[list[int]]], plans: Sequence[Plan], sample: int) -> int:
    """The GPUs Megatron's schedule runs `sample` on."""
    group, plan = next((g, p) for g, p in zip(groups, plans) if any(sample in ids for ids in g))
    return _group_size(plan, group_sample_ids(group).index(sample))


def compare(batch: Batch, scheduler_cls: type, cost_model: CostModel, capacity: int = CAPACITY) -> Comparison:
    """Plan `batch` with Megatron's scheduler and with balance, and time both on the simulator."""
    lens = batch.lengths()
    start = time.perf_counter()
    groups = megatron_groups(scheduler_cls, lens, world_size=batch.ranks, capacity=capacity)
    planned = time.perf_counter() - start
    plans = megatron_plans(groups, lens, world_size=batch.ranks, capacity=capacity, cost_model=cost_model)
    balance = run_strategy("balance", lens, batch.ranks, capacity, cost_model, batch.context)
    longest = int(np.argmax(lens))
    return Comparison(
        batch=batch,
        megatron_step=megatron_step_time(plans, cost_model),
        megatron_groups=len(groups),
        megatron_plan_seconds=planned,
        megatron_longest_ranks=_megatron_group_size(groups, plans, longest),
        balance_step=balance.step_time,
        balance_plan_seconds=balance.plan_seconds,
        balance_longest_ranks=_group_size(balance.plan, longest),
        bound=lower_bound(lens, batch.ranks, capacity, cost_model),
    )


def cost_model(model: str = MODEL, hardware: str = HARDWARE) -> CostModel:
    """The comparison's cost model: `model` on one device per HDP rank of `hardware`."""
    return CostModel.preset(model, Hardware.preset(hardware, 1))


HEADER = (
    f"{'batch':>17} {'Megatron s':>10} {'groups':>6} {'plan s':>7} {'balance s':>9} {'plan s':>7} "
    f"{'bal/Meg':>7} {'Meg/LB':>6} {'bal/LB':>6} {'D(longest) M/b':>14}"
)


def format_row(c: Comparison) -> str:
    return (
        f"{c.batch.label:>17} {c.megatron_step:>10.2f} {c.megatron_groups:>6} {c.megatron_plan_seconds:>7.2f} "
        f"{c.balance_step:>9.2f} {c.balance_plan_seconds:>7.2f} {c.ratio:>7.3f} {c.megatron_step / c.bound:>6.3f} "
        f"{c.balance_step / c.bound:>6.3f} {f'{c.megatron_longest_ranks}/{c.balance_longest_ranks}':>14}"
    )


def summary(comparisons: Sequence[Comparison]) -> str:
    """The median and largest balance / Megatron against the goals."""
    ratios = [c.ratio for c in comparisons]
    floors = [c.bound / c.megatron_step for c in comparisons]
    median, worst = statistics.median(ratios), max(ratios)
    verdict = {True: "met", False: "NOT met"}
    return (
        f"balance / Megatron: median {median:.3f} (goal <= {GOAL_MEDIAN}: {verdict[median <= GOAL_MEDIAN]}), "
        f"max {worst:.3f} (goal <= {GOAL_EACH} on every batch: {verdict[worst <= GOAL_EACH]})\n"
        f"lower bound / Megatron, what no schedule can beat: median {statistics.median(floors):.3f}, "
        f"max {max(floors):.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megatron-wheel", type=Path, default=None, help=f"the megatron-core {MEGATRON_VERSION} wheel")
    parser.add_argument("--ranks", type=int, nargs="*", default=None, help="only the batches at these rank counts")
    args = parser.parse_args()
    try:
        scheduler = load_scheduler(find_wheel(args.megatron_wheel))
    except WheelNotFoundError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    cost = cost_model()
    batches = [b for b in BATCHES if args.ranks is None or b.ranks in args.ranks]
    print(
        f"Megatron-Core {MEGATRON_VERSION} hybrid CP (as executed: a barrier per group) vs balance, {MODEL} on "
        f"{HARDWARE}, C={format_tokens(CAPACITY)}, {format_tokens(TOKENS_PER_RANK)} tokens per rank, seed 0; "
        "LB: the simulator's lower bound"
    )
    print(HEADER)
    comparisons = []
    for batch in batches:
        comparisons.append(compare(batch, scheduler, cost))
        print(format_row(comparisons[-1]), flush=True)
    print(summary(comparisons))


if __name__ == "__main__":
    main()
