"""The search: enumerate the small outer space, bound, and solve the stage ILP only where it can win.

Outer space (planner/search_space.py): tp (divides heads, kv heads and a node), cp, pp, dp, micro-batch
size b (m = global/(dp·b)), schedule and virtual stages, ZeRO level, recompute mode and mesh placement. Every
candidate gets a memory lower bound and a lower bound on the time the search reports for it: the ILP's
closed form (planner/cost_model.py `lower_bound`) without a pipeline, else the plan's schedule simulated
from its stage times (planner/shared_cores.py), sharpened just before solving (`refined_bound`: the busiest
rank over whole blocks that fit its memory). Candidates are solved in order of those bounds, and the
search stops once the least bound left passes the k-th best distinct plan's reported time: the ranking
is the one solving every candidate would give (tests/test_search.py checks it, and each candidate's ILP
optimum, against brute force), while only a few ILPs are solved and only plans that can still enter the
ranking are simulated. A simulated plan within POLISH_WITHIN of the k-th best then goes through a local
search on its simulated time from the ILP's partition (planner/polish.py), since the ILP's closed form can
rate equal partitions the simulation does not; on small cases the plan's time is brute force's least
simulated time over every candidate, partition and recompute count (tests/test_search.py).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from meshplan.planner.candidate import Candidate, Links
from meshplan.planner.cluster_spec import ClusterSpec
from meshplan.planner.constraints import Constraints
from meshplan.planner.cost_collectives import (
    GradSync,
    grad_sync,
    root_hook_time,
    sharded_accumulation,
    step_sync_time,
    unhidden_share,
)
from meshplan.planner.cost_cp import cp_terms
from meshplan.planner.cost_ep import ep_terms, links_with_ep
from meshplan.planner.cost_memory import (
    fixed_bytes,
    gather_workspace,
    grads_idle,
    state_bytes,
    state_kept,
)
from meshplan.planner.cost_model import (
    Evaluation,
    StageProblem,
    Terms,
    build_problem,
    crossings,
    evaluate,
    least_recompute,
)
from meshplan.planner.cost_pipeline import (
    bubble_micro_batches,
    grad_moments,
    in_flight,
    pipeline_stage_split,
    unfused_share,
    zb_ratio,
)
from meshplan.planner.errors import InfeasibleError, InputError
from meshplan.planner.ilp import PartitionSolver, Solution
from meshplan.planner.memory_reserve import Reserve, reserve, usable_bytes
from meshplan.planner.model_spec import ModelSpec
from meshplan.planner.placement import Placer, allowed_cuts, model_graph
from meshplan.planner.plan import (
    Plan,
    SearchStats,
    stage_rank,
)
from meshplan.planner.polish import polish
from meshplan.planner.search_plan import describe, infeasible_message, parallel_config, plan_key, to_plan
from meshplan.planner.search_space import candidates, memory_key
from meshplan.planner.shared_cores import (
    evaluation_lower_bound,
    makespan_lower_bound,
    relative_rate,
    shared_iteration_time,
)
from meshplan.planner.stage_split import split_bounds, split_cuts

Progress = Callable[[int, int], None]
# The local search on the simulated time (planner/polish.py) runs on plans within this factor of the
# keep-th best: one layer moved between stages shifts a plan by a share of a stage, rarely by more
POLISH_WITHIN = 1.02
TOLERANCE = 1 + 1e-12  # a bound this close to a solved time may still tie it (ties go to the earlier candidate)


@dataclass
class Scored:
    cand: Candidate
    problem: StageProblem
    solution: Solution
    index: int  # enumeration order: the tie-break (simpler plans are enumerated first)
    time: float  # predicted iteration seconds: the objective, pipelines simulated (planner/shared_cores.py)

    @property
    def objective(self) -> float:
        return self.solution.objective


class _Bounds(NamedTuple):
    """A candidate's bounds before any ILP: `closed` on the ILP's objective (cost_model.lower_bound),
    `ratio` its memory lower bound over the limit, and the pieces of the closed form the reported-time
    bound reuses (work per micro-batch over all ranks, the longest layer, the tail's bound)."""

    closed: float
    ratio: float
    work: float
    longest: float
    tail: float
    bubble: float
    room: list[float]  # bytes per rank left for blocks (memory_lower_bound's)
    block_state: float  # least state bytes of a block, as memory_lower_bound counts it
    limit: float  # the bytes a rank may use (Search.limit), `ratio`'s denominator


class _Board:
    """The solved plans, one per distinct plan (what `to_plan` lists: parallel config and placement;
    a free-recompute candidate that recomputes nothing is its no-recompute sibling's plan), best reported
    time first; `kth` is the keep-th best reported time (inf while fewer)."""

    def __init__(self, keep: int):
        self.keep = keep
        self.plans: dict[tuple, Scored] = {}
        self.others: list[Scored] = []  # duplicates, and plans left unsimulated (closed-form time)
        self.kth = math.inf

    def add(self, key: tuple, scored: Scored, ranked: bool) -> None:
        old = self.plans.get(key)
        if not ranked or (old is not None and (old.time, old.index) <= (scored.time, scored.index)):
            self.others.append(scored)
            return
        if old is not None:
            self.others.append(old)
        self.plans[key] = scored
        if len(self.plans) >= self.keep:
            self.kth = sorted(r.time for r in self.plans.values())[self.keep - 1]

    def results(self) -> list[Scored]:
        """The ranked plans, then the others (these are never better than the keep-th ranked one)."""
        def order(r: Scored) -> tuple[float, int]:
            return r.time, r.index
        return sorted(self.plans.values(), key=order) + sorted(self.others, key=order)


class Search:
    """One search: the candidate list, bounds, the partition solver and the results."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, constraints: Constraints, profile,
                 solver: str | None = None, force_assignment: bool = False):
        self.model, self.cluster, self.c, self.profile = model, cluster, constraints, profile
        self.sharded = sharded_accumulation(profile)  # the software keeps gradients sharded when pipelined
        self.seq = constraints.effective_seq_len(model)
        self.placer = Placer(cluster)
        self.cuts = allowed_cuts(model_graph(model))
        self.kinds = [layer.kind for layer in model.layers]
        self.terms = Terms(model, profile, self.seq, constraints.dtype)
        self.terms.moe_imbalance = constraints.moe_imbalance  # planner/cost_ep.py
        self.partition = PartitionSolver(solver, force_assignment)
        self.considered = 0
        self.feasible = 0
        # (demand or None until exit 3 needs it, index, candidate) of candidates that cannot fit
        self.memory_pruned: list[tuple[float | None, int, Candidate]] = []
        # (reported-time lower bound, memory lower bound, candidate) of everything considered, for `--pareto`;
        # the time bound None where the memory bound alone pruned it (`_queue`)
        self.bounds_seen: list[tuple[float | None, float, Candidate]] = []
        self.ranked_times: dict[Candidate, float] = {}  # solved candidates' reported (simulated) times
        self.polished: dict[tuple, tuple] = {}  # local-search results by problem, start and schedule
        self.refined_bounds: dict[Candidate, float] = {}  # the sharper bounds the search computed
        self.quick = _Quick(model)
        self.rate = relative_rate(profile)  # None unless CPU ranks outnumbered the cores when profiled

    def terms_for(self, cand: Candidate) -> Terms:
        """The candidate's Terms: the shared ones, or its CP degree's (planner/cost_cp.py); for a MoE model
        its EP layout's (planner/cost_ep.py)."""
        links = self.links(cand)
        terms = self.terms if cand.cp == 1 else cp_terms(self.terms, cand.cp, cand.cp_mode, links.cp_link(cand.cp_mode))
        return ep_terms(terms, cand, links.ep, self.c.moe_imbalance, links.edp)

    def reserve(self, cand: Candidate) -> Reserve:
        """Device memory outside the allocator on a rank of this candidate (planner/memory_reserve.py)."""
        return reserve(self.cluster.device, cand.tp, cand.pp, cand.dp, cand.cp, cand.ep)

    def limit(self, cand: Candidate) -> float:
        """Bytes the allocator may use on a rank of this candidate: capacity less reserve and margin."""
        return self.terms._get(("limit", cand.tp, cand.pp, cand.dp, cand.cp, cand.ep), lambda: usable_bytes(
            self.cluster.device.memory_bytes, self.c.memory_margin, self.reserve(cand)))

    def links(self, cand: Candidate) -> Links:
        key = ("links", cand.pp, cand.dp, cand.tp, cand.order, cand.cp, cand.ep, cand.expert_tp)
        if key not in self.terms.memo:
            self.terms.memo[key] = links_with_ep(self.placer, cand, self.placer.links(cand.pp, cand.dp, cand.tp,
                                                                                      cand.order, cand.cp))
        return self.terms.memo[key]

    def problem(self, cand: Candidate) -> StageProblem:
        links = self.links(cand)
        return build_problem(self.model, self.profile, cand, self.seq, self.c.dtype, links, self.limit(cand),
                             self.cuts_for(cand), self.terms)

    def cuts_for(self, cand: Candidate) -> list[bool]:
        """Where a stage may start: wherever one tensor crosses, or only at the engine's fixed split."""
        bounds = split_bounds(self.kinds, cand.pp * cand.v, self.c.split) if cand.pp > 1 else None
        return self.cuts if bounds is None else split_cuts(self.cuts, bounds)

    def bounds(self, cand: Candidate) -> tuple[float, float]:
        """(lower_bound, memory_lower_bound) of the candidate's problem, from per-kind sums without
        building it (thousands of candidates; tests check it equals the per-layer computation)."""
        parts = self._bounds(cand)
        return parts.closed, parts.ratio

    def reported_bound(self, cand: Candidate) -> float:
        """A lower bound on the time the search reports for any plan of the candidate (`iteration_time`)."""
        return self._reported(cand, self._bounds(cand))

    def _reported(self, cand: Candidate, parts: _Bounds) -> float:
        """The reported time is the closed form without a pipeline; on shared cores at least the closed
        form's bound over `speedup`; else the simulated makespan's bound (shared_cores.makespan_lower_bound)
        plus the tail's."""
        if cand.pp == 1:
            return parts.closed
        if self.rate is not None:
            return parts.closed / self.speedup(cand)
        span = makespan_lower_bound(cand.schedule, cand.pp, cand.v, cand.m, parts.work, parts.longest)
        return span + parts.tail

    def _bounds(self, cand: Candidate) -> _Bounds:
        q = self.quick
        links = self.links(cand)
        b, tp, S, pp = cand.b, cand.tp, cand.num_stages, cand.pp
        dp = cand.dp * cand.cp  # the ranks that average gradients and shard ZeRO state
        terms = self.terms_for(cand)
        sums = self._kind_sums(b, tp, cand.schedule, terms)
        fsum, gsum, tsum, tmax = sums["f"], sums["g"], sums["t"], sums["tmax"]
        rows = sums["rows"]
        sync_plan = grad_sync(cand, self.sharded)
        agg = self._layer_sums(tp, dp, cand.zero, links.dp_cp_group, sync_plan, terms)
        rank = self._ranks(pp, cand.schedule, cand.v)
        pipe = self._pipeline(cand, links.pp, rank)[0]
        unhidden = unhidden_share(self.profile, dp, cand.zero, q.num_layers, S)
        pooled = agg["gather"] + agg["reduce"]
        z3 = max(pooled - fsum - gsum, unhidden * agg["gather"]) if pooled > 0 else 0.0
        work = tsum + pipe + z3 + S * root_hook_time(self.profile, dp, cand.zero)
        rec_time, rec_saving, _ = terms.recompute(b, tp, cand.recompute)
        recompute = "none" if cand.recompute == "none" else ("all" if cand.recompute_pinned else "free")
        inflight = self._inflight(cand.schedule, pp, cand.v, cand.m)
        fixed = fixed_bytes(pp, rank, q.tied / tp * agg["tied_bytes"],
                            agg["workspace"] if cand.zero >= 3 and dp > 1 else 0.0)
        limit = self.limit(cand)
        left = [limit - f for f in fixed]
        kept = state_kept(grads_idle(agg["state_bytes"], self._moments(cand.schedule, pp, cand.v, cand.m)))
        block_state = agg["block_state_min"] * kept
        for i, params_state, kind in agg["ends"]:
            r = rank[0] if i < q.first_block else rank[-1]
            left[r] -= params_state * kept + inflight[r] * rows[kind][3]
        blocks = q.counts.get("block", 0)
        act_blk = rows["block"][3] if blocks else 0.0
        if min(left) < 0:
            ratio = 2.0 + max(-x for x in left) / limit
        elif not blocks:
            ratio = 0.0
        else:
            act_min = act_blk - (rec_saving if recompute != "none" else 0.0)
            capacity = sum(x / (block_state + inflight[r] * act_min) for r, x in enumerate(left))
            ratio = blocks / capacity if capacity > 0 else float("inf")
        if recompute == "all":
            work += rec_time * blocks
        elif recompute == "free" and rec_saving > 0 and blocks:
            least = least_recompute(left, inflight, block_state, act_blk, rec_saving, blocks)
            work += rec_time * math.ceil(least - 1e-9)
        bubble = bubble_micro_batches(cand.schedule, pp, cand.v, zb_ratio(fsum, gsum))
        tau = max(work / pp, tmax)
        sync = self.terms._get(("step sync", dp * tp * pp, links.tp, links.pp, links.dp, links.cp),
                               lambda: step_sync_time(self.profile, dp * tp * pp, links))
        tail = (agg["opt"] + max(agg["dp"] - gsum, unhidden * agg["dp"])) / pp + sync
        return _Bounds((cand.m + bubble) * tau + tail, ratio, work, tmax, tail, bubble, left, block_state, limit)

    def _kind_sums(self, b: int, tp: int, schedule: str, terms: Terms | None = None) -> dict:
        """Per-kind rows (Terms.kind) and their sums over the model's layers (memoised on `terms`)."""
        terms = terms or self.terms
        key = ("kind sums", b, tp, schedule == "zero-bubble")
        if key not in terms.memo:
            counts = self.quick.counts
            rows = {k: terms.kind(k, b, tp, schedule) for k in counts}
            terms.memo[key] = dict(
                rows=rows, f=sum(n * rows[k][0] for k, n in counts.items()),
                g=sum(n * rows[k][1] for k, n in counts.items()),
                t=sum(n * (rows[k][0] + rows[k][1] + rows[k][2]) for k, n in counts.items()),
                tmax=max(rows[k][0] + rows[k][1] + rows[k][2] for k in counts))
        return terms.memo[key]

    def _pipeline(self, cand: Candidate, link: str, rank: list[int]) -> tuple[float, list[float]]:
        """build_problem's boundaries less their relief, summed over the stages (cost_model.lower_bound)
        and per rank; the same for every candidate of this shape (m matters only through 1F1B's unfused
        share)."""
        pp, b, tp, schedule = cand.pp, cand.b, cand.tp, cand.schedule
        key = ("pipe", pp, cand.v, schedule, b, tp, link, cand.m if schedule == "1f1b" else 0, cand.cp)
        if key not in self.terms.memo:
            hop = self.terms_for(cand).hop(b, tp, link) if pp > 1 else 0.0
            pipe, per_rank = 0.0, [0.0] * pp
            for k in range(cand.num_stages):
                t, relief, _ = pipeline_stage_split(self.profile, hop, crossings(rank, k), schedule,
                                                    unfused_share(schedule, pp, cand.m, rank[k]), b)
                pipe += t - relief
                per_rank[rank[k]] += t - relief
            self.terms.memo[key] = pipe, per_rank
        return self.terms.memo[key]

    def refined_bound(self, cand: Candidate) -> float:
        """A sharper lower bound on the reported time, for candidates about to be solved: the busiest
        rank over whole blocks, each rank holding only what fits its memory (`least_bottleneck`). The
        closed form's τ_max and the simulation's m micro-batches on the busiest rank are at least it."""
        parts = self._bounds(cand)
        q, pp = self.quick, cand.pp
        blocks = q.counts.get("block", 0)
        if not blocks:
            return self._reported(cand, parts)
        links = self.links(cand)
        terms = self.terms_for(cand)
        dp = cand.dp * cand.cp
        rows = self._kind_sums(cand.b, cand.tp, cand.schedule, terms)["rows"]
        rank = self._ranks(pp, cand.schedule, cand.v)
        fixed = list(self._pipeline(cand, links.pp, rank)[1])
        root = root_hook_time(self.profile, dp, cand.zero)
        for k in rank:
            fixed[k] += root
        for i, _, kind in self._layer_sums(cand.tp, dp, cand.zero, links.dp_cp_group,
                                           grad_sync(cand, self.sharded), terms)["ends"]:
            fixed[rank[0] if i < q.first_block else rank[-1]] += sum(rows[kind][:3])
        rec_time, rec_saving, _ = terms.recompute(cand.b, cand.tp, cand.recompute)
        mode = "none" if cand.recompute == "none" else ("all" if cand.recompute_pinned else "free")
        inflight = self._inflight(cand.schedule, pp, cand.v, cand.m)
        act = rows["block"][3]
        slack = parts.limit * 1e-9  # evaluate's feasibility tolerance
        tau = least_bottleneck(blocks, sum(rows["block"][:3]), fixed, [x + slack for x in parts.room],
                               [parts.block_state + k * act for k in inflight], [k * rec_saving for k in inflight],
                               rec_time, mode)
        if pp == 1 or self.rate is not None:
            closed = max(parts.closed, (cand.m + parts.bubble) * tau + parts.tail)
            return closed / self.speedup(cand)
        return max(self._reported(cand, parts), cand.m * tau + parts.tail)

    def demand(self, cand: Candidate) -> float:
        """Average memory a rank needs at best (maximum recompute, perfect balance) over the usable
        memory: how far a pruned candidate is from fitting, to pick the nearest one for exit 3."""
        problem = self.problem(cand)
        saving = problem.rec_saving if problem.recompute != "none" else 0.0
        k = min(problem.inflight)
        need = sum(problem.fixed) + sum(problem.state) + sum(
            (problem.act[i] - (saving if kind == "block" else 0.0)) * k for i, kind in enumerate(problem.kinds))
        return need / (problem.pp * problem.mem_limit)

    def _layer_sums(self, tp: int, dp: int, zero: int, link: str, sync: GradSync, terms: Terms | None = None
                    ) -> dict:
        """Per-layer state and sync sums, memoised on the shared Terms per EP layout (a MoE candidate's EP
        terms differ; not its CP degree or EP link)."""
        terms = terms if terms is not None and terms.model.moe is not None else self.terms
        # EP terms (cost_ep._EPMixin): their layout and expert-data-parallel links
        layout = (terms.ep, terms.expert_tp, terms.edp_link) if hasattr(terms, "ep") else ()
        key = ("sums", tp, dp, zero, link, sync, layout)
        if key not in self.terms.memo:  # per EP layout; the same for every CP degree and EP link
            state, opt, dps, gather, reduce = terms.per_layer(tp, dp, zero, link, sync)
            kinds = self.quick.kinds
            blocks = [i for i, k in enumerate(kinds) if k == "block"]
            self.terms.memo[key] = dict(
                state=sum(state), opt=sum(opt), dp=sum(dps), gather=sum(gather), reduce=sum(reduce),
                block_state=sum(state[i] for i in blocks),
                block_state_min=min((state[i] for i in blocks), default=0.0),
                ends=[(i, state[i], k) for i, k in enumerate(kinds) if k != "block"],
                state_bytes=state_bytes(self.profile, self.c.dtype, zero, dp, sync.full_grads),
                tied_bytes=sum(state_bytes(self.profile, self.c.dtype, zero, dp, sync.full_grads, False)),
                workspace=gather_workspace(self.model, tp, self.c.dtype))
        return self.terms.memo[key]

    def _ranks(self, pp: int, schedule: str, v: int) -> list[int]:
        key = ("ranks", pp, schedule, v)
        if key not in self.terms.memo:
            self.terms.memo[key] = [stage_rank(k, pp, schedule, v) for k in range(pp * v)]
        return self.terms.memo[key]

    def _moments(self, schedule: str, pp: int, v: int, m: int) -> list[tuple[tuple[float, float], ...]]:
        key = ("moments", schedule, pp, v, m)
        if key not in self.terms.memo:
            self.terms.memo[key] = [grad_moments(schedule, pp, v, m, r) for r in range(pp)]
        return self.terms.memo[key]

    def _inflight(self, schedule: str, pp: int, v: int, m: int) -> list[float]:
        key = ("inflight", schedule, pp, v, m)
        if key not in self.terms.memo:
            self.terms.memo[key] = [in_flight(schedule, pp, v, m, r) for r in range(pp)]
        return self.terms.memo[key]

    def run(self, keep: int, progress: Progress | None = None) -> list[Scored]:
        """The `keep` best distinct plans by reported time, as solving every candidate would rank them
        (ties to the earlier candidate), then the other solved candidates (these may carry their
        closed-form time)."""
        queue = self._queue()
        board = _Board(keep)
        # Best-first on the bounds: a candidate comes out first under its reported-time bound, goes back
        # under its refined bound, and is solved when that is still the least bound left; so candidates
        # are solved in order of refined bound, which finds the best plans early and ends the search as
        # soon as the least bound left cannot enter the ranking.
        heap = [(reported, index, False, cand) for reported, index, cand in queue]  # already sorted: a heap
        done = 0
        while heap:
            bound, index, refined, cand = heapq.heappop(heap)
            if bound > board.kth * TOLERANCE:
                break  # no candidate left can enter the ranking
            if not refined:
                if progress is not None:
                    progress(done, len(queue))
                done += 1
                sharper = self.refined_bound(cand)
                self.refined_bounds[cand] = sharper
                if sharper > bound:
                    heapq.heappush(heap, (sharper, index, True, cand))
                    continue
            problem = self.problem(cand)
            solution = self.partition.solve(problem)
            if solution is None:
                self.memory_pruned.append((1.0, index, cand))
                continue
            self.feasible += 1
            scored, ranked = self.score(cand, problem, solution, index, board.kth)
            board.add(plan_key(parallel_config(self, scored), cand.order), scored, ranked)
            if ranked:
                self.ranked_times[cand] = scored.time
        if progress is not None:
            progress(len(queue), len(queue))
        return board.results()

    def _queue(self) -> list[tuple[float, int, Candidate]]:
        """(reported-time bound, index, candidate) of every candidate that may fit, by bound; the others
        go to `memory_pruned` (their demand is computed only for exit 3) and to `bounds_seen` without a
        time bound once a candidate of the same `memory_key` was found not to fit."""
        queue = []
        unfit: dict[tuple, float] = {}  # memory_key -> memory bound of candidates that cannot fit
        for index, cand in enumerate(candidates(self.model, self.cluster, self.c, self.placer)):
            self.considered += 1
            key = memory_key(cand)
            if key in unfit:  # most candidates of a large MoE search: skip their time bounds
                self.bounds_seen.append((None, unfit[key], cand))
                self.memory_pruned.append((None, index, cand))
                continue
            parts = self._bounds(cand)
            reported = self._reported(cand, parts)
            self.bounds_seen.append((reported, parts.ratio * parts.limit, cand))
            if parts.ratio > 1.0:
                unfit[key] = parts.ratio * parts.limit
                self.memory_pruned.append((None, index, cand))
                continue
            queue.append((reported, index, cand))
        queue.sort(key=lambda item: (item[0], item[1]))
        return queue

    def score(self, cand: Candidate, problem: StageProblem, solution: Solution, index: int,
              limit: float = math.inf) -> tuple[Scored, bool]:
        """The solved candidate with its reported time, and whether that is what it holds. A pipeline is
        simulated, and then polished when within POLISH_WITHIN of `limit`, unless its partition's
        simulation cannot come within that (evaluation_lower_bound): then it keeps its closed-form time
        and cannot enter the ranking."""
        time, ranked = solution.objective, True
        if cand.pp > 1:
            solution = self._even_if_faster(cand, problem, solution)
            ev = solution.evaluation or evaluate(problem, solution.bounds, solution.recompute)
            ranked = self._quick_bound(cand, ev) <= limit * POLISH_WITHIN
            if ranked:
                time = self.shared_time(cand, ev)
                if time <= limit * POLISH_WITHIN:
                    solution, time = self._polished(cand, problem, solution, ev, time)
        return Scored(cand, problem, solution, index, time), ranked

    def _polished(self, cand: Candidate, problem: StageProblem, solution: Solution, ev: Evaluation,
                  time: float) -> tuple[Solution, float]:
        """The partition the local search on the simulated time reaches from the ILP's (planner/polish.py),
        with its simulated time."""
        key = (problem.key(), tuple(solution.bounds), tuple(solution.recompute), cand.schedule, cand.pp, cand.v,
               cand.m, cand.dp * cand.cp * cand.tp)
        if key not in self.polished:  # candidates differing only where the problem does not (ZeRO 1 and 2)
            self.polished[key] = polish(problem, solution.bounds, solution.recompute, ev, time,
                                        lambda e: self.shared_time(cand, e), lambda e: self._quick_bound(cand, e))
        bounds, recompute, ev, time, _ = self.polished[key]
        if bounds is solution.bounds and recompute is solution.recompute:
            return solution, time
        return Solution(bounds, recompute, ev.iteration_time, ev), time

    def _quick_bound(self, cand: Candidate, ev: Evaluation) -> float:
        """A lower bound on the reported time of this partition without simulating it (0 on shared CPU
        cores, where processor sharing can make the simulation shorter than the stages' own times)."""
        return evaluation_lower_bound(ev, cand.schedule, cand.pp, cand.v, cand.m) if self.rate is None else 0.0

    def _even_if_faster(self, cand: Candidate, problem: StageProblem, solution: Solution) -> Solution:
        """The ILP balances each rank's total work, which the schedule's simulation does not always
        reward: with interleaved stages a stage holding two blocks while another holds the head alone
        delays every micro-batch that passes it. Megatron-LM's even split (blocks evenly over stages,
        embedding with the first, head with the last) is simulated too, and kept when it fits and is
        faster."""
        if cand.v == 1:  # one stage per rank: balancing the ranks is balancing the stages
            return solution
        bounds = even_bounds(problem)
        if bounds is None or bounds == solution.bounds:
            return solution
        if problem.recompute == "all":
            recompute = [sum(k == "block" for k in problem.kinds[a:b]) for a, b in zip(bounds, bounds[1:])]
        elif any(solution.recompute):
            return solution
        else:
            recompute = [0] * len(bounds[:-1])
        ev = evaluate(problem, bounds, recompute)
        if not ev.feasible:
            return solution
        mine = solution.evaluation or evaluate(problem, solution.bounds, solution.recompute)
        if self.shared_time(cand, ev) < self.shared_time(cand, mine) * (1 - 1e-9):
            return Solution(bounds, recompute, solution.objective, ev)
        return solution

    def speedup(self, cand: Candidate) -> float:
        """How much below its `bounds` lower bound a candidate's prediction can fall on shared CPU cores
        (>= 1; bound / speedup stays a lower bound): the simulated schedule takes at least the busiest
        rank's m micro-batches, at most rate(dp·tp) faster, where the bound also counts up to pp − 1
        bubble micro-batches."""
        if self.rate is None or cand.pp == 1:
            return 1.0
        return max(1.0, self.rate(cand.dp * cand.cp * cand.tp)) * (cand.m + cand.pp - 1) / cand.m

    def iteration_time(self, cand: Candidate, problem: StageProblem, solution: Solution) -> float:
        """The predicted iteration seconds of a solution's own partition: the closed form without a
        pipeline, else its pipeline part simulated (with processor sharing on CPU ranks that outnumber the
        cores). The search reports the partition `score` reaches from it (planner/polish.py)."""
        if cand.pp == 1:
            return solution.objective
        return self.shared_time(cand, evaluate(problem, solution.bounds, solution.recompute))

    def shared_time(self, cand: Candidate, ev: Evaluation) -> float:
        """An evaluation's iteration seconds with processor sharing applied (unchanged without it)."""
        return shared_iteration_time(ev, cand.schedule, cand.pp, cand.v, cand.m, cand.dp * cand.cp * cand.tp,
                                     self.rate)

    def nearest(self, limit: int = 4) -> tuple[Candidate, StageProblem, Solution] | None:
        """The candidate closest to fitting: the few with the best memory bounds, each solved for the
        least memory over the limit."""
        best = None
        seen = set()
        pruned = [(self.demand(cand) if demand is None else demand, index, cand)
                  for demand, index, cand in self.memory_pruned]
        for _, _, cand in sorted(pruned, key=lambda t: (t[0], t[1])):
            if cand.recompute == "none" and not cand.recompute_pinned and self.c.recompute is None:
                cand = _replace(cand, recompute="full")
            if cand in seen:
                continue
            seen.add(cand)
            if len(seen) > limit:
                break
            problem = self.problem(cand)
            sol = self.partition.min_memory(problem)
            if sol is not None and (best is None or sol.objective < best[2].objective):
                best = (cand, problem, sol)
        return best


def even_bounds(problem: StageProblem) -> list[int] | None:
    """Stage bounds with the blocks spread evenly (planner/stage_split.py "even"); None unless every cut is
    allowed."""
    return split_bounds(problem.kinds, problem.num_stages, "even") if all(problem.cuts[1:]) else None


def least_bottleneck(blocks: int, block_time: float, fixed: list[float], room: list[float], block_bytes: list[float],
                     saving: list[float], rec_time: float, mode: str) -> float:
    """Least time per micro-batch of the busiest rank over whole-block partitions (inf: they cannot fit).
    Rank r holding n blocks takes fixed[r] + n·block_time + ρ·rec_time, ρ the fewest recomputed blocks
    that fit its memory, n·block_bytes[r] − ρ·saving[r] ≤ room[r] (mode none: ρ = 0; all: ρ = n). Both
    are lower bounds of the rank's time and memory in `evaluate` (ZeRO-3 gathers and the step's
    transients left out), so every feasible partition has a rank at least this busy. Each rank's time
    grows with n, so giving blocks one at a time to the rank whose next block costs least is optimal
    for the min-max (the result is the blocks-th smallest of the ranks' merged increasing sequences)."""
    def cost(r: int, n: int) -> float:
        if mode == "free" and saving[r] > 0:  # rounding can only lower ρ: still a lower bound
            rec = max(0, math.ceil((n * block_bytes[r] - room[r]) / saving[r] - 1e-9))
            fits = rec <= n
        else:
            rec = n if mode == "all" else 0
            fits = n * block_bytes[r] - rec * saving[r] <= room[r]
        return fixed[r] + n * block_time + rec * rec_time if fits else math.inf

    worst = max(fixed)
    heap = [(cost(r, 1), r) for r in range(len(fixed))]
    heapq.heapify(heap)
    held = [0] * len(fixed)
    for _ in range(blocks):
        value, r = heapq.heappop(heap)
        if value == math.inf:
            return math.inf
        worst = max(worst, value)
        held[r] += 1
        heapq.heappush(heap, (cost(r, held[r] + 1), r))
    return worst


class _Quick:
    """Per-kind layer counts of the model, for `Search.bounds`."""

    def __init__(self, model: ModelSpec):
        self.kinds = [layer.kind for layer in model.layers]
        self.counts: dict[str, int] = {}
        for k in self.kinds:
            self.counts[k] = self.counts.get(k, 0) + 1
        self.num_layers = len(self.kinds)
        self.first_block = self.kinds.index("block") if "block" in self.kinds else 1
        self.tied = sum(layer.tied_params for layer in model.layers if layer.kind == "head")


def _replace(cand: Candidate, **kw) -> Candidate:
    from dataclasses import replace

    return replace(cand, **kw)


def find_plan(model: ModelSpec, cluster: ClusterSpec, constraints: Constraints, profile=None,
              progress: Progress | None = None, solver: str | None = None, force_assignment: bool = False,
              considered: list[tuple[float, float, str]] | None = None) -> Plan:
    """The plan with the least predicted iteration time that fits every device (exit 3 otherwise).
    `solver`: "HiGHS" or "CBC" (default: HiGHS when highspy is installed); `force_assignment`: use the
    binary layer → stage ILP even where the per-rank count ILP is exact (identical blocks).
    `considered`, when given, receives (time, peak memory, label) of every candidate: the exact prediction
    for those the ILP solved, the lower bounds for those pruned before solving."""
    if profile is None:
        from meshplan.profiler.source import profile_for

        profile = profile_for(model, cluster, constraints.dtype)
    from meshplan.planner import ilp

    limited = ilp.TIME_LIMITED[0]
    start = time.perf_counter()
    search = Search(model, cluster, constraints, profile, solver, force_assignment)
    results = search.run(1 + constraints.top_k, progress)
    seconds = time.perf_counter() - start
    if considered is not None:
        solved = {r.cand: r for r in results}
        for bound, memory, cand in search.bounds_seen:
            if bound is None:  # pruned with others of its memory_key before its time bound was computed
                bound = search.reported_bound(cand)
            if cand in solved:
                r = solved[cand]
                ev = evaluate(r.problem, r.solution.bounds, r.solution.recompute)
                bound, memory = r.time, max(ev.rank_memory)
            considered.append((bound, memory, describe(cand)))
    if not search.considered:
        pins = [f"--{k.replace('_', '-')} {v}" for k, v in (
            ("dp", constraints.dp), ("tp", constraints.tp), ("pp", constraints.pp), ("cp", constraints.cp),
            ("cp_mode", constraints.cp_mode), ("ep", constraints.ep), ("expert_tp", constraints.expert_tp),
            ("micro_batch_size", constraints.micro_batch_size), ("schedule", constraints.schedule),
            ("virtual_stages", constraints.virtual_stages)) if v is not None]
        raise InputError(f"{'/'.join(p.split()[0] for p in pins) or 'constraints'}: no parallel configuration of "
                         f"{model.name} on {cluster.name} satisfies {' '.join(pins) or 'the constraints'} with global "
                         f"batch {constraints.global_batch_size} (zero-bubble runs as ZB-V with 2 virtual stages, "
                         "1f1b and zero-bubble need at least pp micro-batches, interleaved-1f1b a multiple of pp)")
    if not results:
        raise InfeasibleError(infeasible_message(search))
    stats = SearchStats(candidates=search.considered, feasible=search.feasible, seconds=round(seconds, 4),
                        solver=f"{search.partition.solver} via PuLP ({search.partition.solves} ILPs, "
                               f"{search.partition.hits} cache hits"
                               + (f", {ilp.TIME_LIMITED[0] - limited} stopped at the {ilp.TIME_LIMIT_S:.0f} s limit"
                                  if ilp.TIME_LIMITED[0] > limited else "") + ")",
                        software=getattr(getattr(profile, "roofline", None), "software", ""),
                        stage_split=constraints.split)
    plan = to_plan(search, results, stats)
    from meshplan.planner.cp_report import cp_choice_notes

    plan.cp_notes = cp_choice_notes(search, plan)  # for the CLI summary (not part of the plan JSON)
    return plan
