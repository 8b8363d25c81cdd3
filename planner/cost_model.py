"""Cost model (DESIGN.md §5): one function per term, each citing its source, fed only by Profile queries.

The search turns a candidate (mesh shape, micro-batching, schedule, ZeRO level, recompute mode,
placement) into a `StageProblem`: per-layer and per-stage coefficients that are linear in the layer →
stage assignment and the per-stage recompute counts. `evaluate` computes the predicted iteration time
and memory of one partition from those coefficients; the ILP (planner/ilp.py) optimises exactly the same
expressions, and the brute-force tests compare the two.

Units: per-stage times here are seconds per micro-batch (the plan JSON multiplies them by m: seconds per
iteration, as `plan show` reads them); the tail terms (gradient sync, optimizer step) are seconds per
iteration; memory is bytes per device.

The terms live by family: cost_compute (layers' compute and recompute), cost_collectives (tensor- and
data-parallel communication, the optimizer step), cost_pipeline (point-to-point, bubbles, in-flight
micro-batches), cost_memory (state, activations, transients); cost_cp and cost_ep add context and expert
parallelism. This module puts them together per candidate (planner/candidate.py).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field
from typing import NamedTuple

from meshplan.planner.candidate import Candidate, Links
from meshplan.planner.cost_collectives import (
    GradSync,
    dp_reduction_times,
    engine_copy_time,
    gather_bytes,
    grad_sync,
    optimizer_time,
    overlap_tax,
    root_hook_time,
    sharded_accumulation,
    sharded_dp_time,
    step_sync_time,
    tp_comm_time,
    unhidden_share,
)
from meshplan.planner.cost_compute import compute_time, recompute_time
from meshplan.planner.cost_memory import (
    Workspace,
    activation_bytes,
    fixed_bytes,
    gather_workspace,
    grads_idle,
    later_moments,
    loss_grad_16bit,
    peak_memory,
    regathered_input,
    state_bytes,
    state_kept,
    step_transients,
)
from meshplan.planner.cost_pipeline import (
    bubble_micro_batches,
    emb_in_flight,
    grad_moments,
    in_flight,
    pipeline_stage_split,
    pp_comm_time,
    split_backward_factor,
    unfused_share,
    zb_ratio,
)
from meshplan.planner.model_spec import ModelSpec

# ---------------------------------------------------------------------------------------------------
# The per-candidate problem: coefficients linear in the assignment, shared by the ILP and `evaluate`.
# ---------------------------------------------------------------------------------------------------

@dataclass
class StageProblem:
    """Everything the stage partition + recompute choice depends on, for one candidate.

    Per layer l: `time` = forward + backward + TP comm per micro-batch; `fwd`, `bwd`; `act` bytes per
    micro-batch without recompute; `state` bytes of parameters + gradients + optimizer; `opt` and `dp`
    seconds per iteration; `gather` data-parallel seconds per micro-batch (hooks, ZeRO-3 gathers). Per
    block: `rec_time` and `rec_saving` when recomputed. Per stage: `boundary` PP comm per micro-batch
    (plus the stage root unit's data-parallel hooks when measured) and `rank`. Per rank: `inflight`
    multiplier and `fixed` bytes (tied copy, ZeRO-3 workspace).
    """

    kinds: list[str]
    time: list[float]
    fwd: list[float]
    bwd: list[float]
    act: list[float]
    state: list[float]
    opt: list[float]
    dp: list[float]
    gather: list[float]  # per micro-batch: ZeRO-3 parameter gathers
    reduce: list[float]  # per micro-batch: gradient reductions before the step's last (dp_reduction_times)
    rec_time: float
    rec_saving: float
    rec_tp: float  # TP comm added per recomputed block (already in rec_time; kept for the report)
    boundary: list[float]
    rank: list[int]
    pp: int
    inflight: list[float]
    fixed: list[float]
    mem_limit: float
    weight: float  # m + bubble micro-batches
    bubble: float  # bubble micro-batches
    m: int
    unhidden: float  # share of DP traffic that can never overlap (the last bucket; 1: measured exposed)
    recompute: str  # "free": 0..n per stage; "none"; "all"
    ws: Workspace  # the step's transient bytes (peak_memory)
    grads_idle: list[float]  # per rank: share of `state` not yet allocated at the activation peak
    later: list[tuple[tuple[float, float], ...]]  # per rank: later_moments
    emb_inflight: list[float]  # per rank: emb_in_flight
    cuts: list[bool] = field(default_factory=list)  # cuts[l]: a stage may start at layer l (l ≥ 1)
    # per stage: the part of `boundary` that is not the stage's own work in the shared-core simulation,
    # and the wait it puts on each hop instead (cost_pipeline.pipeline_busy_wait); empty: none
    boundary_relief: list[float] = field(default_factory=list)
    hop_wait: list[float] = field(default_factory=list)
    step_sync: float = 0.0  # seconds per iteration on every rank: the step's scalar all-reduces (step_sync_time)
    # share of the GPU that overlapped collectives take from compute while they run (`overlap_tax`)
    overlap_tax: float = 0.0

    @functools.cached_property
    def layer_sums(self) -> tuple[list[float], ...]:
        """Running sums over the layers of fwd, bwd, time, gather, reduce, act, state, opt, dp and the
        optimizer workspace: `evaluate` sums a stage's layers as two lookups (the local search evaluates
        thousands of partitions of one problem)."""
        cols = (self.fwd, self.bwd, self.time, self.gather, self.reduce, self.act, self.state, self.opt, self.dp,
                self.ws.per_layer)
        return tuple([0.0, *itertools.accumulate(col)] for col in cols)

    @property
    def state_kept(self) -> float:
        return state_kept(self.grads_idle)

    @property
    def num_layers(self) -> int:
        return len(self.kinds)

    @property
    def num_stages(self) -> int:
        return len(self.rank)

    def uniform_blocks(self) -> bool:
        """Blocks identical and laid out embedding, blocks…, head with every cut allowed: then block
        counts per stage determine the plan and the count ILP is the same problem."""
        kinds = self.kinds
        if len(kinds) < 3 or kinds[0] != "embedding" or kinds[-1] != "head" or \
                any(k != "block" for k in kinds[1:-1]) or not all(self.cuts[1:]):
            return False
        blocks = range(1, len(kinds) - 1)
        return all(
            all(math.isclose(arr[i], arr[1], rel_tol=1e-12, abs_tol=0.0) for i in blocks)
            for arr in (self.time, self.fwd, self.bwd, self.act, self.state, self.opt, self.dp, self.gather,
                        self.reduce, self.ws.per_layer)
        )

    def key(self) -> tuple:
        """Identical sub-problems (many candidates share one) hash equal."""
        return (tuple(self.kinds), tuple(self.time), tuple(self.fwd), tuple(self.bwd), tuple(self.act),
                tuple(self.state), tuple(self.opt), tuple(self.dp), tuple(self.gather), tuple(self.reduce),
                self.rec_time,
                self.rec_saving, tuple(self.boundary), tuple(self.rank), tuple(self.inflight),
                tuple(self.fixed), self.mem_limit, self.weight, self.unhidden, self.recompute, tuple(self.cuts),
                tuple(self.ws.act), tuple(self.ws.emb), tuple(self.ws.opt), tuple(self.ws.per_layer),
                tuple(self.grads_idle), tuple(self.later), tuple(self.emb_inflight), tuple(self.boundary_relief),
                tuple(self.hop_wait),
                self.step_sync)


@dataclass
class StageResult:
    forward: float
    backward: float
    recompute: float
    communication: float
    total: float  # per micro-batch
    dp_sync: float  # exposed, per iteration (the rank's)
    optimizer: float  # per iteration (the rank's)
    parameters: float
    gradients: float
    optimizer_state: float
    activations: float
    memory_total: float  # the rank's (all its stages)
    workspace: float = 0.0  # the rank's peak above its state, fixed bytes and in-flight activations
    relief: float = 0.0  # per micro-batch: part of `communication` that is not the stage's own work
    hop_wait: float = 0.0  # per micro-batch and hop direction: the wait the simulation puts there


@dataclass
class Evaluation:
    iteration_time: float
    stage_time_max: float  # the bottleneck rank's time per micro-batch
    tail: float
    rank_memory: list[float]
    feasible: bool
    stages: list[StageResult]


class _Row(NamedTuple):
    """One stage's sums in `evaluate` (seconds per micro-batch, or per iteration for opt and dp; bytes)."""
    f: float
    g: float
    base: float
    gather: float
    reduce: float
    rec: float
    act: float
    state: float
    opt: float
    dp: float
    opt_ws: float


