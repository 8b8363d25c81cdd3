"""CPU ranks that outnumber the cores share them: a rank idle in the pipeline bubble gives its core to the
busy ones, which then run faster than the profile's times.

A CPU profile is measured with all `concurrent_ranks` processes computing at once, each with
`threads_per_rank` threads on `cpu_cores` cores, so its times hold at the speed min(1, C / (R·t)). With
n processes computing the speed is min(1, C / (n·t)) (processor sharing, the standard model of a
time-shared CPU: Kleinrock, Queueing Systems vol. 2, 1976, ch. 4). The closed form of the cost model
keeps every rank at the measured speed, which over-predicts bubble-heavy plans: while some ranks idle in
the bubble, the busy ones run faster than with all ranks computing. For pipelined plans the
search therefore predicts the pipeline part by simulating the plan's own schedule with processor sharing
(planner/schedule.py) from the closed form's per-stage times; the once-per-iteration tail (optimizer,
exposed gradient sync) runs on all ranks and keeps the measured speed. Only computation speeds up: a
stage's other work (pipeline bookkeeping and transfers, engine hooks) keeps its measured time, and 1F1B's
wait for a round trip, which the in-situ pairs measure with the bookkeeping, goes on the hops, where the
schedule's own order decides whether a rank waits for it: timed inside the executor
(benchmarks/pipeline_trace.py), a stage's forward and backward actions run at the profile's speed while
much of a rank's step is spent waiting on transfers, which no idle core shortens. The simulation, not
the closed form's bubble formula, then also sets the bubble: for zero-bubble V with few micro-batches
(m < 2pp − 1) that formula is optimistic, and scaling it by the sharing speed-up would count the bubble
twice.

Where no cores are shared the ILP still optimises the closed form, and the search reports each pipelined
candidate that can still enter its ranking by the same simulation at constant speed (Search.score; a longest
path over the schedule's fixed dependency graph, `fixed_speed_makespan`): the closed form's (m + bubble)·τ_max
charges every
micro-batch the slowest rank's time and the bubble in those units, while the real order waits on each
stage's own neighbours. With unequal chunks that matters: an interleaved schedule whose chunks differ (a
chunk holding the LM head is several times the others) can rank below one with fewer chunks in the real
order while the closed form, blind to where the slow chunk sits, ranks them the other way round.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache
from itertools import accumulate

import numpy as np
from meshplan.planner.cost_model import Evaluation
from meshplan.planner.plan import stage_rank
from meshplan.planner.schedule import StageTimes, rank_actions, simulate

Rate = Callable[[int], float]


def relative_rate(profile) -> Rate | None:
    """rate(n): speed with n processes computing over the speed the profile was measured at; None when
    the profile's ranks did not outnumber the cores (GPUs, presets, enough CPU cores)."""
    cores, threads = getattr(profile, "cpu_cores", 0), getattr(profile, "threads_per_rank", 0)
    if profile.device_kind != "cpu" or cores <= 0 or threads <= 0:
        return None

    def speed(n: int) -> float:
        return min(1.0, cores / (max(1, n) * threads))

    measured = speed(profile.concurrent_ranks)
    if measured >= 1.0:
        return None
    return lambda n: speed(n) / measured


def stage_times(ev: Evaluation) -> list[StageTimes]:
    """Per-micro-batch stage times of an evaluation: the stage's other work (pipeline overhead, engine
    hooks, parameter gathers) as its `overhead`, less the part of 1F1B's pipeline cost that is waiting
    on the neighbour, which goes on the hops (cost_pipeline.pipeline_busy_wait)."""
    return [StageTimes(forward=s.forward, backward=s.backward, recompute=s.recompute,
                       overhead=max(0.0, s.communication - s.relief), communication=s.hop_wait)
            for s in ev.stages]


def shared_iteration_time(ev: Evaluation, schedule: str, pp: int, v: int, m: int, replicas: int,
                          rate: Rate | None) -> float:
    """The evaluation's iteration time with the pipeline part simulated: the plan's own schedule from its
    per-stage times, under processor sharing when `rate` is given; `replicas` (dp·tp) processes run every
    pipeline rank's work at once."""
    if pp == 1:
        return ev.iteration_time
    if rate is None:
        return fixed_speed_makespan(schedule, pp, v, m, stage_times(ev)) + ev.tail
    shared = simulate(schedule, pp, v, m, stage_times(ev), rate=lambda n: rate(n * replicas))
    return shared.makespan + ev.tail


# ------------------------------------------------------------------------------ constant speed, fast

_KIND = {"F": 0, "B": 1, "I": 2, "W": 3}


