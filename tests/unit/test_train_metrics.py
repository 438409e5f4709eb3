"""StepRecord's TFLOP/s, MFU and per-dataset tokens, and MetricsLog's experiment loggers, with fake wandb,
mlflow and TensorBoard modules (none of them is needed, nor any network)."""

import dataclasses
import json
import sys
import types

import pytest

from bytescale_compile.engine.diagnostics import StepPrediction
from bytescale_compile.engine.runtime import StepStats
from bytescale_compile.planner import CostModel, plan
from bytescale_compile.planner.model_shape import ModelShape
from bytescale_compile.sim.simulator import busy_times, p2p_bytes, simulate, step_time, ulysses_bytes
from bytescale_compile.train import metrics
from bytescale_compile.train.flops import achieved, model_flops
from bytescale_compile.train.metrics import (
    LOGGER_RUNS_FILE,
    METRICS_FILE,
    LoggerError,
    MetricsLog,
    StepRecord,
    check_loggers,
)

SHAPE = ModelShape("tiny", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=128)
COST_MODEL = CostModel.analytic(SHAPE)
LENGTHS = [5, 100, 37]


def _stats(step: int = 1) -> StepStats:
    planned = plan(LENGTHS, world_size=2, capacity=256, cost_model=COST_MODEL)
    return StepStats(
        step=step,
        strategy="balance",
        loss=2.5,
        tokens=sum(LENGTHS),
        time=0.25,
        plan_time=0.01,
        busy=[0.2, 0.1],
        micro_batches=[1, 2],
        p2p_bytes=0,
        mixer_bytes=0,
        allreduce_bytes=0,
        offloaded_bytes=0,
        peak_saved_bytes=[0, 0],
        plan=planned,
        grad_norm=1.5,
    )


def _record(step: int = 1, **changes) -> StepRecord:
    return dataclasses.replace(StepRecord.from_stats(_stats(step), 1e-3, COST_MODEL), **changes)


def test_a_line_is_the_steps_figures_beside_the_simulators_for_its_plan():
    """Every field of a metrics.jsonl line, against the step's stats and one simulation of its plan by hand."""
    planned = plan([300, 40, 90, 7], world_size=2, capacity=256, cost_model=COST_MODEL, pp_size=2)
    stats = dataclasses.replace(
        _stats(3), plan=planned, p2p_bytes=7, offloaded_bytes=9, stage_bytes=11, bubbles=[0.25, 0.5], reduce_time=0.02
    )
    timeline = simulate(planned, COST_MODEL)
    busy = busy_times(timeline)
    line = StepRecord.from_stats(stats, 1e-3, COST_MODEL, 0.5).to_dict()
    assert line == {
        "step": 3,
        "strategy": "balance",
        "loss": 2.5,
        "tokens": sum(LENGTHS),
        "tokens_per_second": sum(LENGTHS) / 0.25,
        "lr": 1e-3,
        "time": 0.25,
        "grad_norm": 1.5,
        "skipped": False,
        "busy_spread": 2.0,
        "micro_batches": [1, 2],
        "p2p_bytes": 7,
        "offloaded_bytes": 9,
        "predicted_time": step_time(planned, COST_MODEL),
        "predicted_busy_spread": float(busy[busy > 0].max() / busy[busy > 0].min()),
        "predicted_p2p_bytes": p2p_bytes(planned, COST_MODEL) + ulysses_bytes(planned, COST_MODEL),
        "data_wait_s": 0.5,
        "plan_time_s": 0.01,
        "stage_bytes": 11,
        "bubbles": [0.25, 0.5],
        "predicted_bubbles": timeline.bubbles,
        "reduce_time": 0.02,
        "reduce_overlap": 0.0,
        "splits": planned.splits(),
        "checkpoint_stall_s": None,
    }
    assert list(line)[:16] == list(StepRecord.__dataclass_fields__)[:16], "the line's fields in their order"


def test_a_given_prediction_is_taken_as_it_is(monkeypatch):
    monkeypatch.setattr(metrics, "predict", lambda *a: pytest.fail("the record simulated a step it was given"))
    given = StepPrediction(time=0.5, busy_spread=1.25, p2p_bytes=3.0, bubbles=None)
    record = StepRecord.from_stats(_stats(), 1e-3, COST_MODEL, prediction=given)
    assert (record.predicted_time, record.predicted_busy_spread, record.predicted_p2p_bytes) == (0.5, 1.25, 3.0)
    assert record.predicted_bubbles is None and "(predicted 0.50)" in record.summary()


def test_from_stats_without_a_shape_leaves_the_new_fields_out():
    record = StepRecord.from_stats(_stats(), 1e-3, COST_MODEL, 0.0, None)
    assert (record.tflops, record.mfu, record.dataset_tokens) == (None, None, None)
    line = record.to_dict()
    assert not {"tflops", "mfu", "dataset_tokens"} & line.keys()
    assert "TFLOP/s" not in record.summary() and "MFU" not in record.summary()


