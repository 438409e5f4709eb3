"""The distributed optimizer on 4 gloo ranks: bf16 weights, an fp32 gradient buffer reduce-scattered in buckets
during the backward, fp32 main weights and AdamW moments sharded; equal to a single-process loop written here."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.distributed as dist

import bytescale_compile as bsc
from bytescale_compile.engine import grad_buffer
from bytescale_compile.engine.collectives import sync_gradients
from bytescale_compile.engine.dist_optim import DistributedOptimizer
from bytescale_compile.engine.optim import StepGuard, build_optimizer, param_groups
from bytescale_compile.engine.protocol import num_targets, packed_row
from bytescale_compile.testing import run_distributed
from bytescale_compile.train.checkpoint import load_checkpoint, load_model_weights, save_checkpoint
from tests.helpers import hf_llama, rel_err

LENGTHS = [90, 60, 10, 12, 7, 20, 3, 5]  # with C = 32: sequences over 3 and 2 ranks, packed short ones
UNEQUAL_LENGTHS = [64, 60, 10, 12, 7, 20, 3, 5]  # on 4 ranks: micro-batch counts [1, 1, 2, 2]
CAPACITY = 32
STEPS = 5
BUCKET_BYTES = 40_000  # several buckets for a tiny model
LR, BETAS, DECAY = 3e-3, (0.9, 0.95), 0.1


def _batch(step: int, lengths: list[int] = LENGTHS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return [torch.randint(0, 128, (n,), generator=g) for n in lengths]


def _reference(
    model: torch.nn.Module, steps: int, lengths: list[int] = LENGTHS
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The loop the distributed optimizer must equal: a bf16 model whose gradients are summed in fp32 over the
    whole batch, token-level loss, clipped to norm 1, and torch's AdamW on an fp32 master copy."""
    params = dict(model.named_parameters())
    master = {n: p.detach().clone() for n, p in params.items()}
    groups = param_groups(model, DECAY)
    names = {id(p): n for n, p in params.items()}
    optimizer = torch.optim.AdamW(
        [{**g, "params": [master[names[id(p)]] for p in g["params"]]} for g in groups], lr=LR, betas=BETAS
    )
    for p in params.values():
        p.data = p.data.to(torch.bfloat16)
    losses = []
    for step in range(steps):
        batch = _batch(step, lengths)
        grads = {n: torch.zeros_like(m) for n, m in master.items()}
        num_items = num_targets([len(s) for s in batch])
        total = 0.0
        for seq in batch:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(**packed_row(seq, [len(seq)], num_items=num_items).kwargs(labels=True))
            loss = out.loss.float()
            loss.backward()
            total += loss.item()
            for n, p in params.items():
                grads[n] += p.grad.float()
                p.grad = None
        norm = torch.nn.utils.get_total_norm(list(grads.values()))
        torch.nn.utils.clip_grads_with_norm_(list(grads.values()), 1.0, norm)
        for n, m in master.items():
            m.grad = grads[n]
        optimizer.step()
        for n, p in params.items():
            p.data.copy_(master[n])
        losses.append(total)
    return losses, {n: p.detach().float() for n, p in params.items()}


