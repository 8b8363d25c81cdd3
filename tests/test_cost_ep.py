"""Expert-parallel cost terms (planner/cost_ep.py) against hand calculations, the search's choice of ep,
and the MoE exports and `plan show` lines."""

import pytest
from meshplan.planner.candidate import Candidate
from meshplan.planner.cluster_spec import parse_cluster
from meshplan.planner.constraints import Constraints
from meshplan.planner.cost_collectives import GradSync
from meshplan.planner.cost_compute import model_flops_per_iteration
from meshplan.planner.cost_cp import all_to_all_time
from meshplan.planner.cost_ep import (
    DEFAULT_IMBALANCE,
    dispatch_bytes,
    ep_comm_time,
    ep_link,
    ep_options,
    ep_terms,
    moe_tp_comm_time,
    token_buffer_bytes,
)
from meshplan.planner.cost_model import Terms
from meshplan.planner.errors import InputError
from meshplan.planner.export import to_deepspeed, to_megatron, to_torchtitan
from meshplan.planner.model_sources import builtin_model
from meshplan.planner.placement import Placer
from meshplan.planner.search import find_plan
from meshplan.planner.show import render
from meshplan.profiler.presets import preset_profile
from meshplan.profiler.profile import collective_factors

MIXTRAL = builtin_model("mixtral-8x7b")
CLUSTER = parse_cluster("2x8xh100-80gb")


@pytest.fixture(scope="module")
def profile():
    return preset_profile(MIXTRAL, CLUSTER, "bf16")


def test_dispatch_bytes_is_imbalance_b_s_topk_h():
    # b=1, s=4096, top 2, h=4096, bf16, no tp: 1.25 x 4096 x 2 x 4096 x 2 bytes
    assert dispatch_bytes(MIXTRAL, 4096.0, 1, "bf16", 1.25) == 1.25 * 4096 * 2 * 4096 * 2
    assert dispatch_bytes(MIXTRAL, 4096.0, 2, "bf16", 1.0) == 4096 * 2 * 4096 * 2 / 2  # T/tp tokens per rank
    assert token_buffer_bytes(MIXTRAL, 4096.0, 1, 8, "bf16", 1.25) == 2 * 1.25 * 4096 * 2 * 4096 * 2


@pytest.mark.parametrize("link", ["intra_node", "inter_node"])
def test_all_to_all_time_by_hand(profile, link):
    nbytes = dispatch_bytes(MIXTRAL, 4096.0, 1, "bf16", DEFAULT_IMBALANCE)
    steps, factor = collective_factors("all_gather", 8)
    assert (steps, factor) == (7, 7 / 8)  # (n - 1) steps, (n - 1)/n of the bytes (nccl-tests PERFORMANCE.md)
    one = profile.collective_time("all_gather", nbytes, 8, link)  # the link fit's all-gather at these factors
    fwd, bwd = ep_comm_time(profile, MIXTRAL, 4096.0, 1, 8, "bf16", link, DEFAULT_IMBALANCE)
    assert fwd == pytest.approx(2 * one) and bwd == pytest.approx(2 * one)  # dispatch + combine each way
    assert ep_comm_time(profile, MIXTRAL, 4096.0, 1, 1, "bf16", link, DEFAULT_IMBALANCE) == (0.0, 0.0)


def test_inter_node_all_to_all_is_slower(profile):
    intra = ep_comm_time(profile, MIXTRAL, 4096.0, 1, 8, "bf16", "intra_node", 1.25)[0]
    inter = ep_comm_time(profile, MIXTRAL, 4096.0, 1, 8, "bf16", "inter_node", 1.25)[0]
    assert inter > 2 * intra


