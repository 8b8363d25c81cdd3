"""Stage partition + recomputation as an integer program (PuLP; HiGHS when highspy is installed, else CBC).

Two formulations of the same problem (planner/cost_model.py `StageProblem`, `evaluate`):

- `solve_assignment` — the general one: binary x[l, s] = layer l on stage s, contiguity through
  cumulative sums (a layer's stage never decreases along the chain, every stage non-empty), only cuts the
  model graph allows, integer recomputed-block counts per stage, min-max of the ranks' time per
  micro-batch plus the largest tail, per-rank memory ≤ limit.
- `solve_counts` — when the blocks are identical (same cost coefficients), a plan is determined by how
  many blocks each stage holds (the embedding is always on the first stage and the head on the last);
  every term of the objective and the constraints depends only on those counts, so this smaller integer
  program has exactly the optimum of `solve_assignment` (tests/test_ilp.py checks both against brute
  force). The search uses it for such models and `solve_assignment` for all others.

Both maximise nothing clever: the objective is weight·τ + tail with τ ≥ each rank's time per micro-batch
and tail ≥ each rank's optimizer + exposed gradient sync; since both are minimised, the max() pieces of
the cost model are exact.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pulp
from meshplan.planner.cost_model import Evaluation, StageProblem, evaluate, min_recomputed_blocks, rank_of_stages
from meshplan.planner.polish import fewest_recompute

# Times are scaled to milliseconds and bytes to MiB to keep the solvers' tolerances meaningful: a MIP's
# feasibility tolerance (1e-6 in HiGHS and CBC) is then a byte, where in GiB it was a kilobyte, enough to
# accept a partition that `evaluate` rejects. Memory rows keep MEM_SLACK (about 100 bytes) inside the limit.
MiB = float(1 << 20)
MS = 1e3
MEM_SLACK = 1e-4


def solver_name() -> str:
    return "HiGHS" if _has_highs() else "CBC"


def _has_highs() -> bool:
    try:
        import highspy  # noqa: F401
    except ImportError:
        return False
    return True


_BANNER_SILENCED = False


def _silence_highs_banner() -> None:
    """HiGHS prints a copyright banner on stdout when the first Highs() of a process is built, before
    any option can be set; build that first one with stdout closed so `plan --json` stays pure JSON."""
    global _BANNER_SILENCED
    if _BANNER_SILENCED:
        return
    import os
    import sys

    import highspy

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    _BANNER_SILENCED = True


# A safety net for the large binary assignment ILP (many stages over many non-identical layers): past it
# the best solution found is used and counted in `time_limited` (the search statistics report it).
TIME_LIMIT_S = 20.0
TIME_LIMITED = [0]


def _solver(prefer: str | None = None):
    name = prefer or solver_name()
    if name == "HiGHS":
        _silence_highs_banner()
        return pulp.HiGHS(msg=False, gapRel=0.0, gapAbs=1e-9, threads=1, timeLimit=TIME_LIMIT_S)
    return pulp.COIN_CMD(msg=False, gapRel=0.0, gapAbs=1e-9, threads=1, timeLimit=TIME_LIMIT_S, path=_cbc_path())


def _cbc_path() -> str | None:
    """A `cbc` on PATH, else the binary PuLP ships (PuLP 3 deprecates PULP_CBC_CMD, not the binary;
    COIN_CMD is its current interface to CBC)."""
    import shutil

    from pulp.apis.coin_api import pulp_cbc_path

    return shutil.which("cbc") or pulp_cbc_path


def _solved(prob: pulp.LpProblem, status: int) -> bool:
    """Optimal, or stopped by the time limit with an integer solution in hand."""
    if pulp.LpStatus[status] == "Optimal" and prob.sol_status == pulp.LpSolutionOptimal:
        return True
    if prob.sol_status == pulp.LpSolutionIntegerFeasible or pulp.LpStatus[status] in ("Optimal", "Not Solved") \
            and all(v.value() is not None for v in prob.variables()):
        TIME_LIMITED[0] += 1
        return pulp.LpStatus[status] != "Infeasible"
    return False


class Solution:
    """A partition (stage s = layers [bounds[s], bounds[s+1])) with per-stage recomputed blocks;
    `evaluation`, when known, is `evaluate` of it on the problem it was solved for (the search reuses it)."""

    def __init__(self, bounds: list[int], recompute: list[int], objective: float,
                 evaluation: Evaluation | None = None):
        self.bounds = bounds
        self.recompute = recompute
        self.objective = objective
        self.evaluation = evaluation

    def __repr__(self) -> str:
        return f"Solution(bounds={self.bounds}, recompute={self.recompute}, objective={self.objective:.6g})"


def _finish(problem: StageProblem, bounds: list[int], recompute: list[int]) -> Solution | None:
    ev = evaluate(problem, bounds, recompute)
    if not ev.feasible:
        return None
    if problem.recompute == "free":
        trimmed = _trim_recompute(problem, bounds, recompute, ev.iteration_time)
        if trimmed != recompute:
            recompute, ev = trimmed, evaluate(problem, bounds, trimmed)
    return Solution(bounds, recompute, ev.iteration_time, ev)


def _trim_recompute(P: StageProblem, bounds: list[int], recompute: list[int], objective: float) -> list[int]:
    """The min-max objective does not care about recompute on ranks that are not the bottleneck; drop
    every recomputed block that neither memory nor the objective needs (same optimum, less work)."""
    recompute = list(recompute)
    for s in range(len(recompute)):
        while recompute[s] > 0:
            recompute[s] -= 1
            ev = evaluate(P, bounds, recompute)
            if not ev.feasible or ev.iteration_time > objective * (1 + 1e-12):
                recompute[s] += 1
                break
    return recompute


def _rank_rows(prob: pulp.LpProblem, P: StageProblem, rank_expr, min_memory: bool) -> None:
    """Objective and per-rank rows; rank_expr(r) gives the rank's linear pieces (all its stages)."""
    tau = prob.add_variable("tau", lowBound=0)
    tail = prob.add_variable("tail", lowBound=0)
    excess = prob.add_variable("excess", lowBound=0) if min_memory else None
    zero3 = any(g > 0 for g in P.gather) or any(x > 0 for x in P.reduce)
    tax = P.overlap_tax  # hidden traffic slows the compute it overlaps: exposed + tax · (traffic − exposed)
    for r in range(P.pp):
        pc = rank_expr(r)
        time = pc["time"]
        if zero3:  # gathers and reductions not hidden behind the rank's compute (cost_model.evaluate)
            z = prob.add_variable(f"z3_{r}", lowBound=0)
            pooled = pc["gather"] + pc["reduce"]
            prob += z >= pooled - pc["fwd"] - pc["bwd"], f"z3_over_{r}"
            prob += z >= P.unhidden * pc["gather"], f"z3_floor_{r}"
            time = time + (1.0 - tax) * z + tax * pooled if tax else time + z
        prob += tau >= time, f"tau_{r}"
        prob += tail >= pc["opt"] + (1.0 - tax) * (pc["dp"] - pc["bwd"]) + tax * pc["dp"], f"tail_overlap_{r}"
        prob += tail >= pc["opt"] + ((1.0 - tax) * P.unhidden + tax) * pc["dp"], f"tail_bucket_{r}"
        base = pc["state"] + P.fixed[r] / MiB  # cost_memory.peak_memory: one row per transient moment
        moments = {"act": P.inflight[r] * pc["act"] + P.ws.act[r] / MiB - P.grads_idle[r] * pc["state"],
                   "emb": P.emb_inflight[r] * pc["act"] + P.ws.emb[r] / MiB,
                   "opt": pc["opt_ws"] + P.ws.opt[r] / MiB}
        for j, (n, idle) in enumerate(P.later[r]):
            moments[f"act{j + 1}"] = n * pc["act"] + P.ws.act[r] / MiB - idle * pc["state"]
        for name, extra in moments.items():
            if min_memory:
                prob += base + extra <= P.mem_limit / MiB - MEM_SLACK + excess, f"mem_{name}_{r}"
            elif math.isfinite(P.mem_limit):
                prob += base + extra <= P.mem_limit / MiB - MEM_SLACK, f"mem_{name}_{r}"
    prob += excess if min_memory else P.weight * tau + tail


