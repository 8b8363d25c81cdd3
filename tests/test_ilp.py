"""Both stage ILPs return the brute-force optimum of the same cost model on small instances."""

import math
from dataclasses import replace

import pytest
from meshplan.planner.constraints import Constraints
from meshplan.planner.cost_model import evaluate
from meshplan.planner.ilp import PartitionSolver, solve_assignment, solve_counts
from meshplan.planner.search import Search
from meshplan.planner.search_space import candidates
from meshplan.profiler.presets import preset_profile

from tests.planner_brute import brute_partition, small_cluster, small_model


def _problems(memory_bytes: int, blocks: int = 4, every: int = 1, **pins):
    model = small_model(blocks)
    cluster = small_cluster("2x4xa100-40gb", memory_bytes)
    profile = preset_profile(model, cluster, "fp32")
    constraints = Constraints(global_batch_size=8, seq_len=64, dtype="fp32", **pins)
    search = Search(model, cluster, constraints, profile)
    cands = list(candidates(model, cluster, constraints, search.placer))
    return [search.problem(c) for c in cands[::every]]


def _same(solution, expected):
    if expected is None:
        return solution is None
    return solution is not None and math.isclose(solution.objective, expected, rel_tol=1e-7)


@pytest.mark.parametrize("memory_bytes", [10**9, 1_500_000, 2_500_000])
def test_count_ilp_matches_brute_force(memory_bytes):
    problems = _problems(memory_bytes, every=4)
    assert len(problems) > 100
    infeasible = recomputed = 0
    for P in problems:
        expected = brute_partition(P)
        infeasible += expected is None
        sol = solve_counts(P)
        assert _same(sol, expected), P
        recomputed += bool(sol and any(sol.recompute))
    if memory_bytes < 10**7:
        assert 0 < infeasible < len(problems) and recomputed  # memory binds for some, not all


@pytest.mark.parametrize("memory_bytes", [10**9, 3_000_000])
def test_assignment_ilp_matches_brute_force_12_layers(memory_bytes):
    problems = _problems(memory_bytes, blocks=10, every=41, pp=4)
    for P in problems:
        expected = brute_partition(P)
        sol = solve_assignment(P)
        assert _same(sol, expected), P
        if sol is not None:  # contiguous, non-empty stages, recompute within the blocks
            b = sol.bounds
            assert b[0] == 0 and b[-1] == P.num_layers and all(x < y for x, y in zip(b, b[1:]))
            assert evaluate(P, b, sol.recompute).feasible


def test_assignment_ilp_respects_forbidden_cuts():
    P = _problems(10**9, blocks=6, pp=2, schedule="1f1b", micro_batch_size=1)[0]
    cuts = [True] * P.num_layers
    for i in (3, 4, 5):
        cuts[i] = False
    P = replace(P, cuts=cuts)
    sol = solve_assignment(P)
    assert sol is not None and sol.bounds[1] not in (3, 4, 5)
    assert math.isclose(sol.objective, brute_partition(P), rel_tol=1e-7)


def test_cbc_and_highs_agree():
    pytest.importorskip("highspy")  # the [highs] extra ([dev] installs it)
    for P in _problems(2_000_000, every=40):
        a, b = solve_counts(P, "CBC"), solve_counts(P, "HiGHS")
        assert (a is None) == (b is None)
        if a is not None:
            assert math.isclose(a.objective, b.objective, rel_tol=1e-7)


def test_solver_cache_reuses_identical_problems():
    P = _problems(10**9, pp=2, schedule="1f1b", micro_batch_size=1, zero=0)[0]
    solver = PartitionSolver()
    first = solver.solve(P)
    again = solver.solve(replace(P))
    assert again is first and solver.hits >= 1


def _siblings(memory_bytes: int):
    """A no-recompute problem and its free-recompute sibling (the same candidate with recompute=full)."""
    none = _problems(memory_bytes, pp=2, schedule="1f1b", micro_batch_size=1, zero=0, recompute="none")[0]
    free = _problems(memory_bytes, pp=2, schedule="1f1b", micro_batch_size=1, zero=0)
    free = next(P for P in free if P.recompute == "free" and P.rank == none.rank and P.time == none.time)
    return none, free


def test_free_recompute_shares_the_no_recompute_relaxation():
    """Without a memory limit recomputing only adds time, so a free-recompute problem's relaxation is its
    no-recompute sibling's: where that fits, both get its optimum from one memory-free solve."""
    none, free = _siblings(10**9)
    solver = PartitionSolver()
    a = solver.solve(none)
    b = solver.solve(free)
    solves = solver.solves
    c = solver.solve(replace(free, mem_limit=free.mem_limit * 2))
    assert solver.solves == solves  # the shared relaxation fits: no new ILP
    for P, sol in ((none, a), (free, b)):
        assert sol.recompute == [0] * P.num_stages
        assert math.isclose(sol.objective, brute_partition(P), rel_tol=1e-7)
    assert c.bounds == b.bounds


def test_relaxation_gives_each_problem_its_own_objective():
    """Problems that share a memory-free optimum may differ by terms the same for every partition (the
    step's scalar all-reduces): each gets its own objective, not the cached one's."""
    P = _problems(10**9, pp=2, schedule="1f1b", micro_batch_size=1, zero=0, recompute="none")[0]
    shifted = replace(P, step_sync=P.step_sync + 1e-3)
    solver = PartitionSolver()
    solver.solve(P)
    sol = solver.solve(shifted)
    assert sol.objective == pytest.approx(evaluate(shifted, sol.bounds, sol.recompute).iteration_time, rel=1e-12)
    assert math.isclose(sol.objective, brute_partition(shifted), rel_tol=1e-7)