def test_expert_state_is_split_over_ep_and_sharded_over_expert_dp(profile):
    # mixtral block: 1,451,270,144 parameters of which 8 experts x 3 x 4096 x 14336 = 1,409,286,144
    block, experts = 1_451_270_144, 1_409_286_144
    assert MIXTRAL.layers[1].params == block
    cand = Candidate(dp=16, tp=1, pp=1, v=1, schedule="1f1b", b=1, m=2, zero=1, recompute="none", ep=8)
    terms = ep_terms(Terms(MIXTRAL, profile, 4096, "bf16"), cand, "intra_node")
    state = terms.per_layer(1, 16, 1, "inter_node", GradSync(False, 1))[0]
    # ZeRO-1, bf16: parameter 2 + fp32 gradient 4 + optimizer 12/shards bytes per parameter
    rest = (block - experts) * (2 + 4 + 12 / 16)  # over dp x cp = 16
    local_experts = experts / 8 * (2 + 4 + 12 / 2)  # 1 expert per rank, optimizer over edp = 16/8 = 2
    assert state[1] == pytest.approx(rest + local_experts)
    dense = Terms(MIXTRAL, profile, 4096, "bf16").per_layer(1, 16, 1, "inter_node", GradSync(False, 1))[0]
    assert dense[1] == pytest.approx(block * (2 + 4 + 12 / 16))  # ep = 1: every expert on every rank


def test_expert_state_folded_over_tp(profile):
    """EP folded over TP (expert_tp 1, tp 2, dp 8, ep 16): each rank holds 8/16 of an expert (the experts'
    per-rank share is experts / ep), their optimizer state over edp = dp x tp / ep = 1; the rest ÷ tp, over dp."""
    block, experts = 1_451_270_144, 1_409_286_144
    cand = Candidate(dp=8, tp=2, pp=1, v=1, schedule="1f1b", b=1, m=2, zero=1, recompute="none", ep=16)
    terms = ep_terms(Terms(MIXTRAL, profile, 4096, "bf16"), cand, "intra_node")
    state = terms.per_layer(2, 8, 1, "inter_node", GradSync(False, 1))[0]
    rest = (block - experts) / 2 * (2 + 4 + 12 / 8)
    assert state[1] == pytest.approx(rest + experts / 16 * (2 + 4 + 12 / 1))


def test_folded_ep_plans(tmp_path):
    """ParallelConfig: EP spans TP only under sequence parallelism with expert_tp 1, as tp times a divisor of
    dp x cp; `plan show` lists its groups as runs of consecutive ranks."""
    from meshplan.planner.plan import ParallelConfig
    from meshplan.planner.show_moe import ep_groups

    base = dict(dp=2, tp=2, pp=1, virtual_stages=1, zero=1, schedule="1f1b", micro_batch_size=1,
                num_micro_batches=1, global_batch_size=2, seq_len=64, recompute="none", dtype="bf16",
                sequence_parallel=True)
    p = ParallelConfig.from_dict({**base, "ep": 4})
    assert p.experts_span_tp and p.expert_dp == 1
    assert not ParallelConfig.from_dict({**base, "ep": 2, "expert_tp": 2}).experts_span_tp
    with pytest.raises(InputError, match="plan.parallel.ep"):  # 2 is no multiple of tp = 4
        ParallelConfig.from_dict({**base, "dp": 1, "tp": 4, "global_batch_size": 1, "ep": 2})
    plan = find_plan(MIXTRAL, CLUSTER, Constraints(global_batch_size=32, seq_len=4096, tp=2, pp=1, ep=8,
                                                   expert_tp=1, top_k=1), preset_profile(MIXTRAL, CLUSTER, "bf16"))
    assert plan.parallel.experts_span_tp and plan.parallel.expert_dp == 2
    assert ep_groups(plan) == [list(range(8)), list(range(8, 16))]  # row-major placement: one node each
    ds: list[str] = []
    to_deepspeed(plan, ds)
    assert any("spans the tp=2 ranks" in w for w in ds)
    warnings: list[str] = []
    to_megatron(plan, warnings)
    assert not any("folds" in w for w in warnings)  # Megatron-Core runs the same folding


def test_block_time_carries_the_all_to_alls(profile):
    base = Terms(MIXTRAL, profile, 4096, "bf16")
    cand = Candidate(dp=16, tp=1, pp=1, v=1, schedule="1f1b", b=1, m=2, zero=1, recompute="none", ep=8)
    terms = ep_terms(base, cand, "intra_node", 1.25)
    f, g = terms.ep_comm(1, 1)
    assert terms.kind("block", 1, 1)[2] == pytest.approx(base.kind("block", 1, 1)[2] + f + g)
    # the busiest rank's grouped GEMMs: more rows than the balanced mean, so at least as slow
    assert terms.kind("block", 1, 1)[0] >= base.kind("block", 1, 1)[0] * 0.99
    rec = terms.recompute(1, 1, "full")[0] - base.recompute(1, 1, "full")[0]
    assert rec >= f  # full recompute replays dispatch and combine