def _pieces(P: StageProblem, layer_sum, rec, boundary: float) -> dict:
    """Linear pieces (ms, MiB) given layer_sum(coeffs) = Σ_l coeff_l · [l is counted]."""
    return {
        "time": layer_sum([t * MS for t in P.time]) + P.rec_time * MS * rec + boundary * MS,
        "fwd": layer_sum([f * MS for f in P.fwd]), "bwd": layer_sum([b * MS for b in P.bwd]),
        "gather": layer_sum([g * MS for g in P.gather]), "reduce": layer_sum([x * MS for x in P.reduce]),
        "dp": layer_sum([d * MS for d in P.dp]), "opt": layer_sum([o * MS for o in P.opt]),
        "state": layer_sum([x / MiB for x in P.state]),
        "opt_ws": layer_sum([x / MiB for x in P.ws.per_layer]),
        "act": layer_sum([a / MiB for a in P.act]) - (P.rec_saving / MiB) * rec,
    }


def _add(pieces: list[dict]) -> dict:
    return {k: pulp.lpSum(pc[k] for pc in pieces) for k in pieces[0]}


def _recompute_var(prob, P: StageProblem, name: str, blocks_expr):
    if P.recompute == "none" or P.rec_time == 0 and P.rec_saving == 0:
        return 0
    r = prob.add_variable(name, lowBound=0, cat="Integer")
    if P.recompute == "all":
        prob += r == blocks_expr, f"{name}_all"
    else:
        prob += r <= blocks_expr, f"{name}_max"
    return r


