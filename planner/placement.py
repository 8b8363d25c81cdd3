"""Placing the [pp, dp, tp] mesh on the cluster graph, and where the model graph allows a stage cut.

TP groups take the fastest links (consecutive ranks inside a node); the remaining two dimensions are
laid out in the order the search picks: pipeline neighbours next to each other (order dp, pp, tp) or
data-parallel replicas next to each other (order pp, dp, tp, the default of `init_device_mesh`). The
link class a dimension's collectives run over is the slowest link inside its worst group, read from the
cluster's networkx graph (two devices on the same node switch talk over the intra-node link).
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
import numpy as np
from meshplan.planner.cluster_spec import ClusterSpec
from meshplan.planner.cost_model import Links
from meshplan.planner.model_spec import ModelSpec

ORDERS: tuple[tuple[str, ...], ...] = (("pp", "dp", "tp"), ("dp", "pp", "tp"))


@dataclass(frozen=True)
class Placement:
    """`ranks[i][j][k]` = the global rank at pp index i, dp index j, tp index k; `order` lists the
    dimensions from outermost (slowest links) to innermost (fastest)."""

    order: tuple[str, ...]
    ranks: np.ndarray

    def to_dict(self) -> dict:
        return {"order": list(self.order), "ranks": self.ranks.tolist()}


def node_ids(graph: nx.Graph, world: int) -> np.ndarray:
    """Node (switch) of every device, read from the graph's device → switch edges."""
    ids = np.zeros(world, dtype=np.int64)
    for rank in range(world):
        switch = next(n for n in graph.neighbors(rank) if graph.nodes[n].get("kind") == "switch")
        ids[rank] = graph.nodes[switch]["node"]
    return ids


class Placer:
    """Caches the cluster graph's node map; answers placements and link classes per mesh shape."""

    def __init__(self, cluster: ClusterSpec):
        self.cluster = cluster
        self.graph = cluster.graph()
        self.nodes = node_ids(self.graph, cluster.world_size)
        self._links: dict[tuple, Links] = {}

    def place(self, pp: int, dp: int, tp: int, order: tuple[str, ...]) -> Placement:
        sizes = {"pp": pp, "dp": dp, "tp": tp}
        grid = np.arange(pp * dp * tp).reshape([sizes[d] for d in order])
        axes = [order.index(d) for d in ("pp", "dp", "tp")]
        return Placement(order, grid.transpose(axes))

    def links(self, pp: int, dp: int, tp: int, order: tuple[str, ...]) -> Links:
        key = (pp, dp, tp, order)
        if key not in self._links:
            nodes = self.nodes[self.place(pp, dp, tp, order).ranks]
            self._links[key] = Links(tp=_class(nodes, 2), pp=_class(nodes, 0), dp=_class(nodes, 1))
        return self._links[key]

    def orders(self, pp: int, dp: int, tp: int) -> list[tuple[str, ...]]:
        """Orders that differ in link classes (the default first); equal ones would be duplicates."""
        seen, out = set(), []
        for order in ORDERS:
            links = self.links(pp, dp, tp, order)
            if links not in seen:
                seen.add(links)
                out.append(order)
        return out


def _class(nodes: np.ndarray, axis: int) -> str:
    """inter_node if any group along `axis` spans two nodes."""
    if nodes.shape[axis] <= 1:
        return "intra_node"
    spread = nodes.max(axis=axis) != nodes.min(axis=axis)
    return "inter_node" if bool(spread.any()) else "intra_node"


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
