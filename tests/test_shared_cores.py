"""Processor sharing: CPU ranks that outnumber the cores run faster while others idle in the bubble."""

import pytest
from meshplan.planner.cluster_spec import parse_cluster
from meshplan.planner.constraints import Constraints
from meshplan.planner.model_sources import builtin_model
from meshplan.planner.schedule import StageTimes, simulate
from meshplan.planner.search import find_plan
from meshplan.planner.shared_cores import relative_rate
from meshplan.profiler.presets import preset_profile


def _profile(cores: int, ranks: int = 4, device: str = "cpu"):
    profile = preset_profile(builtin_model("tiny"), parse_cluster(f"{ranks}xcpu"), "fp32")
    profile.device_kind, profile.cpu_cores, profile.threads_per_rank, profile.concurrent_ranks = device, cores, 1, ranks
    return profile


def test_rate_is_relative_to_the_measured_contention():
    rate = relative_rate(_profile(cores=2))  # measured at 4 processes on 2 cores: half speed
    assert rate(4) == pytest.approx(1.0) and rate(2) == pytest.approx(2.0) and rate(1) == pytest.approx(2.0)
    assert rate(8) == pytest.approx(0.5)
    assert relative_rate(_profile(cores=4)) is None  # every rank had its core
    assert relative_rate(_profile(cores=2, device="cuda")) is None
    assert relative_rate(_profile(cores=0)) is None  # not recorded


def test_shared_simulation_speeds_up_only_what_runs_alone():
    rate = relative_rate(_profile(cores=2))
    st = [StageTimes(1.0, 2.0)] * 4
    fixed = simulate("gpipe", 4, 1, 2, st)
    assert fixed.makespan == pytest.approx(15.0)  # (m + pp - 1)(f + b)
    # with 2 micro-batches at most 2 of the 4 ranks compute at once: all of it at full speed
    assert simulate("gpipe", 4, 1, 2, st, rate=rate).makespan == pytest.approx(7.5)
    steady = simulate("1f1b", 4, 1, 8, st, rate=rate)
    work = 4 * 8 * 3.0 * 0.5 / 2  # core-seconds at full speed over 2 cores: the floor
    assert work <= steady.makespan < simulate("1f1b", 4, 1, 8, st).makespan
    same = simulate("1f1b", 2, 1, 4, st[:2], rate=lambda n: 1.0)
    assert [(e.kind, e.start, e.end) for e in same.events] == \
        [(e.kind, e.start, e.end) for e in simulate("1f1b", 2, 1, 4, st[:2]).events]


def test_search_predicts_pipelined_plans_faster_on_shared_cores():
    model, cluster = builtin_model("tiny"), parse_cluster("4xcpu")
    pins = dict(global_batch_size=16, seq_len=64, dtype="fp32", top_k=0)
    gpipe = Constraints(**pins, pp=4, dp=1, tp=1, schedule="gpipe", micro_batch_size=8)
    shared = find_plan(model, cluster, gpipe, _profile(cores=2)).predicted.iteration_time_s
    alone = find_plan(model, cluster, gpipe, _profile(cores=4)).predicted.iteration_time_s
    # at most 2 of the 4 ranks compute at once: everything at twice the measured speed (the exact law is
    # test_shared_simulation_speeds_up_only_what_runs_alone); the closed form's bubble differs a little
    assert alone / 3 < shared < 0.75 * alone
    dp = Constraints(**pins, pp=1, dp=4, tp=1, micro_batch_size=4)  # every rank always busy: unchanged
    assert find_plan(model, cluster, dp, _profile(cores=2)).predicted.iteration_time_s == \
        pytest.approx(find_plan(model, cluster, dp, _profile(cores=4)).predicted.iteration_time_s)