def solve_assignment(P: StageProblem, solver: str | None = None, min_memory: bool = False) -> Solution | None:
    """The general ILP: binary layer → stage assignment with contiguity (see module docstring)."""
    N, S = P.num_layers, P.num_stages
    if S > N:
        return None
    prob = pulp.LpProblem("stage_partition", pulp.LpMinimize)
    x: dict[tuple[int, int], pulp.LpVariable] = {}
    for lyr in range(N):
        for s in range(max(0, S - N + lyr), min(S - 1, lyr) + 1):  # room for the other stages
            x[lyr, s] = prob.add_variable(f"x_{lyr}_{s}", cat="Binary")
    for lyr in range(N):
        prob += pulp.lpSum(x[lyr, s] for s in range(S) if (lyr, s) in x) == 1, f"assign_{lyr}"
    prob += x[0, 0] == 1, "first_layer"
    prob += x[N - 1, S - 1] == 1, "last_layer"
    cum = {}
    for lyr in range(N):
        acc = []
        for s in range(S):
            if (lyr, s) in x:
                acc.append(x[lyr, s])
            cum[lyr, s] = pulp.lpSum(acc)
    for lyr in range(N - 1):
        for s in range(S - 1):
            prob += cum[lyr, s] >= cum[lyr + 1, s], f"order_{lyr}_{s}"
        if P.cuts and not P.cuts[lyr + 1]:  # no stage may start at lyr + 1
            for s in range(S):
                if (lyr + 1, s) in x or (lyr, s) in x:
                    prob += x.get((lyr, s), 0) == x.get((lyr + 1, s), 0), f"nocut_{lyr + 1}_{s}"
    for s in range(S):
        prob += pulp.lpSum(x[lyr, s] for lyr in range(N) if (lyr, s) in x) >= 1, f"nonempty_{s}"
    blocks = [i for i, k in enumerate(P.kinds) if k == "block"]
    stage_pieces = []
    for s in range(S):
        def layer_sum(coeffs, s=s):
            return pulp.lpSum(coeffs[lyr] * x[lyr, s] for lyr in range(N) if (lyr, s) in x and coeffs[lyr] != 0)
        rec = _recompute_var(prob, P, f"r_{s}", pulp.lpSum(x[i, s] for i in blocks if (i, s) in x))
        stage_pieces.append(_pieces(P, layer_sum, rec, P.boundary[s]))
    ranks = rank_of_stages(P)
    _rank_rows(prob, P, lambda r: _add([stage_pieces[s] for s in ranks[r]]), min_memory)
    status = prob.solve(_solver(solver))
    if not _solved(prob, status):
        return None
    stage_of = [next(s for s in range(S) if (lyr, s) in x and x[lyr, s].value() > 0.5) for lyr in range(N)]
    bounds = [0] + [lyr for lyr in range(1, N) if stage_of[lyr] != stage_of[lyr - 1]] + [N]
    recompute = [_int(prob, f"r_{s}") for s in range(S)]
    return _result(P, bounds, recompute, min_memory)


