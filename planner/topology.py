"""The cluster's network as NCCL sees it: NVLink domains, per-GPU NICs on rails, leaf and spine switches.

A DGX-style node puts its GPUs on one NVSwitch fabric (an NVLink domain; GB200 NVL72 spans 18 trays of 4
GPUs in one 72-GPU domain) and gives each GPU its own NIC, cabled rail-optimised: NIC i of every node in a
scalable unit (SU) goes to leaf switch i of that SU, and leaves reach each other through spine switches
(NVIDIA DGX SuperPOD reference architectures: 20 DGX A100 or 32 DGX H100 per SU, a non-blocking fat tree).
A group of ranks is costed on the slowest link class any of its members must cross:

- ``intra_node``: all inside one NVLink domain;
- ``inter_node``: across domains, inside one SU (one leaf hop on each rail);
- ``inter_leaf``: across SUs, through the spine; per-GPU bandwidth ÷ the leaf's oversubscription.

NCCL runs a collective that spans domains hierarchically and its ring's bottleneck is the per-GPU NIC
(every GPU drives its own rail), so the per-GPU bandwidth of the slowest class crossed is what the
collective's bus bandwidth follows (nccl-tests PERFORMANCE.md: "the speed of the hardware bottleneck").

A ring crosses the spine only where it leaves a scalable unit: NCCL chains each channel's ring through the
nodes in rank order, one network hop from node n's last GPU to node n + 1's first (NVIDIA/nccl
src/graph/connect.cc, connectRings), so a group spanning k SUs sends one NIC's worth out of each of them.
Its collectives run at NIC speed (``inter_node``) while every leaf's uplink, its GPUs' NIC bandwidth ÷ the
oversubscription, has room for the ring exits of all the groups that run at once (`ring_exits_fit`);
point-to-point between pipeline stages and all-to-all send from every GPU across, and are costed as
``inter_leaf``.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
import numpy as np
from meshplan.planner.fields import Fields

LINK_ORDER = ("intra_node", "inter_node", "inter_leaf")


@dataclass(frozen=True)
class Topology:
    """nvlink_domain: GPUs per NVLink domain (0: one node). nics_per_node: NICs per node, shared by its
    GPUs (0: one per GPU). nodes_per_leaf: nodes in one scalable unit under one leaf per rail (0: all).
    oversubscription: a leaf's downlink over uplink bandwidth (1: non-blocking)."""

    nvlink_domain: int = 0
    nics_per_node: int = 0
    nodes_per_leaf: int = 0
    oversubscription: float = 1.0

    @classmethod
    def from_dict(cls, data: dict, path: str) -> Topology:
        f = Fields(data, path)
        over = f.float("oversubscription", min=1.0, default=1.0)
        return cls(f.int("nvlink_domain", min=0, default=0), f.int("nics_per_node", min=0, default=0),
                   f.int("nodes_per_leaf", min=0, default=0), over)


def domain_size(topo: Topology, devices_per_node: int) -> int:
    return topo.nvlink_domain or devices_per_node


