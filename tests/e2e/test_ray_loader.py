"""`--loader ray` (train/remote.py, paper §6): the scheduler draws and plans exactly what `--loader local` does,
ranks get only their micro-batches' tokens, a killed data server is restarted without changing a loss (or, with
no restart left, every rank gets an error naming it), resume equals an uninterrupted run, and the errors a user
meets first. Ray starts once for the module; the torchrun cases (2 ranks) are slow."""

from __future__ import annotations

import copy
import sys

import numpy as np
import pytest
import torch

import bytescale_compile as bsc
from bytescale_compile.data import GlobalBatchSampler, TokenDataset
from bytescale_compile.engine.runtime import BatchError
from bytescale_compile.models.llama import tiny
from bytescale_compile.planner import CostModel, PlanError, PlanRequest, plan
from bytescale_compile.train import remote
from bytescale_compile.train.__main__ import main
from bytescale_compile.train.remote import DataServerError, RemoteBatches, scheduler_for
from tests.trainer_runs import (
    GLOBAL_TOKENS,
    MAX_LEN,
    run_losses,
    run_metrics,
    run_trainer,
    torchrun_command,
    train_args,
)

ray = pytest.importorskip("ray")

CAPACITY = 1024
COST = CostModel.preset("llama-7b")


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray for the whole module; the trainer joins it and leaves it running."""
    remote.connect_ray(None, 2)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def local_losses(workspace, tmp_path_factory) -> list[float]:
    out = tmp_path_factory.mktemp("local") / "run"
    assert main(train_args(workspace, out)) == 0
    return run_losses(out)


def _scheduler(
    dataset: TokenDataset, tmp_path, world_size: int, servers: int = 2, prefetch: int = 2, capacity: int = CAPACITY
):
    sampler = GlobalBatchSampler(dataset, GLOBAL_TOKENS, seed=0, max_len=MAX_LEN)
    request = PlanRequest(world_size=world_size, capacity=capacity, cost_model=COST, strategy="balance")
    return scheduler_for(
        tmp_path, dataset, servers, GLOBAL_TOKENS, 0, MAX_LEN, sampler.state_dict(), 1, request, prefetch
    )


@pytest.mark.slow
def test_runtime_runs_a_given_plan_and_refuses_one_of_another_batch():
    torch.manual_seed(0)
    model = tiny()
    twin = copy.deepcopy(model)
    batch = [torch.randint(0, 128, (n,)) for n in (40, 9, 17)]
    planning = bsc.Runtime(model, torch.optim.SGD(model.parameters(), lr=0.5), capacity=64)
    given = bsc.Runtime(twin, torch.optim.SGD(twin.parameters(), lr=0.5), capacity=64)
    ready = given.plan(np.array([40, 9, 17]))
    assert given.step(batch, plan=ready).loss == pytest.approx(planning.step(batch).loss, rel=1e-6)
    with pytest.raises(BatchError, match="plan and batch are of different steps"):
        given.step(batch[:2], plan=ready)


def test_scheduler_plans_like_local_and_sends_each_rank_only_its_sequences(workspace, ray_session, tmp_path):
    dataset = TokenDataset.open(workspace.data)
    scheduler = _scheduler(dataset, tmp_path, world_size=2, servers=3)
    ranks = [RemoteBatches(scheduler, rank, 1) for rank in (0, 1)]
    try:
        for batch in zip(range(3), GlobalBatchSampler(dataset, GLOBAL_TOKENS, seed=0, max_len=MAX_LEN)):
            expected = plan(batch[1].lengths, world_size=2, capacity=CAPACITY, cost_model=COST, strategy="balance")
            for rank, steps in enumerate(ranks):
                loaded = next(steps)
                assert loaded.plan.to_json() == expected.to_json()
                np.testing.assert_array_equal(loaded.batch.lengths, batch[1].lengths)
                mine = {s for mb in expected.micro_batches_of(rank) for s in mb.sequences}
                assert set(loaded.batch.sequences) == mine
                for seq in mine:
                    assert loaded.batch.tokens(seq, 1, 5).tolist() == batch[1].tokens(seq, 1, 5).tolist()
                others = set(range(len(batch[1].lengths))) - mine
                if others:
                    with pytest.raises(BatchError, match=f"not sent to rank {rank}"):
                        loaded.batch.tokens(min(others))
    finally:
        for steps in ranks:
            steps.close()
        ray.kill(scheduler)


@pytest.mark.slow
def test_a_server_without_restarts_left_is_named(workspace, ray_session, tmp_path):
    dataset = TokenDataset.open(workspace.data)
    scheduler = _scheduler(dataset, tmp_path, world_size=1, servers=1)
    steps = RemoteBatches(scheduler, 0, 1)
    try:
        next(steps)
        ray.kill(steps.servers[0], no_restart=True)
        with pytest.raises(DataServerError, match="data server 0 died"):
            for _ in range(3):  # the step already prefetched may have been read before the kill
                next(steps)
    finally:
        steps.close()
        ray.kill(scheduler)


@pytest.mark.slow
def test_a_plan_error_of_the_scheduler_reaches_the_rank_as_itself(workspace, ray_session, tmp_path):
    scheduler = _scheduler(TokenDataset.open(workspace.data), tmp_path, world_size=1, capacity=8)
    steps = RemoteBatches(scheduler, 0, 1)
    try:
        with pytest.raises(PlanError) as raised:
            next(steps)
        assert "Traceback" not in str(raised.value)
    finally:
        steps.close()
        ray.kill(scheduler)


@pytest.mark.slow
def test_ray_equals_local_in_one_process(workspace, ray_session, local_losses, tmp_path):
    out = tmp_path / "ray"
    assert main(train_args(workspace, out, "--loader", "ray")) == 0
    np.testing.assert_allclose(run_losses(out), local_losses, rtol=1e-6, atol=0)
    for record in run_metrics(out):
        assert record["data_wait_s"] >= 0 and record["plan_time_s"] > 0


@pytest.mark.slow
def test_killed_server_is_restarted_and_losses_do_not_change(
    workspace, ray_session, local_losses, tmp_path, monkeypatch
):
    fetched = RemoteBatches.__next__

    def kill_after_step_1(self):
        loaded = fetched(self)
        if not getattr(self, "killed", False):
            self.killed = True
            ray.kill(self.servers[0], no_restart=False)
        return loaded

    monkeypatch.setattr(RemoteBatches, "__next__", kill_after_step_1)
    out = tmp_path / "killed"
    assert main(train_args(workspace, out, "--loader", "ray", "--prefetch-steps", "0")) == 0
    np.testing.assert_allclose(run_losses(out), local_losses, rtol=1e-6, atol=0)


def test_without_ray_the_error_says_how_to_install(workspace, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    assert main(train_args(workspace, tmp_path / "out", "--loader", "ray")) == 2
    assert "pip install 'bytescale_compile[ray]'" in capsys.readouterr().err


def test_unreachable_ray_address_is_named(workspace, tmp_path, capsys):
    assert main(train_args(workspace, tmp_path / "out", "--loader", "ray", "--ray-address", "127.0.0.1:9")) == 2
    err = capsys.readouterr().err.strip()
    assert "--ray-address 127.0.0.1:9" in err and "\n" not in err


def test_missing_dataset_with_ray_is_the_usual_error(workspace, tmp_path, capsys):
    assert main(train_args(workspace, tmp_path / "out", "--loader", "ray", "--data", str(tmp_path / "nothing"))) == 2
    err = capsys.readouterr().err
    assert "nothing.json not found" in err and "data prepare" in err


@pytest.mark.slow
def test_two_ranks_ray_equals_local(workspace, tmp_path):
    run_trainer(torchrun_command(2, train_args(workspace, tmp_path / "local", "--capacity", "512")))
    run_trainer(
        torchrun_command(
            2, train_args(workspace, tmp_path / "ray", "--capacity", "512", "--loader", "ray", "--ray-cpus", "2")
        )
    )
    local, remote_run = run_metrics(tmp_path / "local"), run_metrics(tmp_path / "ray")
    np.testing.assert_allclose([r["loss"] for r in remote_run], [r["loss"] for r in local], rtol=1e-6, atol=0)
    for key in ("micro_batches", "predicted_time", "predicted_busy_spread", "predicted_p2p_bytes", "tokens"):
        assert [r[key] for r in remote_run] == [r[key] for r in local], key


@pytest.mark.slow
def test_resume_with_ray_equals_an_uninterrupted_run(workspace, tmp_path):
    common = ("--capacity", "512", "--decay-steps", "5", "--loader", "ray", "--ray-cpus", "2")
    run_trainer(torchrun_command(2, train_args(workspace, tmp_path / "full", "--steps", "5", *common)))
    run_trainer(
        torchrun_command(2, train_args(workspace, tmp_path / "cut", "--steps", "2", "--checkpoint-every", "2", *common))
    )
    output = run_trainer(
        torchrun_command(2, train_args(workspace, tmp_path / "cut", "--steps", "5", "--resume", *common))
    )
    assert "resumed from" in output
    assert [r["step"] for r in run_metrics(tmp_path / "cut")] == [1, 2, 3, 4, 5]
    np.testing.assert_allclose(run_losses(tmp_path / "cut"), run_losses(tmp_path / "full"), rtol=1e-6, atol=0)
