"""The executors never wait for the device between micro-batches: their inputs go to the device at the start of the
step, the loss stays there, busy time comes from a `Stopwatch`, and the Runtime reads every figure of the step in one
gather at its end; the step still equals the single-process one.

On the CPU the structure is checked by recording every host read (`Tensor.item`, `float()`, `tolist()`, ...) from
the first micro-batch's start to the end of the executor's forward-backward; on CUDA a step's micro-batch loop runs
under `torch.cuda.set_sync_debug_mode("error")`, which raises on any synchronizing call.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch import nn

import bytescale_compile as bsc
from bytescale_compile.engine import batch as batch_module
from bytescale_compile.engine.batch import (
    ListBatch,
    MicroBatchInputs,
    Stopwatch,
    build_micro_batch,
    num_targets,
)
from bytescale_compile.engine.collectives import gather
from bytescale_compile.kernels.transfer import to_device
from bytescale_compile.models.llama import LlamaConfig, LlamaForCausalLM, tiny
from bytescale_compile.planner.plan import MicroBatch, Plan, local_tokens
from bytescale_compile.testing import run_distributed
from tests.helpers import reference_step, rel_err

LR = 0.5
WARM_UP = [40, 24, 34, 30]
"""Two micro-batches of 64 tokens, each packing two sequences (`_plan`)."""
REPACKED = [20, 44, 28, 36]
"""The same micro-batch sizes packed at other boundaries: new segment tables, the compiled shapes unchanged."""
_READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__", "__array__")
"""The `torch.Tensor` methods through which the host reads a tensor's values (on CUDA: a wait for the device)."""


def _plan(lengths: list[int], pp_size: int = 1) -> Plan:
    """One HDP rank running two micro-batches, sequences (0, 1) then (2, 3)."""
    mbs = [
        MicroBatch(i, (0,), seqs, 0.0, local_tokens([lengths[s] for s in seqs], 1), 0.0)
        for i, seqs in enumerate([(0, 1), (2, 3)])
    ]
    return Plan("balance", 1, 64, pp_size, lengths, mbs, [[0, 1]])


def _batch(lengths: list[int], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g) for n in lengths]


@dataclass
class _Read:
    method: str
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass
class _HostReads:
    """Host reads of tensors while `active`, and whether inputs were copied to the device while it was."""

    active: bool = False
    reads: list[_Read] | None = None
    late_copies: int = 0

    def of_device_values(self) -> list[_Read]:
        """The reads of floating-point values: losses, norms, timings, which live on the device on CUDA (the
        integer reads left are of the host's tables, and the CPU-only checks of ids and targets)."""
        return [r for r in self.reads or [] if r.dtype.is_floating_point]


def _recording(monkeypatch: pytest.MonkeyPatch, run: Callable[..., object]) -> tuple[_HostReads, Callable[..., object]]:
    """`run` wrapped so that every host read from its first micro-batch's start to its return is recorded, and every
    copy of inputs to the device made after that start is counted."""
    seen = _HostReads(reads=[])
    for name in _READS:
        original = getattr(torch.Tensor, name)

        def read(self: torch.Tensor, *args: object, _name: str = name, _original: Callable = original, **kw: object):
            if seen.active and seen.reads is not None:
                seen.reads.append(_Read(_name, self.dtype, tuple(self.shape)))
            return _original(self, *args, **kw)

        monkeypatch.setattr(torch.Tensor, name, read)
    start, to = Stopwatch.start, MicroBatchInputs.to

    def first_start(self: Stopwatch) -> None:
        seen.active = True
        start(self)

    def copy(self: MicroBatchInputs, device: torch.device) -> MicroBatchInputs:
        seen.late_copies += seen.active
        return to(self, device)

    monkeypatch.setattr(Stopwatch, "start", first_start)
    monkeypatch.setattr(MicroBatchInputs, "to", copy)

    def wrapped(*args: object, **kwargs: object) -> object:
        try:
            return run(*args, **kwargs)
        finally:
            seen.active = False

    return seen, wrapped


