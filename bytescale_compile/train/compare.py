"""`torchrun --nproc_per_node=N -m bytescale_compile.train.compare [--config FILE.toml] [options]`

With `--strategy all` (as `examples/configs/demo.toml` sets), every strategy (balance, naive, static and auto)
trained in turn from the same initial weights on the same batches, each into `--out/<strategy>` beside one
config.toml, with the options of `python -m bytescale_compile.train` (one strategy: the same run as the trainer's);
then a table of their steady steps and the simulator's projection of the same model and data at 512 ranks
(`projection.py`). `make demo` runs it. The model compiles once: the strategies train
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

__all__ = ["COMPARE", "StrategySummary", "compare", "comparison", "main", "summarize"]


def compare(inputs: RunInputs, device: torch.device) -> list[RunResult]:
    """Train each strategy of the config in turn on `device`, from the same prepared model and initial weights."""
    from .prepared import prepare
    from .trainer import session, train

    prepared = prepare(inputs, device)
    with session(inputs.config) as stop:
        return [train(inputs, prepared, strategy, stop) for strategy in inputs.config.strategies]


def _report(inputs: RunInputs, results: list[RunResult]) -> None:
    """The trainer's table of every strategy, then rank 0's simulated 512-rank projection."""
    from .metrics import echo

    report_runs(inputs, results)
    if int(os.environ.get("RANK", "0")) == 0:
        echo("\n" + _projection(inputs, int(os.environ.get("WORLD_SIZE", "1")), results[0].capacity), True)


def _projection(inputs: RunInputs, world_size: int, capacity: int) -> str:
    """The simulated 512-rank projection of the run's model and data, or why there is none."""
    from ..planner.model_shape import ModelConfigError
    from .projection import project_run

    try:
        return project_run(inputs.config, inputs.model.module, inputs.train_data.lengths, world_size, capacity).report()
    except ModelConfigError as e:
        return f"no simulated projection: {e}"


COMPARE = Entry(
    "python -m bytescale_compile.train.compare", "bytescale_compile.train.compare", __doc__, True, compare, _report
)
"""The strategies of the config from the same weights, then the table and the projection."""


def main(argv: Sequence[str] | None = None) -> int:
    return train_main(argv, COMPARE)


if __name__ == "__main__":
    exit_with(main())
