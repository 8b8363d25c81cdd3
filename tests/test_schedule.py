import itertools

import pytest
from meshplan.planner.schedule import StageTimes, plan_timeline, rank_actions, simulate

from tests.helpers import make_plan

CASES = [(name, pp, v, m)
         for name, pp, v, m in itertools.product(("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"),
                                                 (1, 2, 3, 4), (1, 2, 3), (1, 2, 4, 6, 8, 12))
         if not (name in ("gpipe", "1f1b") and v != 1)
         and not (name == "1f1b" and m < pp)  # torch's Schedule1F1B refuses m < pp
         and not (name == "interleaved-1f1b" and m % pp)
         and not (name == "zero-bubble" and v != 2 and m % max(1, m // pp))]


def torch_orders(name: str, pp: int, v: int, m: int) -> list[list[str]]:
    """The per-rank compute order torch's own schedule generators produce (no process group needed)."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    if name in ("gpipe", "1f1b"):
        obj = object.__new__(schedules.ScheduleGPipe if name == "gpipe" else schedules.Schedule1F1B)
        obj._num_stages, obj._n_microbatches = pp, m
        order = obj._get_pipeline_order()
    else:
        cls = (schedules.ScheduleZBVZeroBubble if name == "zero-bubble" and v == 2
               else schedules.ScheduleInterleavedZeroBubble if name == "zero-bubble"
               else schedules.ScheduleInterleaved1F1B)
        obj = object.__new__(cls)
        obj.pp_group_size, obj.n_local_stages, obj._n_microbatches, obj.num_stages = pp, v, m, pp * v
        obj.number_of_rounds = max(1, m // pp)
        obj.microbatches_per_round = m // obj.number_of_rounds
        order = {r: obj._calculate_single_rank_operations(r) for r in range(pp)}
    return [[f"{a.stage_index}{a.computation_type.value}{a.microbatch_index}" for a in order[r]
             if a is not None and a.computation_type.value in ("F", "B", "I", "W")] for r in range(pp)]


@pytest.mark.parametrize("name,pp,v,m", CASES)
def test_orders_match_torch(name, pp, v, m):
    try:
        expected = torch_orders(name, pp, v, m)
    except AttributeError as exc:  # private API moved in another torch version
        pytest.skip(f"torch schedule internals changed: {exc}")
    mine = [[str(a) for a in order] for order in rank_actions(name, pp, v, m)]
    if name == "1f1b":
        # torch's _get_pipeline_order numbers the last rank's forwards from 1 (F1..Fm, an IR off-by-one);
        # the runtime (_step_microbatches: warm-up min(m, pp - rank) = 1) runs F0 B0 F1 B1 ...
        assert mine[-1] == [f"{pp - 1}{k}{i}" for i in range(m) for k in "FB"]
        mine, expected = mine[:-1], expected[:-1]
    assert mine == expected


@pytest.mark.parametrize("pp,m", [(2, 2), (2, 8), (4, 4), (4, 8), (8, 16)])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_equal_stage_bubble_is_textbook(name, pp, m):
    t = simulate(name, pp, 1, m, [StageTimes(1.0, 2.0)] * pp)
    assert t.makespan == pytest.approx((m + pp - 1) * 3.0)
    assert t.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1))


def test_interleaved_and_zero_bubble_shrink_the_bubble():
    pp, m, f, b = 4, 8, 1.0, 2.0
    one = simulate("1f1b", pp, 1, m, [StageTimes(f, b)] * pp)
    inter = simulate("interleaved-1f1b", pp, 2, m, [StageTimes(f / 2, b / 2)] * (2 * pp))
    zbv = simulate("zero-bubble", pp, 2, m, [StageTimes(f / 2, b / 2)] * (2 * pp))
    assert sum(one.busy) == pytest.approx(sum(inter.busy)) == pytest.approx(sum(zbv.busy))
    # interleaved: (p - 1) / v warm-up slots instead of p - 1 (Narayanan et al. 2021)
    assert inter.makespan == pytest.approx(m * (f + b) + (pp - 1) * (f + b) / 2)
    assert zbv.bubble_fraction < inter.bubble_fraction < one.bubble_fraction


@pytest.mark.parametrize("name,pp,v,m", [("gpipe", 3, 1, 5), ("1f1b", 4, 1, 6), ("interleaved-1f1b", 2, 3, 4),
                                         ("zero-bubble", 3, 2, 5), ("zero-bubble", 2, 1, 4)])
def test_every_rank_runs_each_of_its_stages_once_per_micro_batch(name, pp, v, m):
    orders = rank_actions(name, pp, v, m)
    split = name == "zero-bubble"
    for rank, order in enumerate(orders):
        stages = {a.stage for a in order}
        assert len(stages) == v
        for stage in stages:
            for kind in ("F", "I", "W") if split else ("F", "B"):
                got = sorted(a.micro_batch for a in order if a.stage == stage and a.kind == kind)
                assert got == list(range(m)), (rank, stage, kind)


@pytest.mark.parametrize("name,pp,v,m", [("1f1b", 4, 1, 8), ("interleaved-1f1b", 4, 2, 8), ("zero-bubble", 4, 2, 8),
                                         ("gpipe", 3, 1, 4)])
def test_events_respect_dependencies_and_never_overlap_on_a_rank(name, pp, v, m):
    comm = 0.25
    st = [StageTimes(1.0, 2.0, recompute=0.5, communication=comm) for _ in range(pp * v)]
    t = simulate(name, pp, v, m, st)
    end = {}
    for e in t.events:
        if e.kind in ("forward", "backward", "backward_input", "backward_weight"):
            end[e.stage, e.kind, e.micro_batch] = e.end
    start = {(e.stage, e.kind, e.micro_batch): e.start for e in t.events}
    bwd = "backward_input" if name == "zero-bubble" else "backward"
    from meshplan.planner.plan import stage_rank

    def hop(a, b):
        return comm if stage_rank(a, pp, name, v) != stage_rank(b, pp, name, v) else 0.0

    last = pp * v - 1
    for s in range(pp * v):
        for mb in range(m):
            if s > 0:
                assert start[s, "forward", mb] >= end[s - 1, "forward", mb] + hop(s - 1, s) - 1e-9
            after = end[s, "forward", mb] if s == last else end[s + 1, bwd, mb] + hop(s + 1, s)
            assert start[s, "recompute", mb] >= after - 1e-9
            assert start[s, bwd, mb] == pytest.approx(start[s, "recompute", mb] + 0.5)
    for r in range(pp):
        compute = sorted(t.rank_events(r, compute_only=True), key=lambda e: e.start)
        for a, b in zip(compute, compute[1:]):
            assert b.start >= a.end - 1e-9


def test_communication_lengthens_the_iteration_and_shows_as_p2p():
    fast = simulate("1f1b", 2, 1, 4, [StageTimes(1.0, 2.0)] * 2)
    slow = simulate("1f1b", 2, 1, 4, [StageTimes(1.0, 2.0, communication=0.5)] * 2)
    assert slow.makespan > fast.makespan
    p2p = [e for e in slow.events if e.kind.startswith("p2p")]
    assert {e.kind for e in p2p} == {"p2p_forward", "p2p_backward"}
    assert all(e.peer != e.rank for e in p2p)


def test_activations_in_flight():
    assert simulate("gpipe", 4, 1, 8, [StageTimes(1, 2)] * 4).max_in_flight == {s: 8 for s in range(4)}
    assert simulate("1f1b", 4, 1, 8, [StageTimes(1, 2)] * 4).max_in_flight == {s: 4 - s for s in range(4)}


def test_bad_arguments():
    with pytest.raises(ValueError, match="stage_times"):
        simulate("1f1b", 2, 1, 4, [StageTimes(1, 2)])
    with pytest.raises(ValueError, match="virtual_stages"):
        rank_actions("gpipe", 2, 2, 4)
    with pytest.raises(ValueError, match="schedule"):
        rank_actions("pipedream", 2, 1, 4)
    with pytest.raises(ValueError, match="forward"):
        StageTimes(-1.0, 2.0)


def test_plan_timeline_uses_per_iteration_stage_times():
    plan = make_plan(pp=2, num_micro_batches=4, micro_batch_size=1, dp=1)
    t = plan_timeline(plan)  # make_plan: 1 ms forward + 2 ms backward per iteration, i.e. per 4 micro-batches
    assert sum(t.busy) == pytest.approx(2 * 0.003)
    assert t.bubble_fraction == pytest.approx(1 / 5)