def test_choice_is_the_fastest_shared_prediction():
    model, cluster = builtin_model("tiny"), parse_cluster("4xcpu")
    plan = find_plan(model, cluster, Constraints(global_batch_size=16, seq_len=64, dtype="fp32", top_k=4),
                     _profile(cores=2))
    assert all(plan.predicted.iteration_time_s <= a.predicted.iteration_time_s for a in plan.alternatives)


def test_pruning_keeps_the_best_shared_prediction():
    """The lower bounds, divided by the largest sharing speed-up a candidate can get, still prune only
    candidates that cannot win: the best equals that of solving every candidate."""
    from meshplan.planner.search import Search

    model, cluster = builtin_model("tiny"), parse_cluster("4xcpu")
    constraints = Constraints(global_batch_size=16, seq_len=64, dtype="fp32", top_k=0, zero=0, recompute="none")
    pruned = Search(model, cluster, constraints, _profile(cores=2)).run(1)
    everything = Search(model, cluster, constraints, _profile(cores=2)).run(10**6)
    assert len(everything) > 10
    assert pruned[0].time == pytest.approx(min(r.time for r in everything))


def _with_pipeline_costs(profile, gpipe: float = 1e-3, steady: float = 3.3e-3):
    """In-situ pipeline figures as tiny's 4-rank profile measured them (GPipe 0.97 ms, 1F1B 3.3 ms at b=1)."""
    from meshplan.profiler.profile import PipelineSample

    overheads = {"gpipe": gpipe, "1f1b": steady, "interleaved-1f1b": 2e-3, "zero-bubble": 2.4e-3}
    profile.pipeline_overheads = dict(overheads)
    profile.pipeline_samples = [PipelineSample(1, dict(overheads)),  # the P2P grows with the micro-batch
                                PipelineSample(16, {k: 2 * v for k, v in overheads.items()})]
    return profile


def test_overhead_keeps_its_measured_time_on_shared_cores():
    rate = relative_rate(_profile(cores=2))
    with_overhead = [StageTimes(1.0, 2.0, overhead=1.0)] * 4
    folded = [StageTimes(1.0 + 1 / 3, 2.0 + 2 / 3)] * 4
    alone = simulate("gpipe", 4, 1, 2, with_overhead)
    assert alone.makespan == pytest.approx(simulate("gpipe", 4, 1, 2, folded).makespan)
    assert len(alone.events) == 4 * 2 * 2  # the overhead continues its computation's event
    # at most 2 of 4 ranks compute: the computation runs twice as fast, the overhead as measured
    assert simulate("gpipe", 4, 1, 2, with_overhead, rate=rate).makespan == pytest.approx(5 * (1.5 + 1.0))


def test_one_f_one_b_round_trip_waits_on_the_hops():
    from meshplan.planner.cost_pipeline import pipeline_busy_wait

    profile = _with_pipeline_costs(_profile(cores=2))
    busy, wait = pipeline_busy_wait(profile, "1f1b")
    assert busy == pytest.approx(1e-3) and wait == pytest.approx(1.3e-3)  # 3.3 = 2 x 1.0 + 1.3
    assert pipeline_busy_wait(profile, "1f1b", unfused=0.5)[1] == pytest.approx(0.65e-3)
    assert pipeline_busy_wait(profile, "gpipe") == (0.0, 0.0)  # all of GPipe's figure is the ranks' work
    assert pipeline_busy_wait(_profile(cores=2), "1f1b") == (0.0, 0.0)  # presets: nothing measured


SLOW = 0.1  # a 1F1B figure far above twice GPipe's, most of it a wait on the hops: the bound's stress case


