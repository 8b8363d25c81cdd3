"""Pipeline schedule simulator: the per-rank action orders of torch.distributed.pipelining, run with their
dependencies to get one iteration's timeline, makespan and bubble.

The orders follow torch 2.13's torch/distributed/pipelining/schedules.py:
- gpipe            ScheduleGPipe: all forwards, then all backwards.
- 1f1b             Schedule1F1B: min(m, pp - rank) warm-up forwards, then backward/forward pairs, then the rest.
- interleaved-1f1b ScheduleInterleaved1F1B (looped stages k % pp): `_get_warmup_ops` with factor 2 and
                   `_get_1f1b_rank_ops`, depth first over rounds of m // max(1, m // pp) micro-batches.
- zero-bubble      v == 2: ScheduleZBVZeroBubble (V-shaped stages, backward split into input-grad I and
                   weight-grad W); otherwise ScheduleInterleavedZeroBubble (looped, factor 1, I/W split).
tests/test_schedule.py checks every order against torch's own generator.

Each rank runs its actions in order; an action starts when its rank is free and its inputs have arrived:
a forward needs the previous stage's forward of that micro-batch, a backward the next stage's backward
(the last stage's backward needs its own forward), a weight-grad its input-grad. Crossing ranks adds that
boundary's point-to-point time. Recomputation runs just before the backward (input-grad) that needs it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from meshplan.planner.plan import SCHEDULES, Plan, stage_rank

COMPUTE_KINDS = ("forward", "backward", "backward_input", "backward_weight", "recompute")
COMM_KINDS = ("p2p_forward", "p2p_backward")


@dataclass(frozen=True)
class StageTimes:
    """Seconds for ONE micro-batch on one pipeline stage.

    `backward` is the whole backward (input-grad + weight-grad); zero-bubble schedules split it, giving
    `weight_fraction` of it to the weight-grad. `communication` is the point-to-point time of the tensor
    this stage sends to its neighbour (activation forward, its gradient backward). `overhead` is the
    stage's work besides computing (pipeline bookkeeping, engine hooks, collectives), run after the
    forward and the backward in proportion to them; processor sharing does not speed it up (`simulate`)."""

    forward: float
    backward: float
    recompute: float = 0.0
    communication: float = 0.0
    weight_fraction: float = 0.5
    overhead: float = 0.0

    def __post_init__(self) -> None:
        for name in ("forward", "backward", "recompute", "communication", "overhead"):
            if getattr(self, name) < 0:
                raise ValueError(f"StageTimes.{name}: expected >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.weight_fraction <= 1.0:
            raise ValueError(f"StageTimes.weight_fraction: expected in [0, 1], got {self.weight_fraction}")


@dataclass(frozen=True)
class Action:
    """One scheduled computation, named as torch does: F forward, B full backward, I input-grad, W weight-grad."""

    stage: int
    kind: str
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.micro_batch}"


@dataclass(frozen=True)
class Event:
    """Something that takes time on a pipeline rank. For p2p events `rank` receives from `peer`."""

    rank: int
    stage: int
    micro_batch: int
    kind: str
    start: float
    end: float
    peer: int | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    """One simulated iteration of a pipeline schedule."""

    schedule: str
    pp: int
    virtual_stages: int
    num_micro_batches: int
    actions: list[list[Action]]
    events: list[Event]
    makespan: float
    busy: list[float]  # compute seconds per rank
    max_in_flight: dict[int, int] = field(default_factory=dict)  # stage -> most micro-batches held at once

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the ranks' compute time over the iteration: 1 - busy / (pp x makespan)."""
        if self.makespan <= 0:
            return 0.0
        return max(0.0, 1.0 - sum(self.busy) / (self.pp * self.makespan))

    def rank_events(self, rank: int, compute_only: bool = False) -> list[Event]:
        return [e for e in self.events if e.rank == rank and (not compute_only or e.kind in COMPUTE_KINDS)]


# ---------------------------------------------------------------------------------------------- orders


