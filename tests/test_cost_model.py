"""Cost-model terms against hand-computed values."""

import math
from dataclasses import replace

import pytest
from meshplan.planner.candidate import Candidate, Links
from meshplan.planner.cluster_spec import parse_cluster
from meshplan.planner.cost_collectives import (
    dp_ops,
    dp_sync_time,
    optimizer_time,
    root_hook_time,
    sharded_dp_time,
    tp_comm_time,
    unhidden_share,
)
from meshplan.planner.cost_memory import Workspace, grad_bytes, peak_memory, state_bytes_per_param
from meshplan.planner.cost_model import StageProblem, build_problem, crossings, evaluate
from meshplan.planner.cost_pipeline import (
    bubble_micro_batches,
    emb_in_flight,
    grad_moments,
    in_flight,
    pipeline_stage_time,
    unfused_share,
    zb_ratio,
)
from meshplan.planner.model_sources import builtin_model
from meshplan.profiler.presets import preset_profile


def test_adam_mixed_precision_bytes_per_param():
    """18 B with fp32 gradients (the executor, Megatron-LM bf16); ZeRO's 16 B where gradients stay 16-bit."""
    assert sum(state_bytes_per_param("bf16", 0, 8)) == 18.0
    assert sum(state_bytes_per_param("bf16", 0, 8, grad=2.0)) == 16.0
    assert sum(state_bytes_per_param("fp32", 0, 1)) == 16.0  # 4 + 4 + 8, no master copy
    # fp32 training keeps fp32 gradients whatever the software's mixed-precision setting (grad_bytes)
    profile = preset_profile(builtin_model("tiny"), parse_cluster("8xa100-80gb"), "bf16", grad_bytes=2)
    assert grad_bytes(profile, "bf16") == 2.0 and grad_bytes(profile, "fp32") == 4.0
    assert grad_bytes(preset_profile(builtin_model("tiny"), parse_cluster("8xa100-80gb"), "bf16"), "bf16") == 4.0
    assert state_bytes_per_param("bf16", 1, 8) == (2.0, 4.0, 12.0 / 8)
    assert state_bytes_per_param("bf16", 2, 8) == (2.0, 4.0 / 8, 12.0 / 8)
    # ZeRO-3 in mixed precision: the fp32 shard is the master copy; 16-bit parameters are gathered per unit
    assert state_bytes_per_param("bf16", 3, 8, grad=2.0) == (0.0, 2.0 / 8, 12.0 / 8)


def test_optimizer_state_as_the_software_keeps_it():
    """Apex's DistributedFusedAdam under NeMo 1 (profiler/roofline.py opt_bytes): fp32 moments and the 16-bit
    remainders of the master copy, 2 + 4 + 4 = 10 B a parameter, sharded over dp like the executor's 12; bf16
    state with no master copy, 2 + 2 = 4. fp32 training keeps its own 8 whatever the mixed-precision setting.
    The step reads and writes each optimizer byte once: 36 - 2 x 2 = 32 B a parameter for 10."""
    from meshplan.planner.cost_memory import state_bytes
    from meshplan.profiler.presets import ADAM_BYTES_PER_PARAM, CLIP_BYTES_PER_PARAM

    cluster = parse_cluster("8xh100-80gb")
    nemo = preset_profile(builtin_model("tiny"), cluster, "bf16", grad_bytes=2, opt_bytes=10.0)
    assert state_bytes(nemo, "bf16", 1, 8) == (2.0, 2.0, 10.0 / 8)
    assert state_bytes(nemo, "fp32", 1, 8)[2] == 8.0 / 8
    bf16_state = preset_profile(builtin_model("tiny"), cluster, "bf16", opt_bytes=4.0)
    assert state_bytes(bf16_state, "bf16", 0, 1) == (2.0, 4.0, 4.0)
    executor = preset_profile(builtin_model("tiny"), cluster, "bf16")
    assert state_bytes(executor, "bf16", 1, 8)[2] == 12.0 / 8
    rate = cluster.device.memory_bandwidth_Bps * cluster.device.memory_efficiency
    assert nemo.optimizer_s_per_param == pytest.approx((ADAM_BYTES_PER_PARAM - 4 + CLIP_BYTES_PER_PARAM) / rate)
    assert executor.optimizer_s_per_param == pytest.approx((ADAM_BYTES_PER_PARAM + CLIP_BYTES_PER_PARAM) / rate)


def test_fsdp_state_as_the_executor_holds_it():
    """FSDP2 keeps the fp32 shard next to the gathered parameter below ZeRO-3 (in mixed precision the
    shard is the master copy, already counted), and unsharded gradients while micro-batches accumulate."""
    assert state_bytes_per_param("fp32", 1, 2) == (4.0 + 2.0, 4.0, 4.0)
    assert state_bytes_per_param("fp32", 2, 2) == (6.0, 2.0, 4.0)
    assert state_bytes_per_param("fp32", 2, 2, accumulating=True) == (6.0, 4.0, 4.0)
    assert state_bytes_per_param("fp32", 3, 2, accumulating=True) == (2.0, 4.0, 4.0)
    # replicate (ZeRO-0) is FSDP2's engine with the whole parameter as its shard
    assert state_bytes_per_param("fp32", 0, 2) == (8.0, 4.0, 8.0)
    assert state_bytes_per_param("bf16", 0, 2) == (2.0, 4.0, 12.0)
    # FSDP2 accumulates unreduced gradients in its reduce dtype, fp32 (to_accumulated_grad_if_needed)
    assert state_bytes_per_param("bf16", 3, 8, accumulating=True) == (0.0, 4.0, 12.0 / 8)
    assert state_bytes_per_param("fp32", 3, 1, accumulating=True) == (4.0, 4.0, 8.0)  # no data parallelism


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