def rank_of_stages(problem: StageProblem) -> list[list[int]]:
    ranks: list[list[int]] = [[] for _ in range(problem.pp)]
    for s, r in enumerate(problem.rank):
        ranks[r].append(s)
    return ranks


def _stage_rows(P: StageProblem, bounds: list[int], recompute: list[int]) -> list[_Row]:
    F, G, T, GA, RE, AC, ST, OP, DP, WS = P.layer_sums
    rows = []
    for s in range(P.num_stages):
        a, b = bounds[s], bounds[s + 1]
        rec = recompute[s] * P.rec_time
        rows.append(_Row(F[b] - F[a], G[b] - G[a], T[b] - T[a] + rec + P.boundary[s], GA[b] - GA[a], RE[b] - RE[a],
                         rec, AC[b] - AC[a] - recompute[s] * P.rec_saving, ST[b] - ST[a], OP[b] - OP[a],
                         DP[b] - DP[a], WS[b] - WS[a]))
    return rows


def _rank_memory(P: StageProblem, mine: list[_Row], r: int) -> float:
    return peak_memory(sum(w.state for w in mine), P.fixed[r], P.inflight[r], sum(w.act for w in mine),
                       sum(w.opt_ws for w in mine), P.ws, r, P.grads_idle[r], P.later[r], P.emb_inflight[r])


