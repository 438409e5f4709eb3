"""Refit the cost model's time in the training job itself, under the load the steps will run under.

`bytescale-compile profile` times one decoder layer, alone or as ranks sharing a CPU, minutes before
training. Steps then run the whole optimized model (embedding, every layer, the fused loss), with the
load of that moment, and gloo's P2P on a CPU is no 25 GB/s link: predictions missed measured steps by
35-60% either way (benchmarks/history/training.md). Here every rank of the job, at once, runs the model it will train on
sequences of a few lengths, through `Runtime.forward_backward`, then exchanges a ring step of bytes with
its neighbours and all-reduces a gradient's worth; T(s) is refitted so that `layers x T(s)` is the whole
model's time (the embedding, LM head and loss, the micro-batch's fixed cost and the TP all-reduces folded into
it: their own terms become 0), and the bandwidths and latency become the measured ones. A real cluster has two
link classes, inside a node and across nodes, and Ulysses' all-to-all inside a node: from the ranks' hosts the
job also times a ring inside each node, a ring whose every hop crosses nodes, and the all-to-all of a node, and
fits the `Topology` the planner and simulator charge rings and all-to-alls on (`planner.topology.fit_topology`).
Act(s), the optimizer step and everything else keep the given cost model's values. Nothing is trained:
gradients are zeroed after, and no optimizer step runs.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..engine.collectives import sync_gradients
from ..engine.mesh import TrainMesh
from ..engine.runtime import ListBatch, Runtime
from ..planner import BALANCE, STATIC, CostModel, Hardware, MicroBatch, Plan
from ..planner.equations import RECOMPUTE_TIME
from ..planner.plan import local_tokens
from ..planner.profiler import fit_time
from ..planner.topology import Topology, fit_topology

__all__ = ["CALIBRATION_FRACTIONS", "Calibration", "Links", "calibrate", "calibration_lengths", "ranks_per_node"]

logger = logging.getLogger(__name__)

CALIBRATION_FRACTIONS = (1 / 8, 1 / 4, 1 / 2, 1)
"""Sequence lengths measured, as fractions of the capacity C: T(s) is fitted where the plans' micro-batches are."""
P2P_BYTES = 16 << 20
"""Bytes each rank sends its ring neighbour to measure bandwidth (a few K/V chunks of a long sequence); in the
all-to-all, what it holds in all (1/u of it to each of the u - 1 peers)."""


