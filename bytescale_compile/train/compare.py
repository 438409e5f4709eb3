"""`torchrun --nproc_per_node=N -m bytescale_compile.train.compare [--config FILE.toml] [options]`

With `--strategy all` (as `examples/configs/demo.toml` sets), every strategy (balance, naive, static and auto)
trained in turn from the same initial weights on the same batches, each into `--out/<strategy>` beside one
config.toml, with the options of `python -m bytescale_compile.train` (one strategy: the same run as the trainer's);
then a table of their steady steps and the simulator's projection of the same model and data at 512 ranks
(`projection.py`), and on CPU ranks what the measured ratios can and cannot show. `make demo` runs it. The model compiles once: the strategies train
one prepared model, its weights reset in place between them.

The table is `summary.py`'s, whose names import from here too.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .__main__ import Entry, exit_with, report_runs
from .__main__ import main as train_main
from .summary import StrategySummary, comparison, summarize

if TYPE_CHECKING:
    import torch

    from .inputs import RunInputs
    from .trainer import RunResult

__all__ = ["COMPARE", "StrategySummary", "compare", "comparison", "cpu_ratios_note", "main", "summarize"]


def compare(inputs: RunInputs, device: torch.device) -> list[RunResult]:
    """Train each strategy of the config in turn on `device`, from the same prepared model and initial weights."""
    from .prepared import prepare
    from .trainer import session, train

    prepared = prepare(inputs, device)
    with session(inputs.config) as stop:
        return [train(inputs, prepared, strategy, stop) for strategy in inputs.config.strategies]


def _report(inputs: RunInputs, results: list[RunResult]) -> None:
    """The trainer's table of every strategy, then rank 0's simulated 512-rank projection and, on CPU ranks, what
    the measured ratios can and cannot show."""
    from .launch import local_device
    from .metrics import echo

    report_runs(inputs, results)
    if int(os.environ.get("RANK", "0")) == 0:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        text, balance_speedup = _projection(inputs, world, results[0].capacity)
        echo("\n" + text, True)
        if local_device().type == "cpu":
            predicted = all(r.unpredicted is None for r in results)
            note = cpu_ratios_note(world, _cores(), predicted=predicted, projected_speedup=balance_speedup)
            echo("\n" + note, True)


def _cores() -> int:
    """The cores this process may run on (the machine's, less any affinity mask)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_ratios_note(ranks: int, cores: int, *, predicted: bool, projected_speedup: float | None) -> str:
    """The closing lines of a comparison on CPU ranks: what its measured ratios can and cannot show. Ranks on one
    machine's cores exchange K/V through its memory, not a network, and ranks that share cores wait for the
    cores rather than for each other, so balancing the work has little to win there; the gain at scale is the
    simulation's, where it shows one (`projected_speedup`: balance's over static in the projection, None without
    one), and the measured figures of record (GPU ones included) are in RESULTS.md. `predicted`: the table holds
    predictions of this device."""
    shown = "that every strategy trains the same model to the same losses (up to float rounding)"
    if predicted:
        shown += ", and how well the cost model predicts these steps"
    why = "their rings cross no network, so a balanced plan has little to win"
    if ranks == 1:
        why = "one rank has nothing to balance"
    elif ranks > cores:
        why = f"ranks sharing cores wait for the cores, not for each other, and {why}"
    return (
        f"What the measured ratios above can show, on {ranks} CPU rank{'s' if ranks > 1 else ''} and {cores} "
        f"core{'s' if cores > 1 else ''}: {shown}.\n"
        f"What they cannot show: the method's gain. Here {why}.\n" + _where_the_gain_is(projected_speedup)
    )


def _where_the_gain_is(speedup: float | None) -> str:
    measured = "measured figures, GPU ones included, are in benchmarks/RESULTS.md."
    if speedup is None:
        return measured[0].upper() + measured[1:]
    if speedup > 1:
        return f"The gain at scale is the SIMULATED projection above (balance {speedup:.2f}x static); {measured}"
    return (
        f"Nor does the SIMULATED projection above show one for this model (balance {speedup:.2f}x static); "
        f"benchmarks/planner.py projects the paper's models, and {measured}"
    )


def _projection(inputs: RunInputs, world_size: int, capacity: int) -> tuple[str, float | None]:
    """The simulated 512-rank projection of the run's model and data and balance's speedup over static in it, or
    why there is none."""
    from ..planner import BALANCE
    from ..planner.model_shape import ModelConfigError
    from .projection import project_run

    try:
        projection = project_run(inputs.config, inputs.model.module, inputs.train_data.lengths, world_size, capacity)
    except ModelConfigError as e:
        return f"no simulated projection: {e}", None
    return projection.report(), next(s.speedup for s in projection.steps if s.strategy == BALANCE)


COMPARE = Entry(
    "python -m bytescale_compile.train.compare", "bytescale_compile.train.compare", __doc__, True, compare, _report
)
"""The strategies of the config from the same weights, then the table and the projection."""


def main(argv: Sequence[str] | None = None) -> int:
    return train_main(argv, COMPARE)


if __name__ == "__main__":
    exit_with(main())
