"""Brute force over every plan under the cost model, for checking the ILPs and the search on small
instances (≤ 8 devices, ≤ 12 layers)."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

from meshplan.planner.cluster_spec import ClusterSpec, LinkSpec, parse_cluster
from meshplan.planner.constraints import Constraints
from meshplan.planner.cost_model import StageProblem, evaluate
from meshplan.planner.model_sources import builtin_model
from meshplan.planner.model_spec import ModelSpec
from meshplan.planner.search import Search
from meshplan.planner.search_space import candidates


def partitions(P: StageProblem):
    """Every contiguous split of the layers into P.num_stages non-empty stages at allowed cuts."""
    N, S = P.num_layers, P.num_stages
    cuts = [i for i in range(1, N) if not P.cuts or P.cuts[i]]
    for inner in itertools.combinations(cuts, S - 1):
        yield [0, *inner, N]


def recompute_choices(P: StageProblem, bounds: list[int]):
    blocks = [sum(1 for i in range(bounds[s], bounds[s + 1]) if P.kinds[i] == "block")
              for s in range(P.num_stages)]
    if P.recompute == "none" or (P.rec_time == 0 and P.rec_saving == 0):
        yield [0] * len(blocks)
    elif P.recompute == "all":
        yield blocks
    else:
        yield from (list(r) for r in itertools.product(*[range(n + 1) for n in blocks]))


def brute_partition(P: StageProblem) -> float | None:
    best = None
    for bounds in partitions(P):
        for rec in recompute_choices(P, bounds):
            ev = evaluate(P, bounds, rec)
            if ev.feasible and (best is None or ev.iteration_time < best):
                best = ev.iteration_time
    return best


def every_candidate(search: Search):
    """(candidate, problem, brute-force closed-form optimum, the search's solution, its reported time) of
    every candidate, each solved and scored on its own (the local search on the simulated time included):
    what the search would rank with no pruning at all."""
    c = search.c
    for cand in candidates(search.model, search.cluster, c, search.placer):
        problem = search.problem(cand)
        solution = search.partition.solve(problem)
        reported = search.score(cand, problem, solution, 0)[0].time if solution is not None else None
        yield cand, problem, brute_partition(problem), solution, reported


def brute_simulated(search: Search) -> float:
    """The least reported time over every candidate, partition and recompute count that fits: each
    pipeline's schedule simulated (Search.shared_time), as the search reports it."""
    best = math.inf
    for cand in candidates(search.model, search.cluster, search.c, search.placer):
        problem = search.problem(cand)
        for bounds in partitions(problem):
            for rec in recompute_choices(problem, bounds):
                ev = evaluate(problem, bounds, rec)
                if ev.feasible:
                    best = min(best, search.shared_time(cand, ev) if cand.pp > 1 else ev.iteration_time)
    return best


def brute_search(model: ModelSpec, cluster: ClusterSpec, constraints: Constraints, profile) -> float | None:
    search = Search(model, cluster, constraints, profile)
    best = None
    for cand in candidates(model, cluster, constraints, search.placer):
        value = brute_partition(search.problem(cand))
        if value is not None and (best is None or value < best):
            best = value
    return best


def small_model(blocks: int = 4, name: str = "tiny") -> ModelSpec:
    base = builtin_model(name)
    return replace(base, name=f"{name}-{blocks}", num_layers=blocks, layers=())


def small_cluster(text: str, memory_bytes: int) -> ClusterSpec:
    """The preset with `memory_bytes` per device, and the compute efficiency and links the presets had
    when issue 21 stated its case (0.5 of peak; NVLink 300 GB/s at 5 us, the NIC 25 GB/s at 10 us; nothing
    held outside the allocator), so that the case's numbers hold while the presets follow their sources."""
    cluster = parse_cluster(text)
    device = replace(cluster.device, memory_bytes=memory_bytes, efficiency=0.5, context_bytes=0.0,
                     communicator_bytes=0.0)
    return replace(cluster, device=device, intra_node=LinkSpec(300e9, 5e-6), inter_node=LinkSpec(25e9, 10e-6))