def test_no_host_read_between_micro_batches_and_the_step_equals_the_reference(monkeypatch):
    torch.manual_seed(0)
    model = tiny()
    reference = copy.deepcopy(model)
    runtime = bsc.Runtime(model, torch.optim.SGD(model.parameters(), lr=LR), capacity=64)
    runtime.step(_batch(WARM_UP, 0), plan=_plan(WARM_UP))  # compiles: traced code must not meet the patches
    reference_step(reference, _batch(WARM_UP, 0), lr=LR)
    reference.zero_grad()  # reference_step accumulates into .grad
    seen, forward_backward = _recording(monkeypatch, runtime.executor.forward_backward)
    monkeypatch.setattr(runtime.executor, "forward_backward", forward_backward)
    stats = runtime.step(_batch(REPACKED, 1), plan=_plan(REPACKED))
    assert seen.reads is not None and seen.late_copies == 0, "inputs were copied after the first micro-batch began"
    assert not seen.of_device_values(), f"host reads between micro-batches: {seen.of_device_values()}"
    ref_loss, ref_params = reference_step(reference, _batch(REPACKED, 1), lr=LR)
    assert abs(stats.loss - ref_loss) <= 1e-5 * abs(ref_loss), (stats.loss, ref_loss)
    for name, p in model.named_parameters():
        assert rel_err(p, ref_params[name]) <= 1e-5, name
    assert stats.micro_batches == [2] and stats.busy[0] > 0 and not stats.skipped


def test_the_recording_sees_a_loss_read_between_micro_batches(monkeypatch):
    """The check above can fail: a loss read as a float inside the loop (what the executor did before) is seen."""
    torch.manual_seed(0)
    model = tiny()
    runtime = bsc.Runtime(model, torch.optim.SGD(model.parameters(), lr=LR), capacity=64)
    runtime.step(_batch(WARM_UP, 0), plan=_plan(WARM_UP))
    original = runtime.executor._loss

    def read_each(inputs: MicroBatchInputs) -> torch.Tensor:
        loss = original(inputs)
        float(loss.detach())
        return loss

    monkeypatch.setattr(runtime.executor, "_loss", read_each)
    seen, forward_backward = _recording(monkeypatch, runtime.executor.forward_backward)
    monkeypatch.setattr(runtime.executor, "forward_backward", forward_backward)
    runtime.step(_batch(WARM_UP, 1), plan=_plan(WARM_UP))
    assert [r.method for r in seen.of_device_values()] == ["__float__", "__float__"]