def solve_counts(P: StageProblem, solver: str | None = None, min_memory: bool = False) -> Solution | None:
    """The ILP over blocks (and recomputed blocks) per pipeline rank, for identical blocks between an
    embedding (always on stage 0) and a head (always on the last stage). Every term of the cost model
    depends on a rank's stages only through these two sums, so they are the whole decision; the rank's
    blocks are then spread over its stages (each middle stage gets at least one). Ranks that are
    interchangeable (same stage kinds, in-flight count and fixed bytes) are ordered to break symmetry."""
    N, S = P.num_layers, P.num_stages
    L = N - 2
    if S > N:
        return None
    ranks = rank_of_stages(P)
    prob = pulp.LpProblem("stage_counts", pulp.LpMinimize)
    n, rec, signature = [], [], []
    for r, stages in enumerate(ranks):
        low = sum(1 for s in stages if 0 < s < S - 1)
        n.append(prob.add_variable(f"n_{r}", lowBound=low, upBound=L, cat="Integer"))
        rec.append(_recompute_var(prob, P, f"r_{r}", n[r]))
        signature.append((low, 0 in stages, S - 1 in stages, P.inflight[r], P.fixed[r], P.ws.act[r], P.ws.emb[r],
                          P.ws.opt[r], P.grads_idle[r], P.later[r], P.emb_inflight[r],
                          sum(P.boundary[s] for s in stages)))
    prob += pulp.lpSum(n) == L, "all_blocks"
    for r in range(1, P.pp):
        if signature[r] == signature[r - 1]:
            prob += (L + 1) * n[r - 1] + rec[r - 1] >= (L + 1) * n[r] + rec[r], f"symmetry_{r}"

    def rank_expr(r: int) -> dict:
        stages = ranks[r]
        ends = ([0] if 0 in stages else []) + ([N - 1] if S - 1 in stages else [])

        def layer_sum(coeffs):
            return coeffs[1] * n[r] + sum(coeffs[i] for i in ends)
        return _pieces(P, layer_sum, rec[r], sum(P.boundary[s] for s in stages))

    _rank_rows(prob, P, rank_expr, min_memory)
    status = prob.solve(_solver(solver))
    if not _solved(prob, status):
        return None
    counts = [0] * S
    recompute = [0] * S
    for r, stages in enumerate(ranks):
        total = int(round(n[r].value()))
        rtotal = int(round(rec[r].value())) if not isinstance(rec[r], int) else 0
        middle = [s for s in stages if 0 < s < S - 1]
        for s in middle:
            counts[s] = 1
        left = total - len(middle)
        for i in range(left):  # spread the rest evenly over the rank's stages
            counts[stages[i % len(stages)]] += 1
        for i in range(rtotal):
            for s in sorted(stages, key=lambda k: counts[k] - recompute[k], reverse=True)[:1]:
                recompute[s] += 1
    bounds = [0]
    for s in range(S):
        bounds.append(bounds[-1] + counts[s] + (1 if s == 0 else 0) + (1 if s == S - 1 else 0))
    return _result(P, bounds, recompute, min_memory)


def fixed_bounds(P: StageProblem) -> list[int] | None:
    """The only partition a problem allows (an engine's fixed stage split, planner/stage_split.py: exactly
    one allowed cut per boundary), else None."""
    if not P.cuts or P.num_stages < 2:
        return None
    starts = [layer for layer in range(1, P.num_layers) if P.cuts[layer]]
    return [0, *starts, P.num_layers] if len(starts) == P.num_stages - 1 else None


def solve_fixed(P: StageProblem, bounds: list[int], min_memory: bool = False) -> Solution | None:
    """The optimum over recompute counts of a fixed partition, without an ILP: a recomputed block only adds
    time to its own rank, so each rank recomputes the fewest blocks that fit (planner/polish.py's search);
    for the least memory, every block it may."""
    return _result(P, bounds, fewest_recompute(P, bounds, most=min_memory), min_memory)