@dataclass(frozen=True)
class Links:
    """The links between HDP ranks as the job measured them: bytes/s per process (one device: a rank's TP
    devices measure side by side) while every rank sends at once, mean over ranks; None where the layout has
    nothing to measure."""

    hosts: int
    ranks_per_node: int
    """Consecutive HDP ranks on one host, as the topology places ranks (`ranks_per_node`)."""
    intra_p2p: float | None
    """A ring over each node's ranks (None with one rank per node)."""
    inter_p2p: float | None
    """A ring whose every hop crosses nodes (None on one node)."""
    all_to_all: float | None
    """Each rank sends 1/u of its bytes to each other rank of its node: bytes to others / seconds (None with
    one rank per node)."""
    preset: str | None
    """The hardware whose topology supplies the classes not measured (None: there was none, so each is set
    to the class measured)."""


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
    links: Links | None
    """The link classes measured (None on one rank); the fitted topology is `cost_model.hardware.topology`."""
    cost_model: CostModel

    def summary(self) -> str:
        """Each measurement next to what the fitted model predicts for it (all ranks busy, as measured)."""
        model, world = self.cost_model, self.world_size
        busy = max(1.0, world / model.hardware.compute_slots) if model.hardware.compute_slots else 1.0
        rows = [
            f"cost model calibrated in this job, {world} rank{'s' if world > 1 else ''} at once: whole model fwd+bwd per micro-batch"
            + (f", {_ranks_worth(slots)} of cores" if (slots := model.hardware.compute_slots) and busy > 1 else "")
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
        if self.links is not None:
            rows += _links_summary(self.links, model.hardware.topology)
        return "\n".join(rows)


def _links_summary(links: Links, topology: Topology | None) -> list[str]:
    """The link classes measured (per device) and the topology fitted to them (per HDP rank)."""

    def missing(why: str, other: str) -> str:
        return f"not measured ({why}): " + (f"kept from {links.preset}" if links.preset else f"set to the link {other}")

    inside = (
        f"P2P {links.intra_p2p / 1e9:.3g} GB/s, all-to-all {links.all_to_all / 1e9:.3g} GB/s"
        if links.intra_p2p is not None and links.all_to_all is not None
        else missing("one rank per node", "across nodes")
    )
    across = (
        f"P2P {links.inter_p2p / 1e9:.3g} GB/s" if links.inter_p2p is not None else missing("one node", "inside a node")
    )
    rows = [
        f"  links per device, every rank at once: {links.hosts} host{'s' if links.hosts > 1 else ''}, "
        f"{links.ranks_per_node} rank{'s' if links.ranks_per_node > 1 else ''} per node",
        f"    inside a node: {inside}",
        f"    across nodes: {across}",
    ]
    if topology is None:
        return [*rows, "  no topology fitted: no ring ran inside a node or across nodes"]
    switches = topology.devices_per_node // topology.devices_per_switch
    all_to_all = topology.tp_size * (topology.all_to_all_link or topology.device_link)
    rows.append(
        f"  fitted topology per HDP rank (TP {topology.tp_size}): {topology.ranks_per_node} rank{'s' if topology.ranks_per_node > 1 else ''} per "
        "node, "
        f"{switches} switch{'es' if switches > 1 else ''} per node; link {topology.rank_link / 1e9:.3g} GB/s"
        + (f", switch uplink {topology.rank_uplink / 1e9:.3g} GB/s" if switches > 1 else "")
        + f", rail {topology.rank_rail / 1e9:.3g} GB/s, all-to-all {all_to_all / 1e9:.3g} GB/s"
    )
    return rows


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
    layout = _layout(runtime.executor.mesh)
    probes = _link_probes(runtime.executor.mesh, runtime.device, layout, repeats)
    table = runtime.gather([*times, allreduce, *probes.values()]).mean(axis=0).tolist()
    count = len(lengths) + (1 if ring else 0)
    times, shared, allreduce = table[: len(lengths)], (table[len(lengths)] if ring else None), table[count]
    measured = dict(zip(probes, table[count + 1 :]))
    bandwidth, latency = measured["ring"], measured["latency"]
    base = runtime.cost_model.hardware
    links = _links(layout, measured, base) if world > 1 else None
    slots = _compute_slots(runtime)
    alone = min(1.0, slots / world) if slots is not None else 1.0
    topology = _fitted_topology(links, runtime.tp_size, base.topology)
    model = _refit(
        runtime.cost_model, lengths, [t * alone for t in times], bandwidth, latency, world, slots, topology=topology
    )
    model = model.replace(boundary_bytes_per_token=_boundary_bytes(runtime, model))
    if shared is not None:
        model = _with_ring_overhead(model, shared_length, shared * alone, world)
    return Calibration(
        lengths=lengths,
        times=tuple(times),
        p2p_bandwidth=bandwidth,
        p2p_latency=latency,
        allreduce_seconds=allreduce,
        world_size=world,
        shared_length=shared_length,
        shared_seconds=shared,
        links=links,
        cost_model=model,
    )


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


def ranks_per_node(hosts: Sequence[str]) -> int:
    """HDP ranks per node as `Topology` places them (rank i on node i // n) for ranks on `hosts` (HDP rank
    order): the largest n whose aligned blocks of n ranks each sit on one host, the gcd of the runs of
    one host. torchrun lays ranks out node after node, and n is then each host's ranks; otherwise a warning
    says that the planner sees smaller nodes than the hosts."""
    runs = [len(list(run)) for _, run in itertools.groupby(hosts)]
    n = math.gcd(*runs)
    if len(runs) != len(set(hosts)) or len(set(runs)) > 1:
        logger.warning(
            "the HDP ranks' hosts are not in equal runs of consecutive ranks (runs of %s ranks): the topology "
            "sees nodes of %d ranks, so Ulysses groups stay inside those; launch the ranks node after node "
            "(torchrun's default) to plan with whole nodes",
            runs,
            n,
        )
    return n


@dataclass(frozen=True)
class _Layout:
    """Where the HDP ranks sit, the same on every rank (read from every rank's host): what each probe sends."""

    hosts: tuple[str, ...]
    ranks_per_node: int

    @property
    def nodes(self) -> int:
        return len(self.hosts) // self.ranks_per_node

    @property
    def across_nodes(self) -> tuple[int, ...] | None:
        """A ring whose every hop crosses hosts: the k-th rank of each node in turn, k = 0, 1, ...; None
        where no such ring exists (one node, or hosts laid out so that it would meet one host twice in a row)."""
        n = self.ranks_per_node
        order = tuple(node * n + k for k in range(n) for node in range(self.nodes))
        hops = zip(order, order[1:] + order[:1])
        if self.nodes < 2 or any(self.hosts[a] == self.hosts[b] for a, b in hops):
            return None
        return order


def _layout(mesh: TrainMesh) -> _Layout:
    """Each HDP rank's host (the host of its TP index 0: a TP group shares a node), from every rank's
    `socket.gethostname()`."""
    name = socket.gethostname()
    names = [name]
    if dist.is_initialized() and dist.get_world_size() > 1:
        names = [""] * dist.get_world_size()
        dist.all_gather_object(names, name)
    hosts = tuple(names[mesh.global_rank(h) - mesh.tp_rank] for h in range(mesh.hdp))
    return _Layout(hosts, ranks_per_node(hosts))


def _link_probes(mesh: TrainMesh, device: torch.device, layout: _Layout, repeats: int) -> dict[str, float]:
    """This rank's measurements, by name: "ring" (bytes/s, every HDP rank sends to HDP rank + 1 while
    receiving from HDP rank - 1, among the ranks of this TP index) and "latency" (seconds of a one-byte
    ring exchange); then bytes/s of "intra" (a ring over each node's ranks), "inter" (`_Layout.across_nodes`)
    and "all_to_all" (among each node's ranks) where the layout has them (the same on every rank). On one node
    the ring over it is the ring over all ranks: "intra" is "ring"."""
    if mesh.hdp == 1:
        return {"ring": float("inf"), "latency": 0.0}
    everyone = tuple(range(mesh.hdp))
    calls = {"latency": _ring(mesh, device, everyone, 1), "ring": _ring(mesh, device, everyone, P2P_BYTES)}
    n, node = layout.ranks_per_node, mesh.hdp_rank // layout.ranks_per_node
    members = tuple(range(node * n, node * n + n))
    if n > 1 and layout.nodes > 1:
        calls["intra"] = _ring(mesh, device, members, P2P_BYTES)
    if layout.across_nodes is not None:
        calls["inter"] = _ring(mesh, device, layout.across_nodes, P2P_BYTES)
    if n > 1:
        calls["all_to_all"] = _all_to_all(mesh, device, members, P2P_BYTES // n)
    seconds = dict(zip(calls, _timed_rounds(list(calls.values()), repeats)))
    sent = {"latency": 0, "all_to_all": (n - 1) * (P2P_BYTES // n)}
    measured = {k: (t if k == "latency" else sent.get(k, P2P_BYTES) / t) for k, t in seconds.items()}
    if n > 1 and layout.nodes == 1:
        measured["intra"] = measured["ring"]
    return measured


def _ring(mesh: TrainMesh, device: torch.device, order: Sequence[int], numel: int) -> Callable[[], None]:
    """A call: this rank sends `numel` bytes to the HDP rank after it in `order` (this rank's TP index) while
    receiving as many from the one before it."""
    at = order.index(mesh.hdp_rank)
    after, before = order[(at + 1) % len(order)], order[at - 1]
    return _exchange(mesh, device, sends={after: numel}, receives={before: numel})


def _all_to_all(mesh: TrainMesh, device: torch.device, members: Sequence[int], chunk: int) -> Callable[[], None]:
    """A call: this rank sends `chunk` bytes to every other of `members` (HDP ranks) and receives as many from
    each. As the Ulysses attention runs its all-to-all (`runtime/ulysses.py`): one batch of P2P on the default
    process group, so that no process group per node is made and the figure is the one its steps see."""
    peers = {h: chunk for h in members if h != mesh.hdp_rank}
    return _exchange(mesh, device, sends=peers, receives=peers)


def _exchange(
    mesh: TrainMesh, device: torch.device, *, sends: dict[int, int], receives: dict[int, int]
) -> Callable[[], None]:
    """A call posting one batch of P2P: `sends[h]` bytes to HDP rank h of this TP index, `receives[h]` from
    it; it returns once they are done (on a GPU, once the device has done them: the caller times it)."""
    out = {h: torch.zeros(n, dtype=torch.uint8, device=device) for h, n in sends.items()}
    into = {h: torch.empty(n, dtype=torch.uint8, device=device) for h, n in receives.items()}

    def run() -> None:
        ops = [dist.P2POp(dist.isend, t, mesh.global_rank(h)) for h, t in out.items()]
        ops += [dist.P2POp(dist.irecv, t, mesh.global_rank(h)) for h, t in into.items()]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return run


def _links(layout: _Layout, measured: dict[str, float], base: Hardware) -> Links:
    return Links(
        hosts=len(set(layout.hosts)),
        ranks_per_node=layout.ranks_per_node,
        intra_p2p=measured.get("intra"),
        inter_p2p=measured.get("inter"),
        all_to_all=measured.get("all_to_all"),
        preset=base.name if base.topology is not None else None,
    )


def _fitted_topology(links: Links | None, tp_size: int, base: Topology | None) -> Topology | None:
    """The topology fitted to `links` (`fit_topology`); None on one rank (nothing measured: the given
    hardware stays), and where no ring ran inside a node or across nodes (hosts interleaved so that neither
    exists: the ring over all ranks then stands for every link, as without a topology)."""
    if links is None:
        return None
    if links.intra_p2p is None and links.inter_p2p is None:
        logger.warning(
            "calibration measured no ring inside a node or across nodes (hosts interleaved rank by rank): the "
            "cost model keeps one bandwidth for every link and no topology"
        )
        return None
    return fit_topology(
        ranks_per_node=links.ranks_per_node,
        tp_size=tp_size,
        intra_p2p=links.intra_p2p,
        inter_p2p=links.inter_p2p,
        all_to_all=links.all_to_all,
        base=base,
    )


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
    *,
    topology: Topology | None,
) -> CostModel:
    """`base` with T(s) = whole-model time / layers (beta_head, beta_embed, delta and the TP all-reduces' tau 0:
    the measurement holds them), and (with several ranks) the measured ring bandwidth and latency, which
    `allreduce_time` uses too (it comes out about half the measured all-reduce on gloo), and `topology`, the
    links fitted to the measurements, for the rings and all-to-alls."""
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
            topology=topology,
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
        tp_comm_time=0.0,
        hardware=hardware,
        source=f"{base.source}, calibrated",
        device=base.device or "calibrated in the job",
    )


def _ranks_worth(slots: float) -> str:
    """`1 rank's worth`, `2 ranks' worth`, `1.5 ranks' worth`: the possessive of a count of ranks."""
    return f"{slots:g} rank's worth" if slots == 1 else f"{slots:g} ranks' worth"