@lru_cache(maxsize=8)
def _dependency_graph(schedule: str, pp: int, v: int, m: int) -> tuple[list[int], list[tuple[int, int, int, int]]]:
    """The schedule's actions as (previous action on the rank, input action, stage whose P2P the input
    crosses or -1, duration slot = stage·4 + kind), and an order of them where both come first. Inputs
    as `schedule.simulate` reads them: a forward needs the previous stage's forward, a backward the next
    stage's backward or input-grad (the last stage its own forward), a weight-grad its input-grad. Built
    once per shape: the top candidates of a search share a few."""
    orders = rank_actions(schedule, pp, v, m)
    last = pp * v - 1
    rank_of = [stage_rank(k, pp, schedule, v) for k in range(last + 1)]
    slots = [[a.stage * 4 + _KIND[a.kind] for a in order] for order in orders]
    mbs = [[a.micro_batch for a in order] for order in orders]
    ident = [-1] * ((last + 1) * 4 * m)  # (slot, micro-batch) → action
    n = 0
    for rank_slots, rank_mbs in zip(slots, mbs):
        for slot, mb in zip(rank_slots, rank_mbs):
            ident[slot * m + mb] = n
            n += 1
    rows: list[tuple[int, int, int, int]] = []
    deps: list[list[int]] = []
    for rank_slots, rank_mbs in zip(slots, mbs):
        prev, rank_deps = -1, []
        for slot, mb in zip(rank_slots, rank_mbs):
            stage, kind = divmod(slot, 4)
            src = _input(stage, kind, last)
            dep = cross = -1
            if src is not None:
                dep = ident[src * m + mb]
                if dep < 0:  # "B" or "I": a split backward's input-grad
                    dep = ident[(src + 1) * m + mb]
                cross = src // 4 if rank_of[src // 4] != rank_of[stage] else -1
            rows.append((prev, dep, cross, slot))
            rank_deps.append(dep)
            prev = len(rows) - 1
        deps.append(rank_deps)
    placed = [False] * n
    sequence: list[int] = []
    pos = [0] * pp
    starts = [0, *accumulate(len(order) for order in orders)]
    while len(sequence) < n:  # round robin, as the ranks run: each rank on while its input is placed
        before = len(sequence)
        for r, rank_deps in enumerate(deps):
            p, end, base = pos[r], len(rank_deps), starts[r]
            while p < end and (rank_deps[p] < 0 or placed[rank_deps[p]]):
                placed[base + p] = True
                sequence.append(base + p)
                p += 1
            pos[r] = p
        if len(sequence) == before:
            raise RuntimeError(f"pipeline schedule {schedule} deadlocked")
    return sequence, rows


def _input(stage: int, kind: int, last: int) -> int | None:
    """Slot (stage·4 + kind) of an action's input, B standing for B or I (I is the next slot); None for
    stage 0's forwards. Kinds as `_KIND` numbers them: F 0, B 1, I 2, W 3."""
    if kind == 0:
        return (stage - 1) * 4 if stage > 0 else None
    if kind == 3:
        return stage * 4 + 1
    return stage * 4 if stage == last else (stage + 1) * 4 + 1


def fixed_speed_makespan(schedule: str, pp: int, v: int, m: int, times: Sequence[StageTimes]) -> float:
    """`schedule.simulate(...).makespan` without processor sharing, as a longest path: at constant speed
    each action starts when its rank is free and its input has arrived, so one pass over the dependency
    graph in order gives every end time (the event simulation's cost grows with the events it interleaves;
    the search scores many pipelines). Spans are added in `simulate`'s order, so the sums are the same.
    Memoised: candidates that differ only in memory (ZeRO level, placement) have the same stage times."""
    return _makespan(schedule, pp, v, m, tuple(times))


@lru_cache(maxsize=256)
def _makespan(schedule: str, pp: int, v: int, m: int, times: tuple[StageTimes, ...]) -> float:
    sequence, rows = _dependency_graph(schedule, pp, v, m)
    comm = [t.communication for t in times]
    spans: list[tuple[float, float, float]] = []
    for t in times:  # per slot: F, B, I, W, as schedule._spans splits them (a zero span adds nothing)
        work = t.forward + t.backward
        share = t.forward / work if work > 0 else 0.5
        after_f, after_b = t.overhead * share, t.overhead * (1 - share)
        spans += [(t.forward, after_f, 0.0), (t.recompute, t.backward, after_b),
                  (t.recompute, t.backward * (1 - t.weight_fraction), after_b),
                  (t.backward * t.weight_fraction, 0.0, 0.0)]
    end = [0.0] * len(rows)
    makespan = 0.0
    for i in sequence:
        prev, dep, cross, slot = rows[i]
        start = end[prev] if prev >= 0 else 0.0
        if dep >= 0:
            ready = end[dep] + comm[cross] if cross >= 0 else end[dep]
            if ready > start:
                start = ready
        a, b, c = spans[slot]
        finish = end[i] = start + a + b + c
        if finish > makespan:
            makespan = finish
    return makespan


