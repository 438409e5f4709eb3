"""Refit the cost model's time in the training job itself, under the load the steps will run under.

`bytescale-compile profile` times one decoder layer, alone or as ranks sharing a CPU, minutes before
training. Steps then run the whole optimized model (embedding, every layer, the fused loss), with the
load of that moment, and gloo's P2P on a CPU is no 25 GB/s link: predictions missed measured steps by
35-60% either way (benchmarks/history/training.md). Here every rank of the job, at once, runs the model it will train on
sequences of a few lengths, through `Runtime.forward_backward`, then exchanges a ring step of bytes with
its neighbours and all-reduces a gradient's worth; T(s) is refitted so that `layers x T(s)` is the whole
model's time (the embedding, LM head and loss, and the micro-batch's fixed cost folded into it: their own terms
become 0), and the bandwidths and latency become the measured ones. Act(s), the optimizer step and everything
else keep the given cost model's values. Nothing is trained: gradients are zeroed after, and no optimizer step
runs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..engine.collectives import sync_gradients
from ..engine.mesh import TrainMesh
from ..engine.runtime import ListBatch, Runtime
from ..planner import BALANCE, STATIC, CostModel, MicroBatch, Plan
from ..planner.equations import RECOMPUTE_TIME
from ..planner.plan import local_tokens
from ..planner.profiler import fit_time

__all__ = ["CALIBRATION_FRACTIONS", "Calibration", "calibrate", "calibration_lengths"]

logger = logging.getLogger(__name__)

CALIBRATION_FRACTIONS = (1 / 8, 1 / 4, 1 / 2, 1)
"""Sequence lengths measured, as fractions of the capacity C: T(s) is fitted where the plans' micro-batches are."""
P2P_BYTES = 16 << 20
"""Bytes each rank sends its ring neighbour to measure bandwidth (a few K/V chunks of a long sequence)."""


@dataclass(frozen=True)
class Calibration:
    """What the job measured, and the cost model fitted to it."""

    lengths: tuple[int, ...]
    times: tuple[float, ...]
    """Seconds of one micro-batch of one sequence, whole model fwd+bwd: per length, median over repeats,
    mean over ranks."""
    p2p_bandwidth: float
    """Bytes/s of one rank's send while every rank sends to its ring neighbour."""
    p2p_latency: float
    """Seconds of a one-element ring exchange."""
    allreduce_seconds: float
    """Of the runtime's gradient sync."""
    world_size: int
    shared_length: int
    """Tokens of the sequence every rank shared, one ring over all of them (0 on one rank, or for a model whose
    attention cannot be sharded)."""
    shared_seconds: float | None
    """Its fwd+bwd (None where nothing was shared)."""
    cost_model: CostModel

    def summary(self) -> str:
        """Each measurement next to what the fitted model predicts for it (all ranks busy, as measured)."""
        model, world = self.cost_model, self.world_size
        busy = max(1.0, world / model.hardware.compute_slots) if model.hardware.compute_slots else 1.0
        rows = [
            f"cost model calibrated in this job, {world} rank{'s' if world > 1 else ''} at once: whole model fwd+bwd per micro-batch"
            + (f", {model.hardware.compute_slots:g} ranks' worth of cores" if busy > 1 else "")
        ]
        rows += [
            f"  {s:>7} tokens {t * 1e3:>9.1f} ms (fit {model.micro_batch_time([s]) * busy * 1e3:.1f})"
            for s, t in zip(self.lengths, self.times)
        ]
        if self.shared_seconds is not None:
            held = local_tokens([self.shared_length], world)
            fit = (
                float(model.seq_time(self.shared_length)) / world
                + float(model.ring_compute_time(held, world))
                + model.micro_batch_overhead
            )
            rows.append(
                f"  {self.shared_length:>7} tokens split over all ranks {self.shared_seconds * 1e3:>9.1f} ms "
                f"(fit {fit * busy * 1e3:.1f}: ring overhead {model.ring_overhead * 1e9:.0f} ns per token, "
                f"layer and ring step)"
            )
        rows.append(
            f"  ring P2P {self.p2p_bandwidth / 1e9:.3g} GB/s, latency {self.p2p_latency * 1e6:.0f} us; gradient "
            f"all-reduce {self.allreduce_seconds * 1e3:.1f} ms (predicted {model.allreduce_time() * 1e3:.1f})"
        )
        return "\n".join(rows)