def _int(prob: pulp.LpProblem, name: str) -> int:
    var = prob.variablesDict().get(name)
    return int(round(var.value())) if var is not None and var.value() is not None else 0


def _result(P: StageProblem, bounds: list[int], recompute: list[int], min_memory: bool) -> Solution | None:
    if min_memory:
        ev = evaluate(P, bounds, recompute)
        return Solution(bounds, recompute, max(m - P.mem_limit for m in ev.rank_memory))
    return _finish(P, bounds, recompute)


class PartitionSolver:
    """Solves stage problems with two caches: identical problems (many outer candidates share one), and
    the memory-free optimum per objective — if it fits a problem's memory it is that problem's optimum too
    (a relaxation's optimum that is feasible is optimal), so ZeRO levels or margins with the same times,
    and a free-recompute candidate and its no-recompute sibling (`_memory_free`), cost one solve."""

    def __init__(self, solver: str | None = None, force_assignment: bool = False):
        self.solver = solver or solver_name()
        self.force_assignment = force_assignment
        self.cache: dict[tuple, Solution | None] = {}
        self.free: dict[tuple, Solution | None] = {}
        self.seen: dict[tuple, int] = {}
        self.solves = 0
        self.hits = 0

    def _solve(self, P: StageProblem, min_memory: bool = False) -> Solution | None:
        if (bounds := fixed_bounds(P)) is not None:
            return solve_fixed(P, bounds, min_memory)
        self.solves += 1
        use_counts = P.uniform_blocks() and not self.force_assignment
        return (solve_counts if use_counts else solve_assignment)(P, self.solver, min_memory=min_memory)

    def solve(self, P: StageProblem) -> Solution | None:
        key = P.key()
        if key in self.cache:
            self.hits += 1
            return self.cache[key]
        relaxed = _memory_free(P)
        tkey = _time_key(relaxed)
        first = self.seen.setdefault(tkey, 0) == 0
        self.seen[tkey] += 1
        if tkey not in self.free and (first or min_recomputed_blocks(P) > 0):
            # Solve directly the first time an objective appears, or when memory surely binds (the
            # memory-free optimum cannot fit); the memory-free solve pays off from the second time on.
            sol = self._solve(P)
            self.cache[key] = sol
            return sol
        if tkey not in self.free:
            self.free[tkey] = self._solve(relaxed)
        free = self.free[tkey]
        ev = evaluate(P, free.bounds, free.recompute) if free is not None else None
        if ev is not None and ev.feasible:  # P's own evaluation: the time key leaves out constant terms
            self.hits += 1
            sol = Solution(free.bounds, free.recompute, ev.iteration_time, ev)
        else:
            sol = self._solve(P)
        self.cache[key] = sol
        return sol

    def min_memory(self, P: StageProblem) -> Solution | None:
        """The partition with the least memory over the limit (for the exit-3 message)."""
        return self._solve(P, min_memory=True)


def _memory_free(P: StageProblem) -> StageProblem:
    """P without its memory limit. With free recompute counts that is P without recompute: a recomputed
    block only adds time (rec_time ≥ 0), so the optimum recomputes nothing. A candidate and its free-
    recompute sibling then share one relaxation: where it fits, both have its optimum and plan."""
    if P.recompute == "free" and P.rec_time >= 0:
        P = replace(P, recompute="none", rec_time=0.0, rec_saving=0.0, rec_tp=0.0)
    return replace(P, mem_limit=math.inf)


def _time_key(P: StageProblem) -> tuple:
    """Everything but memory: two problems with this key have the same objective everywhere (values
    rounded to 12 digits: ZeRO-1 and ZeRO-2 reach the same sync time through different sums)."""
    def r(xs):
        return tuple(float(f"{x:.12g}") for x in xs)
    return (tuple(P.kinds), r(P.time), r(P.fwd), r(P.bwd), r(P.opt), r(P.dp), r(P.gather), r(P.reduce),
            r([P.rec_time]), r(P.boundary), tuple(P.rank), r([P.weight, P.unhidden, P.overlap_tax]), P.recompute,
            tuple(P.cuts))
