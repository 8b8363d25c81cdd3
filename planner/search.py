"""The search: enumerate the small outer space, bound, and solve the stage ILP only where it can win.

Outer space: tp (divides heads, kv heads and a node), pp, dp = world/(tp·pp), micro-batch size b
(m = global/(dp·b)), schedule and virtual stages, ZeRO level, recompute mode and mesh placement. Every
candidate gets a lower bound on its iteration time (planner/cost_model.py `lower_bound`) and a memory
lower bound; candidates are solved in order of their bound and the search stops once the bound reaches
the k-th best solved plan — so the result is the optimum over the whole space under the cost model
(tests/test_search.py checks it against brute force), while only a few ILPs are solved.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from meshplan.planner.cluster_spec import ClusterSpec
from meshplan.planner.constraints import Constraints
from meshplan.planner.cost_model import (
    Candidate,
    Evaluation,
    GradSync,
    StageProblem,
    Terms,
    bubble_micro_batches,
    build_problem,
    crossings,
    evaluate,
    fixed_bytes,
    gather_workspace,
    grad_sync,
    grads_idle,
    in_flight,
    least_recompute,
    model_flops_per_iteration,
    pipeline_stage_split,
    root_hook_time,
    state_bytes_per_param,
    state_kept,
    step_sync_time,
    unfused_share,
    unhidden_share,
    zb_ratio,
)
from meshplan.planner.errors import InfeasibleError, InputError
from meshplan.planner.ilp import PartitionSolver, Solution
from meshplan.planner.model_spec import ModelSpec
from meshplan.planner.placement import Placer, allowed_cuts, model_graph
from meshplan.planner.plan import (
    Alternative,
    ParallelConfig,
    Placement,
    Plan,
    Predicted,
    SearchStats,
    StagePlan,
    stage_rank,
)
from meshplan.planner.report import human_bytes
from meshplan.planner.shared_cores import relative_rate, shared_iteration_time

Progress = Callable[[int, int], None]
MAX_VIRTUAL_STAGES = 8
RESCORE_WITHIN = 1.2  # closed-form candidates this close to the best get their schedules simulated
RESCORE_MAX = 24


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


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def schedules(pp: int, m: int, num_layers: int, constraints: Constraints) -> Iterator[tuple[str, int]]:
    """(schedule, virtual stages) that torch.distributed.pipelining can run for this pp and m.
    zero-bubble is emitted only as ZB-V (v = 2, V-shaped placement, ScheduleZBVZeroBubble) to keep the
    executor's mapping simple; Schedule1F1B and ZBV need m ≥ pp; interleaved needs m % pp == 0."""
    pin_s, pin_v = constraints.schedule, constraints.virtual_stages
    if pp == 1:
        options = [("1f1b", 1), ("gpipe", 1)] if pin_s in (None, "1f1b", "gpipe") else []
        for name, v in options:
            if (pin_s is None and name == "1f1b" or pin_s == name) and pin_v in (None, 1):
                yield name, v
        return
    if pin_v in (None, 1):
        if pin_s in (None, "gpipe"):
            yield "gpipe", 1
        if pin_s in (None, "1f1b") and m >= pp:
            yield "1f1b", 1
    if pin_s in (None, "interleaved-1f1b") and m % pp == 0:
        vs = [pin_v] if pin_v is not None else range(2, MAX_VIRTUAL_STAGES + 1)
        for v in vs:
            if v >= 2 and pp * v <= num_layers:
                yield "interleaved-1f1b", v
    if pin_s in (None, "zero-bubble") and pin_v in (None, 2) and m >= pp and 2 * pp <= num_layers:
        yield "zero-bubble", 2