def build_graph(name: str, num_nodes: int, devices_per_node: int, topo: Topology, nvlink_Bps: float,
                nvlink_latency_s: float, nic_Bps: float, nic_latency_s: float, memory_bytes: int) -> nx.Graph:
    """Devices (int ranks) → NVSwitch of their domain; devices → leaf of their SU and rail (per-GPU NIC
    bandwidth, shared when NICs are fewer than GPUs); leaves → one spine (a leaf's uplink: its downlinks
    ÷ oversubscription). Edges carry `bandwidth_Bps`, `latency_s` and `link`."""
    g = nx.Graph(name=name)
    world = num_nodes * devices_per_node
    dom = domain_size(topo, devices_per_node)
    nics = topo.nics_per_node or devices_per_node
    per_leaf = topo.nodes_per_leaf or num_nodes
    nic_share = nic_Bps * min(1.0, nics / devices_per_node)
    if num_nodes > 1 or world > dom:
        g.add_node("spine", kind="spine")
    leaves: dict[str, int] = {}
    for rank in range(world):
        node, local = divmod(rank, devices_per_node)
        switch = f"nvswitch{rank // dom}"
        if switch not in g:
            g.add_node(switch, kind="switch", node=rank // dom)
        g.add_node(rank, kind="device", node=node, domain=rank // dom, su=node // per_leaf, local_rank=local,
                   memory_bytes=memory_bytes)
        g.add_edge(rank, switch, bandwidth_Bps=nvlink_Bps, latency_s=nvlink_latency_s / 2, link="intra_node")
        if "spine" in g:
            rail = local * nics // devices_per_node
            leaf = f"leaf{node // per_leaf}.{rail}"
            if leaf not in g:
                g.add_node(leaf, kind="leaf", su=node // per_leaf, rail=rail)
            g.add_edge(rank, leaf, bandwidth_Bps=nic_share, latency_s=nic_latency_s / 2, link="inter_node")
            leaves[leaf] = leaves.get(leaf, 0) + 1
    for leaf, down in leaves.items():
        g.add_edge(leaf, "spine", bandwidth_Bps=down * nic_share / topo.oversubscription, latency_s=0.0,
                   link="inter_leaf")
    return g


def device_levels(graph: nx.Graph, world: int) -> tuple[np.ndarray, np.ndarray]:
    """(NVLink domain, scalable unit) of every rank, read from the graph."""
    dom = np.array([graph.nodes[r]["domain"] for r in range(world)], dtype=np.int64)
    su = np.array([graph.nodes[r]["su"] for r in range(world)], dtype=np.int64)
    return dom, su


def device_leaves(graph: nx.Graph, world: int) -> np.ndarray:
    """The index of every rank's leaf switch (its SU and rail), read from the graph; -1 without a network."""
    names: dict[str, int] = {}
    leaf = np.full(world, -1, dtype=np.int64)
    for r in range(world):
        for nb in graph.neighbors(r):
            if graph.nodes[nb].get("kind") == "leaf":
                leaf[r] = names.setdefault(nb, len(names))
    return leaf


def ring_exits_fit(sus: np.ndarray, leaves: np.ndarray, axes: tuple[int, ...], leaf_gpus: np.ndarray,
                   oversubscription: float) -> bool:
    """Whether the rings of all groups spanning `axes` of a placed mesh (`sus` and `leaves` of its ranks)
    leave their SUs within the leaves' uplinks. Each group spanning several SUs leaves each of them once,
    on one of the rails its members there use (shared equally among them); a leaf's uplink carries
    (its GPUs, `leaf_gpus` by leaf index, ÷ oversubscription) NICs' worth."""
    if oversubscription <= 1.0 or (leaves < 0).any():
        return True
    su, leaf = groups_along(sus, axes), groups_along(leaves, axes)
    spanning = su.min(axis=1) != su.max(axis=1)
    if not spanning.any():
        return True
    su, leaf = su[spanning], leaf[spanning]
    n_sus = int(sus.max()) + 1
    group = np.repeat(np.arange(len(su)), su.shape[1])
    triples = np.unique(np.stack([group, su.ravel(), leaf.ravel()], axis=1), axis=0)
    exits, per_exit = np.unique(triples[:, 0] * n_sus + triples[:, 1], return_inverse=True, return_counts=True)[1:]
    flows = np.bincount(triples[:, 2], weights=1.0 / per_exit[exits], minlength=len(leaf_gpus))
    return bool((flows <= leaf_gpus / oversubscription + 1e-9).all())


def group_class(domains: np.ndarray, sus: np.ndarray, axis: int) -> str:
    """Slowest link class any group along `axis` of a placed mesh crosses."""
    if domains.shape[axis] <= 1:
        return "intra_node"
    if bool((sus.max(axis=axis) != sus.min(axis=axis)).any()):
        return "inter_leaf"
    if bool((domains.max(axis=axis) != domains.min(axis=axis)).any()):
        return "inter_node"
    return "intra_node"


def spread_class(domains: np.ndarray, sus: np.ndarray, axis: int) -> str:
    """`group_class` of the groups along `axis` for collectives that send from every member to every
    other (all-to-all), with the fewest members any group has inside one NVLink domain when they span
    domains ("inter_node/8"): those exchange over NVLink (cost_cp.all_to_all_time)."""
    cls = group_class(domains, sus, axis)
    if cls == "intra_node":
        return cls
    local = members_per_domain(domains, (axis,))
    return f"{cls}/{local}" if local > 1 else cls


def groups_along(mesh: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """A per-rank array of a placed mesh as one row per group spanning `axes`."""
    rest = [a for a in range(mesh.ndim) if a not in axes]
    return np.transpose(mesh, rest + list(axes)).reshape(-1, int(np.prod([mesh.shape[a] for a in axes])))


def members_per_domain(domains: np.ndarray, axes: tuple[int, ...]) -> int:
    """Fewest members any group spanning `axes` of a placed [pp, dp, cp, tp] mesh has inside one NVLink
    domain (its other members sit in other domains)."""
    runs = np.sort(groups_along(domains, axes), axis=1)  # one run per (group, domain)
    starts = np.ones(runs.shape, dtype=bool)
    starts[:, 1:] = runs[:, 1:] != runs[:, :-1]  # every group starts a run of its own
    return int(np.bincount(np.cumsum(starts.ravel()) - 1).min())


def bottleneck_Bps(graph: nx.Graph, a: int, b: int) -> float:
    """Bandwidth of the slowest edge on the lowest-latency path between two devices: what a P2P send
    between them gets."""
    path = nx.shortest_path(graph, a, b, weight="latency_s")
    return min(graph.edges[u, v]["bandwidth_Bps"] for u, v in zip(path, path[1:]))