def rank_memory(problem: StageProblem, bounds: list[int], recompute: list[int]) -> list[float]:
    """`evaluate(...).rank_memory` alone (the local search's recompute bisection asks for nothing else)."""
    rows = _stage_rows(problem, bounds, recompute)
    return [_rank_memory(problem, [rows[s] for s in stages], r) for r, stages in enumerate(rank_of_stages(problem))]


def evaluate(problem: StageProblem, bounds: list[int], recompute: list[int],
             state_split: tuple[float, float, float] = (1.0, 0.0, 0.0)) -> Evaluation:
    """Predicted iteration time and per-rank memory of one partition: stage s holds layers
    [bounds[s], bounds[s+1]) and recomputes `recompute[s]` of its blocks.

    iteration = (m + bubble) · max_rank τ_rank + max_rank tail_rank, with τ_rank the rank's time per
    micro-batch (all its stages, plus the sharded-DP traffic it cannot hide: max(gather + reduce −
    compute, unhidden · gather), prefetching across the rank's layers) and tail_rank = optimizer + exposed
    gradient sync, exposed = max(sync − one micro-batch of the rank's backward, unhidden · sync) (the
    last bucket cannot overlap). A rank's memory is its state, fixed bytes and the largest transient
    moment of `peak_memory`."""
    P = problem
    rows = _stage_rows(P, bounds, recompute)
    ranks = rank_of_stages(P)
    tau, tails, mem, z3, pooled_of, held = [], [], [], [], [], []
    for r, stages in enumerate(ranks):
        mine = [rows[s] for s in stages]
        gather = sum(w.gather for w in mine)
        pooled = gather + sum(w.reduce for w in mine)
        pooled_of.append(pooled)
        compute = sum(w.f + w.g for w in mine)
        z3.append(max(pooled - compute, P.unhidden * gather) if pooled > 0 else 0.0)
        # hidden traffic still slows the compute it overlaps (overlap_tax of it while it runs)
        z3[r] += P.overlap_tax * (pooled - z3[r]) if pooled > 0 else 0.0
        tau.append(sum(w.base for w in mine) + z3[r])
        sync = sum(w.dp for w in mine)
        exposed = max(sync - sum(w.g for w in mine), P.unhidden * sync)
        exposed += P.overlap_tax * (sync - exposed)
        tails.append((exposed, sum(w.opt for w in mine) + P.step_sync))
        mem.append(_rank_memory(P, mine, r))
        held.append(sum(w.state + P.inflight[r] * w.act for w in mine))
    tau_max, tail = max(tau), max(e + o for e, o in tails)
    results = []
    p_frac, g_frac, o_frac = state_split
    for s, row in enumerate(rows):
        r = P.rank[s]
        pooled_r = pooled_of[r]
        share = (row.gather + row.reduce) / pooled_r if pooled_r > 0 else 0.0
        total = row.base + z3[r] * share
        n_r = len(ranks[r])
        results.append(StageResult(
            forward=row.f, backward=row.g, recompute=row.rec,
            communication=total - row.f - row.g - row.rec, total=total,
            dp_sync=tails[r][0] / n_r, optimizer=tails[r][1] / n_r,
            parameters=row.state * p_frac + P.fixed[r] / n_r, gradients=row.state * g_frac,
            optimizer_state=row.state * o_frac, activations=P.inflight[r] * row.act, memory_total=mem[r],
            workspace=(mem[r] - P.fixed[r] - held[r]) / n_r,
            relief=P.boundary_relief[s] if P.boundary_relief else 0.0,
            hop_wait=P.hop_wait[s] / 2 if P.hop_wait else 0.0))
    iteration = P.weight * tau_max + tail
    return Evaluation(iteration, tau_max, tail, mem, max(mem) <= P.mem_limit * (1 + 1e-9), results)