def candidates(model: ModelSpec, cluster: ClusterSpec, constraints: Constraints,
               placer: Placer) -> Iterator[Candidate]:
    """Every outer candidate that satisfies the pins, simplest first within each mesh shape."""
    world, gbs, c = cluster.world_size, constraints.global_batch_size, constraints
    n_layers = len(model.layers)
    for tp in divisors(world):
        if (c.tp is not None and tp != c.tp) or cluster.devices_per_node % tp or model.num_heads % tp \
                or model.num_kv_heads % tp or model.ffn_hidden_size % tp or c.effective_seq_len(model) % tp:
            continue  # the executor shards heads and the MLP by tp and the sequence (sequence parallel) too
        for pp in divisors(world // tp):
            if (c.pp is not None and pp != c.pp) or pp > n_layers:
                continue
            dp = world // (tp * pp)
            if (c.dp is not None and dp != c.dp) or gbs % dp:
                continue
            for b in divisors(gbs // dp):
                if c.micro_batch_size is not None and b != c.micro_batch_size:
                    continue
                m = gbs // (dp * b)
                for schedule, v in schedules(pp, m, n_layers, c):
                    for zero in ([c.zero] if c.zero is not None else range(4 if dp > 1 else 1)):
                        if schedule == "zero-bubble" and zero == 3:
                            continue  # the executor refuses it: FSDP2 resharding breaks the split backward
                        if c.recompute is not None:
                            modes = [(c.recompute, c.recompute != "none")]
                        else:
                            modes = [("none", False), ("selective", False), ("full", False)]
                        for mode, pinned in modes:
                            for order in placer.orders(pp, dp, tp):
                                yield Candidate(dp=dp, tp=tp, pp=pp, v=v, schedule=schedule, b=b, m=m, zero=zero,
                                                recompute=mode, recompute_pinned=pinned, order=order)


class Search:
    """One search: the candidate list, bounds, the partition solver and the results."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, constraints: Constraints, profile,
                 solver: str | None = None, force_assignment: bool = False):
        self.model, self.cluster, self.c, self.profile = model, cluster, constraints, profile
        self.seq = constraints.effective_seq_len(model)
        self.mem_limit = cluster.device.memory_bytes * (1 - constraints.memory_margin)
        self.placer = Placer(cluster)
        self.cuts = allowed_cuts(model_graph(model))
        self.terms = Terms(model, profile, self.seq, constraints.dtype)
        self.partition = PartitionSolver(solver, force_assignment)
        self.considered = 0
        self.feasible = 0
        self.memory_pruned: list[tuple[float, int, Candidate]] = []
        # (time lower bound, memory lower bound, candidate) of everything considered, for `--pareto`.
        self.bounds_seen: list[tuple[float, float, Candidate]] = []
        self.quick = _Quick(model)
        self.rate = relative_rate(profile)  # None unless CPU ranks outnumbered the cores when profiled
        self.max_speedup = max(1.0, self.rate(1)) * cluster.world_size if self.rate is not None else 1.0

    def problem(self, cand: Candidate) -> StageProblem:
        links = self.placer.links(cand.pp, cand.dp, cand.tp, cand.order)
        return build_problem(self.model, self.profile, cand, self.seq, self.c.dtype, links, self.mem_limit,
                             self.cuts, self.terms)

    def bounds(self, cand: Candidate) -> tuple[float, float]:
        """(lower_bound, memory_lower_bound) of the candidate's problem, from per-kind sums without
        building it (thousands of candidates; tests check it equals the per-layer computation)."""
        q = self.quick
        links = self.placer.links(cand.pp, cand.dp, cand.tp, cand.order)
        b, tp, S, pp = cand.b, cand.tp, cand.num_stages, cand.pp
        rows = {k: self.terms.kind(k, b, tp, cand.schedule) for k in q.counts}
        fsum = sum(n * rows[k][0] for k, n in q.counts.items())
        gsum = sum(n * rows[k][1] for k, n in q.counts.items())
        tsum = sum(n * (rows[k][0] + rows[k][1] + rows[k][2]) for k, n in q.counts.items())
        tmax = max(rows[k][0] + rows[k][1] + rows[k][2] for k in q.counts)
        agg = self._layer_sums(tp, cand.dp, cand.zero, links.dp, grad_sync(cand))
        rank = self._ranks(pp, cand.schedule, cand.v)
        hop = self.terms.hop(b, tp, links.pp) if pp > 1 else 0.0
        pipe = 0.0
        for k in range(S):  # build_problem's boundary less its relief, as cost_model.lower_bound sums it
            t, relief, _ = pipeline_stage_split(self.profile, hop, crossings(rank, k), cand.schedule,
                                                unfused_share(cand.schedule, pp, cand.m, rank[k]), b)
            pipe += t - relief
        unhidden = unhidden_share(self.profile, cand.dp, cand.zero, q.num_layers, S)
        z3 = max(agg["gather"] - fsum - gsum, unhidden * agg["gather"]) if agg["gather"] > 0 else 0.0
        work = tsum + pipe + z3 + S * root_hook_time(self.profile, cand.dp, cand.zero)
        rec_time, rec_saving, _ = self.terms.recompute(b, tp, cand.recompute)
        recompute = "none" if cand.recompute == "none" else ("all" if cand.recompute_pinned else "free")
        inflight = self._inflight(cand.schedule, pp, cand.v, cand.m)
        fixed = fixed_bytes(pp, rank, q.tied / tp * sum(agg["state_bytes"]),
                            agg["workspace"] if cand.zero >= 3 and cand.dp > 1 else 0.0)
        left = [self.mem_limit - f for f in fixed]
        kept = state_kept(grads_idle(agg["state_bytes"], cand.m, inflight))
        block_state = agg["block_state_min"] * kept
        for i, params_state, kind in agg["ends"]:
            r = rank[0] if i < q.first_block else rank[-1]
            left[r] -= params_state * kept + inflight[r] * rows[kind][3]
        blocks = q.counts.get("block", 0)
        act_blk = rows["block"][3] if blocks else 0.0
        if min(left) < 0:
            ratio = 2.0 + max(-x for x in left) / self.mem_limit
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
        tail = (agg["opt"] + max(agg["dp"] - gsum, unhidden * agg["dp"])) / pp + \
            step_sync_time(self.profile, cand.dp * tp * pp, links)
        return (cand.m + bubble) * tau + tail, ratio

    def demand(self, cand: Candidate) -> float:
        """Average memory a rank needs at best (maximum recompute, perfect balance) over the usable
        memory: how far a pruned candidate is from fitting, to pick the nearest one for exit 3."""
        problem = self.problem(cand)
        saving = problem.rec_saving if problem.recompute != "none" else 0.0
        k = min(problem.inflight)
        need = sum(problem.fixed) + sum(problem.state) + sum(
            (problem.act[i] - (saving if kind == "block" else 0.0)) * k for i, kind in enumerate(problem.kinds))
        return need / (problem.pp * self.mem_limit)

    def _layer_sums(self, tp: int, dp: int, zero: int, link: str, sync: GradSync) -> dict:
        key = ("sums", tp, dp, zero, link, sync)
        if key not in self.terms.memo:
            state, opt, dps, gather = self.terms.per_layer(tp, dp, zero, link, sync)
            kinds = self.quick.kinds
            blocks = [i for i, k in enumerate(kinds) if k == "block"]
            self.terms.memo[key] = dict(
                state=sum(state), opt=sum(opt), dp=sum(dps), gather=sum(gather),
                block_state=sum(state[i] for i in blocks),
                block_state_min=min((state[i] for i in blocks), default=0.0),
                ends=[(i, state[i], k) for i, k in enumerate(kinds) if k != "block"],
                state_bytes=state_bytes_per_param(self.c.dtype, zero, dp, sync.full_grads),
                workspace=gather_workspace(self.model, tp, self.c.dtype))
        return self.terms.memo[key]

    def _ranks(self, pp: int, schedule: str, v: int) -> list[int]:
        key = ("ranks", pp, schedule, v)
        if key not in self.terms.memo:
            self.terms.memo[key] = [stage_rank(k, pp, schedule, v) for k in range(pp * v)]
        return self.terms.memo[key]

    def _inflight(self, schedule: str, pp: int, v: int, m: int) -> list[float]:
        key = ("inflight", schedule, pp, v, m)
        if key not in self.terms.memo:
            self.terms.memo[key] = [in_flight(schedule, pp, v, m, r) for r in range(pp)]
        return self.terms.memo[key]

    def run(self, keep: int, progress: Progress | None = None) -> list[Scored]:
        bounded: list[tuple[float, int, Candidate]] = []
        for index, cand in enumerate(candidates(self.model, self.cluster, self.c, self.placer)):
            self.considered += 1
            bound, ratio = self.bounds(cand)
            self.bounds_seen.append((bound, ratio * self.mem_limit, cand))
            if ratio > 1.0:
                self.memory_pruned.append((self.demand(cand), index, cand))
                continue
            bounded.append((bound, index, cand))
        bounded.sort(key=lambda item: (item[0], item[1]))
        results: list[Scored] = []
        solved_none: dict[Candidate, bool] = {}
        for done, (bound, index, cand) in enumerate(bounded):
            if progress is not None:
                progress(done, len(bounded))
            if len(results) >= keep:
                limit = results[keep - 1].time * (1 + 1e-12)
                if bound > limit * self.max_speedup:
                    break  # sorted bounds: no later candidate can do better
                if bound > limit * self.speedup(cand):
                    continue
            problem = self.problem(cand)
            if cand.recompute != "none" and not cand.recompute_pinned:
                # With free recompute counts the optimum is the no-recompute one whenever that fits.
                sibling = _replace(cand, recompute="none")
                if sibling not in solved_none:
                    solved_none[sibling] = self.partition.solve(self.problem(sibling)) is not None
                if solved_none[sibling]:
                    continue
            solution = self.partition.solve(problem)
            if cand.recompute == "none":
                solved_none[cand] = solution is not None
            if solution is None:
                self.memory_pruned.append((1.0, index, cand))
                continue
            self.feasible += 1
            results.append(Scored(cand, problem, solution, index, self.iteration_time(cand, problem, solution)))
            results.sort(key=lambda r: (r.time, r.index))
        if progress is not None:
            progress(len(bounded), len(bounded))
        return self.rescore(results, keep) if self.rate is None else results

    def rescore(self, results: list[Scored], keep: int) -> list[Scored]:
        """Re-rank the closed form's best by simulating their pipeline schedules (planner/shared_cores.py:
        the closed form charges every micro-batch the slowest rank's time, which misjudges unequal chunks
        of interleaved schedules). Simulating costs up to 0.3 s a candidate at pp=16, m=512, so only the
        `keep` best and those within RESCORE_WITHIN of the best, at most RESCORE_MAX, are simulated; they
        come first, re-sorted, and the rest follow with their closed-form times."""
        if not results:
            return results
        near = sum(1 for r in results if r.time <= results[0].time * RESCORE_WITHIN)
        count = min(len(results), max(keep, min(near, RESCORE_MAX)))
        head = [replace(r, time=self.shared_time(r.cand, evaluate(r.problem, r.solution.bounds, r.solution.recompute)))
                if r.cand.pp > 1 else r for r in results[:count]]
        return sorted(head, key=lambda r: (r.time, r.index)) + results[count:]

    def speedup(self, cand: Candidate) -> float:
        """How much below its `bounds` lower bound a candidate's prediction can fall on shared CPU cores
        (>= 1; bound / speedup stays a lower bound): the simulated schedule takes at least the busiest
        rank's m micro-batches, at most rate(dp·tp) faster, where the bound also counts up to pp − 1
        bubble micro-batches."""
        if self.rate is None or cand.pp == 1:
            return 1.0
        return max(1.0, self.rate(cand.dp * cand.tp)) * (cand.m + cand.pp - 1) / cand.m

    def iteration_time(self, cand: Candidate, problem: StageProblem, solution: Solution) -> float:
        """The predicted iteration seconds of a solved candidate: the closed form, or on CPU ranks that
        outnumber the cores, its pipeline part simulated with processor sharing."""
        if self.rate is None or cand.pp == 1:
            return solution.objective
        return self.shared_time(cand, evaluate(problem, solution.bounds, solution.recompute))

    def shared_time(self, cand: Candidate, ev: Evaluation) -> float:
        """An evaluation's iteration seconds with processor sharing applied (unchanged without it)."""
        return shared_iteration_time(ev, cand.schedule, cand.pp, cand.v, cand.m, cand.dp * cand.tp, self.rate)

    def nearest(self, limit: int = 4) -> tuple[Candidate, StageProblem, Solution] | None:
        """The candidate closest to fitting: the few with the best memory bounds, each solved for the
        least memory over the limit."""
        best = None
        seen = set()
        for _, _, cand in sorted(self.memory_pruned, key=lambda t: (t[0], t[1])):
            if cand.recompute == "none" and not cand.recompute_pinned:
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
            if cand in solved:
                r = solved[cand]
                ev = evaluate(r.problem, r.solution.bounds, r.solution.recompute)
                bound, memory = r.time, max(ev.rank_memory)
            considered.append((bound, memory, describe(cand)))
    if not search.considered:
        pins = [f"--{k.replace('_', '-')} {v}" for k, v in (
            ("dp", constraints.dp), ("tp", constraints.tp), ("pp", constraints.pp),
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
                                  if ilp.TIME_LIMITED[0] > limited else "") + ")")
    return to_plan(search, results, stats)


def describe(cand: Candidate) -> str:
    v = f" v={cand.v}" if cand.v > 1 else ""
    return (f"pp={cand.pp} dp={cand.dp} tp={cand.tp} zero={cand.zero} {cand.schedule}{v} "
            f"b={cand.b} m={cand.m} recompute={cand.recompute}")


def infeasible_message(search: Search) -> str:
    """Exit 3: the nearest candidate, by how much it exceeds memory where, and what would make it fit."""
    usable = search.mem_limit
    near = search.nearest()
    c, dev = search.c, search.cluster.device
    state = sum(layer.params for layer in search.model.layers) * 16.0
    need_devices = int(-(-state // usable))
    hints = []
    if c.zero is not None and c.zero < 3:
        hints.append("--zero 3 (shard parameters, gradients and optimizer over dp)")
    if c.recompute in ("none", "selective"):
        hints.append("--recompute full")
    if c.micro_batch_size is not None and c.micro_batch_size > 1:
        hints.append("a smaller --micro-batch-size")
    for flag, value in (("--tp", c.tp), ("--pp", c.pp), ("--dp", c.dp)):
        if value is not None:
            hints.append(f"dropping {flag} {value}")
    if c.memory_margin > 0.05:
        hints.append(f"a smaller --memory-margin than {c.memory_margin}")
    hints.append(f"more devices (model state alone is {human_bytes(state)} at 16 B/param: at least "
                 f"{need_devices} devices of {human_bytes(dev.memory_bytes)} with ZeRO-3)")
    tried = [name for name, pin in (("ZeRO level", c.zero), ("recompute mode", c.recompute),
                                    ("micro-batch size", c.micro_batch_size)) if pin is None]
    fit = "; to fit try " + ", ".join(hints) + (f" (every {', '.join(tried)} was tried)" if tried else "")
    if near is None:
        return (f"no feasible plan: no parallel configuration of {search.model.name} on {search.cluster.name} "
                f"satisfies the constraints (searched {search.considered} candidates){fit}")
    cand, problem, sol = near
    ev = evaluate(problem, sol.bounds, sol.recompute)
    worst = max(range(len(ev.rank_memory)), key=lambda r: ev.rank_memory[r])
    stages = [s for s, r in enumerate(problem.rank) if r == worst]
    over = ev.rank_memory[worst] - usable
    need, limit = human_bytes(ev.rank_memory[worst]), human_bytes(dev.memory_bytes)
    return (f"no plan fits in memory: the nearest ({describe(cand)}) needs {need} on "
            f"pipeline rank {worst} (stage {', '.join(map(str, stages))}), {human_bytes(over)} ({int(over)} bytes) "
            f"over the {human_bytes(usable)} usable per device ({limit} less the {c.memory_margin:.0%} "
            f"margin){fit}")




def _predicted(search: Search, scored: Scored, ev: Evaluation) -> Predicted:
    cand = scored.cand
    seconds = scored.time
    tokens = search.c.global_batch_size * search.seq
    flops = model_flops_per_iteration(search.model, search.c.global_batch_size, search.seq)
    peak = search.cluster.device.peak_flops[search.c.dtype] * cand.dp * cand.tp * cand.pp
    bubble = scored.problem.bubble
    return Predicted(
        iteration_time_s=seconds, tokens_per_s=tokens / seconds,
        bubble_fraction=bubble / (scored.problem.m + bubble), peak_memory_bytes=max(ev.rank_memory),
        mfu=flops / (seconds * peak))


def _parallel(search: Search, scored: Scored) -> ParallelConfig:
    cand = scored.cand
    mode = cand.recompute if any(scored.solution.recompute) or cand.recompute_pinned else "none"
    return ParallelConfig(
        dp=cand.dp, tp=cand.tp, pp=cand.pp, virtual_stages=cand.v, zero=cand.zero, schedule=cand.schedule,
        micro_batch_size=cand.b, num_micro_batches=cand.m, global_batch_size=search.c.global_batch_size,
        seq_len=search.seq, recompute=mode, dtype=search.c.dtype, sequence_parallel=cand.tp > 1)


def to_plan(search: Search, results: list[Scored], stats: SearchStats) -> Plan:
    best = results[0]
    cand, sol = best.cand, best.solution
    pb, gb, ob = state_bytes_per_param(search.c.dtype, cand.zero, cand.dp, grad_sync(cand).full_grads)
    total = pb + gb + ob
    ev = evaluate(best.problem, sol.bounds, sol.recompute, (pb / total, gb / total, ob / total))
    stages, m = [], cand.m
    for s, res in enumerate(ev.stages):
        stages.append(StagePlan(
            stage=s, pp_rank=best.problem.rank[s], layers=[sol.bounds[s], sol.bounds[s + 1]],
            recompute_layers=sol.recompute[s],
            # Seconds per iteration on the stage (its m micro-batches; plan show divides by m): busy time
            # without the bubble; dp_sync (exposed) and optimizer are the rank's once-per-iteration tail.
            predicted_time_s={"forward": m * res.forward, "backward": m * res.backward,
                              "recompute": m * res.recompute, "communication": m * res.communication,
                              "total": m * res.total, "dp_sync": res.dp_sync, "optimizer": res.optimizer},
            predicted_memory_bytes={"parameters": res.parameters, "gradients": res.gradients,
                                    "optimizer": res.optimizer_state, "activations": res.activations,
                                    "workspace": res.workspace, "total": res.memory_total}))
    alternatives, seen = [], {_key(_parallel(search, best), best.cand.order)}
    for other in results[1:]:
        par = _parallel(search, other)
        if _key(par, other.cand.order) in seen:
            continue
        seen.add(_key(par, other.cand.order))
        oev = evaluate(other.problem, other.solution.bounds, other.solution.recompute)
        note = f"{(other.time / best.time - 1):+.1%} time"
        if other.cand.order != cand.order:
            note += f", mesh order {'/'.join(other.cand.order)}"
        alternatives.append(Alternative(par, _predicted(search, other, oev), note))
    placement = search.placer.place(cand.pp, cand.dp, cand.tp, cand.order)
    return Plan(model=search.model, cluster=search.cluster, parallel=_parallel(search, best), stages=stages,
                predicted=_predicted(search, best, ev), alternatives=alternatives[:search.c.top_k], search=stats,
                placement=Placement(list(placement.order), placement.ranks.tolist()))


def _key(par: ParallelConfig, order: tuple[str, ...]) -> tuple:
    return tuple(sorted(vars(par).items())) + (order,)
