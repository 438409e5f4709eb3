"""What planning needs to know of a compiled model, learnt once at setup: the `SetupProbe`.

Whether a model's sequences may be split over ranks or packed (its shard blockers), and what a hybrid's
convolutions and scans cost at a chunk boundary instead of K/V (its mixer costs), are read from the compile
report. Every rank compiles the same model, so every rank reaches the same answer without communicating;
pipeline stages hold different layers, so their reasons are gathered over the stages (one collective).

The probe compiles the model on a tiny packed row when nothing has compiled it yet, forward only and outside any
micro-batch context: nothing is communicated (but the stages' gather) and no gradient is touched. It needs no
optimizer, so setup code asks it directly instead of building a `Runtime` to ask; a `Runtime` runs it once, on its
first plan, or takes the one given.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from ..api import OptimizedModule
from ..passes.report import CompileReport
from ..planner import CostModel
from ..planner.model_shape import model_shape
from .executor import Executor, WholeModelExecutor
from .pipeline import PipelineExecutor
from .protocol import packed_row
from .stages import checkpointed, stage_spec

__all__ = ["SetupProbe", "default_cost_model", "executor_for", "fitted_cost_model", "probe", "probe_executor"]


@dataclass(frozen=True)
class SetupProbe:
    """A compiled model's facts that every plan of a run reads, the same on every rank."""

    shard_blockers: tuple[str, ...]
    """Why the model's sequences cannot be split over ranks or packed (empty: they can); with pipelines, every
    stage's reasons."""
    cost_model: CostModel
    """The cost model given, fitted to the model (`fitted_cost_model`) with its mixer costs charged."""
    mixer_layers: int
    """Layers whose token mixers are a hybrid's segment-aware convolutions or scans (0 with pipelines, whose
    stages would each count their own)."""
    mixer_state_bytes: float
    """Bytes one chunk boundary of a shared sequence moves over those layers."""
    hdp: int
    """HDP ranks: the ranks plans are made for."""
    pp_size: int
    """Stages of a pipeline (1: the whole model)."""
    tp_size: int
    """Ranks of a TP group (one HDP rank of the plans)."""

    @property
    def shardable(self) -> bool:
        """Sequences may be split over ranks and packed together."""
        return not self.shard_blockers

    def charged(self, cost_model: CostModel) -> CostModel:
        """`cost_model` fitted to the probed model and charged its mixer costs, for one that has none (a cost
        model loaded or calibrated elsewhere keeps its own)."""
        fitted = _fitted(cost_model, self.tp_size, self.cost_model.model.recompute)
        if not self.mixer_layers or fitted.model.mixer_layers:
            return fitted
        return fitted.replace(
            mixer_layers=min(self.mixer_layers, fitted.model.layers), mixer_state_bytes=self.mixer_state_bytes
        )


def probe(
    model: OptimizedModule, cost_model: CostModel | None = None, *, mixed_precision: torch.dtype | None = None
) -> SetupProbe:
    """Probe `model` (the whole model or this rank's pipeline stage, through `optimize()`), compiling it under
    `mixed_precision`'s autocast if nothing has compiled it yet (the graphs the steps will run). `cost_model`
    defaults to the analytic one of the model's config. With pipelines, call it on every rank at once."""
    if not isinstance(model, OptimizedModule):
        raise TypeError(
            f"probe() takes a model through bytescale_compile.optimize(), got {type(model).__name__}: the probe "
            f"reads the compile report of the module the steps will run"
        )
    return probe_executor(executor_for(model, mixed_precision), cost_model or default_cost_model(model))


def executor_for(model: OptimizedModule, mixed_precision: torch.dtype | None = None) -> Executor:
    """The executor of `model`: of the whole model, or of its pipeline stage (a collective on the first call)."""
    kind = WholeModelExecutor if stage_spec(model) is None else PipelineExecutor
    return kind(model, mixed_precision)


def probe_executor(executor: Executor, cost_model: CostModel) -> SetupProbe:
    """The probe of `executor`'s module (what a `Runtime` runs on its own executor)."""
    model = executor.model
    if not model.compilations:
        _compile(executor)
    layers, state_bytes = _mixer_costs(model, executor.pp_size)
    probed = SetupProbe(
        shard_blockers=tuple(executor.shard_blockers()),
        cost_model=fitted_cost_model(cost_model, model, executor.mesh.tp),
        mixer_layers=layers,
        mixer_state_bytes=state_bytes,
        hdp=executor.mesh.hdp,
        pp_size=executor.pp_size,
        tp_size=executor.mesh.tp,
    )
    return dataclasses.replace(probed, cost_model=probed.charged(probed.cost_model))


def fitted_cost_model(cost_model: CostModel, model: nn.Module, tp_size: int) -> CostModel:
    """`cost_model` with its heads sharded over the run's TP group (`CostModel.tp_size`: a Ulysses degree splits
    each TP rank's heads), recomputing each layer's forward where `model` is gradient-checkpointed."""
    return _fitted(cost_model, tp_size, checkpointed(model))


def _fitted(cost_model: CostModel, tp_size: int, recompute: bool) -> CostModel:
    if (cost_model.model.tp_size, cost_model.model.recompute) == (tp_size, recompute):
        return cost_model
    return cost_model.replace(tp_size=tp_size, recompute=recompute)


def default_cost_model(model: nn.Module) -> CostModel:
    """An analytic cost model from the config of the model (behind `optimize()` if wrapped): our LLaMA or any
    Hugging Face causal LM; `ModelConfigError` names the model class and the field it could not read."""
    return CostModel.analytic(model_shape(model))


def _mixer_costs(model: OptimizedModule, pp_size: int) -> tuple[int, float]:
    """(layers, bytes per chunk boundary) of a hybrid's convolutions and scans, from the compile report; none for a
    pipeline stage, which holds some of the layers only and would plan differently from the other stages."""
    if pp_size > 1:
        return 0, 0.0
    layers, state_bytes = CompileReport(graphs=model.compiled_graphs).mixer_costs()
    return layers, float(state_bytes)


def _compile(executor: Executor) -> None:
    """Compile the executor's module on a tiny packed row (two sequences of 4 tokens) so planning can read its
    report: forward only, outside any micro-batch context."""
    row = packed_row(torch.zeros(8, dtype=torch.long, device=executor.device), [4, 4])
    kwargs = executor.probe_inputs(row.kwargs(labels=executor.hf_labels))
    executor.model.train()
    with executor.autocast():
        executor.model.compile_and_run(**kwargs)