# ---------------------------------------------------------------------------------------------------
# Building the problem from a candidate.
# ---------------------------------------------------------------------------------------------------


class Terms:
    """Memoised per-kind and per-parameter-count terms: the search builds thousands of problems that
    share them (the Profile is queried once per distinct input)."""

    def __init__(self, model: ModelSpec, profile, seq_len: int, dtype: str):
        self.model, self.profile, self.s, self.dtype = model, profile, seq_len, dtype
        self.memo: dict[tuple, object] = {}

    def _get(self, key: tuple, fn):
        if key not in self.memo:
            self.memo[key] = fn()
        return self.memo[key]

    def kind(self, kind: str, b: int, tp: int, schedule: str = "1f1b") -> tuple[float, float, float, float]:
        """(forward, backward, TP comm, activation bytes) of one layer of `kind` per micro-batch, the
        backward as `schedule` runs it (split for zero-bubble)."""
        def make():
            f, g = compute_time(self.profile, kind, b, self.s, tp)
            g *= split_backward_factor(self.profile, schedule, b)
            c = tp_comm_time(self.profile, kind, b, self.s, self.model.hidden_size, tp, self.dtype, "none")
            return f, g, c, activation_bytes(self.profile, kind, b, self.s, tp, "none", tp > 1)
        return self._get(("kind", kind, b, tp, schedule == "zero-bubble"), make)

    def recompute(self, b: int, tp: int, mode: str) -> tuple[float, float, float]:
        """(extra time, activation bytes saved, extra TP comm) per recomputed block per micro-batch."""
        def make():
            if mode == "none" or not self.model.num_layers:
                return 0.0, 0.0, 0.0
            h = self.model.hidden_size
            _, _, c, a = self.kind("block", b, tp)
            rec_tp = tp_comm_time(self.profile, "block", b, self.s, h, tp, self.dtype, mode) - c
            rec = recompute_time(self.profile, "block", b, self.s, tp, mode) + rec_tp
            return rec, a - activation_bytes(self.profile, "block", b, self.s, tp, mode, tp > 1), rec_tp
        return self._get(("rec", b, tp, mode), make)

    def side_comm(self, b: int, tp: int, mode: str) -> dict[str, tuple[float, float]]:
        """{term: (seconds per block, seconds again per recomputed block)} per micro-batch of the
        communication other than tensor parallelism that `kind` counts in a block's communication value
        (context and expert parallel: CPTerms, planner/cost_ep.py), so that reports can tell them apart."""
        return {}

    def hop(self, b: int, tp: int, link: str) -> float:
        h = self.model.hidden_size
        return self._get(("hop", b, tp, link),
                         lambda: pp_comm_time(self.profile, b, self.s, h, tp, self.dtype, tp > 1, link))

    def per_layer(self, tp: int, dp: int, zero: int, link: str, sync: GradSync = GradSync(False, 1)
                  ) -> tuple[list, list, list, list, list]:
        """(state bytes, optimizer s, per-iteration DP sync s, per-micro-batch sharded DP s, per-micro-batch
        gradient reductions s) of every layer (`dp_reduction_times`)."""
        def make():
            per_param = {blk: sum(state_bytes(self.profile, self.dtype, zero, dp, sync.full_grads, blk))
                         for blk in (True, False)}
            by_params: dict[tuple, tuple] = {}
            out: tuple[list, list, list, list, list] = ([], [], [], [], [])
            in_situ = dp > 1 and self.profile.wrapper(zero) is not None
            for layer in self.model.layers:
                key = (layer.params, layer.kind == "block")
                if key not in by_params:
                    w = layer.params / tp
                    gather = gather_bytes(self.profile, self.dtype, zero, layer.kind == "block")
                    # in situ, the embedding's and head's hooks are the stage root's (root_hook_time)
                    per_mb = 0.0 if in_situ and layer.kind != "block" else \
                        sharded_dp_time(self.profile, w, self.dtype, dp, zero, link, gather)
                    tail, reduce = dp_reduction_times(self.profile, w, self.dtype, dp, zero, link, sync, gather)
                    by_params[key] = (
                        w * per_param[layer.kind == "block"], optimizer_time(self.profile, w, dp, zero, tp)
                        + engine_copy_time(self.profile, w, self.dtype, dp, zero, sync), tail, per_mb, reduce)
                for lst, value in zip(out, by_params[key]):
                    lst.append(value)
            return out
        return self._get(("layer", tp, dp, zero, link, sync), make)


