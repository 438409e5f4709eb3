"""One HDP rank's hardware (`Hardware`) and the clusters it is preset for (`HARDWARE_PRESETS`).

Apart from the cost model's equations because the simulator, the topology's ring bandwidths and the CLI's
`--cluster` read a rank's bandwidths and peak FLOPs without any model's coefficients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

from .topology import Topology

__all__ = ["HARDWARE_PRESETS", "Hardware"]


@dataclass(frozen=True)
class Hardware:
    """One HDP rank: a GPU, or a TP group seen as one rank. With a `topology`, ring P2P runs at the
    bandwidth of the links a ring crosses (`Topology`); without one, every rank has its own
    `network_bandwidth` link and rings never meet."""

    name: str = "h100"
    matmul_flops: float = 989e12
    """Dense bf16 peak, FLOP/s."""
    mfu: float = 0.45
    """Fraction of the peak that training achieves."""
    hbm_bytes: float = 80e9
    d2h_bandwidth: float = 25e9
    """Bytes/s, PCIe device to host (offload)."""
    h2d_bandwidth: float = 25e9
    """Bytes/s, PCIe host to device (reload)."""
    network_bandwidth: float = 25e9
    """Bytes/s per rank, for ring P2P (without a topology) and the gradient all-reduce."""
    latency: float = 10e-6
    """Seconds per message or kernel launch (the gamma of T(s))."""
    topology: Topology | None = None
    compute_slots: float | None = None
    """Ranks that compute at full speed at once when every rank of the job shares one machine (CPU ranks
    oversubscribing its cores: cores / threads per rank); more busy ranks than that slow each one down in
    proportion (`sim/simulator.py`). None: every rank has its own device."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "compute_slots" and value is None:
                continue
            if f.name not in ("name", "topology") and not (math.isfinite(value) and value > 0):
                raise ValueError(f"Hardware {self.name!r}: {f.name} must be a positive number, got {value}")
        if self.mfu > 1:
            raise ValueError(f"Hardware {self.name!r}: mfu must be <= 1, got {self.mfu}")
        if self.topology is not None and not isinstance(self.topology, Topology):
            raise TypeError(f"Hardware {self.name!r}: topology must be a Topology, got {type(self.topology).__name__}")

    @classmethod
    def preset(cls, name: str, tp_size: int = 1) -> Hardware:
        """One HDP rank of TP `tp_size` devices on a cluster of `HARDWARE_PRESETS`: peak FLOPs, HBM, PCIe and
        NIC shares scale with the rank's devices."""
        if name not in HARDWARE_PRESETS:
            raise ValueError(f"unknown hardware preset {name!r}; presets: {', '.join(HARDWARE_PRESETS)}")
        return HARDWARE_PRESETS[name](tp_size)

    @classmethod
    def from_dict(cls, data: dict) -> Hardware:
        """The inverse of `dataclasses.asdict` (what `CostModel.save` writes)."""
        topology = data.get("topology")
        return cls(**{**data, "topology": Topology(**topology) if topology is not None else None})

    @property
    def tp_size(self) -> int:
        """Devices per HDP rank: the topology's TP size. Without a topology 1, so no TP communication is
        charged (a rank is one device, or a TP group whose coefficients already hold its all-reduces)."""
        return 1 if self.topology is None else self.topology.tp_size

    @property
    def tp_link(self) -> float:
        """Bytes/s per direction of one device's intra-node link, which the TP all-reduces run on (NVLink,
        or PCIe through the switch on the L20 servers); infinite without a topology (no TP traffic)."""
        return math.inf if self.topology is None else self.topology.device_link

    def ring_bandwidth(self, group_size) -> np.ndarray:
        """Bytes/s per rank of a ring of `group_size` adjacent ranks (vectorised)."""
        if self.topology is None:
            return np.full(np.shape(group_size), self.network_bandwidth)
        return self.topology.aligned_ring_bandwidth(group_size)

    def split_ring_bandwidth(self, ranks: tuple[int, ...], ulysses: int) -> float:
        """Bytes/s per rank of the `ulysses` rings of a u × r split over `ranks` (`Topology.split_ring_bandwidth`);
        `network_bandwidth` without a topology."""
        if self.topology is None:
            return self.network_bandwidth
        return self.topology.split_ring_bandwidth(ranks, ulysses)

    def all_to_all_bandwidth(self, ranks: tuple[int, ...], ulysses: int) -> float:
        """Bytes/s per rank of the Ulysses all-to-alls of groups of `ulysses` consecutive `ranks`
        (`Topology.all_to_all_bandwidth`); `network_bandwidth` without a topology."""
        if self.topology is None:
            return self.network_bandwidth if ulysses > 1 else math.inf
        return self.topology.all_to_all_bandwidth(ranks, ulysses)


def _l20_cluster(tp_size: int) -> Hardware:
    """The paper's cluster (the draft text of §6.1): 16 L20s per server (119.5 TFLOP/s dense bf16, 48 GB), 4
    PCIe switches each linking 4 GPUs and 2 NICs, PCIe 64 GB/s bidirectional (32 per direction), 8 x 400
    Gbps RDMA per server. Assumed: a switch's uplink to the host is one x16 link (32 GB/s per direction), and
    the offload copies of the switch's GPUs share it."""
    topology = Topology(
        devices_per_node=16,
        devices_per_switch=4,
        tp_size=tp_size,
        device_link=32e9,
        switch_uplink=32e9,
        nic_bandwidth=50e9,
        nics_per_node=8,
    )
    offload = topology.rank_uplink / topology.ranks_per_switch
    return Hardware(
        name=f"l20-tp{tp_size}",
        matmul_flops=tp_size * 119.5e12,
        hbm_bytes=tp_size * 48e9,
        d2h_bandwidth=offload,
        h2d_bandwidth=offload,
        network_bandwidth=topology.rank_rail,
        topology=topology,
    )


def _h100_nvlink(tp_size: int) -> Hardware:
    """8 H100 SXM per node on one NVSwitch (NVLink 450 GB/s per direction), one 400 Gbps NIC per GPU, each
    GPU with its own PCIe x16 Gen5 link to the host (about 50 GB/s per direction for offload)."""
    topology = Topology(
        devices_per_node=8,
        devices_per_switch=8,
        tp_size=tp_size,
        device_link=450e9,
        switch_uplink=450e9,
        nic_bandwidth=50e9,
        nics_per_node=8,
    )
    return Hardware(
        name=f"h100-nvlink-tp{tp_size}",
        matmul_flops=tp_size * 989e12,
        hbm_bytes=tp_size * 80e9,
        d2h_bandwidth=tp_size * 50e9,
        h2d_bandwidth=tp_size * 50e9,
        network_bandwidth=topology.rank_rail,
        topology=topology,
    )


HARDWARE_PRESETS = {"l20": _l20_cluster, "h100-nvlink": _h100_nvlink}
"""Clusters by name; each builds the Hardware of one HDP rank for a TP size."""
