"""Cost-model terms against hand-computed values."""

import math

import pytest

from planner.cluster_spec import parse_cluster
from planner.cost_model import (
    Candidate,
    Links,
    StageProblem,
    bubble_micro_batches,
    build_problem,
    evaluate,
    in_flight,
    state_bytes_per_param,
    zb_ratio,
)
from planner.model_sources import builtin_model
from profiler.presets import preset_profile


def test_adam_mixed_precision_is_16_bytes_per_param():
    assert sum(state_bytes_per_param("bf16", 0, 8)) == 16.0
    assert sum(state_bytes_per_param("fp32", 0, 8)) == 16.0  # 4 + 4 + 8, no master copy
    assert state_bytes_per_param("bf16", 1, 8) == (2.0, 2.0, 12.0 / 8)
    assert state_bytes_per_param("bf16", 2, 8) == (2.0, 2.0 / 8, 12.0 / 8)
    assert state_bytes_per_param("bf16", 3, 8) == (2.0 / 8, 2.0 / 8, 12.0 / 8)


def test_1f1b_in_flight_per_stage():
    assert [in_flight("1f1b", 4, 1, 8, r) for r in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1f1b", 4, 1, 2, r) for r in range(4)] == [2, 2, 2, 1]  # at most m
    assert [in_flight("gpipe", 4, 1, 8, r) for r in range(4)] == [8] * 4
    # Megatron interleaved: rank 0 holds pp·(1 + (pp-1)/(pp·v)) stage micro-batches.
    pp, v = 4, 2
    assert in_flight("interleaved-1f1b", pp, v, 16, 0) == pytest.approx(pp * (1 + (pp - 1) / (pp * v)))
    assert in_flight("interleaved-1f1b", pp, v, 16, 3) == pytest.approx(((v - 1) * pp + 1) / v)
    assert [in_flight("zero-bubble", 4, 2, 8, r) for r in range(4)] == [4] * 4


def test_bubble_closed_forms():
    assert bubble_micro_batches("1f1b", 4, 1, 0.0) == 3
    assert bubble_micro_batches("gpipe", 4, 1, 0.0) == 3
    assert bubble_micro_batches("interleaved-1f1b", 4, 3, 0.0) == 1
    assert zb_ratio(1.0, 2.0) == pytest.approx(1 / 3)  # ZB-H1: a third of the 1F1B bubble
    assert bubble_micro_batches("zero-bubble", 4, 2, zb_ratio(1.0, 2.0)) == pytest.approx(1.0)
    assert bubble_micro_batches("1f1b", 1, 1, 0.0) == 0


def _problem(**kw):
    model = builtin_model("llama3-8b")
    cluster = parse_cluster("8xa100-80gb")
    profile = preset_profile(model, cluster)
    cand = Candidate(**{**dict(dp=1, tp=1, pp=4, v=1, schedule="1f1b", b=1, m=8, zero=0, recompute="none"), **kw})
    links = Links("intra_node", "intra_node", "intra_node")
    cuts = [True] * len(model.layers)
    return model, profile, build_problem(model, profile, cand, 2048, "bf16", links, math.inf, cuts)


def test_memory_terms_by_hand():
    model, profile, P = _problem()
    bounds = [0, 9, 17, 25, 34]
    ev = evaluate(P, bounds, [0, 0, 0, 0])
    block = model.layers[1].params
    # rank 1: 8 blocks, 16 B/param, 3 micro-batches in flight (1F1B, pp=4)
    act = profile.activation_bytes("block", 1, 2048, 1, "none", False)
    assert ev.rank_memory[1] == pytest.approx(8 * block * 16 + 3 * 8 * act)
    # Korthikanti: s·b·h·(34 + 5·a·s/h) bytes in 16-bit without TP
    h, a, s = model.hidden_size, model.num_heads, 2048
    assert act == pytest.approx(s * h * (34 + 5 * a * s / h))
    # rank 0 holds the embedding (untied) and 4 in-flight micro-batches
    emb = model.layers[0]
    emb_act = profile.activation_bytes("embedding", 1, 2048, 1, "none", False)
    assert ev.rank_memory[0] == pytest.approx((emb.params + 8 * block) * 16 + 4 * (8 * act + emb_act))


def test_recompute_reduces_activations_and_adds_time():
    _, profile, P = _problem(recompute="full")
    bounds = [0, 9, 17, 25, 34]
    base = evaluate(P, bounds, [0, 0, 0, 0])
    rec = evaluate(P, bounds, [8, 0, 0, 0])
    full = profile.activation_bytes("block", 1, 2048, 1, "none", False)
    kept = profile.activation_bytes("block", 1, 2048, 1, "full", False)
    assert base.rank_memory[0] - rec.rank_memory[0] == pytest.approx(4 * 8 * (full - kept))
    fwd, _ = profile.layer_time("block", 1, 2048, 1)
    assert rec.stages[0].recompute == pytest.approx(8 * fwd)
    assert rec.iteration_time > base.iteration_time


def test_tied_head_copy_on_a_rank_without_the_embedding():
    model = builtin_model("gpt2")
    cluster = parse_cluster("8xa100-80gb")
    profile = preset_profile(model, cluster)
    links = Links("intra_node", "intra_node", "intra_node")
    cand = Candidate(dp=1, tp=1, pp=2, v=1, schedule="1f1b", b=1, m=4, zero=0, recompute="none")
    P = build_problem(model, profile, cand, 1024, "bf16", links, math.inf, [True] * len(model.layers))
    assert P.fixed == [0.0, model.vocab_size * model.hidden_size * 16.0]
    # V-shaped zero-bubble puts the head back on rank 0 with the embedding: no copy
    cand = Candidate(dp=1, tp=1, pp=2, v=2, schedule="zero-bubble", b=1, m=4, zero=0, recompute="none")
    P = build_problem(model, profile, cand, 1024, "bf16", links, math.inf, [True] * len(model.layers))
    assert P.rank == [0, 1, 1, 0] and P.fixed == [0.0, 0.0]


def test_iteration_time_formula():
    _, _, P = _problem()
    assert isinstance(P, StageProblem)
    ev = evaluate(P, [0, 9, 17, 25, 34], [0, 0, 0, 0])
    # 1F1B: (m + p - 1) x the slowest rank's time per micro-batch, plus the optimizer tail
    assert ev.iteration_time == pytest.approx((8 + 3) * ev.stage_time_max + ev.tail)
    assert ev.stage_time_max == pytest.approx(max(s.total for s in ev.stages))