def calibration_lengths(capacity: int) -> tuple[int, ...]:
    """`CALIBRATION_FRACTIONS` of the capacity, at least 16 tokens apart."""
    lengths = sorted({max(16, int(capacity * f)) for f in CALIBRATION_FRACTIONS})
    if len(lengths) < 3:
        lengths = [16, 32, 64]
    return tuple(lengths)


def calibrate(runtime: Runtime, lengths: Sequence[int] | None = None, repeats: int = 3, seed: int = 0) -> Calibration:
    """Measure on every rank at once and return the runtime's cost model refitted (the same on every rank:
    the fit reads the all-reduced measurements). The caller decides whether to use it
    (`Runtime.cost_model = result.cost_model`). Nothing steps an optimizer: a Runtime built with `optimizer=None`
    calibrates alike."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if runtime.pp_size > 1:
        raise ValueError(
            "calibrate a Runtime over the whole model, not a pipeline stage: the cost model is per "
            "layer, and pipelines of any pp_size plan with it"
        )
    lengths = tuple(int(s) for s in (lengths or calibration_lengths(runtime.capacity)))
    if len(set(lengths)) < 3 or min(lengths) < 2:
        raise ValueError(f"calibration needs at least 3 distinct lengths >= 2 to fit T(s), got {list(lengths)}")
    world = runtime.world_size
    # a model whose attention cannot be sharded never runs a ring: nothing to measure, ring_overhead stays
    ring = world > 1 and not runtime.shard_blockers()
    shared_length = world * max(lengths) // 2 if ring else 0
    calls = [_forward_backward(runtime, _one_each(length, world, runtime.capacity), seed) for length in lengths]
    if ring:
        calls.append(_forward_backward(runtime, _all_share(shared_length, world, runtime.capacity), seed))
    times = _timed_rounds(calls, repeats)
    runtime.model.zero_grad(set_to_none=False)
    (allreduce,) = _timed_rounds([lambda: sync_gradients(runtime.params, world, runtime.executor.sync_group)], repeats)
    runtime.model.zero_grad(set_to_none=False)
    bandwidth, latency = _ring_exchange(runtime.executor.mesh, repeats)
    table = runtime.gather([*times, allreduce, bandwidth, latency]).mean(axis=0).tolist()
    allreduce, bandwidth, latency = table[-3:]
    times, shared = table[: len(lengths)], (table[len(lengths)] if ring else None)
    slots = _compute_slots(runtime)
    alone = min(1.0, slots / world) if slots is not None else 1.0
    model = _refit(runtime.cost_model, lengths, [t * alone for t in times], bandwidth, latency, world, slots)
    model = model.replace(boundary_bytes_per_token=_boundary_bytes(runtime, model))
    if shared is not None:
        model = _with_ring_overhead(model, shared_length, shared * alone, world)
    return Calibration(lengths, tuple(times), bandwidth, latency, allreduce, world, shared_length, shared, model)


def _boundary_bytes(runtime: Runtime, model: CostModel) -> float | None:
    """This model's hidden state per token as a pipeline stage sends it (the autocast dtype, else the
    parameters'); the cost model's own figure for a model without `config.hidden_size`."""
    hidden = getattr(getattr(runtime.model.original_module, "config", None), "hidden_size", None)
    if not isinstance(hidden, int):
        return model.boundary_bytes_per_token
    dtype = runtime.mixed_precision or runtime.params[0].dtype
    return float(hidden * dtype.itemsize)


def _forward_backward(runtime: Runtime, plan: Plan, seed: int) -> Callable[[], object]:
    """A call running `plan` on random tokens (the same on every rank)."""
    generator = torch.Generator().manual_seed(seed)
    vocab = runtime.vocab_size or 2
    batch = ListBatch([torch.randint(vocab, (n,), generator=generator) for n in plan.sequences], vocab)
    return lambda: runtime.forward_backward(plan, batch)


def _one_each(length: int, world: int, capacity: int) -> Plan:
    """Every rank one micro-batch of one sequence of `length` tokens, nothing shared."""
    micro_batches = [MicroBatch(r, (r,), (r,), 0.0, length, 0.0) for r in range(world)]
    return Plan(STATIC, world, max(length, capacity), 1, [length] * world, micro_batches, [[r] for r in range(world)])


def _all_share(length: int, world: int, capacity: int) -> Plan:
    """One sequence of `length` tokens split over every rank: one ring over the whole world."""
    held = local_tokens([length], world)
    micro_batch = MicroBatch(0, tuple(range(world)), (0,), 0.0, held, 0.0)
    return Plan(BALANCE, world, max(held, capacity), 1, [length], [micro_batch], [[0]] * world)


def _with_ring_overhead(model: CostModel, length: int, seconds: float, world: int) -> CostModel:
    """`model` with `ring_overhead` set so that a sequence of `length` over `world` ranks takes the measured
    `seconds`: what the ring costs beyond the split compute, per token held, layer and ring step (none if it
    costs nothing: the ring's bytes then hide under the compute, as the simulator assumes)."""
    held = local_tokens([length], world)
    extra = seconds - float(model.seq_time(length)) / world - model.micro_batch_overhead
    overhead = max(extra, 0.0) / (max(model.ring_layers, 1) * (world - 1) * held)
    return model.replace(ring_overhead=overhead)


def _timed_rounds(calls: Sequence[Callable[[], object]], repeats: int) -> list[float]:
    """Median seconds of each call over `repeats` rounds, after a warm-up round (a new length may compile).
    Rounds run every call in turn, so a change of the machine's load touches all of them alike, and every
    call starts on all ranks together (a barrier), so they share the machine as in a step."""
    samples: list[list[float]] = [[] for _ in calls]
    for round_ in range(repeats + 1):
        for call, kept in zip(calls, samples):
            if dist.is_initialized():
                dist.barrier()
            began = time.perf_counter()
            call()
            if round_:
                kept.append(time.perf_counter() - began)
    return [statistics.median(kept) for kept in samples]


def _ring_exchange(mesh: TrainMesh, repeats: int) -> tuple[float, float]:
    """(bytes/s, seconds of latency) of every HDP rank sending to HDP rank + 1 while receiving from HDP rank - 1,
    among the ranks of this TP index (the peers of a ring)."""
    world, rank = mesh.hdp, mesh.hdp_rank
    if world == 1:
        return float("inf"), 0.0
    after, before = mesh.global_rank((rank + 1) % world), mesh.global_rank((rank - 1) % world)

    def exchange(numel: int) -> Callable[[], None]:
        send, recv = torch.zeros(numel, dtype=torch.uint8), torch.empty(numel, dtype=torch.uint8)

        def run() -> None:
            ops = [dist.P2POp(dist.isend, send, after), dist.P2POp(dist.irecv, recv, before)]
            for request in dist.batch_isend_irecv(ops):
                request.wait()

        return run

    latency, seconds = _timed_rounds([exchange(1), exchange(P2P_BYTES)], repeats)
    return P2P_BYTES / seconds, latency


def _compute_slots(runtime: Runtime) -> float | None:
    """Ranks this machine's cores run at full speed at once (cores / threads per rank), where the ranks are
    CPU processes on one machine that are more than that; None otherwise."""
    if runtime.device.type != "cpu":
        return None
    slots = (os.cpu_count() or 1) / torch.get_num_threads() / runtime.tp_size  # HDP ranks: tp processes each
    return slots if runtime.world_size > slots else None


def _refit(
    base: CostModel,
    lengths: Sequence[int],
    times: Sequence[float],
    bandwidth: float,
    latency: float,
    world: int,
    slots: float | None,
) -> CostModel:
    """`base` with T(s) = whole-model time / layers (beta_head, beta_embed and delta 0: the measurement holds
    them), and (with several ranks) the measured ring bandwidth and latency, which `allreduce_time` uses too (it
    comes out about half the measured all-reduce on gloo)."""
    # the measured model recomputes its forward when `base.recompute`, which T(s) charges again itself
    per_layer = base.layers * (RECOMPUTE_TIME if base.recompute else 1.0)
    alpha1, beta1, gamma = (c / per_layer for c in fit_time(lengths, times))
    hardware = base.hardware
    if world > 1:
        hardware = dataclasses.replace(
            hardware,
            name=f"{hardware.name}, calibrated",
            network_bandwidth=bandwidth,
            latency=max(latency, 1e-9),
            topology=None,
            compute_slots=slots,
        )
    logger.info("calibrated T(s) per layer: %.4g s^2 + %.4g s + %.4g", alpha1, beta1, gamma)
    return base.replace(
        alpha1=alpha1,
        beta1=beta1,
        gamma=gamma,
        beta_head=0.0,
        beta_embed=0.0,
        delta=0.0,
        hardware=hardware,
        source=f"{base.source}, calibrated",
        device=base.device or "calibrated in the job",
    )