def crossings(rank: list[int], k: int) -> int:
    """Neighbours of stage k that live on another pipeline rank."""
    return int(k > 0 and rank[k - 1] != rank[k]) + int(k < len(rank) - 1 and rank[k + 1] != rank[k])


def build_problem(model: ModelSpec, profile, cand: Candidate, seq_len: int, dtype: str, links: Links,
                  mem_limit: float, cuts: list[bool], terms: Terms | None = None) -> StageProblem:
    """Coefficients of `cand` for every layer, stage and rank."""
    from meshplan.planner.cost_cp import add_cp_buffers, cp_terms
    from meshplan.planner.cost_ep import DEFAULT_IMBALANCE, add_ep_buffers, ep_terms
    from meshplan.planner.plan import stage_rank

    base = terms or Terms(model, profile, seq_len, dtype)
    imbalance = getattr(base, "moe_imbalance", DEFAULT_IMBALANCE)  # MoE models (planner/cost_ep.py)
    terms = ep_terms(cp_terms(base, cand.cp, cand.cp_mode, links.cp_link(cand.cp_mode)), cand, links.ep, imbalance,
                     links.edp)
    b, tp, pp, v, zero = cand.b, cand.tp, cand.pp, cand.v, cand.zero
    dp = cand.dp * cand.cp  # from here on: the ranks that average gradients and shard ZeRO state (dp x cp)
    kinds = [layer.kind for layer in model.layers]
    rows = {k: terms.kind(k, b, tp, cand.schedule) for k in set(kinds)}
    fwd = [rows[k][0] for k in kinds]
    bwd = [rows[k][1] for k in kinds]
    time = [rows[k][0] + rows[k][1] + rows[k][2] for k in kinds]
    act = [rows[k][3] for k in kinds]
    sync = grad_sync(cand, sharded_accumulation(profile))
    state, opt, dps, gather, reduce = terms.per_layer(tp, dp, zero, links.dp_cp_group, sync)
    rec_time, rec_saving, rec_tp = terms.recompute(b, tp, cand.recompute)
    S = cand.num_stages
    rank = [stage_rank(k, pp, cand.schedule, v) for k in range(S)]
    hop = terms.hop(b, tp, links.pp) if pp > 1 else 0.0
    root = root_hook_time(profile, dp, zero)
    splits = [pipeline_stage_split(profile, hop, crossings(rank, k), cand.schedule,
                                   unfused_share(cand.schedule, pp, cand.m, rank[k]), b) for k in range(S)]
    boundary = [root + t for t, _, _ in splits]
    inflight = [in_flight(cand.schedule, pp, v, cand.m, r) for r in range(pp)]
    moments = [grad_moments(cand.schedule, pp, v, cand.m, r) for r in range(pp)]
    state_per_param = state_bytes(profile, dtype, zero, dp, sync.full_grads)
    tied = sum(layer.tied_params for layer in model.layers if layer.kind == "head")
    fixed = fixed_bytes(pp, rank, tied / tp * sum(state_bytes(profile, dtype, zero, dp, sync.full_grads, False)),
                        gather_workspace(model, tp, dtype) if zero >= 3 and dp > 1 else 0.0)
    bubble = bubble_micro_batches(cand.schedule, pp, v, zb_ratio(sum(fwd), sum(bwd)))
    recompute = "none" if cand.recompute == "none" else ("all" if cand.recompute_pinned else "free")
    return StageProblem(
        kinds=kinds, time=time, fwd=fwd, bwd=bwd, act=act, state=state, opt=opt, dp=dps, gather=gather,
        reduce=reduce,
        rec_time=rec_time, rec_saving=rec_saving, rec_tp=rec_tp, boundary=boundary, rank=rank, pp=pp,
        inflight=inflight, fixed=fixed, mem_limit=mem_limit, weight=cand.m + bubble, bubble=bubble, m=cand.m,
        unhidden=unhidden_share(profile, dp, zero, len(kinds), S), recompute=recompute, cuts=cuts,
        boundary_relief=[r for _, r, _ in splits], hop_wait=[w for _, _, w in splits],
        ws=add_ep_buffers(add_cp_buffers(step_transients(model, cand, seq_len, dtype, rank,
                                                         loss_grad_16bit(profile),
                                                         regathered_input(profile, model, cand, seq_len, dtype)),
                                         model, cand, seq_len, dtype), model, cand, seq_len, dtype, imbalance),
        grads_idle=grads_idle(state_per_param, moments), later=later_moments(state_per_param, moments),
        emb_inflight=[emb_in_flight(cand.schedule, pp, v, cand.m, r) for r in range(pp)],
        step_sync=step_sync_time(profile, dp * tp * pp, links), overlap_tax=overlap_tax(profile),
    )