def stage_busy(ev: Evaluation) -> list[float]:
    """Seconds each stage computes per micro-batch in the simulation (its spans: forward, backward,
    recompute and its own overhead; the hop waits are not the stage's)."""
    return [t.forward + t.backward + t.recompute + t.overhead for t in stage_times(ev)]


def makespan_lower_bound(schedule: str, pp: int, v: int, m: int, work: float, longest: float) -> float:
    """Least constant-speed makespan of any partition whose stages compute `work` seconds per micro-batch
    in all, no rank less than `longest` (its largest layer): each rank runs its m micro-batches one after
    the other, m·max(work/pp, longest), and with one stage per rank or looped chunks, at least
    `fill_factor`·work (the pipeline's fill and drain, whatever the partition)."""
    return max(m * max(work / pp, longest), fill_factor(schedule, pp, v, m) * work)


@lru_cache(maxsize=512)
def fill_factor(schedule: str, pp: int, v: int, m: int) -> float:
    """κ ≥ m/pp with makespan ≥ κ · Σ_k w_k for every partition, w_k stage k's seconds per micro-batch.

    Paths of the dependency graph (makespan ≥ each one's length), for rank r and chunk c, k = c·pp + r
    (GPipe and 1F1B: v = 1, c = 0; looped interleaving: stage j on rank j % pp, m a multiple of pp):
    micro-batch 0's forwards through stages 0..k-1, rank r's own actions from F(k, 0) to B(k, m-1),
    then micro-batch m-1's backwards through stages k-1..0. Before F(k, 0) rank r has only run the first
    round's forwards of its chunks below c (pp micro-batches each), and after B(k, m-1) only the last
    round's backwards of those (schedule.rank_actions: rounds of pp micro-batches, warm-up and cool-down
    of at least c·pp steps), so the path has length
        Σ_{j<k} w_j + m·w_r − pp·Σ_{c'<c} w_{c'·pp+r}     (F_j + B_j = w_j),
    linear in w with coefficients A[stage, path] ≥ 0. For any λ ≥ 0 with Σλ = 1 the makespan is at least
    Σ_k (Aλ)_k w_k ≥ min_k (Aλ)_k · Σ_k w_k. λ solving Aλ = 1 (normalised) makes every stage's coefficient
    equal, the best such bound where it is ≥ 0 (for v = 1 it is C of the closed form m/(1 − (1 − 1/m)^pp)
    per unit of work); any other λ ≥ 0 is still a valid one. Other schedules (zero-bubble): m/pp."""
    even = m / pp
    if pp == 1 or schedule not in ("gpipe", "1f1b", "interleaved-1f1b") or m % pp and v > 1:
        return even
    if v == 1:
        return max(even, 1.0 / (1.0 - (1.0 - 1.0 / m) ** pp))
    A = _path_coefficients(pp, v, m)
    try:
        lam = np.linalg.solve(A, np.ones(len(A)))
    except np.linalg.LinAlgError:
        return even
    lam = np.clip(lam, 0.0, None)
    if lam.sum() <= 0:
        return even
    lam /= lam.sum()
    return max(even, float((A @ lam).min()) * (1 - 1e-12))


@lru_cache(maxsize=64)
def _path_coefficients(pp: int, v: int, m: int) -> np.ndarray:
    """A[stage (c', s) → c'·pp + s, path (r, c) → c·pp + r] of `fill_factor`'s paths."""
    S = pp * v
    k = np.arange(S)
    stage, path = k[:, None], k[None, :]
    own = (stage % pp) == (path % pp)
    below = stage < path  # the stage is on the path's forward chain and backward drain
    A = below.astype(float)
    A[own] += m
    A[own & below] -= pp  # the rank's own earlier chunks: first and last rounds run off the path
    return A


def evaluation_lower_bound(ev: Evaluation, schedule: str, pp: int, v: int, m: int) -> float:
    """A lower bound on `shared_iteration_time(ev, ...)` without processor sharing, from the stages' own
    times (no simulation): each rank's m micro-batches, and the longest of `fill_factor`'s paths."""
    if pp == 1:
        return ev.iteration_time
    busy = np.array(stage_busy(ev))
    ranks = np.zeros(pp)
    np.add.at(ranks, [stage_rank(k, pp, schedule, v) for k in range(len(busy))], busy)
    best = m * float(ranks.max())
    if fill_factor(schedule, pp, v, m) > m / pp:  # the schedules whose paths fill_factor knows
        best = max(best, float((_path_coefficients(pp, v, m).T @ busy).max()))
    return best + ev.tail