def _problem(software: dict | None = None, **kw):
    model = builtin_model("llama3-8b")
    cluster = parse_cluster("8xa100-80gb")
    profile = preset_profile(model, cluster, **(software or {}))
    cand = Candidate(**{**dict(dp=1, tp=1, pp=4, v=1, schedule="1f1b", b=1, m=8, zero=0, recompute="none"), **kw})
    links = Links("intra_node", "intra_node", "intra_node")
    cuts = [True] * len(model.layers)
    return model, profile, build_problem(model, profile, cand, 2048, "bf16", links, math.inf, cuts)


def test_memory_terms_by_hand():
    model, profile, P = _problem()
    bounds = [0, 9, 17, 25, 34]
    ev = evaluate(P, bounds, [0, 0, 0, 0])
    block = model.layers[1].params
    # rank 1: 8 blocks, 18 B/param (fp32 gradients), and the larger of 3 micro-batches in flight (1F1B, pp=4)
    # and the foreach AdamW step's sqrt(v), 4 B per parameter, once the activations are freed
    act = profile.activation_bytes("block", 1, 2048, 1, "none", False)
    assert ev.rank_memory[1] == pytest.approx(8 * block * 18 + max(3 * 8 * act, 8 * block * 4))
    # llama3-8b's block in bf16 (profiler.analytic), per token: two RMSNorm inputs (+ fp32 rstd) and outputs,
    # q, k, v (GQA: 8 of 32 heads) and the output, SwiGLU's three f-wide tensors (its fused gate keeps its
    # inputs), fp32 log-sum-exp; + rotary tables
    h, f, s = model.hidden_size, model.ffn_hidden_size, 2048
    kv = model.num_kv_heads * model.head_dim
    per_token = 2 * (2 * h + 4 + 2 * h) + 2 * (h + 2 * kv + h) + 2 * 3 * f + 4 * model.num_heads
    assert act == pytest.approx(s * per_token + 4 * s * model.head_dim // 2 * 4)
    # rank 0 holds the embedding (untied) and 4 in-flight micro-batches
    emb = model.layers[0]
    emb_act = profile.activation_bytes("embedding", 1, 2048, 1, "none", False)
    assert ev.rank_memory[0] == pytest.approx((emb.params + 8 * block) * 18 + 4 * (8 * act + emb_act))


def test_recompute_reduces_activations_and_adds_time():
    _, profile, P = _problem(recompute="full")
    bounds = [0, 9, 17, 25, 34]
    base = evaluate(P, bounds, [0, 0, 0, 0])
    rec = evaluate(P, bounds, [8, 0, 0, 0])
    full = profile.activation_bytes("block", 1, 2048, 1, "none", False)
    kept = profile.activation_bytes("block", 1, 2048, 1, "full", False)
    assert base.stages[0].activations - rec.stages[0].activations == pytest.approx(4 * 8 * (full - kept))
    assert base.rank_memory[0] > rec.rank_memory[0]
    fwd, _ = profile.layer_time("block", 1, 2048, 1)
    assert rec.stages[0].recompute == pytest.approx(8 * fwd)
    assert rec.iteration_time > base.iteration_time


def test_tied_head_copy_in_the_last_stage():
    model = builtin_model("gpt2")
    cluster = parse_cluster("8xa100-80gb")
    profile = preset_profile(model, cluster)
    links = Links("intra_node", "intra_node", "intra_node")
    cand = Candidate(dp=1, tp=1, pp=2, v=1, schedule="1f1b", b=1, m=4, zero=0, recompute="none")
    P = build_problem(model, profile, cand, 1024, "bf16", links, math.inf, [True] * len(model.layers))
    assert P.fixed == [0.0, model.vocab_size * model.hidden_size * 18.0]
    # V-shaped zero-bubble puts the head back on rank 0 with the embedding, but in another stage module
    # (executor/train.py keeps a copy per stage and sums their gradients): the copy is on rank 0
    cand = Candidate(dp=1, tp=1, pp=2, v=2, schedule="zero-bubble", b=1, m=4, zero=0, recompute="none")
    P = build_problem(model, profile, cand, 1024, "bf16", links, math.inf, [True] * len(model.layers))
    assert P.rank == [0, 1, 1, 0] and P.fixed == [model.vocab_size * model.hidden_size * 18.0, 0.0]


def test_iteration_time_formula():
    _, _, P = _problem()
    assert isinstance(P, StageProblem)
    ev = evaluate(P, [0, 9, 17, 25, 34], [0, 0, 0, 0])
    # 1F1B: (m + p - 1) x the slowest rank's time per micro-batch, plus the optimizer tail
    assert ev.iteration_time == pytest.approx((8 + 3) * ev.stage_time_max + ev.tail)
    assert ev.stage_time_max == pytest.approx(max(s.total for s in ev.stages))


def test_data_parallel_collectives_follow_the_executor_engines():
    """With gradient accumulation the executor reduces once per iteration (ZeRO-0 all-reduce; ZeRO-1/2
    reduce-scatter, then the next forward gathers) and only ZeRO-3 gathers every micro-batch."""
    assert dp_ops(0) == (("all_reduce",), ())
    assert dp_ops(1) == dp_ops(2) == (("reduce_scatter", "all_gather"), ())
    assert dp_ops(3) == (("reduce_scatter",), ("all_gather", "all_gather"))
    model = builtin_model("tiny")
    profile = preset_profile(model, parse_cluster("8xa100-80gb"))
    ar = profile.collective_time("all_reduce", 1000 * 2, 8, "intra_node")
    assert dp_sync_time(profile, 1000, "bf16", 8, 0, "intra_node") == pytest.approx(ar)
    assert sharded_dp_time(profile, 1000, "bf16", 8, 2, "intra_node") == 0.0
    assert sharded_dp_time(profile, 1000, "bf16", 8, 3, "intra_node") == pytest.approx(
        2 * profile.collective_time("all_gather", 2000, 8, "intra_node"))


def test_gradients_reduce_in_fp32_and_parameters_gather_in_bf16():
    """The executor reduces gradients in fp32 (MixedPrecisionPolicy reduce_dtype) and gathers 16-bit
    parameters; a preset's software can say otherwise (Megatron-LM fp16: 2-byte gradients; DeepSpeed's
    BF16_Optimizer: an all-reduce at ZeRO-1)."""
    from dataclasses import replace

    model = builtin_model("tiny")
    profile = preset_profile(model, parse_cluster("8xa100-80gb"))
    n = 50e6
    rs, ag = (profile.collective_time(op, n * b, 8, "intra_node")
              for op, b in (("reduce_scatter", 4), ("all_gather", 2)))
    assert dp_sync_time(profile, n, "bf16", 8, 1, "intra_node") == pytest.approx(rs + ag)
    assert dp_sync_time(profile, n, "bf16", 8, 0, "intra_node") == pytest.approx(
        profile.collective_time("all_reduce", n * 4, 8, "intra_node"))
    fp16 = replace(profile, roofline=replace(profile.roofline, grad_bytes=2))
    assert dp_sync_time(fp16, n, "bf16", 8, 1, "intra_node") == pytest.approx(
        profile.collective_time("reduce_scatter", n * 2, 8, "intra_node") + ag)
    ds = replace(profile, roofline=replace(profile.roofline, grad_reduce="all_reduce"))
    assert dp_sync_time(ds, n, "bf16", 8, 1, "intra_node") == pytest.approx(
        profile.collective_time("all_reduce", n * 4, 8, "intra_node") + ag)
    assert dp_sync_time(ds, n, "bf16", 8, 3, "intra_node") == pytest.approx(rs)  # ZeRO-3 reduce-scatters


def test_gradients_appear_chunk_by_chunk():
    """grad_moments by hand from Megatron-LM's order. 1F1B with a steady phase: the peak holds every
    gradient. m ≤ in-flight: all forwards first, then (m−1) micro-batches with the gradients. Interleaved
    pp=16, v=2, m=16 on rank 9: 29 chunk micro-batches at the peak (warm-up 28 + 1), 4 steady backwards
    of chunk 1 (half the gradients); chunk 0's first backward (k=16) comes 13 cool-down backwards later
    with 16 in flight, and ends with 15 and all gradients."""
    assert grad_moments("1f1b", 4, 1, 8, 0) == ((4.0, 1.0),)
    assert grad_moments("1f1b", 4, 1, 2, 0) == ((2.0, 0.0), (1.0, 1.0))
    assert grad_moments("gpipe", 4, 1, 8, 1) == ((8.0, 0.0), (7.0, 1.0))
    assert grad_moments("interleaved-1f1b", 16, 2, 16, 9) == ((14.5, 0.5), (7.5, 1.0))
    assert grad_moments("interleaved-1f1b", 16, 2, 16, 0) == ((16.0, 0.0), (15.5, 0.5), (7.5, 1.0))
    # ZB-V (torch's order, rank 1 of 16, m = 16): chunk 1's first weight-grad comes at the peak, chunk 0's
    # eight micro-batches later
    assert grad_moments("zero-bubble", 4, 2, 8, 0) == ((4.0, 1.0),)
    assert grad_moments("zero-bubble", 16, 2, 16, 1) == ((16.0, 0.5), (8.0, 1.0))


def test_peak_memory_takes_the_largest_gradient_moment():
    ws = Workspace([0.0], [0.0], [0.0], [])
    # state 100 of which 40 gradients; act 10 per micro-batch: peak (16, none) = 60 + 160 = 220,
    # later (7.5, all) = 100 + 75 = 175, the embedding's (7, all) = 170
    assert peak_memory(100, 0, 16, 10, 0, ws, 0, 0.4, ((7.5, 0.0),), 7.0) == pytest.approx(220)
    assert peak_memory(100, 0, 16, 1, 0, ws, 0, 0.4, ((7.5, 0.0),), 7.0) == pytest.approx(107.5)
    # by default the embedding's moment is one micro-batch below the peak, all gradients held
    assert peak_memory(100, 0, 16, 10, 0, ws, 0, 0.4) == pytest.approx(250)
    assert [emb_in_flight("interleaved-1f1b", 16, 2, 16, r) for r in (0, 9)] == [7.5, 7.5]
    assert emb_in_flight("1f1b", 4, 1, 8, 1) == 2.0
    assert emb_in_flight("zero-bubble", 4, 2, 8, 0) == 3.5  # stage 0's first W: 7 chunk micro-batches left


def _with_engines(profile, hook_s: float, sync_s: float, ratio: float):
    from meshplan.planner.model_spec import wrapped_unit_params
    from meshplan.profiler.profile import ENGINES, WrapperSample

    units = wrapped_unit_params(profile.model, 2)
    profile.wrappers = [WrapperSample(e, 2, 1, 64, units, hook_s, sync_s, ratio) for e in ENGINES]
    return profile, units


def test_in_situ_engine_costs_replace_the_link_fit():
    """A measured engine sample: its hooks are charged per unit and micro-batch (and once per stage for
    the root), its reduction reproduces the measured time on the measured units and is fully exposed,
    and its optimizer ratio multiplies the step."""
    model = builtin_model("tiny")
    profile = preset_profile(model, parse_cluster("2xcpu"))
    base_opt = optimizer_time(profile, 1000, 2, 1)
    profile, units = _with_engines(profile, hook_s=0.002, sync_s=0.03, ratio=2.5)
    block = units[0]
    for zero in (0, 1, 3):
        total = sum(dp_sync_time(profile, n, profile.dtype, 2, zero, "intra_node") for n in units)
        assert total == pytest.approx(0.03)
        assert sharded_dp_time(profile, block, profile.dtype, 2, zero, "intra_node") == 0.002
        assert root_hook_time(profile, 2, zero) == 0.002 and unhidden_share(profile, 2, zero, 6, 1) == 1.0
    assert optimizer_time(profile, 1000, 2, 1) == pytest.approx(2.5 * base_opt)
    assert root_hook_time(profile, 1, 0) == 0.0 and dp_sync_time(profile, block, "fp32", 1, 0, "intra_node") == 0.0
    cand = Candidate(dp=2, tp=1, pp=1, v=1, schedule="1f1b", b=1, m=4, zero=1, recompute="none")
    links = Links("intra_node", "intra_node", "intra_node")
    P = build_problem(model, profile, cand, 64, profile.dtype, links, math.inf, [True] * len(model.layers))
    blocks = [i for i, k in enumerate(P.kinds) if k == "block"]
    assert [P.gather[i] for i in blocks] == [0.002] * len(blocks)
    assert P.gather[0] == P.gather[-1] == 0.0 and P.boundary == [0.002]  # embedding, head: the root unit
    ev = evaluate(P, [0, len(P.kinds)], [0])
    assert ev.tail == pytest.approx(sum(P.opt) + sum(P.dp) + P.step_sync)  # measured in situ: nothing hidden


def test_tp_collectives_not_added_twice_when_measured_across_ranks():
    from meshplan.profiler.profile import ComputeSample

    model = builtin_model("tiny")
    profile = preset_profile(model, parse_cluster("2xcpu"))
    assert tp_comm_time(profile, "block", 1, 64, model.hidden_size, 2, "fp32", "none") > 0
    profile.compute = [ComputeSample("block", b, 64, 2, 0.02, 0.03, with_collectives=True) for b in (1, 2)]
    assert tp_comm_time(profile, "block", 1, 64, model.hidden_size, 2, "fp32", "none") == 0.0


def test_pipeline_overhead_measured_in_situ_per_schedule_replaces_the_hop():
    model = builtin_model("tiny")
    profile = preset_profile(model, parse_cluster("2xcpu"))
    assert pipeline_stage_time(profile, 0.001, 2, "1f1b") == pytest.approx(0.002)  # link fit: a hop per neighbour
    assert pipeline_stage_time(profile, 0.001, 0, "1f1b") == 0.0
    profile.pipeline_overheads = {"1f1b": 0.004, "zero-bubble": 0.006}
    assert pipeline_stage_time(profile, 0.001, 1, "1f1b") == pytest.approx(0.004)
    assert pipeline_stage_time(profile, 0.001, 2, "1f1b") == pytest.approx(0.008)  # per crossing
    assert pipeline_stage_time(profile, 0.001, 1, "zero-bubble") == pytest.approx(0.006)
    assert pipeline_stage_time(profile, 0.001, 1, "gpipe") == pytest.approx(0.004)  # unmeasured: 1F1B's
    links = Links("intra_node", "intra_node", "intra_node")
    for schedule, v, expected in (("1f1b", 1, [0.004] * 2), ("zero-bubble", 2, [0.006] * 4)):
        cand = Candidate(dp=1, tp=1, pp=2, v=v, schedule=schedule, b=1, m=4, zero=0, recompute="none")
        P = build_problem(model, profile, cand, 64, profile.dtype, links, math.inf, [True] * len(model.layers))
        assert P.boundary == [pytest.approx(x) for x in expected]  # ZBV: each stage has one remote neighbour
    assert crossings([0, 1, 0, 1], 1) == 2 and crossings([0, 1, 1, 0], 1) == 1


def test_pipeline_overhead_follows_the_micro_batch_size_between_measured_sizes():
    """The P2P inside the in-situ figure carries b·s·h values: measured at the smallest and largest
    micro-batch size, interpolated over log2(b) between them and clamped outside."""
    from meshplan.profiler.profile import PipelineSample

    model = builtin_model("tiny")
    profile = preset_profile(model, parse_cluster("2xcpu"))
    profile.pipeline_overheads = {"gpipe": 0.001, "1f1b": 0.001}
    profile.pipeline_samples = [PipelineSample(1, {"gpipe": 0.001, "1f1b": 0.001}),
                                PipelineSample(16, {"gpipe": 0.005, "1f1b": 0.003})]
    assert profile.pipeline_overhead("gpipe") == 0.001  # no size: the smallest, as older profiles hold
    assert profile.pipeline_overhead("gpipe", 4) == pytest.approx(0.003)  # halfway in log2(b)
    assert profile.pipeline_overhead("gpipe", 64) == pytest.approx(0.005)
    assert profile.pipeline_overhead("zero-bubble", 16) == pytest.approx(0.003)  # unmeasured: 1F1B's
    links = Links("intra_node", "intra_node", "intra_node")
    boundary = {}
    for b in (1, 16):
        cand = Candidate(dp=1, tp=1, pp=2, v=1, schedule="gpipe", b=b, m=2, zero=0, recompute="none")
        P = build_problem(model, profile, cand, 64, profile.dtype, links, math.inf, [True] * len(model.layers))
        boundary[b] = P.boundary
    assert boundary[1] == [pytest.approx(0.001)] * 2 and boundary[16] == [pytest.approx(0.005)] * 2


def test_one_f_one_b_pays_gpipe_overhead_outside_its_steady_state():
    model = builtin_model("tiny")
    profile = preset_profile(model, parse_cluster("2xcpu"))
    profile.pipeline_overheads = {"gpipe": 0.004, "1f1b": 0.001}
    assert unfused_share("1f1b", 2, 8, 0) == pytest.approx(2 / 8)
    assert unfused_share("1f1b", 2, 8, 1) == pytest.approx(1 / 8)
    assert unfused_share("1f1b", 4, 2, 1) == 1.0 and unfused_share("gpipe", 2, 8, 0) == 0.0
    links = Links("intra_node", "intra_node", "intra_node")
    for m, expected in ((2, [0.004, 0.0025]), (8, [0.00175, 0.001375])):  # rank 0: 2 warm-ups, rank 1: 1
        cand = Candidate(dp=1, tp=1, pp=2, v=1, schedule="1f1b", b=1, m=m, zero=0, recompute="none")
        P = build_problem(model, profile, cand, 64, profile.dtype, links, math.inf, [True] * len(model.layers))
        assert P.boundary == [pytest.approx(x) for x in expected]


def test_zero_bubble_backward_pays_the_measured_split():
    from meshplan.profiler.profile import ChainSample, ComputeSample

    model = builtin_model("tiny")
    profile = preset_profile(model, parse_cluster("2xcpu"))
    profile.compute = [ComputeSample(k, b, 64, 1, 0.001 * b, 0.002 * b) for k in ("embedding", "block", "head")
                       for b in (1, 2, 4)]
    bwd = {b: 3 * 0.002 * b for b in (1, 4)}  # 2 blocks + head
    profile.chains = [ChainSample(b, 64, 2, 4 * 0.003 * b, split_extra_s=0.5 * bwd[b]) for b in (1, 4)]
    assert profile.split_backward_factor(1) == pytest.approx(1.5)
    assert profile.split_backward_factor(2) == pytest.approx(1.5)
    links = Links("intra_node", "intra_node", "intra_node")
    bwd_of = {}
    for schedule, v in (("interleaved-1f1b", 2), ("zero-bubble", 2)):
        cand = Candidate(dp=1, tp=1, pp=2, v=v, schedule=schedule, b=2, m=4, zero=0, recompute="none")
        bwd_of[schedule] = build_problem(model, profile, cand, 64, profile.dtype, links, math.inf,
                                         [True] * len(model.layers)).bwd
    assert bwd_of["zero-bubble"] == [pytest.approx(1.5 * g) for g in bwd_of["interleaved-1f1b"]]


def test_chain_factor_scales_tp1_layer_times_between_measured_sizes():
    from meshplan.profiler.profile import ChainSample, ComputeSample

    model = builtin_model("tiny")
    profile = preset_profile(model, parse_cluster("2xcpu"))
    profile.compute = [ComputeSample(k, b, 64, t, 0.001 * b, 0.002 * b) for k in ("embedding", "block", "head")
                       for b in (1, 2, 4) for t in (1, 2)]
    alone = {b: 4 * 0.003 * b for b in (1, 4)}  # embedding + 2 blocks + head, each 3 ms x b
    assert profile.chain_factor(2) == 1.0  # no chain measured
    profile.chains = [ChainSample(1, 64, 2, 1.2 * alone[1]), ChainSample(4, 64, 2, 1.6 * alone[4])]
    assert profile.chain_factor(1) == pytest.approx(1.2) and profile.chain_factor(4) == pytest.approx(1.6)
    assert profile.chain_factor(2) == pytest.approx(1.4)  # halfway in log2(b)
    assert profile.chain_factor(16) == pytest.approx(1.6)  # clamped
    assert profile.layer_time("block", 2, 64, 1) == pytest.approx((1.4 * 0.002, 1.4 * 0.004))
    assert profile.layer_time("block", 2, 64, 2) == pytest.approx((0.002, 0.004))  # TP: timed as is


def test_tensor_parallel_optimizer_step_takes_the_measured_dtensor_ratio():
    """The TP chain's measured AdamW ratio (DTensor over plain tensors) scales the TP plans' optimizer
    term; data parallelism's in-situ ratio, when larger, wins; unmeasured degrees step at the plain rate."""
    from dataclasses import replace

    from meshplan.planner.cost_collectives import optimizer_time
    from meshplan.profiler.profile import ChainSample, WrapperSample

    profile = preset_profile(builtin_model("tiny"), parse_cluster("2xcpu"))
    plain = optimizer_time(profile, 1e6, 1, 0)
    profile.chains = [ChainSample(b, 64, 2, 0.01, tp=2, optimizer_ratio=r) for b, r in ((1, 3.0), (2, 5.0), (4, 4.0))]
    assert optimizer_time(profile, 1e6, 1, 0, tp=2) == pytest.approx(4.0 * plain)  # the median
    assert optimizer_time(profile, 1e6, 1, 0, tp=4) == pytest.approx(plain)
    profile.wrappers = [WrapperSample("replicate", 2, 1, 64, [1, 1], 0.0, 0.0, 6.0)]
    assert optimizer_time(profile, 1e6, 2, 0, tp=2) == pytest.approx(6.0 * plain)
    profile.wrappers = [replace(profile.wrappers[0], optimizer_ratio=2.0)]
    assert optimizer_time(profile, 1e6, 2, 0, tp=2) == pytest.approx(4.0 * plain)


def test_the_steps_scalar_all_reduces_join_every_ranks_tail():
    """Two all-reduces of a scalar per step over all ranks (gradient norm, loss): the profile's own timing
    when it ran as many ranks, else the link fit at 8 bytes; none on one rank. Every rank's optimizer
    tail carries them, and the lower bounds too."""
    from dataclasses import replace

    from meshplan.planner.cost_collectives import step_sync_time
    from meshplan.planner.cost_model import lower_bound

    model = builtin_model("tiny")
    profile = preset_profile(model, parse_cluster("4xcpu"))
    links = Links("intra_node", "intra_node", "intra_node")
    fit = profile.collective_time("all_reduce", 8.0, 4, "intra_node")
    assert step_sync_time(profile, 1, links) == 0.0
    assert step_sync_time(profile, 4, links) == pytest.approx(2 * fit)
    measured = replace(profile, source="measured", step_sync_s=0.0004, settings={"ranks": 4})
    assert step_sync_time(measured, 4, links) == pytest.approx(0.0008)
    assert step_sync_time(replace(measured, step_sync_s=0.0), 4, links) == 0.0  # measured before it was timed
    assert step_sync_time(measured, 2, links) == pytest.approx(2 * profile.collective_time("all_reduce", 8.0, 2,
                                                                                            "intra_node"))
    cand = Candidate(dp=2, tp=1, pp=2, v=1, schedule="1f1b", b=1, m=4, zero=0, recompute="none")
    P = build_problem(model, measured, cand, 64, measured.dtype, links, math.inf, [True] * len(model.layers))
    assert P.step_sync == pytest.approx(0.0008)
    ev = evaluate(P, [0, 3, len(P.kinds)], [0, 0])
    without = evaluate(replace(P, step_sync=0.0), [0, 3, len(P.kinds)], [0, 0])
    assert ev.iteration_time == pytest.approx(without.iteration_time + 0.0008)
    assert all(s.optimizer == pytest.approx(w.optimizer + 0.0008) for s, w in zip(ev.stages, without.stages))
    assert lower_bound(P) == pytest.approx(lower_bound(replace(P, step_sync=0.0)) + 0.0008)


def test_step_transients_by_hand():
    """Workspace of the three transient moments (cost_memory.Workspace) on a tied model."""
    from meshplan.planner.cost_memory import step_transients

    model = builtin_model("gpt2")  # tied, V = 50257 (not divisible by 2: the vocabulary is not split)
    V, h, s = model.vocab_size, model.hidden_size, 1024
    table = V * h
    one = Candidate(dp=1, tp=1, pp=1, v=1, schedule="1f1b", b=2, m=4, zero=0, recompute="none")
    ws = step_transients(model, one, s, "fp32", [0])
    logits = 2 * s * V * 4.0
    assert ws.act == [max(2 * logits, logits + 4.0 * table)]
    assert ws.emb == [3 * 4.0 * table]  # head and embedding gradients, and their sum
    # foreach AdamW (executor.train.make_optimizer, on every device): sqrt(v) of every local parameter (fp32)
    assert ws.opt == [0.0] and ws.per_layer == [4.0 * layer.params for layer in model.layers]
    piped = Candidate(dp=2, tp=2, pp=2, v=1, schedule="1f1b", b=2, m=1, zero=1, recompute="none")
    ws = step_transients(model, piped, s, "bf16", [0, 1])
    assert ws.act == [0.0, 2 * logits]  # m = 1: the head weight gradient is the gradient itself
    assert ws.emb == [0.0, 0.0]  # a separate copy per stage, nothing accumulated
    # ÷ tp ÷ dp (FSDP shards); the head's copy too
    assert ws.per_layer == [4.0 * layer.params / 4 for layer in model.layers]
    assert ws.opt == [0.0, 4.0 * table / 4]


def test_regathered_input_by_hand():
    """Sequence parallelism that keeps Linear inputs as shards gathers one again at each rank's first backward
    (executor/parallelize.keep_input_shard; Megatron-LM's gather buffer): b·(s/cp)·h in the compute dtype,
    on every pipeline rank's activation moment; none for torch's plain SequenceParallel, which keeps them
    gathered, nor without tensor parallelism."""
    from meshplan.planner.cost_memory import regathered_input, step_transients
    from meshplan.profiler.software import software_settings

    model, cluster = builtin_model("llama3-8b"), parse_cluster("8xh100-80gb")
    cand = Candidate(dp=1, tp=4, pp=2, v=1, schedule="1f1b", b=2, m=4, zero=0, recompute="none", cp=1)
    gathered = 2 * 8192 * model.hidden_size * 2
    for software, expected in (("meshplan", gathered), ("megatron", gathered), ("torchtitan", 0.0)):
        profile = preset_profile(model, cluster, **software_settings(software))
        assert regathered_input(profile, model, cand, 8192, "bf16") == expected, software
    profile = preset_profile(model, cluster)
    assert regathered_input(profile, model, replace(cand, tp=1, dp=4), 8192, "bf16") == 0.0
    assert regathered_input(profile, model, replace(cand, cp=2, dp=1, pp=1), 8192, "bf16") == gathered / 2
    base = step_transients(model, cand, 8192, "bf16", [0, 1])
    with_gather = step_transients(model, cand, 8192, "bf16", [0, 1], regathered=gathered)
    assert [a - b for a, b in zip(with_gather.act, base.act)] == [gathered, gathered]

def test_in_situ_factor_takes_the_units_from_the_model():
    """The measured reduction is compared with the link fit over the cut model's units, counted from the
    model (a tied root holds the embedding's weight once): profiles that stored a wrong root read alike."""
    from dataclasses import replace

    from meshplan.planner.cost_collectives import in_situ_factor
    from meshplan.planner.model_spec import wrapped_unit_params
    from meshplan.profiler.analytic import DTYPE_BYTES
    from meshplan.profiler.profile import WrapperSample

    model = builtin_model("gpt-20m")
    profile = preset_profile(model, parse_cluster("2xcpu"))
    units = wrapped_unit_params(model, 2)
    assert units[-1] == model.vocab_size * model.hidden_size + 256 * model.hidden_size + 2 * model.hidden_size
    right = WrapperSample("replicate", 2, 1, 128, units, 0.001, 0.05, 1.0)
    # the executor reduces gradients in fp32 whatever the compute dtype
    ref = sum(profile.collective_time("all_reduce", n * DTYPE_BYTES["fp32"], 2, "intra_node") for n in units)
    profile.wrappers = [right]
    assert in_situ_factor(profile, 0) == pytest.approx(0.05 / ref)
    profile.wrappers = [replace(right, unit_params=units[:-1] + [99072])]  # as stored before this fix
    assert in_situ_factor(profile, 0) == pytest.approx(0.05 / ref)


def test_zero2_without_pipelining_keeps_gradients_sharded_and_reduces_every_micro_batch():
    """executor/train.py: ZeRO-2/3 at pp = 1 reduce-scatter each of the m micro-batches (sharded
    gradients, m reduce-scatters); ZeRO-1, and any pipelined plan, hold full gradients and reduce once.
    The m − 1 reductions before the last join the per-micro-batch pool (cost_collectives.dp_reduction_times:
    (m − 1)/m of one per micro-batch); the step's tail keeps the last."""
    model, profile, z1 = _problem(dp=8, pp=1, zero=1, m=4)
    _, _, z2 = _problem(dp=8, pp=1, zero=2, m=4)
    block = model.layers[1].params
    assert z1.state[1] - z2.state[1] == pytest.approx(block * 4 * (1 - 1 / 8))  # fp32 gradients ÷ dp
    reduce_scatter = [profile.collective_time("reduce_scatter", layer.params * 4, 8, "intra_node")  # fp32
                      for layer in model.layers]
    assert z2.dp == pytest.approx(z1.dp) and not any(z1.reduce)
    assert z2.reduce == pytest.approx([3 / 4 * t for t in reduce_scatter])
    _, _, z2_pipelined = _problem(dp=4, pp=2, zero=2, m=4)
    _, _, z1_pipelined = _problem(dp=4, pp=2, zero=1, m=4)
    assert z2_pipelined.state == z1_pipelined.state and z2_pipelined.dp == z1_pipelined.dp
    assert not any(z2_pipelined.reduce)


def test_sharded_accumulation_reduces_every_micro_batch_under_pipelining():
    """Roofline.sharded_accumulation (Llama 3's FSDP shards gradients, arXiv:2407.21783 §3.3.2): a pipelined
    ZeRO-2 plan holds gradients ÷ dp and reduce-scatters each micro-batch's, pooled with the compute it
    overlaps: a rank's micro-batch takes its compute plus max(pool − compute, 0) plus the overlap tax on
    the hidden part (cost_model.evaluate), by hand."""
    sharded = dict(sharded_accumulation=True)
    model, profile, full = _problem(dp=4, pp=2, zero=2, m=4)
    _, sprofile, P = _problem(software=sharded, dp=4, pp=2, zero=2, m=4)
    block = model.layers[1].params
    assert full.state[1] - P.state[1] == pytest.approx(block * 4 * (1 - 1 / 4))
    rs = sprofile.collective_time("reduce_scatter", block * 4, 4, "intra_node")
    assert P.reduce[1] == pytest.approx(3 / 4 * rs) and P.dp == pytest.approx(full.dp)
    bounds = [0, 17, 34]
    ev = evaluate(P, bounds, [0, 0])
    tax = sprofile.roofline.comm_sms / sprofile.roofline.sm_count
    for r, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        layers = range(lo, hi)
        compute = sum(P.fwd[i] + P.bwd[i] for i in layers)
        pool = sum(P.reduce[i] for i in layers)
        exposed = max(pool - compute, 0.0)
        own = sum(P.time[i] for i in layers) + P.boundary[r]
        assert ev.stages[r].total == pytest.approx(own + exposed + tax * (pool - exposed))


def test_gradient_moments_in_closed_form_equal_the_walk_of_torchs_orders():
    """GPipe, 1F1B and interleaved 1F1B (m a multiple of pp, as the search emits it): the closed form
    equals walking planner/schedule.rank_actions action by action."""
    from meshplan.planner.cost_pipeline import _looped_moments, _walks

    for schedule, vs in (("gpipe", (1,)), ("1f1b", (1,)), ("interleaved-1f1b", (2, 3, 4))):
        for pp in (1, 2, 3, 4, 8):
            for v in vs:
                for m in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32):
                    if schedule == "interleaved-1f1b" and m % pp:
                        continue
                    walks = _walks(schedule, pp, v, m)
                    assert [_looped_moments(schedule, pp, v, m, r) for r in range(pp)] == walks, (schedule, pp, v, m)