def rank_actions(schedule: str, pp: int, virtual_stages: int, num_micro_batches: int) -> list[list[Action]]:
    """The ordered actions of every pipeline rank, as torch.distributed.pipelining would run them."""
    m, v = num_micro_batches, virtual_stages
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {', '.join(SCHEDULES)}, got '{schedule}'")
    if pp < 1 or v < 1 or m < 1:
        raise ValueError(f"pp, virtual_stages and num_micro_batches must be >= 1, got {pp}, {v}, {m}")
    if schedule in ("gpipe", "1f1b") and v != 1:
        raise ValueError(f"virtual_stages: {schedule} runs one stage per rank, got {v}")
    if schedule == "gpipe":
        return [_gpipe(m, r) for r in range(pp)]
    if schedule == "1f1b":
        return [_one_f_one_b(pp, m, r) for r in range(pp)]
    if schedule == "zero-bubble" and v == 2:
        return [_zbv(pp, m, r) for r in range(pp)]
    rounds = max(1, m // pp)
    if m % rounds:
        raise ValueError(f"num_micro_batches: {schedule} needs a multiple of max(1, m // pp) = {rounds}, got {m}")
    return [_looped(pp, v, m, r, zero_bubble=schedule == "zero-bubble") for r in range(pp)]


def _gpipe(m: int, rank: int) -> list[Action]:
    return [Action(rank, "F", i) for i in range(m)] + [Action(rank, "B", i) for i in range(m)]


def _one_f_one_b(pp: int, m: int, rank: int) -> list[Action]:
    warmup = min(m, pp - rank)  # Schedule1F1B._step_microbatches: last stage 1 warm-up, first stage pp
    ops = [Action(rank, "F", i) for i in range(warmup)]
    fwd, bwd = warmup, 0
    while True:
        ops.append(Action(rank, "B", bwd))
        bwd += 1
        if fwd == m:
            break
        ops.append(Action(rank, "F", fwd))
        fwd += 1
    ops += [Action(rank, "B", i) for i in range(bwd, m)]
    return ops


def _looped(pp: int, v: int, m: int, rank: int, zero_bubble: bool) -> list[Action]:
    """_get_warmup_ops + _get_1f1b_rank_ops of ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble."""
    per_round = m // max(1, m // pp)
    warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * (pp - 1 - rank), m * v)
    steady = v * m - warmup
    counts: dict[tuple[str, int], int] = defaultdict(int)

    def fwd_stage(step: int) -> int:
        return ((step // per_round) % v) * pp + rank

    def bwd_stage(step: int) -> int:
        return (v - 1 - ((step - warmup) // per_round) % v) * pp + rank

    def add(kind: str, stage: int) -> None:
        ops.append(Action(stage, kind, counts[kind, stage]))
        counts[kind, stage] += 1

    ops: list[Action] = []
    backward_steps: list[int] = []
    weights_done = 0
    for step in range(warmup + steady + warmup):
        if step < warmup + steady:
            add("F", fwd_stage(step))
        if step >= warmup:
            add("I" if zero_bubble else "B", bwd_stage(step))
            backward_steps.append(step)
            if zero_bubble and step - warmup >= rank:
                add("W", bwd_stage(backward_steps[weights_done]))
                weights_done += 1
    while zero_bubble and weights_done < len(backward_steps):
        add("W", bwd_stage(backward_steps[weights_done]))
        weights_done += 1
    return ops


def _zbv(pp: int, m: int, rank: int) -> list[Action]:
    """ScheduleZBVZeroBubble._calculate_single_rank_operations (stages rank and 2pp-1-rank)."""
    n = max(2 * pp - 1, m)
    s0, s1 = rank, 2 * pp - 1 - rank
    ops: list[Action] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (pp - rank) - 1):
        ops.append(Action(s0, "F", f0))
        f0 += 1
    for _ in range(rank):
        ops += [Action(s1, "F", f1), Action(s0, "F", f0)]
        f1 += 1
        f0 += 1
    for _ in range(pp - rank):
        ops += [Action(s1, "F", f1), Action(s1, "I", b1), Action(s1, "W", b1)]
        f1 += 1
        b1 += 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            ops.append(Action(s0, "F", f0))
            f0 += 1
        ops += [Action(s0, "I", b0), Action(s0, "W", b0), Action(s1, "F", f1), Action(s1, "I", b1),
                Action(s1, "W", b1)]
        b0 += 1
        f1 += 1
        b1 += 1
    w0, w1 = b0, b1
    for _ in range(rank):
        ops += [Action(s0, "I", b0), Action(s1, "I", b1)]
        b0 += 1
        b1 += 1
    for _ in range(pp - rank):
        ops += [Action(s0, "I", b0), Action(s0, "W", w0)]
        b0 += 1
        w0 += 1
    ops += [Action(s1, "W", i) for i in range(w1, b1)]
    ops += [Action(s0, "W", i) for i in range(w0, b0)]
    return [a for a in ops if a.micro_batch < m]  # torch pads to 2pp-1 micro-batches, then drops the extra


# ------------------------------------------------------------------------------------------ simulation


def simulate(schedule: str, pp: int, virtual_stages: int, num_micro_batches: int,
             stage_times: Sequence[StageTimes], rate: Callable[[int], float] | None = None) -> Timeline:
    """Run one iteration of `schedule` and return its events, makespan and bubble.

    `stage_times[k]` are stage k's per-micro-batch times (k over pp x virtual_stages stages, in model
    order). `rate(n)`: how fast each computing rank runs, relative to those times, while n ranks compute
    at once (processor sharing: CPU ranks that outnumber the cores run faster when others idle in the
    bubble); None: always 1. Point-to-point time and the stages' `overhead` are not scaled: CPU ranks
    that share cores spend most of that time waiting on transfers (benchmarks/pipeline_trace.py shows
    it per rank), which idle cores do not shorten.
    Raises ValueError on inconsistent arguments and RuntimeError if the orders deadlock."""
    num_stages = pp * virtual_stages
    if len(stage_times) != num_stages:
        raise ValueError(f"stage_times: expected pp x virtual_stages = {num_stages} entries, got {len(stage_times)}")
    orders = rank_actions(schedule, pp, virtual_stages, num_micro_batches)
    rank_of = [stage_rank(k, pp, schedule, virtual_stages) for k in range(num_stages)]
    done: dict[tuple[int, str, int], float] = {}  # (stage, kind, micro-batch) -> end time
    events: list[Event] = []
    busy = [0.0] * pp
    pos = [0] * pp
    running: dict[int, _Running] = {}
    last = num_stages - 1
    now = 0.0

    def inputs(a: Action) -> list[tuple[int, str, int]]:
        """(stage, kind, micro-batch) this action waits for; kind 'BI' means B or I."""
        if a.kind == "F":
            return [(a.stage - 1, "F", a.micro_batch)] if a.stage > 0 else []
        if a.kind == "W":
            return [(a.stage, "BI", a.micro_batch)]
        if a.stage == last:
            return [(a.stage, "F", a.micro_batch)]
        return [(a.stage + 1, "BI", a.micro_batch)]

    def finished(stage: int, kind: str, mb: int) -> float | None:
        if kind == "BI":
            t = done.get((stage, "B", mb))
            return t if t is not None else done.get((stage, "I", mb))
        return done.get((stage, kind, mb))

    def arrival(r: int, a: Action) -> tuple[float, list[Event]] | None:
        """When the action's inputs are all on rank r (None: some not produced yet), with the p2p events."""
        ready, p2p = 0.0, []
        for stage, kind, mb in inputs(a):
            t = finished(stage, kind, mb)
            if t is None:
                return None
            if rank_of[stage] != r:
                comm = stage_times[stage].communication
                if comm > 0:
                    p2p.append(Event(r, a.stage, mb, "p2p_forward" if kind == "F" else "p2p_backward",
                                     t, t + comm, peer=rank_of[stage]))
                t += comm
            ready = max(ready, t)
        return ready, p2p

    def finish(r: int, job: _Running) -> None:
        done[job.action.stage, job.action.kind, job.action.micro_batch] = now
        busy[r] += now - job.started
        pos[r] += 1
        del running[r]

    remaining = sum(len(o) for o in orders)
    while remaining:
        wake = math.inf
        for r in range(pp):  # start every action whose inputs have arrived
            while r not in running and pos[r] < len(orders[r]):
                a = orders[r][pos[r]]
                got = arrival(r, a)
                if got is None:
                    break
                if got[0] > now + _EPS:
                    wake = min(wake, got[0])
                    break
                events.extend(got[1])
                running[r] = _Running(a, now, _spans(a, stage_times[a.stage]))
                if not running[r].spans:  # nothing to compute
                    finish(r, running[r])
                    remaining -= 1
        if not running:
            if wake == math.inf:
                stuck = {r: str(orders[r][pos[r]]) for r in range(pp) if pos[r] < len(orders[r])}
                raise RuntimeError(f"pipeline schedule {schedule} deadlocked waiting at {stuck}")
            now = wake
            continue
        speed = rate(len(running)) if rate is not None else 1.0
        for job in running.values():
            job.pace(now, speed if job.spans[0][2] else 1.0)
        now = min(wake, min(job.end for job in running.values()))
        for r, job in list(running.items()):
            if job.end > now + _EPS:
                continue
            prev = events[job.event] if job.event >= 0 else None
            if prev is not None and prev.kind == job.spans[0][0]:  # an overhead span continues its computation
                events[job.event] = replace(prev, end=now)
            else:
                job.event = len(events)
                events.append(Event(r, job.action.stage, job.action.micro_batch, job.spans[0][0], job.span_start, now))
            job.spans.pop(0)
            job.span_start = now
            job.speed = 0.0  # the next span's end is set by pace
            if not job.spans:
                finish(r, job)
                remaining -= 1
    makespan = max((e.end for e in events), default=0.0)
    return Timeline(schedule, pp, virtual_stages, num_micro_batches, orders, events, makespan, busy,
                    _max_in_flight(orders))


_EPS = 1e-12


@dataclass
class _Running:
    """The action a rank is computing: its spans (kind, seconds of work, sped up by processor sharing),
    the current one first, and when the current one ends at the present `speed` (0: not yet paced)."""

    action: Action
    started: float
    spans: list[tuple[str, float, bool]]
    span_start: float = 0.0
    end: float = 0.0
    speed: float = 0.0
    event: int = -1  # index of this action's latest event

    def __post_init__(self) -> None:
        self.span_start = self.started

    def pace(self, now: float, speed: float) -> None:
        """Run on at `speed` from `now`: the work left keeps, the end moves (start + seconds exactly when
        the speed never changes, so a constant-rate run matches the fixed-speed timeline)."""
        if self.speed == speed:
            return
        kind, work, shared = self.spans[0]
        if self.speed > 0:
            work = (self.end - now) * self.speed
            self.spans[0] = (kind, work, shared)
        self.end = now + work / speed
        self.speed = speed


def _spans(a: Action, st: StageTimes) -> list[tuple[str, float, bool]]:
    """The (kind, seconds, shared) an action computes, in order; zero-length ones left out. The stage's
    overhead follows the forward and the backward in proportion (the backward's share on the input-grad
    of a split backward), under the computation's kind, not sped up by sharing."""
    work = st.forward + st.backward
    share = st.forward / work if work > 0 else 0.5
    if a.kind == "F":
        spans = [("forward", st.forward, True), ("forward", st.overhead * share, False)]
    elif a.kind == "B":
        spans = [("recompute", st.recompute, True), ("backward", st.backward, True),
                 ("backward", st.overhead * (1 - share), False)]
    elif a.kind == "I":
        spans = [("recompute", st.recompute, True), ("backward_input", st.backward * (1 - st.weight_fraction), True),
                 ("backward_input", st.overhead * (1 - share), False)]
    else:
        spans = [("backward_weight", st.backward * st.weight_fraction, True)]
    return [(k, sec, shared) for k, sec, shared in spans if sec > 0]


def _max_in_flight(orders: list[list[Action]]) -> dict[int, int]:
    """Most micro-batches whose activations a stage holds at once (forward done, backward not yet):
    what 1F1B's memory advantage over GPipe comes from."""
    peak: dict[int, int] = {}
    for order in orders:
        held: dict[int, int] = defaultdict(int)
        for a in order:
            if a.kind == "F":
                held[a.stage] += 1
                peak[a.stage] = max(peak.get(a.stage, 0), held[a.stage])
            elif a.kind in ("B", "W"):
                held[a.stage] -= 1
    return peak


# ------------------------------------------------------------------------------------------ from a plan


def plan_stage_times(plan: Plan) -> list[StageTimes]:
    """Per-micro-batch stage times from a plan.

    A plan's `stages[k].predicted_time_s` are seconds per ITERATION on that stage (report.py's "time/iter"):
    the sum over its num_micro_batches micro-batches. They are divided by num_micro_batches here; the
    `communication` term becomes the per-micro-batch point-to-point time at the stage's boundary."""
    m = plan.parallel.num_micro_batches
    out = []
    for s in plan.stages:
        t = s.predicted_time_s
        out.append(StageTimes(forward=t.get("forward", 0.0) / m, backward=t.get("backward", 0.0) / m,
                              recompute=t.get("recompute", 0.0) / m, communication=t.get("communication", 0.0) / m))
    return out


def plan_timeline(plan: Plan) -> Timeline:
    """Simulate the plan's own schedule with its predicted stage times."""
    p = plan.parallel
    return simulate(p.schedule, p.pp, p.virtual_stages, p.num_micro_batches, plan_stage_times(plan))