def test_shared_pruning_stays_sound_with_pipeline_costs():
    """Pipeline costs that the simulation does not speed up, and 1F1B's wait moved onto the hops, keep
    bound / speedup below every solved candidate's prediction, and the quick bounds equal the per-layer ones."""
    from meshplan.planner.cost_model import lower_bound
    from meshplan.planner.search import Search
    from meshplan.planner.search_space import candidates

    model, cluster = builtin_model("tiny"), parse_cluster("4xcpu")
    constraints = Constraints(global_batch_size=16, seq_len=64, dtype="fp32", top_k=0, zero=0, recompute="none")
    search = Search(model, cluster, constraints, _with_pipeline_costs(_profile(cores=2), steady=SLOW))
    checked = 0
    for cand in candidates(model, cluster, constraints, search.placer):
        problem = search.problem(cand)
        bound = search.bounds(cand)[0]
        assert bound == pytest.approx(lower_bound(problem), rel=1e-9)
        solution = search.partition.solve(problem)
        if solution is not None and cand.pp > 1:
            assert bound / search.speedup(cand) <= search.iteration_time(cand, problem, solution) * (1 + 1e-9)
            checked += 1
    assert checked > 5
    pruned = Search(model, cluster, constraints, _with_pipeline_costs(_profile(cores=2))).run(1)
    everything = Search(model, cluster, constraints, _with_pipeline_costs(_profile(cores=2))).run(10**6)
    assert pruned[0].time == pytest.approx(min(r.time for r in everything))


SHAPES = [("gpipe", 4, 1, 3), ("gpipe", 3, 1, 6), ("1f1b", 4, 1, 8), ("1f1b", 4, 1, 5), ("interleaved-1f1b", 4, 2, 8),
          ("interleaved-1f1b", 2, 3, 4), ("interleaved-1f1b", 3, 2, 6), ("zero-bubble", 4, 2, 8),
          ("zero-bubble", 4, 2, 5), ("zero-bubble", 3, 3, 6)]


def _random_times(rng, stages: int, spread: float = 1.0) -> list[StageTimes]:
    return [StageTimes(forward=rng.uniform(0.1, 1.0) * spread ** k, backward=rng.uniform(0.2, 2.0),
                       recompute=rng.choice([0.0, rng.uniform(0, 0.5)]), communication=rng.uniform(0, 0.2),
                       overhead=rng.choice([0.0, rng.uniform(0, 0.4)])) for k in range(stages)]


@pytest.mark.parametrize("schedule,pp,v,m", SHAPES)
def test_fixed_speed_makespan_is_the_simulation(schedule, pp, v, m):
    """The longest path over the schedule's dependency graph is the event simulation's makespan at
    constant speed, for every schedule, stage times and hops."""
    import random

    from meshplan.planner.shared_cores import fixed_speed_makespan

    rng = random.Random(f"{schedule}{pp}{v}{m}")
    for _ in range(20):
        times = _random_times(rng, pp * v)
        assert fixed_speed_makespan(schedule, pp, v, m, times) == \
            pytest.approx(simulate(schedule, pp, v, m, times).makespan, rel=1e-12)


@pytest.mark.parametrize("schedule,pp,v,m", SHAPES)
def test_makespan_lower_bound_holds_for_any_stage_times(schedule, pp, v, m):
    """`makespan_lower_bound` from the stages' total work and busiest stage is below the simulated makespan
    whatever the split over stages (balanced, skewed towards either end, random); for GPipe, 1F1B and
    interleaving it includes part of the fill and drain, above m·work/pp."""
    import random

    from meshplan.planner.shared_cores import fill_factor, makespan_lower_bound

    rng = random.Random(f"bound{schedule}{pp}{v}{m}")
    for spread in (1.0, 0.5, 2.0, None):
        for _ in range(15):
            times = _random_times(rng, pp * v, spread if spread is not None else rng.uniform(0.3, 3.0))
            busy = [t.forward + t.backward + t.recompute + t.overhead for t in times]
            bound = makespan_lower_bound(schedule, pp, v, m, sum(busy), max(busy))
            assert bound <= simulate(schedule, pp, v, m, times).makespan * (1 + 1e-9)
    if schedule != "zero-bubble":
        assert fill_factor(schedule, pp, v, m) > m / pp
    if v == 1:
        assert fill_factor(schedule, pp, v, m) == pytest.approx(1 / (1 - (1 - 1 / m) ** pp))