def test_ep_options():
    assert ep_options(builtin_model("llama3-8b"), 16, 1, 2, None, None) == [(1, 1)]  # dense: no enumeration
    got = ep_options(MIXTRAL, 16, 1, 2, None, None)
    assert {ep for ep, _ in got} == {1, 2, 4, 8} and {etp for _, etp in got} == {1, 2}
    assert ep_options(MIXTRAL, 16, 1, 2, 8, 1) == [(8, 1)]
    # tp 4, dp 4: expert_tp 1 folds EP over TP (1, or 4 times a divisor of dp: 4, 8; 16 > 8 experts),
    # expert_tp 4 carves it from dp (1, 2, 4)
    got = ep_options(MIXTRAL, 4, 1, 4, None, None)
    assert sorted(ep for ep, etp in got if etp == 1) == [1, 4, 8]
    assert sorted(ep for ep, etp in got if etp == 4) == [1, 2, 4]


def test_ep_link_by_placement():
    placer = Placer(CLUSTER)
    qwen = dict(tp=1, pp=1, v=1, schedule="1f1b", b=1, m=1, zero=1, recompute="none", order=("pp", "dp", "tp"))
    assert ep_link(placer, Candidate(dp=16, ep=8, **qwen)) == "intra_node"
    assert ep_link(placer, Candidate(dp=16, ep=16, **qwen)) == "inter_node/8"  # 8 members in each node
    # tp 2, expert_tp 2: EP over the dp ranks of one TP position, 4 of them in each node
    assert ep_link(placer, Candidate(dp=8, ep=8, expert_tp=2, **{**qwen, "tp": 2})) == "inter_node/4"
    # expert_tp 1: EP folded over TP, runs of 8 consecutive ranks (4 dp x 2 tp): one node
    assert ep_link(placer, Candidate(dp=8, ep=8, **{**qwen, "tp": 2})) == "intra_node"
    assert ep_link(placer, Candidate(dp=8, ep=16, **{**qwen, "tp": 2})) == "inter_node/8"


def test_edp_link_by_placement():
    """The expert-data-parallel groups (every ep-th rank of the EP runs) as placed on 8 nodes of 8: ep 8 fills a
    node, so each edp group has one rank per node (flat, one NIC each); ep 4: two per node; ep 2: four; ep 16
    spans two nodes, its edp group again one per node. Folded over tp 2 x dp 8 on 2 nodes, ep 8: {0, 8}."""
    from meshplan.planner.cost_ep import edp_link

    placer = Placer(parse_cluster("8x8xh100-80gb"))
    one = dict(tp=1, pp=1, v=1, schedule="1f1b", b=1, m=1, zero=1, recompute="none", order=("pp", "dp", "tp"))
    assert [edp_link(placer, Candidate(dp=64, ep=ep, **one)) for ep in (8, 4, 2, 16)] == \
        ["inter_node", "inter_node/2", "inter_node/4", "inter_node"]
    assert edp_link(Placer(CLUSTER), Candidate(dp=8, ep=8, **{**one, "tp": 2})) == "inter_node"


def test_expert_gradients_reduce_on_their_own_group(profile):
    """ep 4 over dp 64 on 8 nodes: the experts' gradients reduce over 16 ranks, two per node (two NICs per node
    carry them), not over the dp group's eight per node."""
    cand = Candidate(dp=64, tp=1, pp=1, v=1, schedule="1f1b", b=1, m=2, zero=1, recompute="none", ep=4)
    base = Terms(MIXTRAL, profile, 4096, "bf16")
    own = ep_terms(base, cand, "intra_node", 1.25, "inter_node/2").per_layer(1, 64, 1, "inter_node/8")
    shared = ep_terms(base, cand, "intra_node", 1.25).per_layer(1, 64, 1, "inter_node/8")
    experts = 1_409_286_144 / 4  # a rank's 2 experts of a block
    sync = GradSync(False, 1)
    from meshplan.planner.cost_collectives import dp_reduction_times
    tail_own = dp_reduction_times(profile, experts, "bf16", 16, 1, "inter_node/2", sync)[0]
    tail_shared = dp_reduction_times(profile, experts, "bf16", 16, 1, "inter_node/8", sync)[0]
    assert own[2][1] - shared[2][1] == pytest.approx(tail_own - tail_shared)
    assert tail_own > 2 * tail_shared  # a quarter of the NICs per node


