"""Where HDP ranks sit and which links a ring hop crosses (paper §6.1's cluster; benchmarks/history/planner.md).

Devices sit in nodes of `devices_per_node`, behind switches of `devices_per_switch` (PCIe switches on the
paper's L20 servers, one NVSwitch on an H100 node). An HDP rank is `tp_size` adjacent devices, so rank i
is devices [i·tp, (i+1)·tp) on node i·tp // devices_per_node. A hop from rank a to rank b crosses:

- same switch: a's device links out, b's in (PCIe lanes or NVLink);
- same node, another switch: also a's switch uplink out and b's in (through the host's root complex);
- another node: a's NIC rail out and b's in (each device's share of its node's NICs; rail-optimised
  network, no contention in the fabric).

Device links and rails belong to one rank, and a rank runs one micro-batch at a time, so only switch
uplinks are ever shared between rings; the simulator divides them among the flows that overlap in time.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, fields
from functools import cached_property

import numpy as np

__all__ = ["Link", "Topology", "fit_topology"]

Link = tuple[str, int, int]
"""(kind, id, direction): kind "dev" / "rail" (id = rank) or "up" (id = global switch index); 0 out, 1 in."""


@dataclass(frozen=True)
class Topology:
    """The links between HDP ranks; bandwidths are bytes/s per direction."""

    devices_per_node: int
    devices_per_switch: int
    tp_size: int
    device_link: float
    """One device to its switch (a PCIe x16 lane set, or NVLink)."""
    switch_uplink: float
    """One switch to the rest of its node; shared by every flow that leaves or enters the switch within the node."""
    nic_bandwidth: float
    nics_per_node: int
    all_to_all_link: float | None = None
    """What one device's link carries during an all-to-all (measured in the job: a collective to every peer
    runs below the P2P rate); None: `device_link`."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name == "all_to_all_link":
                continue
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"Topology: {f.name} must be a positive number, got {value}")
        if self.devices_per_node % self.devices_per_switch:
            raise ValueError(
                f"Topology: devices_per_node {self.devices_per_node} is not a multiple of "
                f"devices_per_switch {self.devices_per_switch}"
            )
        fits = self.devices_per_switch % self.tp_size == 0
        spans = self.tp_size % self.devices_per_switch == 0 and self.devices_per_node % self.tp_size == 0
        if not (fits or spans):
            raise ValueError(
                f"Topology: a TP group of {self.tp_size} devices must fit one switch of {self.devices_per_switch} "
                f"devices or span whole switches of one node of {self.devices_per_node} (tp_size must divide "
                f"devices_per_switch, or be a multiple of it that divides devices_per_node)"
            )

    @property
    def ranks_per_switch(self) -> int:
        """Ranks behind one switch; 1 for a rank that spans several (its switches' uplinks are its own)."""
        return max(1, self.devices_per_switch // self.tp_size)

    @property
    def rank_uplink(self) -> float:
        """An "up" link's bandwidth: one switch's uplink, shared by the ranks behind it; a rank spanning k
        switches has their k uplinks to itself."""
        return self.switch_uplink * max(1, self.tp_size // self.devices_per_switch)

    @property
    def ranks_per_node(self) -> int:
        return self.devices_per_node // self.tp_size

    @property
    def rank_link(self) -> float:
        """A rank's device links together: its TP devices each carry their shard of the K/V."""
        return self.tp_size * self.device_link

    @property
    def rank_rail(self) -> float:
        """A rank's share of its node's NICs."""
        return self.tp_size * self.nic_bandwidth * self.nics_per_node / self.devices_per_node

    @cached_property
    def _bandwidths(self) -> dict[str, float]:
        return {"dev": self.rank_link, "rail": self.rank_rail, "up": self.rank_uplink}

    def bandwidth(self, link: Link) -> float:
        return self._bandwidths[link[0]]

    def hop(self, a: int, b: int) -> list[Link]:
        """The links a ring hop from rank a to rank b crosses."""
        links: list[Link] = [("dev", a, 0), ("dev", b, 1)]
        if a // self.ranks_per_node != b // self.ranks_per_node:
            return links + [("rail", a, 0), ("rail", b, 1)]
        if a // self.ranks_per_switch != b // self.ranks_per_switch:
            return links + [("up", a // self.ranks_per_switch, 0), ("up", b // self.ranks_per_switch, 1)]
        return links

    def ring_flows(self, ranks: Sequence[int]) -> Counter[Link]:
        """How many of a ring's hops (rank order, the last back to the first) cross each link."""
        flows: Counter[Link] = Counter()
        if len(ranks) > 1:
            for a, b in zip(ranks, [*ranks[1:], ranks[0]]):
                flows.update(self.hop(a, b))
        return flows

    def ring_bandwidth(self, ranks: Sequence[int]) -> float:
        """Bytes/s each rank of a ring over `ranks` can send when it runs alone: its slowest link,
        divided among the ring's own hops that cross it."""
        flows = self.ring_flows(ranks)
        return min((self.bandwidth(link) / n for link, n in flows.items()), default=math.inf)

    def aligned_ring_bandwidth(self, group_size) -> np.ndarray:
        """`ring_bandwidth` of `group_size` adjacent ranks starting on a node's first rank (vectorised):
        what the cost model charges, since the planner knows a group's size before its ranks."""
        d = np.asarray(group_size, np.float64)
        spans_switches = d > self.ranks_per_switch
        spans_nodes = d > self.ranks_per_node
        bw = np.full(d.shape, self.rank_link)
        bw = np.where(spans_switches, np.minimum(bw, self.rank_uplink), bw)
        return np.where(spans_nodes, np.minimum(bw, self.rank_rail), bw)

    def aligned_split_ring_bandwidth(self, group_size: int, ulysses: int) -> float:
        """`split_ring_bandwidth` of `group_size` adjacent ranks from a node's first one, in closed form (the
        planner's group-size search asks for every size): every rank sends one hop on its device link, and on its
        rail where the group spans nodes; a switch's uplink carries one hop per ring, at most one per rank behind
        it, where the rings' hops cross switches inside a node. u divides the group and tiles switches (a
        switch's ranks divide u, or u divides them). inf without a ring (r = 1)."""
        d, u = group_size, ulysses
        if d // u <= 1:
            return math.inf
        bandwidth = self.rank_link
        if d > self.ranks_per_node:
            bandwidth = min(bandwidth, self.rank_rail)
        per_switch = self.ranks_per_switch
        if per_switch < self.ranks_per_node and d > per_switch and u < self.ranks_per_node:
            bandwidth = min(bandwidth, self.rank_uplink / min(u, per_switch))
        return bandwidth

    def split_ring_flows(self, ranks: Sequence[int], ulysses: int) -> Counter[Link]:
        """The hops of the `ulysses` rings of a u × r split over `ranks` (group index g = ring index × u +
        Ulysses index, so ring j is ranks[j::u]), added up: the rings run at once and may share uplinks."""
        flows: Counter[Link] = Counter()
        for j in range(ulysses):
            flows.update(self.ring_flows(ranks[j::ulysses]))
        return flows

    def split_ring_bandwidth(self, ranks: Sequence[int], ulysses: int) -> float:
        """Bytes/s each rank of the split's rings can send when they run alone: `ring_bandwidth` over the
        flows of all `ulysses` rings together (`split_ring_flows`). At u = 1 exactly `ring_bandwidth`."""
        flows = self.split_ring_flows(ranks, ulysses)
        return min((self.bandwidth(link) / n for link, n in flows.items()), default=math.inf)

    def all_to_all_bandwidth(self, ranks: Sequence[int], ulysses: int) -> float:
        """Bytes/s each rank sends at during the all-to-alls of the Ulysses groups of `ranks` (u consecutive
        ranks each, all groups at once): every rank sends 1/u of its bytes to each other member over the
        links of `hop`, so a link carries the sum of those shares; the slowest link (load / bandwidth) sets
        the time of the (u - 1)/u a rank sends. Inside one switch that is the device link, across switches
        the shared uplink may be slower, across nodes the rails (a group spanning nodes pays the slow
        link). With `all_to_all_link` the device links run at it. inf for u = 1 (nothing moves)."""
        if ulysses <= 1:
            return math.inf
        load: Counter[Link] = Counter()
        for g in range(0, len(ranks) - ulysses + 1, ulysses):
            group = ranks[g : g + ulysses]
            for a in group:
                for b in group:
                    if a != b:
                        for link in self.hop(a, b):
                            load[link] += 1
        # loads are in units of 1/u of a rank's bytes; a rank sends (u - 1) such units
        worst = max(n / self._all_to_all_link_bandwidth(link) for link, n in load.items())
        return (ulysses - 1) / worst

    def _all_to_all_link_bandwidth(self, link: Link) -> float:
        """`bandwidth`, but a rank's device links at `all_to_all_link` (per device) where it is set."""
        if link[0] == "dev" and self.all_to_all_link is not None:
            return self.tp_size * self.all_to_all_link
        return self.bandwidth(link)


def fit_topology(
    *,
    ranks_per_node: int,
    tp_size: int,
    intra_p2p: float | None,
    inter_p2p: float | None,
    all_to_all: float | None = None,
    base: Topology | None = None,
) -> Topology:
    """The two-class topology (inside a node, across nodes) that reproduces link bandwidths measured with
    every rank at once. Each is bytes/s per device, i.e. per process: a rank's TP devices measure side by
    side, so a rank's bandwidth is `tp_size` times it. None where it was not measured.

    - `intra_p2p`, a ring over one node's ranks in order, sets the links inside a node: the base's
      switches where its node has as many devices (its device links and uplinks scaled alike, so that
      `ring_bandwidth` over a node's ranks is the measured one), else one switch per node whose device
      link is the measurement.
    - `inter_p2p`, a ring whose every hop crosses nodes, sets the NIC rails (one NIC per device). The
      topology predicts such a ring at min(device link, rail), the measurement whenever the rail is the
      slower class.
    - `all_to_all`, sent to every other rank of a node at once (bytes to others / seconds), becomes
      `all_to_all_link`: `all_to_all_bandwidth` over a node's ranks is then the measured one (or the
      uplinks' bound, where the base's switches are slower). Not measured: None, the device link.

    A class not measured (one rank per node has no ring inside a node; one node none across nodes) is the
    base's, else set equal to the measured class: the planner of a job on one node never crosses nodes, and
    where a plan on this topology does, its figures are as optimistic as the intra-node link."""
    if ranks_per_node < 1 or tp_size < 1:
        raise ValueError(f"fit_topology: ranks_per_node and tp_size must be >= 1, got {ranks_per_node}, {tp_size}")
    for name, value in (("intra_p2p", intra_p2p), ("inter_p2p", inter_p2p), ("all_to_all", all_to_all)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"fit_topology: {name} must be a positive number of bytes/s or None, got {value}")
    if intra_p2p is None and inter_p2p is None:
        raise ValueError("fit_topology: neither the ring inside a node nor the one across nodes was measured")
    if ranks_per_node == 1 and (intra_p2p is not None or all_to_all is not None):
        raise ValueError(
            "fit_topology: with one rank per node nothing runs inside a node: pass intra_p2p=None and all_to_all=None"
        )
    devices = ranks_per_node * tp_size
    per_switch, device_link, uplink = _node_links(base, devices, tp_size)
    if intra_p2p is not None:
        shaped = Topology(devices, per_switch, tp_size, device_link, uplink, 1.0, devices)
        scale = tp_size * intra_p2p / shaped.ring_bandwidth(range(ranks_per_node))
        device_link, uplink = device_link * scale, uplink * scale
    elif base is None and inter_p2p is not None:
        device_link = uplink = inter_p2p  # neither measured nor given: the class measured stands for both
    if inter_p2p is not None:
        nic = inter_p2p
    elif base is not None:
        nic = base.nic_bandwidth * base.nics_per_node / base.devices_per_node
    else:
        nic = device_link
    return Topology(
        devices_per_node=devices,
        devices_per_switch=per_switch,
        tp_size=tp_size,
        device_link=device_link,
        switch_uplink=uplink,
        nic_bandwidth=nic,
        nics_per_node=devices,
        all_to_all_link=all_to_all,
    )


def _node_links(base: Topology | None, devices_per_node: int, tp_size: int) -> tuple[int, float, float]:
    """(devices per switch, device link, switch uplink) of a node of `devices_per_node`: the base's switches
    where its node is that size and a TP group of `tp_size` fits them as `Topology` requires, else one switch
    per node; the base's links (unit links without a base, to be scaled to a measurement)."""
    device_link, uplink = (base.device_link, base.switch_uplink) if base is not None else (1.0, 1.0)
    if base is not None and base.devices_per_node == devices_per_node:
        per_switch = base.devices_per_switch
        fits = per_switch % tp_size == 0
        spans = tp_size % per_switch == 0 and devices_per_node % tp_size == 0
        if fits or spans:
            return per_switch, device_link, uplink
    return devices_per_node, device_link, device_link