def test_from_stats_with_a_shape_and_a_peak_reports_tflops_per_rank_and_mfu():
    record = StepRecord.from_stats(
        _stats(), 1e-3, COST_MODEL, shape=SHAPE, peak=100.0, dataset_tokens={"web": 100, "code": 42}
    )
    tflops, mfu = achieved(model_flops(SHAPE, LENGTHS), 0.25, 100.0, devices=2)
    assert (record.tflops, record.mfu) == (tflops, mfu)
    line = record.to_dict()
    assert (line["tflops"], line["mfu"], line["dataset_tokens"]) == (tflops, mfu, {"web": 100, "code": 42})
    assert "MFU" not in StepRecord.from_stats(_stats(), 1e-3, COST_MODEL, shape=SHAPE).summary()


def test_peaks_predicted_and_reserved_per_step_are_the_largest_over_ranks_and_absent_off_cuda():
    stats = dataclasses.replace(
        _stats(), predicted_peak_bytes=[5 * 2**30, 6 * 2**30], measured_peak_bytes=[4 * 2**30, 2**30]
    )
    cuda = dataclasses.replace(stats, measured_reserved_peak_bytes=[3 * 2**30, 5 * 2**30])
    record = StepRecord.from_stats(cuda, 1e-3, COST_MODEL)
    line = record.to_dict()
    assert (line["predicted_peak_bytes"], line["measured_reserved_peak_bytes"], line["measured_peak_bytes"]) == (
        6 * 2**30,
        5 * 2**30,
        4 * 2**30,
    )
    assert "peak memory 6.00 GiB predicted (5.00 GiB reserved, 4.00 GiB allocated)" in record.summary()
    assert record.scalars()["measured_reserved_peak_bytes"] == 5 * 2**30
    cpu = StepRecord.from_stats(dataclasses.replace(stats, measured_peak_bytes=None), 1e-3, COST_MODEL)
    assert not {"measured_reserved_peak_bytes", "measured_peak_bytes"} & cpu.to_dict().keys()
    assert cpu.summary().endswith("peak memory 6.00 GiB predicted")


def test_summary_shows_tflops_mfu_and_dataset_tokens_when_set():
    summary = _record(tflops=41.23, mfu=0.4168, dataset_tokens={"web": 100, "code": 42}).summary()
    assert ", 41.2 TFLOP/s per rank, MFU 41.7%" in summary
    assert "tokens by dataset web 100, code 42" in summary
    assert "(predicted " in summary and "(predicted " not in _record().summary(predicted=False)


def test_scalars_are_the_numbers_and_each_datasets_tokens():
    scalars = _record(tflops=1.0, dataset_tokens={"web": 100}).scalars()
    assert scalars["loss"] == 2.5 and scalars["tflops"] == 1.0 and scalars["dataset_tokens/web"] == 100.0
    assert not {"step", "skipped", "micro_batches", "mfu", "eval_loss", "strategy"} & scalars.keys()


def test_unknown_logger_is_refused_with_the_known_ones():
    with pytest.raises(LoggerError, match="unknown experiment logger 'neptune'; known: tensorboard, wandb, mlflow"):
        check_loggers(["neptune"])
    assert issubclass(LoggerError, ValueError)


@pytest.mark.parametrize("name", ["wandb", "mlflow", "tensorboard"])
def test_missing_package_is_refused_with_the_pip_hint(monkeypatch, tmp_path, name):
    monkeypatch.setitem(sys.modules, name, None)
    hint = rf"needs the {name} package: pip install 'bytescale_compile\[{name}\]'"
    with pytest.raises(LoggerError, match=hint):
        check_loggers([name])
    with pytest.raises(LoggerError, match=hint):
        MetricsLog(tmp_path, True, loggers=[name])
    assert not (tmp_path / METRICS_FILE).exists()  # refused before anything is written


def test_only_rank0_creates_loggers(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)
    log = MetricsLog(tmp_path, False, loggers=["wandb"])
    log.write(_record())
    log.close()
    assert list(tmp_path.iterdir()) == []


class FakeWandb(types.ModuleType):
    def __init__(self):
        super().__init__("wandb")
        self.inits, self.logged, self.finished = [], [], 0

    def init(self, **kwargs):
        self.inits.append(kwargs)
        fake = self

        class Run:
            def log(self, data, step):
                fake.logged.append((step, data))

            def finish(self):
                fake.finished += 1

        return Run()


def test_wandb_gets_each_steps_scalars_and_a_resumed_run_continues_the_same_run(monkeypatch, tmp_path):
    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    log = MetricsLog(tmp_path, True, loggers=["wandb"], run_name="balance", config={"lr": 1e-3})
    for step in (1, 2):
        log.write(_record(step, tflops=3.0))
    log.close()
    first = wandb.inits[0]
    assert first["name"] == "balance" and first["config"] == {"lr": 1e-3} and first["resume"] == "allow"
    assert first["dir"] == str(tmp_path) and first["project"] == "bytescale_compile"
    assert [step for step, _ in wandb.logged] == [1, 2]
    assert wandb.logged[0][1]["tflops"] == 3.0 and wandb.logged[0][1]["loss"] == 2.5
    assert wandb.finished == 1
    assert json.loads((tmp_path / LOGGER_RUNS_FILE).read_text()) == {"wandb": first["id"]}

    MetricsLog(tmp_path, True, resumed_step=2, loggers=["wandb"]).close()
    assert wandb.inits[1]["id"] == first["id"]
    MetricsLog(tmp_path, True, loggers=["wandb"]).close()  # a fresh run in the same directory: a new run
    assert wandb.inits[2]["id"] != first["id"]