def _held_bytes(optimizer: DistributedOptimizer, model: torch.nn.Module) -> int:
    """Bytes of every distinct storage behind the weights, gradients, main weights and moments."""
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [optimizer.grads.data, optimizer.main, *optimizer.moments.values()]
    for state in optimizer.inner.state.values():
        tensors += [t for t in state.values() if isinstance(t, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _bf16_worker(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = hf_llama()
    reference = copy.deepcopy(model)
    optimizer = DistributedOptimizer(model, LR, DECAY, BETAS, bucket_bytes=BUCKET_BYTES)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    numel = sum(p.numel() for p in model.parameters())
    slack = len(optimizer.buckets) * world * 12  # each bucket's padding to a multiple of the ranks
    assert _held_bytes(optimizer, model) <= (6 + 12 / world) * numel + slack, _held_bytes(optimizer, model) / numel

    calls = []
    original = grad_buffer.reduce_scatter_single

    def counted(*args, **kwargs):
        calls.append(kwargs.get("group"))
        return original(*args, **kwargs)

    grad_buffer.reduce_scatter_single = counted
    try:
        runtime = bsc.Runtime(model, optimizer, capacity=CAPACITY, mixed_precision=torch.bfloat16)
        counts = [len(s) for s in runtime.plan(np.array(UNEQUAL_LENGTHS)).schedule]
        assert len(set(counts)) > 1, counts  # unequal micro-batch counts
        losses, overlaps = [], []
        for step in range(STEPS):
            calls.clear()
            stats = runtime.step(_batch(step, UNEQUAL_LENGTHS))
            assert len(calls) == len(optimizer.buckets) > 2, (len(calls), len(optimizer.buckets))
            losses.append(stats.loss)
            overlaps.append(stats.reduce_overlap)
    finally:
        grad_buffer.reduce_scatter_single = original
    assert max(overlaps) > 0, overlaps  # buckets leave during the backward
    ref_losses, ref_weights = _reference(reference, STEPS, UNEQUAL_LENGTHS)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-3)
    for name, p in model.named_parameters():
        # bf16 rounds each micro-batch's gradient, and Adam's m / sqrt(v) turns that rounding on near-zero
        # gradients into whole steps of either sign: single elements differ, the tensors agree in norm
        assert p.dtype == torch.bfloat16
        err = float((p.float() - ref_weights[name]).norm() / ref_weights[name].norm())
        assert err <= 5e-2, (name, err)


@pytest.mark.slow  # the parts run by default in test_sharded_adamw_on_unequal_micro_batches
def test_bf16_distributed_optimizer_equals_single_process_loop():
    run_distributed(_bf16_worker, 4)


def _idle_rank_worker(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = hf_llama()
    optimizer = DistributedOptimizer(model, LR, DECAY, BETAS, bucket_bytes=BUCKET_BYTES)
    runtime = bsc.Runtime(model, optimizer, strategy="naive", capacity=64, mixed_precision=torch.bfloat16)
    lengths = [40, 6]
    schedule = runtime.plan(np.array(lengths)).schedule
    assert any(not s for s in schedule), schedule
    stats = runtime.step(_batch(0, lengths))
    assert np.isfinite(stats.loss) and not stats.skipped
    weights = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(weights) for _ in range(world)]
    dist.all_gather(everyone, weights)
    assert all(torch.equal(w, weights) for w in everyone)  # the same bf16 weights on every rank


@pytest.mark.slow
def test_a_rank_without_micro_batches_joins_every_reduction():
    run_distributed(_idle_rank_worker, 4)


def _fp32_worker(rank: int, world: int) -> None:
    """fp32 weights keep the torch optimizer and the all-reduce after the backward, bit for bit; and the
    distributed optimizer's sharding, on fp32 weights, equals torch's AdamW to fp32 rounding."""
    torch.manual_seed(0)
    model = hf_llama()
    twin, sharded = copy.deepcopy(model), copy.deepcopy(model)
    runtime = bsc.Runtime(model, torch.optim.AdamW(model.parameters(), lr=LR), capacity=CAPACITY)
    stats = runtime.step(_batch(0))
    assert stats.reduce_overlap == 0.0
    optimizer = torch.optim.AdamW(twin.parameters(), lr=LR)
    by_hand = bsc.Runtime(twin, optimizer, capacity=CAPACITY)
    by_hand.forward_backward(by_hand.plan(np.array(LENGTHS)), _as_batch(_batch(0)))
    sync_gradients(list(twin.parameters()), world)
    torch.nn.utils.clip_grad_norm_(list(twin.parameters()), 1.0)
    optimizer.step()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert p.dtype == torch.float32 and torch.equal(p, q), name

    plain = copy.deepcopy(sharded)
    runtimes = [
        bsc.Runtime(
            sharded,
            DistributedOptimizer(sharded, LR, DECAY, BETAS, dtype=torch.float32, bucket_bytes=BUCKET_BYTES),
            capacity=CAPACITY,
        ),
        bsc.Runtime(plain, build_optimizer(plain, LR, DECAY, BETAS), capacity=CAPACITY),
    ]
    for step in range(2):
        first, second = (runtime.step(_batch(step)).loss for runtime in runtimes)
        assert abs(first - second) <= 1e-6 * abs(second), (first, second)
    for (name, p), q in zip(sharded.named_parameters(), plain.parameters()):
        assert rel_err(p, q) <= 1e-5, (name, rel_err(p, q))


def _as_batch(batch: list[torch.Tensor]):
    from bytescale_compile.engine.batch import ListBatch

    return ListBatch(batch, 128)


@pytest.mark.slow
def test_fp32_step_is_unchanged():
    run_distributed(_fp32_worker, 4)


def _small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.LayerNorm(10), torch.nn.Linear(10, 5, bias=False))


def _unequal_worker(rank: int, world: int) -> None:
    """Rank r runs r backward passes (rank 0 none) over its share of a batch; every rank launches the same
    reduce-scatters in bucket order, and the sharded AdamW equals torch's over the whole batch."""
    model, plain = _small_model(), _small_model()
    optimizer = DistributedOptimizer(model, 0.1, DECAY, BETAS, dtype=torch.float32, bucket_bytes=64)
    reference = build_optimizer(plain, 0.1, DECAY, BETAS)
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(3, 6, generator=g) for _ in range(sum(range(world)))]
    launched = []
    original = grad_buffer.reduce_scatter_single

    def counted(output, full, **kwargs):
        launched.append(full.data_ptr())
        return original(output, full, **kwargs)

    grad_buffer.reduce_scatter_single = counted
    try:
        for _ in range(2):
            optimizer.start(rank)
            for x in inputs[sum(range(rank)) : sum(range(rank + 1))]:
                model(x).pow(2).sum().backward()
            if rank:
                assert optimizer.launched_in_backward == 1.0  # every bucket left before the step's end
            optimizer.finish()
            optimizer.step(StepGuard.of(optimizer.grad_norm(), 1.0))
            for x in inputs:
                plain(x).pow(2).sum().backward()
            torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
            reference.step()
            reference.zero_grad()
    finally:
        grad_buffer.reduce_scatter_single = original
    assert len(launched) == 2 * len(optimizer.buckets) > 4
    order = [optimizer.grads.data.data_ptr() + b.start * 4 for b in optimizer.buckets] * 2
    assert launched == order  # bucket order, on every rank
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert rel_err(p, q) <= 1e-6, (name, rel_err(p, q))

    bf16 = _small_model()
    numel = sum(p.numel() for p in bf16.parameters())
    sharded = DistributedOptimizer(bf16, 0.1, DECAY, BETAS, bucket_bytes=64)
    slack = len(sharded.buckets) * world * 12  # each bucket's padding to a multiple of the ranks
    assert _held_bytes(sharded, bf16) <= (6 + 12 / world) * numel + slack


