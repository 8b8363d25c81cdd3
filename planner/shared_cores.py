"""CPU ranks that outnumber the cores share them: a rank idle in the pipeline bubble gives its core to the
busy ones, which then run faster than the profile's times.

A CPU profile is measured with all `concurrent_ranks` processes computing at once, each with
`threads_per_rank` threads on `cpu_cores` cores, so its times hold at the speed min(1, C / (R·t)). With
n processes computing the speed is min(1, C / (n·t)) (processor sharing, the standard model of a
time-shared CPU: Kleinrock, Queueing Systems vol. 2, 1976, ch. 4). The closed form of the cost model
keeps every rank at the measured speed, which over-predicts bubble-heavy plans (measured on tiny, 4 ranks
on 2 cores: GPipe pp=4 with 2 micro-batches ran in 88 ms against 142 ms predicted). For pipelined plans the
search therefore predicts the pipeline part by simulating the plan's own schedule with processor sharing
(planner/schedule.py) from the closed form's per-stage times; the once-per-iteration tail (optimizer,
exposed gradient sync) runs on all ranks and keeps the measured speed. Only computation speeds up: a
stage's other work (pipeline bookkeeping and transfers, engine hooks) keeps its measured time, and 1F1B's
wait for a round trip, which the in-situ pairs measure with the bookkeeping, goes on the hops, where the
schedule's own order decides whether a rank waits for it. Timed inside the executor (GPipe, pp 4, tiny),
the stages' forward and backward matched the simulation's at full speed while the ranks used 1.3 of the
2 cores and rank 0 waited two thirds of its step; re-predicted from their own profiles
(`benchmarks/resimulate.py`), four tiny/4 benchmark runs moved from 22.2-26.3 % median error to
15.8-20.4 % and from Spearman 0.75-0.84 to 0.79-0.89, while tiny/2 and gpt-20m changed by under 1 point.
The simulation, not the closed form's bubble formula, then also sets the bubble: for zero-bubble V with
few micro-batches (m < 2pp − 1) that formula is optimistic, and scaling it by the sharing speed-up would
count the bubble twice.

Where no cores are shared the search runs on the closed form and then re-ranks its best candidates by the
same simulation at constant speed (Search.rescore): the closed form's (m + bubble)·τ_max charges every
micro-batch the slowest rank's time and the bubble in those units, while the real order waits on each
stage's own neighbours. With unequal chunks that matters: gpt-20m on 2 CPU ranks, interleaved 1F1B with 3
chunks per rank (the LM head's chunk three times the others) measured 1.94 s where the closed form gave
1.50 s and the simulation 1.70 s, and with 2 chunks 1.72 s (closed form 1.54 s, simulation 1.53 s): the
closed form ranked them the wrong way round.
"""

from __future__ import annotations

from collections.abc import Callable

from meshplan.planner.cost_model import Evaluation
from meshplan.planner.schedule import StageTimes, simulate

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
    on the neighbour, which goes on the hops (cost_model.pipeline_busy_wait)."""
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
    shared = simulate(schedule, pp, v, m, stage_times(ev),
                      rate=(lambda n: rate(n * replicas)) if rate is not None else None)
    return shared.makespan + ev.tail