class FakeMlflow(types.ModuleType):
    def __init__(self):
        super().__init__("mlflow")
        self.starts, self.params, self.logged, self.ended, self.runs = [], [], [], 0, 0

    def start_run(self, run_id=None, run_name=None):
        self.starts.append({"run_id": run_id, "run_name": run_name})
        if run_id is None:
            self.runs += 1
            run_id = f"run{self.runs}"
        return types.SimpleNamespace(info=types.SimpleNamespace(run_id=run_id))

    def log_params(self, params):
        self.params.append(params)

    def log_metrics(self, metrics, step):
        self.logged.append((step, metrics))

    def end_run(self):
        self.ended += 1


def test_mlflow_gets_params_once_each_steps_scalars_and_a_resumed_run_continues_the_same_run(monkeypatch, tmp_path):
    mlflow = FakeMlflow()
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)
    log = MetricsLog(tmp_path, True, loggers=["mlflow"], run_name="balance", config={"lr": 1e-3})
    log.write(_record(1, mfu=0.5, dataset_tokens={"web+code@2": 7}))
    log.close()
    assert mlflow.starts == [{"run_id": None, "run_name": "balance"}]
    assert mlflow.params == [{"lr": 1e-3}]
    step, metrics = mlflow.logged[0]
    assert step == 1 and metrics["mfu"] == 0.5 and metrics["dataset_tokens/web_code_2"] == 7.0
    assert mlflow.ended == 1

    log = MetricsLog(tmp_path, True, resumed_step=1, loggers=["mlflow"], config={"lr": 1e-3})
    log.write(_record(2))
    log.close()
    assert mlflow.starts[1]["run_id"] == "run1"
    assert mlflow.params == [{"lr": 1e-3}]  # the continued run has its parameters
    assert [step for step, _ in mlflow.logged] == [1, 2]


def test_tensorboard_is_the_default_when_installed_and_drops_events_after_the_checkpoint(monkeypatch, tmp_path):
    writers = []

    class SummaryWriter:
        def __init__(self, log_dir, purge_step):
            self.log_dir, self.purge_step, self.scalars, self.closed = log_dir, purge_step, [], False
            writers.append(self)

        def add_scalar(self, key, value, step):
            self.scalars.append((key, value, step))

        def flush(self):
            pass

        def close(self):
            self.closed = True

    monkeypatch.setitem(sys.modules, "tensorboard", types.ModuleType("tensorboard"))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=SummaryWriter))
    log = MetricsLog(tmp_path, True, resumed_step=3)
    log.write(_record(4))
    log.close()
    (writer,) = writers
    assert writer.log_dir == str(tmp_path / "tensorboard") and writer.purge_step == 4 and writer.closed
    assert ("loss", 2.5, 4) in writer.scalars

    MetricsLog(tmp_path, True, loggers=()).close()  # none asked for: none made
    assert len(writers) == 1


def test_without_tensorboard_the_default_is_metrics_jsonl_alone(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    log = MetricsLog(tmp_path, True)
    log.write(_record())
    log.close()
    assert [json.loads(line)["step"] for line in (tmp_path / METRICS_FILE).read_text().splitlines()] == [1]


def test_a_failing_logger_is_dropped_with_a_warning_and_metrics_go_on(monkeypatch, tmp_path):
    """rank 0 alone logs: an exception from a logger would leave the other ranks waiting, so it only warns."""

    class Down:
        def __init__(self, run):
            pass

        def log(self, record):
            raise ConnectionError("service unavailable")

        def close(self):
            pass

    monkeypatch.setitem(metrics._BACKENDS, "tensorboard", Down)
    monkeypatch.setattr(metrics, "_installed", lambda name: True)
    log = MetricsLog(tmp_path, True, loggers=["tensorboard"])
    with pytest.warns(UserWarning, match="the tensorboard logger failed and is off .*ConnectionError"):
        log.write(_record(1))
    log.write(_record(2))
    log.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_a_step_that_shares_a_sequence_records_its_splits():
    assert _record().splits is None and "splits" not in _record().to_dict()  # no sequence shared
    planned = plan([400, 5], world_size=2, capacity=256, cost_model=COST_MODEL, sp="ulysses")
    assert planned.splits() == {"2x1": 1}
    record = StepRecord.from_stats(dataclasses.replace(_stats(), plan=planned), 1e-3, COST_MODEL)
    assert record.to_dict()["splits"] == {"2x1": 1} and record.scalars()["splits/2x1"] == 1.0
