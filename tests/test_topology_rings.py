"""Ring collectives across scalable units (planner/topology.ring_exits_fit): NCCL's rings leave each SU
once, so they run at NIC speed unless the leaves' oversubscribed uplinks cannot carry all their exits."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from meshplan.planner.cluster_spec import parse_cluster
from meshplan.planner.placement import Placer
from meshplan.planner.topology import device_leaves, device_levels, ring_exits_fit

ORDER = ("pp", "dp", "cp", "tp")


def pod(oversubscription: float):
    """8 DGX H100 nodes, 2 per scalable unit: 4 SUs, each leaf (SU, rail) serving 2 GPUs."""
    c = parse_cluster("8x8xh100-80gb")
    return replace(c, topology=replace(c.topology, nodes_per_leaf=2, oversubscription=oversubscription))


def mesh_levels(cluster, pp: int, dp: int, tp: int):
    placer = Placer(cluster)
    ranks = placer.place(pp, dp, tp, ORDER).ranks
    return placer.sus[ranks], placer.leaves[ranks], placer.leaf_gpus


def test_leaves_from_the_graph():
    """Leaf of a rank = its SU and rail: 4 SUs x 8 rails, 2 GPUs under each."""
    cluster = pod(2.0)
    g = cluster.graph()
    leaves = device_leaves(g, 64)
    _, su = device_levels(g, 64)
    assert len(set(leaves.tolist())) == 32 and np.bincount(leaves).tolist() == [2] * 32
    assert leaves[0] == leaves[8] and leaves[0] != leaves[16] and leaves[0] != leaves[1]
    assert (su == np.arange(64) // 16).all()


def test_one_rail_per_group():
    """tp 8 in a node, dp 8 over the nodes: 8 groups, group i on rail i, spanning the 4 SUs. Each leaf
    carries one exit (its rail's group) and has 2 GPUs ÷ oversubscription NICs of uplink: room at 2, not at 4."""
    for over, fits in ((1.0, True), (2.0, True), (4.0, False)):
        su, leaf, gpus = mesh_levels(pod(over), 1, 8, 8)
        assert ring_exits_fit(su, leaf, (1,), gpus, over) is fits


def test_two_rails_per_group():
    """tp 4, dp 16: a dp group holds local ranks k and k + 4 of every node, so its exit from an SU is shared
    by two rails, half a NIC on each leaf: it fits up to an oversubscription of 2 GPUs / 0.5 = 4."""
    for over, fits in ((4.0, True), (5.0, False)):
        su, leaf, gpus = mesh_levels(pod(over), 1, 16, 4)
        assert ring_exits_fit(su, leaf, (1,), gpus, over) is fits


def test_link_classes_follow_the_rings():
    """The placement's classes: data parallelism spanning SUs runs on the NICs while its rings fit (the same
    Links as a non-blocking fabric), through the spine when they do not; pipeline transfers, which every
    GPU of a stage sends across, stay on the spine."""
    assert Placer(pod(1.0)).links(1, 8, 8, ORDER).dp == "inter_node"
    assert Placer(pod(2.0)).links(1, 8, 8, ORDER) == Placer(pod(1.0)).links(1, 8, 8, ORDER)
    assert Placer(pod(4.0)).links(1, 8, 8, ORDER).dp == "inter_leaf"
    assert Placer(pod(2.0)).links(8, 1, 8, ORDER).pp == "inter_leaf"


def test_context_parallel_all_to_all_keeps_the_spine():
    """cp 8 over the 8 nodes (tp 8 inside): ring and all-gather CP run as rings at NIC speed; all-to-all
    (DeepSpeed-Ulysses) sends from every member to every other and stays on the spine's share."""
    links = Placer(pod(2.0)).links(1, 1, 8, ORDER, cp=8)
    assert links.cp == "inter_node" and links.cp_link("ring") == "inter_node"
    assert links.cp_link("all-gather") == "inter_node" and links.cp_link("all-to-all") == "inter_leaf"


def test_members_per_domain_counts_the_fewest_of_any_group():
    """The fewest members any group (a row of `groups_along`) has inside one domain, counted for all groups
    at once: against a per-group count on random placed meshes."""
    import numpy as np
    from meshplan.planner.topology import groups_along, members_per_domain

    rng = np.random.default_rng(0)
    for _ in range(200):
        domains = rng.integers(0, 4, size=tuple(int(x) for x in rng.integers(1, 5, size=4)))
        for axes in ((1,), (2,), (1, 2), (0, 3)):
            per_group = min(int(np.unique(row, return_counts=True)[1].min()) for row in groups_along(domains, axes))
            assert members_per_domain(domains, axes) == per_group
    # 2 nodes of 8, dp 4 x cp 4 over them: each dp x cp group holds 8 of its 16 members in each node
    dom = np.repeat(np.arange(2), 8).reshape(1, 4, 4, 1)
    assert members_per_domain(dom, (1, 2)) == 8