def least_recompute(left: list[float], inflight: list[float], state: float, act: float, saving: float,
                    blocks: int) -> float:
    """Fewest recomputed blocks (fractional: a relaxation, so a lower bound) that let `blocks` blocks of
    `state` bytes and `act` activation bytes per in-flight micro-batch fit in the bytes `left` on each
    rank. A rank holds left/c0 blocks free (c0 = state + k·act); beyond that each block costs
    c0/(k·saving) recomputes, up to left/c1 (c1 = state + k·(act − saving)); cheapest ranks fill first."""
    free, extra = 0.0, []
    for x, k in zip(left, inflight):
        x = max(0.0, x)
        c0, c1 = state + k * act, state + k * (act - saving)
        free += x / c0 if c0 > 0 else float("inf")
        if k * saving > 0 and c1 > 0:
            extra.append((c0 / (k * saving), x / c1 - x / c0))
    need = blocks - free
    rec = 0.0
    for cost, room in sorted(extra):
        if need <= 0:
            break
        take = min(room, need)
        rec += take * cost
        need -= take
    return min(float(blocks), rec)


def min_recomputed_blocks(problem: StageProblem) -> float:
    """Fewest recomputed blocks any partition within memory needs (`least_recompute` with the cheapest
    block and the memory each rank has left after the embedding and head)."""
    P = problem
    if P.recompute == "none" or P.rec_saving <= 0 or not math.isfinite(P.mem_limit):
        return 0.0
    blocks = [i for i, k in enumerate(P.kinds) if k == "block"]
    if not blocks:
        return 0.0
    first, last = P.rank[0], P.rank[-1]
    left = [P.mem_limit - f for f in P.fixed]
    kept = P.state_kept
    for i, k in enumerate(P.kinds):
        if k != "block":
            r = first if i < blocks[0] else last
            left[r] -= P.state[i] * kept + P.inflight[r] * P.act[i]
    return least_recompute(left, P.inflight, min(P.state[i] for i in blocks) * kept,
                           min(P.act[i] for i in blocks), P.rec_saving, len(blocks))