def _stage_worker(rank: int, world: int) -> None:
    """PP 2: the last stage's loss stays on the device, and the step equals the whole model's."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1)
    )
    reference = copy.deepcopy(model)
    names = {id(p): n for n, p in model.named_parameters()}
    stage = bsc.pipeline_stage(model, 2)
    runtime = bsc.Runtime(stage, torch.optim.SGD(stage.parameters(), lr=LR), capacity=64)
    runtime.step(_batch(WARM_UP, 0), plan=_plan(WARM_UP, 2))
    reference_step(reference, _batch(WARM_UP, 0), lr=LR)
    reference.zero_grad()  # reference_step accumulates into .grad
    with pytest.MonkeyPatch.context() as patch:
        seen, forward_backward = _recording(patch, runtime.executor.forward_backward)
        patch.setattr(runtime.executor, "forward_backward", forward_backward)
        stats = runtime.step(_batch(REPACKED, 1), plan=_plan(REPACKED, 2))
    assert seen.late_copies == 0 and not seen.of_device_values(), seen.of_device_values()
    ref_loss, ref_params = reference_step(reference, _batch(REPACKED, 1), lr=LR)
    assert abs(stats.loss - ref_loss) <= 1e-5 * abs(ref_loss), (stats.loss, ref_loss)
    for p in stage.parameters():
        assert rel_err(p, ref_params[names[id(p)]]) <= 1e-5, names[id(p)]
    assert min(stats.busy) > 0


@pytest.mark.slow  # 2 processes; the pipeline's equivalence runs by default in test_train_pipeline
def test_pipeline_stages_read_nothing_between_micro_batches():
    run_distributed(_stage_worker, 2)


def test_inputs_go_to_cuda_pinned_and_without_blocking_and_stay_as_they_are_elsewhere(monkeypatch):
    t = torch.arange(6)
    assert to_device(t, torch.device("cpu")) is t
    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: calls.append(("pin", None)) or self)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **kw: calls.append(("to", (a, kw))) or self)
    to_device(t, torch.device("cuda"))
    assert calls == [("pin", None), ("to", ((torch.device("cuda"),), {"non_blocking": True}))]


def test_device_inputs_are_the_host_built_ones():
    """On the CPU the staged inputs hold exactly what `build_micro_batch` built (the same tensors)."""
    lengths = np.array(WARM_UP)
    plan = _plan(WARM_UP)
    read = ListBatch(_batch(WARM_UP, 0), 128).tokens
    built = [build_micro_batch(mb, 0, lengths, read, num_targets(lengths)) for mb in plan.micro_batches]
    staged = batch_module.device_inputs(built, torch.device("cpu"))
    for b, s in zip(built, staged):
        assert s.model_kwargs(labels=True).keys() == {*b.model_kwargs().keys(), "labels"}
        for name, tensor in b.model_kwargs().items():
            assert s.model_kwargs()[name] is tensor, name
        assert s.context is b.context


def test_stopwatch_sums_its_busy_spans_and_refuses_nesting():
    watch = Stopwatch(torch.device("cpu"))
    watch.start()
    watch.stop()
    first = watch.busy
    begun = watch.mark()
    watch.start()
    with pytest.raises(RuntimeError, match="do not nest"):
        watch.start()
    watch.stop()
    assert watch.busy >= first >= 0.0
    assert watch.seconds(begun, watch.mark()) >= watch.busy - first
    with pytest.raises(RuntimeError, match="without start"):
        watch.stop()


def test_gather_reads_host_numbers_and_tensors_in_one_row():
    loss = torch.tensor(1.25, dtype=torch.float32)
    table = gather([loss, 3, 0.5, torch.tensor(7, dtype=torch.int64)], 0, 1, torch.device("cpu"))
    assert table.dtype == np.float64 and table.tolist() == [[1.25, 3.0, 0.5, 7.0]]


def _strict(run: Callable[..., object]) -> Callable[..., object]:
    """`run` under CUDA's sync debug mode "error": any call that waits for the device raises."""

    def wrapped(*args: object, **kwargs: object) -> object:
        torch.cuda.set_sync_debug_mode("error")
        try:
            return run(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    return wrapped


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("lengths", [WARM_UP, REPACKED], ids=["same-packing", "new-packing"])
def test_cuda_micro_batch_loop_never_syncs_the_host(lengths):
    """A step whose executor forward-backward (inputs' copies, every micro-batch's forward and backward) runs under
    `set_sync_debug_mode("error")`, after a warm-up step that compiles; its loss and weights against the CPU
    reference. "new-packing" also meets segment tables of new packings (same shapes: nothing recompiles)."""
    torch.manual_seed(0)
    model = tiny()
    reference: nn.Module = copy.deepcopy(model)
    model.cuda()
    runtime = bsc.Runtime(model, torch.optim.SGD(model.parameters(), lr=LR), capacity=64)
    runtime.step(_batch(WARM_UP, 0), plan=_plan(WARM_UP))
    reference_step(reference, _batch(WARM_UP, 0), lr=LR)
    reference.zero_grad()  # reference_step accumulates into .grad
    runtime.executor.forward_backward = _strict(runtime.executor.forward_backward)
    stats = runtime.step(_batch(lengths, 1), plan=_plan(lengths))
    ref_loss, ref_params = reference_step(reference, _batch(lengths, 1), lr=LR)
    assert abs(stats.loss - ref_loss) <= 1e-4 * abs(ref_loss), (stats.loss, ref_loss)
    for name, p in model.named_parameters():
        assert rel_err(p.cpu(), ref_params[name]) <= 1e-4, name
    assert stats.micro_batches == [2] and stats.busy[0] > 0 and not stats.skipped