def test_pooled_reductions_are_reported_under_dp():
    """planner/exposed.py: ZeRO-3 at pp = 1 with m = 4 pools each micro-batch's parameter gathers with the
    reductions before the last; what compute cannot hide of the pool (plus the overlap tax on the rest) is
    split between `fsdp_gather` and `dp` in proportion to their traffic, and the last reduction's exposed
    part (the step's tail) is `dp` too."""
    from meshplan.planner.cost_model import Terms
    from meshplan.planner.exposed import exposed_communication

    model = builtin_model("llama3-8b")
    profile = preset_profile(model, parse_cluster("8xa100-80gb"))
    cand = Candidate(dp=8, tp=1, pp=1, v=1, schedule="1f1b", b=1, m=4, zero=3, recompute="none")
    links = Links("intra_node", "intra_node", "intra_node")
    terms = Terms(model, profile, 2048, "bf16")
    P = build_problem(model, profile, cand, 2048, "bf16", links, math.inf, [True] * len(model.layers), terms)
    bounds = [0, len(model.layers)]
    ev = evaluate(P, bounds, [0])
    out = exposed_communication(cand, P, ev, bounds, [0], terms)
    gathers, reduces = sum(P.gather), sum(P.reduce)
    assert gathers > 0 and reduces > 0
    pooled = ev.stages[0].communication  # no TP, no pipeline: all of it is the pool's
    assert out["fsdp_gather"] == pytest.approx(4 * pooled * gathers / (gathers + reduces))
    assert out["dp"] == pytest.approx(ev.stages[0].dp_sync + 4 * pooled * reduces / (gathers + reduces))


def test_zero_bubble_walk_settles_after_two_pp_micro_batches():
    """ZB-V's gradient moments stop changing once m reaches 2·pp (its warm-up and both chunks' first
    backwards no longer move; only the steady phase grows), so the search walks at most 4·pp micro-batches:
    walking the full m gives the same moments."""
    from meshplan.planner.cost_pipeline import _walks, emb_in_flight

    for pp in (1, 2, 3, 4, 8, 16):
        settled = _walks("zero-bubble", pp, 2, 2 * pp)
        for m in (2 * pp + 1, 3 * pp + 2, 4 * pp, 4 * pp + 5, 9 * pp + 3):
            assert _walks("zero-bubble", pp, 2, m) == settled, (pp, m)
            for r in range(pp):
                assert grad_moments("zero-bubble", pp, 2, m, r) == grad_moments("zero-bubble", pp, 2, 4 * pp, r)
                assert emb_in_flight("zero-bubble", pp, 2, m, r) == emb_in_flight("zero-bubble", pp, 2, 2 * pp, r)
