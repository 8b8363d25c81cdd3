"""Placing the [pp, dp, tp] mesh on the cluster graph, and where the model graph allows a stage cut.

TP groups take the fastest links (consecutive ranks inside a node); the remaining two dimensions are
laid out in the order the search picks: pipeline neighbours next to each other (order dp, pp, tp) or
data-parallel replicas next to each other (order pp, dp, tp, the default of `init_device_mesh`). The
link class a dimension's collectives run over is the slowest link inside its worst group, read from the
cluster's networkx graph (planner/topology.py): NVLink inside a domain, the NICs across domains, the
spine across scalable units.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
import numpy as np
from meshplan.planner.candidate import Links
from meshplan.planner.cluster_spec import ClusterSpec
from meshplan.planner.model_spec import ModelSpec
from meshplan.planner.topology import (
    device_leaves,
    device_levels,
    group_class,
    members_per_domain,
    ring_exits_fit,
    spread_class,
)

# outermost first; context-parallel groups sit between dp and tp: next to TP inside a node / NVLink domain
# where cp·tp fits, because ring and all-to-all CP communicate every layer (planner/cost_cp.py)
ORDERS: tuple[tuple[str, ...], ...] = (("pp", "dp", "cp", "tp"), ("dp", "pp", "cp", "tp"))
MESH_AXES = ("pp", "dp", "cp", "tp")  # the axes of Placement.ranks (the plan's mesh order)


def full_order(order: tuple[str, ...]) -> tuple[str, ...]:
    """An order over the four mesh dims; a three-dim order (pp, dp, tp) gets cp just outside tp."""
    if "cp" in order:
        return tuple(order)
    out = list(order)
    out.insert(out.index("tp"), "cp")
    return tuple(out)


@dataclass(frozen=True)
class Placement:
    """`ranks[i][j][c][k]` = the global rank at pp index i, dp index j, cp index c, tp index k; `order`
    lists the dimensions from outermost (slowest links) to innermost (fastest)."""

    order: tuple[str, ...]
    ranks: np.ndarray

    def to_dict(self) -> dict:
        return {"order": list(self.order), "ranks": self.ranks.tolist()}




class Placer:
    """Caches the cluster graph's node map; answers placements and link classes per mesh shape."""

    def __init__(self, cluster: ClusterSpec):
        self.cluster = cluster
        self.graph = cluster.graph()
        self.domains, self.sus = device_levels(self.graph, cluster.world_size)
        self.leaves = device_leaves(self.graph, cluster.world_size)
        self.leaf_gpus = np.bincount(self.leaves[self.leaves >= 0])  # GPUs under each leaf switch
        self._links: dict[tuple, Links] = {}
        self._orders: dict[tuple, list[tuple[str, ...]]] = {}

    def place(self, pp: int, dp: int, tp: int, order: tuple[str, ...], cp: int = 1) -> Placement:
        order = full_order(order)
        sizes = {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
        grid = np.arange(pp * dp * cp * tp).reshape([sizes[d] for d in order])
        axes = [order.index(d) for d in MESH_AXES]
        return Placement(order, grid.transpose(axes))

    def links(self, pp: int, dp: int, tp: int, order: tuple[str, ...], cp: int = 1) -> Links:
        key = (pp, dp, tp, full_order(order), cp)
        if key not in self._links:
            ranks = self.place(pp, dp, tp, order, cp).ranks
            dom, su, leaf = self.domains[ranks], self.sus[ranks], self.leaves[ranks]
            over = self.cluster.topology.oversubscription

            def ring(axis: int) -> str:  # collectives: rings leave an SU once each (topology.ring_exits_fit)
                cls = group_class(dom, su, axis)
                if cls == "inter_leaf" and ring_exits_fit(su, leaf, (axis,), self.leaf_gpus, over):
                    return "inter_node"
                return cls

            self._links[key] = Links(tp=ring(3), pp=group_class(dom, su, 0), dp=ring(1), cp=ring(2),
                                     dp_local=members_per_domain(dom, (1, 2)), cp_spread=spread_class(dom, su, 2))
        return self._links[key]

    def orders(self, pp: int, dp: int, tp: int, cp: int = 1) -> list[tuple[str, ...]]:
        """Orders that differ in link classes (the default first); equal ones would be duplicates."""
        key = (pp, dp, tp, cp)
        if key not in self._orders:
            seen, out = set(), []
            for order in ORDERS:
                links = self.links(pp, dp, tp, order, cp)
                if links not in seen:
                    seen.add(links)
                    out.append(order)
            self._orders[key] = out
        return self._orders[key]


def model_graph(model: ModelSpec) -> nx.DiGraph:
    """Layers as a dataflow graph: each layer feeds the next; a tied head also reads the embedding's
    weight (a parameter edge, which a cut may cross at the price of a copy, not an activation edge)."""
    g = nx.DiGraph(name=model.name)
    for i, layer in enumerate(model.layers):
        g.add_node(i, kind=layer.kind, name=layer.name, params=layer.params)
        if i:
            g.add_edge(i - 1, i, kind="activation")
    if model.tied_embeddings:
        heads = [i for i, layer in enumerate(model.layers) if layer.kind == "head" and layer.tied_params]
        for i in heads:
            g.add_edge(0, i, kind="parameter")
    return g


def allowed_cuts(graph: nx.DiGraph) -> list[bool]:
    """cuts[i]: a stage may start at layer i — exactly one activation edge crosses between layers
    < i and ≥ i (a pipeline stage sends one tensor to the next). cuts[0] is True by convention."""
    n = graph.number_of_nodes()
    crossing = [0] * (n + 1)
    for a, b, data in graph.edges(data=True):
        if data.get("kind") != "activation":
            continue
        lo, hi = min(a, b), max(a, b)
        for i in range(lo + 1, hi + 1):
            crossing[i] += 1
    return [True] + [crossing[i] == 1 for i in range(1, n)]