def lower_bound(problem: StageProblem) -> float:
    """A bound no partition of this candidate beats: total work (with the least recompute memory
    allows, and ZeRO-3 gathers hidden at best behind all compute) spread evenly over the ranks and no
    shorter than the longest layer, plus the average tail."""
    P = problem
    gather = sum(P.gather)
    pooled = gather + sum(P.reduce)
    z3 = max(pooled - sum(P.fwd) - sum(P.bwd), P.unhidden * gather) if pooled > 0 else 0.0
    work = sum(P.time) + sum(P.boundary) - sum(P.boundary_relief) + z3  # relief: the simulation may hide it
    if P.recompute == "all":
        work += P.rec_time * sum(1 for k in P.kinds if k == "block")
    elif P.recompute == "free":
        work += P.rec_time * math.ceil(min_recomputed_blocks(P) - 1e-9)
    tau = max(work / P.pp, max(P.time))
    sync, bwd = sum(P.dp), sum(P.bwd)
    tail = (sum(P.opt) + max(sync - bwd, P.unhidden * sync)) / P.pp + P.step_sync
    return P.weight * tau + tail


def memory_lower_bound(problem: StageProblem) -> float:
    """Necessary condition for a partition within memory, as a ratio (≤ 1: may fit; > 1: cannot):
    with maximum recompute, the blocks must fit in what each rank has left after its fixed layers
    (relaxed to fractional blocks)."""
    P = problem
    saving = P.rec_saving if P.recompute != "none" else 0.0
    left = [P.mem_limit - f for f in P.fixed]
    first, last = P.rank[0], P.rank[-1]
    blocks = [i for i, k in enumerate(P.kinds) if k == "block"]
    first_block = blocks[0] if blocks else 1
    kept = P.state_kept
    for i, k in enumerate(P.kinds):  # embedding on the first stage's rank, head on the last's
        if k != "block":
            r = first if i < first_block else last
            left[r] -= P.state[i] * kept + P.inflight[r] * P.act[i]
    if min(left) < 0:
        return 1.0 + max(-x for x in left) / P.mem_limit + 1.0
    if not blocks:
        return 0.0
    per_block = min(P.state[i] for i in blocks) * kept
    act = min(P.act[i] for i in blocks) - saving
    capacity = sum(x / (per_block + P.inflight[r] * act) for r, x in enumerate(left))
    return len(blocks) / capacity if capacity > 0 else float("inf")
