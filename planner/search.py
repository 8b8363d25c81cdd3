"""The search: enumerate the small outer space, bound, and solve the stage ILP only where it can win.

Outer space: tp (divides heads, kv heads and a node), pp, dp = world/(tp·pp), micro-batch size b
(m = global/(dp·b)), schedule and virtual stages, ZeRO level, recompute mode and mesh placement. Every
candidate gets a memory lower bound and a lower bound on the time the search reports for it: the ILP's
closed form (planner/cost_model.py `lower_bound`) without a pipeline, else the plan's schedule simulated
from its stage times (planner/shared_cores.py), sharpened just before solving (`refined_bound`: the busiest
rank over whole blocks that fit its memory). Candidates are solved in order of those bounds, and the
search stops once the least bound left passes the k-th best distinct plan's reported time: the ranking
is the one solving every candidate would give (tests/test_search.py checks it, and each candidate's ILP
optimum, against brute force), while only a few ILPs are solved and only plans that can still enter the
ranking are simulated.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Iterator
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
from meshplan.planner.cost_compute import model_flops_per_iteration
from meshplan.planner.cost_cp import cp_modes, cp_pp_pairs, cp_terms
from meshplan.planner.cost_ep import ep_options, ep_terms, links_with_ep
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
from meshplan.planner.exposed import exposed_communication
from meshplan.planner.ilp import PartitionSolver, Solution
from meshplan.planner.memory_reserve import Reserve, reserve, usable_bytes
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
from meshplan.planner.shared_cores import (
    evaluation_lower_bound,
    makespan_lower_bound,
    relative_rate,
    shared_iteration_time,
)

Progress = Callable[[int, int], None]
MAX_VIRTUAL_STAGES = 8
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


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def schedules(pp: int, m: int, num_layers: int, constraints: Constraints, blocks: int = 0
              ) -> Iterator[tuple[str, int]]:
    """(schedule, virtual stages) that torch.distributed.pipelining can run for this pp and m.
    zero-bubble is emitted only as ZB-V (v = 2, V-shaped placement, ScheduleZBVZeroBubble) to keep the
    executor's mapping simple; Schedule1F1B and ZBV need m ≥ pp; interleaved needs m % pp == 0. Unpinned,
    interleaving takes v = 2 and the v whose pp·v chunks split the `blocks` evenly (Megatron-LM's rule), or
    split them evenly with the embedding and the head counted as a layer each (Megatron-Core's
    account_for_embedding_in_pipeline_split / account_for_loss_in_pipeline_split; Llama 3 §3.3.2 takes one
    layer off the first and the last stage): an uneven chunk delays every micro-batch that passes it, and
    each v costs an ILP."""
    engine = constraints.engine_schedules
    for name, v in _schedules(pp, m, num_layers, constraints, blocks):
        if engine is None or name in engine:
            yield name, v


def _schedules(pp: int, m: int, num_layers: int, constraints: Constraints, blocks: int) -> Iterator[tuple[str, int]]:
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
        vs = [pin_v] if pin_v is not None else [v for v in range(2, MAX_VIRTUAL_STAGES + 1)
                                                if v == 2 or not blocks or blocks % (pp * v) == 0
                                                or (blocks + 2) % (pp * v) == 0]
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
        for cp, pp in cp_pp_pairs(model, cluster, c, tp):  # cp = 1 first (planner/cost_cp.py)
            if (c.pp is not None and pp != c.pp) or pp > n_layers:
                continue
            dp = world // (tp * cp * pp)
            if (c.dp is not None and dp != c.dp) or gbs % dp:
                continue
            for b in divisors(gbs // dp):
                if c.micro_batch_size is not None and b != c.micro_batch_size:
                    continue
                m = gbs // (dp * b)
                for schedule, v in schedules(pp, m, n_layers, c, model.num_layers):
                    for zero in ([c.zero] if c.zero is not None else range(4 if dp * cp > 1 else 1)):
                        if c.engine_zero is not None and zero not in c.engine_zero and dp * cp > 1:
                            continue  # a ZeRO level the --software engine does not run
                        if schedule == "zero-bubble" and zero == 3:
                            continue  # the executor refuses it: FSDP2 resharding breaks the split backward
                        if c.recompute is not None:
                            modes = [(c.recompute, c.recompute != "none")]
                        else:  # the ILP counts full recompute per stage; the executor's selective is all blocks
                            modes = [(mode, pinned) for mode, pinned in (("none", False), ("selective", True),
                                                                         ("full", False))
                                     if c.engine_recompute is None or mode in c.engine_recompute]
                        for mode, pinned in modes:
                            for order in placer.orders(pp, dp, tp, cp):
                                for cp_mode in cp_modes(model, cluster, c, tp, cp):
                                    for ep, etp in ep_options(model, dp, cp, tp, c.ep, c.expert_tp):
                                        yield Candidate(dp=dp, tp=tp, pp=pp, v=v, schedule=schedule, b=b, m=m,
                                                        zero=zero, recompute=mode, recompute_pinned=pinned,
                                                        order=order, cp=cp, cp_mode=cp_mode, ep=ep, expert_tp=etp)


def memory_key(cand: Candidate) -> tuple:
    """What a candidate's memory bound (`Search._bounds`' ratio) depends on: not where its groups are
    placed (`order`) nor anything else that only moves time (tests/test_search.py checks it)."""
    return (cand.tp, cand.cp, cand.cp_mode, cand.pp, cand.dp, cand.b, cand.schedule, cand.v, cand.zero,
            cand.recompute, cand.recompute_pinned, cand.ep, cand.expert_tp)


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
                             self.cuts, self.terms)

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
            board.add(_key(_parallel(self, scored), cand.order), scored, ranked)
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
        """The solved candidate with its reported time, and whether that is what it holds: a pipeline
        whose simulation cannot come within `limit` (evaluation_lower_bound) is not simulated and keeps
        its closed-form time; it cannot enter the ranking."""
        time, ranked = solution.objective, True
        if cand.pp > 1:
            solution = self._even_if_faster(cand, problem, solution)
            ev = solution.evaluation or evaluate(problem, solution.bounds, solution.recompute)
            quick = evaluation_lower_bound(ev, cand.schedule, cand.pp, cand.v, cand.m) if self.rate is None else 0.0
            ranked = quick <= limit * TOLERANCE
            if ranked:
                time = self.shared_time(cand, ev)
        return Scored(cand, problem, solution, index, time), ranked

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
        """The predicted iteration seconds of a solved candidate, as the search reports it: the closed
        form without a pipeline, else its pipeline part simulated (with processor sharing on CPU ranks
        that outnumber the cores)."""
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
    """Stage bounds with the blocks spread evenly (the first stages take one more when they do not
    divide), the embedding in the first stage and the head in the last; None unless the model is
    embedding, blocks, head with every cut allowed and at least one block per stage."""
    kinds, S = problem.kinds, problem.num_stages
    if len(kinds) < 3 or kinds[0] != "embedding" or kinds[-1] != "head" or \
            any(k != "block" for k in kinds[1:-1]) or not all(problem.cuts[1:]):
        return None
    blocks = len(kinds) - 2
    if blocks < S:
        return None
    bounds, start = [0], 1
    for k in range(S):
        start += blocks // S + (1 if k < blocks % S else 0)
        bounds.append(start)
    bounds[-1] = len(kinds)
    return bounds


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
                        software=getattr(getattr(profile, "roofline", None), "software", ""))
    plan = to_plan(search, results, stats)
    from meshplan.planner.cp_report import cp_choice_notes

    plan.cp_notes = cp_choice_notes(search, plan)  # for the CLI summary (not part of the plan JSON)
    return plan


def describe(cand: Candidate) -> str:
    v = f" v={cand.v}" if cand.v > 1 else ""
    cp = f" cp={cand.cp} ({cand.cp_mode})" if cand.cp > 1 else ""
    cp += f" ep={cand.ep}" + (f" expert_tp={cand.expert_tp}" if cand.expert_tp > 1 else "") if cand.ep > 1 else ""
    return (f"pp={cand.pp} dp={cand.dp}{cp} tp={cand.tp} zero={cand.zero} {cand.schedule}{v} "
            f"b={cand.b} m={cand.m} recompute={cand.recompute}")


def infeasible_message(search: Search) -> str:
    """Exit 3: the nearest candidate, by how much it exceeds memory where, and what would make it fit."""
    near = search.nearest()
    c, dev = search.c, search.cluster.device
    per_param = sum(state_bytes(search.profile, c.dtype, 0, 1))
    state = sum(layer.params for layer in search.model.layers) * per_param
    need_devices = int(-(-state // (dev.memory_bytes * (1 - c.memory_margin))))
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
    if c.memory_margin > 0.01:
        hints.append(f"a smaller --memory-margin than {c.memory_margin}")
    if need_devices <= search.cluster.world_size:  # the state fits sharded: the activations do not
        default = " (the default, the model's maximum)" if c.seq_len is None else ""
        hints.insert(0, f"a shorter --seq-len than {search.seq}{default}")
        hints.append(f"more devices (the model state, {human_bytes(state)}, fits on this cluster; the "
                     f"activations of {search.seq}-token sequences do not: more devices split them with "
                     "context parallelism)")
    else:
        hints.append(f"more devices (model state alone is {human_bytes(state)} at {per_param:g} B/param: at "
                     f"least {need_devices} devices of {human_bytes(dev.memory_bytes)} with ZeRO-3)")
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
    usable, res = problem.mem_limit, search.reserve(cand)
    over = ev.rank_memory[worst] - usable
    need, limit = human_bytes(ev.rank_memory[worst]), human_bytes(dev.memory_bytes)
    held = f" less {human_bytes(res.total)} for the {res.describe()}," if res.total else ","
    return (f"no plan fits in memory: the nearest ({describe(cand)}) needs {need} on "
            f"pipeline rank {worst} (stage {', '.join(map(str, stages))}), {human_bytes(over)} ({int(over)} bytes) "
            f"over the {human_bytes(usable)} usable per device ({limit}{held} less the {c.memory_margin:.0%} "
            f"margin){fit}")




def _predicted(search: Search, scored: Scored, ev: Evaluation) -> Predicted:
    cand = scored.cand
    seconds = scored.time
    tokens = search.c.global_batch_size * search.seq
    flops = model_flops_per_iteration(search.model, search.c.global_batch_size, search.seq)
    peak = search.cluster.device.peak_flops[search.c.dtype] * cand.dp * cand.cp * cand.tp * cand.pp
    bubble = scored.problem.bubble
    exposed = exposed_communication(cand, scored.problem, ev, scored.solution.bounds, scored.solution.recompute,
                                    search.terms_for(cand))
    return Predicted(
        iteration_time_s=seconds, tokens_per_s=tokens / seconds,
        bubble_fraction=bubble / (scored.problem.m + bubble), peak_memory_bytes=max(ev.rank_memory),
        mfu=flops / (seconds * peak), exposed_communication_s=exposed, usable_memory_bytes=search.limit(cand))


def _parallel(search: Search, scored: Scored) -> ParallelConfig:
    cand = scored.cand
    mode = cand.recompute if any(scored.solution.recompute) or cand.recompute_pinned else "none"
    return ParallelConfig(
        dp=cand.dp, tp=cand.tp, pp=cand.pp, virtual_stages=cand.v, zero=cand.zero, schedule=cand.schedule,
        micro_batch_size=cand.b, num_micro_batches=cand.m, global_batch_size=search.c.global_batch_size,
        seq_len=search.seq, recompute=mode, dtype=search.c.dtype, sequence_parallel=cand.tp > 1, cp=cand.cp,
        cp_mode=cand.cp_mode if cand.cp > 1 else "ring", ep=cand.ep, expert_tp=cand.expert_tp,
        fp8=getattr(getattr(search.profile, "roofline", None), "fp8", "none"))


def to_plan(search: Search, results: list[Scored], stats: SearchStats) -> Plan:
    best = results[0]
    cand, sol = best.cand, best.solution
    pb, gb, ob = state_bytes(search.profile, search.c.dtype, cand.zero, cand.dp,
                             grad_sync(cand, search.sharded).full_grads)
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
    placement = search.placer.place(cand.pp, cand.dp, cand.tp, cand.order, cand.cp)
    return Plan(model=search.model, cluster=search.cluster, parallel=_parallel(search, best), stages=stages,
                predicted=_predicted(search, best, ev), alternatives=alternatives[:search.c.top_k], search=stats,
                placement=Placement(list(placement.order), placement.ranks.tolist()))


def _key(par: ParallelConfig, order: tuple[str, ...]) -> tuple:
    return tuple(sorted(vars(par).items())) + (order,)
