"""DeepSpeed's pipeline engine, run step by step as its source orders it, against what the cost model charges
for it (`p2p="blocking"`, planner/cost_pipeline.pp_comm_time): the MT-NLG and BLOOM rows of
benchmarks/published_runs.py ran on it.

DeepSpeed's TrainSchedule (deepspeed/runtime/pipe/schedule.py) runs 2·(m + p − 1) lock-step steps; at each
step even and odd stages alternate forward and backward. A forward step first sends the previous
micro-batch's input gradient back, then receives this micro-batch's activation; a backward step receives
this micro-batch's output gradient, then sends the previous forward's activation on. Each transfer is a
blocking send/recv (deepspeed/runtime/pipe/p2p.py: "Doesn't support async_op true"): both sides wait for
each other and for the whole message. Here every transfer is such a rendezvous."""

from __future__ import annotations

import pytest
from meshplan.planner.cluster_spec import parse_cluster
from meshplan.planner.cost_pipeline import bubble_micro_batches, pp_comm_time
from meshplan.planner.model_sources import builtin_model
from meshplan.profiler.presets import preset_profile
from meshplan.profiler.software import software_settings


def train_schedule(stages: int, m: int, stage: int) -> list[tuple]:
    """One stage's instructions, in TrainSchedule.steps' order: ("xfer", peer, tag) or (kind, micro-batch)."""
    ops: list[tuple] = []
    prev = -1
    for step in range(2 * (m + stages - 1)):
        even_step, even_stage = step % 2 == 0, stage % 2 == 0
        if even_step == even_stage:  # _even_step_forward_id / _odd_step_forward_id
            mb, forward = (step if even_step else step - 1) // 2 - stage // 2, True
        elif even_step:  # _even_step_backward_id
            mb, forward = step // 2 - stages + (stage + 1) // 2, False
        else:  # _odd_step_backward_id
            mb, forward = (step - 1) // 2 - stages + 1 + stage // 2, False
        valid = 0 <= mb < m
        if forward and stage > 0:  # SendGrad(prev), RecvActivation(curr)
            if 0 <= prev < m:
                ops.append(("xfer", stage - 1, ("grad", stage - 1, prev)))
            if valid:
                ops.append(("xfer", stage - 1, ("act", stage - 1, mb)))
        if not forward and stage < stages - 1:  # RecvGrad(curr), SendActivation(prev)
            if valid:
                ops.append(("xfer", stage + 1, ("grad", stage, mb)))
            if 0 <= prev < m:
                ops.append(("xfer", stage + 1, ("act", stage, prev)))
        if valid:
            ops.append(("F" if forward else "B", mb))
        prev = mb
    return ops


def run_engine(stages: int, m: int, forward: float, backward: float, transfer: float) -> float:
    """Makespan of the schedule with every transfer a blocking rendezvous of `transfer` seconds."""
    ops = [train_schedule(stages, m, s) for s in range(stages)]
    pc, clock = [0] * stages, [0.0] * stages
    while any(pc[s] < len(ops[s]) for s in range(stages)):
        moved = False
        for s in range(stages):
            while pc[s] < len(ops[s]):
                op = ops[s][pc[s]]
                if op[0] != "xfer":
                    clock[s] += forward if op[0] == "F" else backward
                elif pc[op[1]] < len(ops[op[1]]) and ops[op[1]][pc[op[1]]] == ("xfer", s, op[2]):
                    q = op[1]
                    clock[s] = clock[q] = max(clock[s], clock[q]) + transfer
                    pc[q] += 1
                else:
                    break
                pc[s] += 1
                moved = True
        assert moved, f"the schedule deadlocks at {pc}"
    return max(clock)


def test_every_transfer_is_matched():
    """Each stage's sends meet the neighbour's receives in the same order: the schedule runs to the end."""
    for stages, m in ((2, 1), (3, 5), (4, 4), (7, 3), (8, 20)):
        assert run_engine(stages, m, 1.0, 2.0, 0.1) > 0
        for s in range(stages):
            assert sum(op[0] == "F" for op in train_schedule(stages, m, s)) == m


def test_without_transfers_it_is_1f1b():
    """With free transfers the lock-step schedule takes 1F1B's (m + p − 1)·(F + B)."""
    for stages, m, f, b in ((4, 8, 1.0, 2.0), (8, 32, 1.0, 3.0), (35, 240, 34.9e-3, 115.5e-3)):
        assert run_engine(stages, m, f, b, 0.0) == pytest.approx((m + stages - 1) * (f + b))


def test_blocking_term_matches_the_engine():
    """The cost model charges a middle stage pp_comm_time per neighbour (both transfers, whole) on top of
    F + B, over m + p − 1 micro-batch times; DeepSpeed's engine run step by step takes that within 1 %,
    for an MT-NLG-sized stage (gpt3-175b's hidden size; F and B as the roofline gives a 3-layer stage)."""
    spec, cluster = builtin_model("gpt3-175b"), parse_cluster("4x8xa100-80gb")
    profile = preset_profile(spec, cluster, "bf16", **software_settings("megatron-deepspeed-2022", "bf16"))
    b, s, h, tp = 1, 2048, spec.hidden_size, 8
    one = profile.collective_time("send_recv", b * s * h * 2, 2, "inter_node")
    side = pp_comm_time(profile, b, s, h, tp, "bf16", True, "inter_node")
    assert side == pytest.approx(2 * one * profile.correction("pp_comm"))
    forward, backward = profile.roofline.layer(spec, "block", b, s, tp)
    forward, backward = 3 * forward, 3 * (backward + forward)  # full recompute reruns the forward
    for stages, m in ((8, 64), (35, 240)):
        closed = (m + bubble_micro_batches("1f1b", stages, 1, 0.0)) * (forward + backward + 2 * side)
        engine = run_engine(stages, m, forward, backward, one * profile.correction("pp_comm"))
        assert engine == pytest.approx(closed, rel=0.01)
