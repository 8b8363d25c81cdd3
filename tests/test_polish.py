"""The local search on the simulated time (planner/polish.py): its recompute rule and its moves."""

import itertools

from meshplan.planner.cost_model import evaluate, rank_memory, rank_of_stages
from meshplan.planner.polish import _Moves, polish
from meshplan.planner.search import Search

from tests.planner_brute import partitions
from tests.test_search import BINDING, _setup


def _free_problem(case):
    memory_bytes, cluster, blocks, pins = case
    model, cl, constraints, profile = _setup(memory_bytes, cluster, blocks, **pins)
    search = Search(model, cl, constraints, profile)
    for cand in search._queue():
        problem = search.problem(cand[2])
        if problem.recompute == "free" and problem.rec_saving > 0 and problem.pp > 1:
            return search, cand[2], problem
    raise AssertionError("no free-recompute pipeline candidate")


def test_each_rank_recomputes_the_fewest_blocks_that_fit():
    """For every partition, `recompute_for` gives each rank the least recomputed-block count with which
    it fits, found by brute force over every count of every stage (memory binds in this case)."""
    search, cand, P = _free_problem(BINDING[0])
    moves, ranks = _Moves(P), rank_of_stages(P)
    checked = binding = 0
    for bounds in partitions(P):
        counts = moves.counts(bounds)
        least = [None] * P.pp
        for rec in itertools.product(*[range(n + 1) for n in counts]):
            mem = evaluate(P, bounds, list(rec)).rank_memory
            for r, stages in enumerate(ranks):
                total = sum(rec[s] for s in stages)
                if mem[r] <= P.mem_limit * (1 + 1e-9) and (least[r] is None or total < least[r]):
                    least[r] = total
        rec = moves.recompute_for(bounds, [0] * len(counts))
        ev = evaluate(P, bounds, rec)
        if any(x is None for x in least):
            assert not ev.feasible
            continue
        assert ev.feasible and [sum(rec[s] for s in stages) for stages in ranks] == least, bounds
        checked += 1
        binding += any(least)
    assert checked > 10 and binding > 0


def test_polish_only_keeps_moves_that_shorten_the_simulated_time():
    """From the ILP's partition, every kept move fits and shortens the simulated time; the result's
    time is its own simulation, and no single-boundary neighbour of it simulates shorter."""
    search, cand, P = _free_problem(BINDING[0])
    sol = search.partition.solve(P)
    ev = evaluate(P, sol.bounds, sol.recompute)
    start = search.shared_time(cand, ev)
    bounds, rec, out, time, runs = polish(P, sol.bounds, sol.recompute, ev, start,
                                          lambda e: search.shared_time(cand, e), lambda e: 0.0)
    assert out.feasible and time <= start and runs > 0
    assert time == search.shared_time(cand, evaluate(P, bounds, rec))
    for nb, nr in _Moves(P).around(bounds, rec, wide=False):
        nev = evaluate(P, nb, nr)
        if nev.feasible:
            assert search.shared_time(cand, nev) >= time * (1 - 1e-9)


def test_rank_memory_is_evaluate_s():
    """The bisection's memory-only evaluation gives `evaluate`'s per-rank memory for every partition and
    recompute count of an interleaved case (ranks holding two stages each)."""
    search, cand, P = _free_problem(BINDING[4])
    assert len(rank_of_stages(P)[0]) == 2
    moves = _Moves(P)
    n = 0
    for bounds in partitions(P):
        for rec in itertools.product(*[range(c + 1) for c in moves.counts(bounds)]):
            assert rank_memory(P, bounds, list(rec)) == evaluate(P, bounds, list(rec)).rank_memory
            n += 1
    assert n > 100