def test_spread_all_to_all_by_hand(profile):
    """16 ranks, 8 per node: each rank sends 16 chunks of nbytes/16; 7 go over NVLink, 8 over its NIC."""
    nbytes = dispatch_bytes(MIXTRAL, 4096.0, 1, "bf16", 1.0)
    across = profile.collective_time("all_gather", nbytes * 8 / 15, 16, "inter_node")
    inside = profile.collective_time("all_gather", nbytes * 7 / 15, 16, "intra_node")
    _, factor = collective_factors("all_gather", 16)
    assert nbytes * 8 / 15 * factor == pytest.approx(nbytes * 8 / 16)  # the 8 remote chunks' bytes
    assert all_to_all_time(profile, nbytes, 16, "inter_node/8") == pytest.approx(max(across, inside))
    flat = all_to_all_time(profile, nbytes, 16, "inter_node")  # every chunk through the NIC
    assert flat == pytest.approx(profile.collective_time("all_gather", nbytes, 16, "inter_node"))
    assert all_to_all_time(profile, nbytes, 16, "inter_node/8") < 0.6 * flat
    # one member per node: everything crosses, as the flat class
    assert all_to_all_time(profile, nbytes, 16, "inter_node/1") == pytest.approx(flat)


def test_mfu_counts_active_flops():
    # per token forward: 2 x (attention weights + router + top_k experts) + attention scores
    h, s = 4096, 4096
    attn = h * (4096 + 2 * 1024) + 4096 * h
    block = 2 * s * (attn + h * 8 + 2 * 3 * h * 14336) + 4 * s * s * 4096
    head, emb = 2 * s * h * 32000, 2 * s * h
    assert model_flops_per_iteration(MIXTRAL, 1, s) == pytest.approx(3 * (32 * block + head + emb))


def test_constraints_refuse_bad_ep():
    with pytest.raises(InputError, match="--ep: 3 must divide the model's 8 experts"):
        Constraints(ep=3).validate(MIXTRAL, CLUSTER)
    with pytest.raises(InputError, match="dense"):
        Constraints(ep=2).validate(builtin_model("llama3-8b"), CLUSTER)
    with pytest.raises(InputError, match=r"--ep: 8 must divide dp x cp = 2 .* or with --expert-tp 1 be tp times"):
        Constraints(dp=2, tp=2, ep=8).validate(MIXTRAL, CLUSTER)  # 8 = tp 2 x 4, and 4 does not divide dp 2
    Constraints(dp=4, tp=2, ep=8).validate(MIXTRAL, CLUSTER)  # folded: tp 2 x 4 over dp 4
    with pytest.raises(InputError, match="--expert-tp"):
        Constraints(tp=2, expert_tp=4).validate(MIXTRAL, CLUSTER)


@pytest.fixture(scope="module")
def ep8_plan(profile):
    c = Constraints(global_batch_size=32, seq_len=4096, ep=8, top_k=1)
    return find_plan(MIXTRAL, CLUSTER, c, profile)


def test_pinned_ep_plans_and_exports(ep8_plan):
    plan = ep8_plan
    assert plan.parallel.ep == 8 and plan.model.moe is not None
    assert plan.predicted.exposed_communication_s["ep"] > 0
    warnings: list[str] = []
    assert "--expert-model-parallel-size 8" in to_megatron(plan, warnings)
    assert "--num-experts 8" in to_megatron(plan) and "--moe-router-topk 2" in to_megatron(plan)
    assert "expert_parallel_degree = 8" in to_torchtitan(plan, warnings)
    ds: list[str] = []
    to_deepspeed(plan, ds)
    assert any("ep_size=8" in w for w in ds)
    text = " ".join(render(plan).split())  # as printed, less the terminal's line wrapping
    assert "ep 8: 1 experts per rank" in text and "EP groups" in text and "exposed all-to-all" in text