def test_sharded_adamw_on_unequal_micro_batches():
    run_distributed(_unequal_worker, 3)


def _checkpoint_worker(rank: int, world: int, root: str) -> None:
    """A resume from a checkpoint of the fp32 main weights and sharded moments continues bit for bit, also into
    another layout of fragments, and the checkpoint holds the fp32 main weights under the parameters' names and shapes."""
    g = torch.Generator().manual_seed(rank)
    inputs = [torch.randn(3, 6, generator=g) for _ in range(4)]

    def train(model, optimizer, steps):
        weights = []
        for x in steps:
            optimizer.start(1)
            model(x.to(torch.bfloat16)).float().pow(2).sum().backward()
            optimizer.finish()
            optimizer.step()
            weights.append(torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]))
        return weights

    model = _small_model()
    optimizer = DistributedOptimizer(model, 0.1, DECAY, BETAS, bucket_bytes=64)
    train(model, optimizer, inputs[:2])
    path = save_checkpoint(root, 2, model, optimizer, {"step": 2})
    uninterrupted = train(model, optimizer, inputs[2:])
    mains = {n: p.detach().clone() for n, p in _small_model().named_parameters()}
    resumed_model = _small_model()
    resumed = DistributedOptimizer(resumed_model, 0.1, DECAY, BETAS, bucket_bytes=64)
    assert load_checkpoint(path, resumed_model, resumed) == {"step": 2}
    assert all(torch.equal(a, b) for a, b in zip(train(resumed_model, resumed, inputs[2:]), uninterrupted))
    # read back by other fragments: the pieces are resharded, AdamW is elementwise, so still bit for bit
    regrouped_model = _small_model()
    regrouped = DistributedOptimizer(regrouped_model, 0.1, DECAY, BETAS, bucket_bytes=40)
    load_checkpoint(path, regrouped_model, regrouped)
    assert all(torch.equal(a, b) for a, b in zip(train(regrouped_model, regrouped, inputs[2:]), uninterrupted))
    fp32 = _small_model()
    load_model_weights(path, fp32)
    for name, p in fp32.named_parameters():
        assert p.dtype == torch.float32 and not torch.equal(p, mains[name])  # trained
        assert not torch.equal(p.to(torch.bfloat16).float(), p)  # the fp32 main weights, not bf16 ones


def test_checkpoint_resumes_the_uninterrupted_run(tmp_path):
    run_distributed(_checkpoint_worker, 2, str(tmp_path))