def test_search_chooses_ep_for_mixtral(profile):
    plan = find_plan(MIXTRAL, CLUSTER, Constraints(global_batch_size=32, seq_len=4096, top_k=1), profile)
    p = plan.parallel
    assert p.ep > 1
    # EP carved from dp x cp, or folded over TP as tp times a divisor of it (expert_tp 1)
    assert (p.dp * p.cp) % p.ep == 0 or (p.experts_span_tp and p.ep % p.tp == 0 and (p.dp * p.cp) % (p.ep // p.tp) == 0)
    assert p.expert_dp == p.dp * p.cp * (p.tp if p.experts_span_tp else 1) // p.ep


def test_moe_plan_round_trips(ep8_plan, tmp_path):
    from meshplan.planner.plan import load_plan, save_plan

    path = str(tmp_path / "plan.json")
    save_plan(ep8_plan, path)
    again = load_plan(path)
    p = again.parallel
    assert p.ep == 8 and p.expert_dp == p.dp * p.cp * (p.tp if p.experts_span_tp else 1) // 8
    assert again.parallel == ep8_plan.parallel
    assert again.model == ep8_plan.model and again.model.moe.num_experts == 8


def test_fp8_experts_run_fp8_gemms_with_their_casts():
    """Under an FP8 recipe the experts' GEMMs run at the FP8 rates (faster than 16-bit), and current scaling
    adds one 2-byte read per cast element over delayed: forward the routed rows' last-GEMM input (T·k·f),
    backward every expert GEMM's output gradient (T·k·(2f + h), SwiGLU). mixtral-8x7b, ep = 1, one H100
    (2.97 TB/s achievable)."""
    from dataclasses import replace

    from meshplan.profiler.moe_cost import moe_ffn_time
    from meshplan.profiler.presets import device_roofline

    model, T = builtin_model("mixtral-8x7b"), 8192
    h, f, k = 4096, 14336, 2
    bf16 = device_roofline(parse_cluster("8xh100-80gb"), "bf16")
    delayed, current = (moe_ffn_time(replace(bf16, fp8=r), model, T, 1) for r in ("delayed", "current"))
    assert sum(delayed) < sum(moe_ffn_time(bf16, model, T, 1))
    assert current[0] - delayed[0] == pytest.approx(2 * T * k * f / 2.97e12)
    assert current[1] - delayed[1] == pytest.approx(2 * T * k * (2 * f + h) / 2.97e12)


def test_moe_tp_collectives_by_dispatcher():
    """A MoE block's TP collectives against the dense MLP's all-gather + reduce-scatter of T·h (one all-reduce's
    bytes) that every block is charged, per direction. Megatron-Core (moe_dispatch "sharded") under expert TP
    gathers the received rows over TP, top_k · imbalance · T·h, and its shared experts the sequence again; with
    expert_tp 1 the MoE runs no TP collective; the executor dispatches as Megatron-Core does. An engine that
    gathers the sequence before routing ("gathered") keeps the dense MLP's under expert TP."""
    from dataclasses import replace as dc_replace

    from meshplan.planner.model_spec import MoESpec

    cluster, T, h = parse_cluster("8xh100-80gb"), 4096.0, 4096
    dense = T * h * 2
    mcore = preset_profile(MIXTRAL, cluster, "bf16", moe_dispatch="sharded")
    ours = preset_profile(MIXTRAL, cluster, "bf16", moe_dispatch="gathered")
    assert preset_profile(MIXTRAL, cluster, "bf16").roofline.moe_dispatch == "sharded"  # the executor's

    def ar(profile, nbytes):
        return profile.collective_time("all_reduce", nbytes, 4, "intra_node")

    assert moe_tp_comm_time(mcore, MIXTRAL, T, 4, 2, 4, "bf16", 1.25) == pytest.approx(
        ar(mcore, 2 * 1.25 * dense) - ar(mcore, dense))
    assert moe_tp_comm_time(mcore, MIXTRAL, T, 4, 1, 4, "bf16", 1.25) == pytest.approx(  # ep 1: no imbalance
        ar(mcore, 2 * dense) - ar(mcore, dense))
    assert moe_tp_comm_time(mcore, MIXTRAL, T, 4, 8, 1, "bf16", 1.25) == pytest.approx(-ar(mcore, dense))
    assert moe_tp_comm_time(ours, MIXTRAL, T, 4, 2, 4, "bf16", 1.25) == 0.0
    assert moe_tp_comm_time(ours, MIXTRAL, T, 4, 8, 1, "bf16", 1.25) == pytest.approx(-ar(ours, dense))
    assert moe_tp_comm_time(mcore, MIXTRAL, T, 1, 8, 1, "bf16", 1.25) == 0.0  # no TP
    shared = dc_replace(MIXTRAL, moe=MoESpec(num_experts=8, top_k=2, expert_ffn_hidden_size=14336,
                                              num_shared_experts=1, shared_expert_ffn_hidden_size=14336))
    assert moe_tp_comm_time(mcore, shared, T, 4, 8, 1, "bf16", 1.25) == pytest.approx(0.0)
    assert moe_tp_comm_time(ours, shared, T, 4, 8, 1, "bf16", 1.25) == pytest.approx(-ar(ours, dense))


def test_expert_tp_dispatch_volume_and_block_charges():
    """Under expert TP (tp 2) an engine that gathers the sequence first dispatches all T tokens' rows from every
    TP rank, Megatron-Core and the executor their sequence shard's; the block's communication value carries the
    all-to-alls and the MoE's TP difference both ways, and full recompute replays their forward halves."""
    cluster = parse_cluster("8xh100-80gb")
    base = dict(dp=4, tp=2, pp=1, v=1, schedule="1f1b", b=1, m=2, zero=1, recompute="none", ep=4, expert_tp=2)
    for software, shard in (({"moe_dispatch": "gathered"}, 1), ({}, 2)):
        profile = preset_profile(MIXTRAL, cluster, "bf16", **software)
        dense = Terms(MIXTRAL, profile, 4096, "bf16")
        terms = ep_terms(dense, Candidate(**base), "intra_node", 1.25)
        f, g = terms.ep_comm(1, 2)
        assert (f, g) == pytest.approx(ep_comm_time(profile, MIXTRAL, 4096.0, shard, 4, "bf16", "intra_node", 1.25))
        d = terms.moe_tp(1, 2)
        assert terms.kind("block", 1, 2)[2] == pytest.approx(dense.kind("block", 1, 2)[2] + f + g + 2 * d)
        rec, _, rec_tp = terms.recompute(1, 2, "full")
        _, _, dense_rec_tp = dense.recompute(1, 2, "full")
        assert rec_tp == pytest.approx(dense_rec_tp + d)
        assert (d > 0) == (shard == 2)  # the sharded dispatch gathers top_k x the rows


def test_moe_memory_bound_bytes_by_hand():
    """What a MoE feed-forward moves over HBM (mixtral-8x7b, SwiGLU, bf16, ep 1, one H100): the permutation's
    gather and scatter-add of T·top_k rows (read + write, 2·2·T·k·h·2 bytes) and the experts' activation on
    every routed row (SiLU read + write, product two reads + a write: 5·2 bytes per element of T·k·f); backward
    twice. Isolated as the time that disappears when HBM is 1000 x faster (no launch floor; the GEMMs stay
    compute-bound but the router's backward, [T, 8] x [8, h], which is added back)."""
    from dataclasses import replace as dc_replace

    from meshplan.profiler.moe_cost import block_ffn_time_correction, moe_ffn_time
    from meshplan.profiler.presets import device_roofline

    rl = dc_replace(device_roofline(parse_cluster("1xh100-80gb"), "bf16"), launch_s=0.0)
    fast = dc_replace(rl, hbm_Bps=rl.hbm_Bps * 1000)
    T, h, f, k = 8192, 4096, 14336, 2
    moved = 2 * 2 * T * k * h * 2 + 5 * 2 * T * k * f
    rate = rl.hbm_Bps * rl.hbm_fraction
    slow_f, slow_b = moe_ffn_time(rl, MIXTRAL, T, 1)
    fast_f, fast_b = moe_ffn_time(fast, MIXTRAL, T, 1)
    assert slow_f - fast_f == pytest.approx(moved / rate * (1 - 1e-3), rel=1e-6)
    router = rl.gemm_fwd_bwd(T, 8, h)[1] - fast.gemm_fwd_bwd(T, 8, h)[1]
    assert slow_b - fast_b == pytest.approx(2 * moved / rate * (1 - 1e-3) + router, rel=1e-6)
    # the block's correction takes out the dense MLP's activation (T·f, which the block's elementwise charged)
    cf = block_ffn_time_correction(rl, MIXTRAL, T, 1)[0] - block_ffn_time_correction(fast, MIXTRAL, T, 1)[0]
    assert cf == pytest.approx((moved - 5 * 2 * T * f) / rate * (1 - 1e-3), rel=1e-6)


def test_ep_regroups_received_rows_by_local_expert():
    """With EP and several experts per rank the received rows (imbalance · T·top_k) are sorted by local expert
    and back: two more read + write passes over them forward, four backward, as many bytes as the
    permutation's gather and scatter-add (mixtral-8x7b, ep 2: 4 local experts; ep 8: 1, no regrouping)."""
    from dataclasses import replace as dc_replace

    from meshplan.profiler.moe_cost import moe_ffn_time
    from meshplan.profiler.presets import device_roofline

    rl = dc_replace(device_roofline(parse_cluster("1xh100-80gb"), "bf16"), launch_s=0.0)
    fast = dc_replace(rl, hbm_Bps=rl.hbm_Bps * 1000)
    T, h, f, k = 8192, 4096, 14336, 2
    rate = rl.hbm_Bps * rl.hbm_fraction * 1000 / 999
    for ep, passes in ((2, 4), (8, 2)):
        moved = passes * 2 * T * k * h * 2 + 5 * 2 * T * k * f
        assert moe_ffn_time(rl, MIXTRAL, T, 1, ep)[0] - moe_ffn_time(fast, MIXTRAL, T, 1, ep)[0] == \
            pytest.approx(moved / rate, rel=1e-6)


def test_expert_tp_keeps_whole_rows():
    """Under expert TP (tp 2, ep 4, imbalance 1.25) the rows an expert multiplies are whole on every TP rank:
    beyond the closed forms' ÷tp the block keeps (1 − 1/2) of imbalance · T·top_k·h more values per saved
    copy: the experts' input rows (Megatron-Core, the executor), and where the sequence is gathered before
    routing their partial-sum output as well.
    Full recompute drops them with the block; selective keeps them. Folded EP (expert_tp 1): nothing."""
    cluster = parse_cluster("8xh100-80gb")
    base = dict(dp=4, tp=2, pp=1, v=1, schedule="1f1b", b=1, m=2, zero=1, recompute="none", ep=4, expert_tp=2)
    T, k, h = 4096, 2, 4096
    for software, copies in (({"moe_dispatch": "gathered"}, 2), ({}, 1)):
        profile = preset_profile(MIXTRAL, cluster, "bf16", **software)
        dense = Terms(MIXTRAL, profile, 4096, "bf16")
        terms = ep_terms(dense, Candidate(**base), "intra_node", 1.25)
        extra = copies * 1.25 * T * k * h * 2 * (1 - 1 / 2)
        assert terms.kind("block", 1, 2)[3] - dense.kind("block", 1, 2)[3] == pytest.approx(extra)
        assert terms.recompute(1, 2, "full")[1] - dense.recompute(1, 2, "full")[1] == pytest.approx(extra)
        assert terms.recompute(1, 2, "selective")[1] == pytest.approx(dense.recompute(1, 2, "selective")[1])
    folded = ep_terms(Terms(MIXTRAL, preset_profile(MIXTRAL, cluster, "bf16"), 4096, "bf16"),
                      Candidate(**{**base, "ep": 8, "expert_tp": 1}), "intra_node", 1.25)
    assert folded.whole_rows_bytes(1, 2) == 0.0
