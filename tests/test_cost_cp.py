"""Context-parallel cost terms (planner/cost_cp.py) against hand calculations, and the search with cp."""

import pytest
from meshplan.planner.candidate import Candidate
from meshplan.planner.cluster_spec import parse_cluster
from meshplan.planner.constraints import Constraints
from meshplan.planner.cost_compute import compute_time
from meshplan.planner.cost_cp import (
    CPTerms,
    block_compute_time,
    causal_core_flops,
    cp_comm_time,
    cp_degrees,
    kv_block_bytes,
    kv_buffer_bytes,
    mode_fits,
)
from meshplan.planner.cost_model import Terms, build_problem
from meshplan.planner.errors import InputError
from meshplan.planner.model_sources import builtin_model
from meshplan.planner.placement import Placer
from meshplan.planner.search import find_plan
from meshplan.planner.search_space import candidates
from meshplan.profiler.analytic import layer_forward_flops
from meshplan.profiler.presets import preset_profile

LLAMA = builtin_model("llama3-8b")  # h 4096, 32 heads, 8 kv heads, head_dim 128
H100 = parse_cluster("8xh100-80gb")


def test_kv_block_and_buffers_by_hand():
    # 2 (K and V) x b 1 x s/cp 32768 x kv_dim 8*128 / tp 2 x 2 B
    assert kv_block_bytes(LLAMA, 1, 131072, 2, 4, "bf16") == 2 * 32768 * 1024 / 2 * 2
    assert kv_buffer_bytes(LLAMA, 1, 131072, 2, 4, "ring", "bf16") == 4 * kv_block_bytes(LLAMA, 1, 131072, 2, 4, "bf16")
    # all-to-all: gathered q, k, v and output: (2 q_dim + 2 kv_dim) per token of the chunk
    assert kv_buffer_bytes(LLAMA, 1, 131072, 1, 4, "all-to-all", "bf16") == 32768 * (2 * 4096 + 2 * 1024) * 2
    assert kv_buffer_bytes(LLAMA, 1, 131072, 1, 1, "ring", "bf16") == 0.0
    # all-gather: in backward the gathered K, V and their dK, dV in sequence and in gathered order (cp each)
    kv = kv_block_bytes(LLAMA, 1, 131072, 2, 4, "bf16")
    assert kv_buffer_bytes(LLAMA, 1, 131072, 2, 4, "all-gather", "bf16") == 12 * kv


def test_ring_comm_exposed_only_beyond_the_attention_block():
    profile = preset_profile(LLAMA, H100)
    s, cp, tp = 8192, 4, 1
    kv = kv_block_bytes(LLAMA, 1, s, tp, cp, "bf16")
    step_f = profile.collective_time("send_recv", kv, 2, "intra_node")  # one KV block to the ring neighbour
    step_b = profile.collective_time("send_recv", 2 * kv, 2, "intra_node")  # K, V and dK, dV
    # attention that hides everything: nothing exposed
    assert cp_comm_time(profile, LLAMA, 1, s, tp, cp, "ring", "bf16", "intra_node", 1.0, 1.0) == (0.0, 0.0)
    # no attention to hide behind: cp - 1 full exchanges, backward twice the bytes
    f, b = cp_comm_time(profile, LLAMA, 1, s, tp, cp, "ring", "bf16", "intra_node", 0.0, 0.0)
    assert f == pytest.approx(3 * step_f) and b == pytest.approx(3 * step_b)
    # partly hidden: (cp - 1)·(step − attention/cp)
    attn = 2 * cp * step_f / 3
    f, _ = cp_comm_time(profile, LLAMA, 1, s, tp, cp, "ring", "bf16", "intra_node", attn, 0.0)
    assert f == pytest.approx(3 * (step_f - attn / cp))


def test_all_to_all_comm_four_each_way():
    profile = preset_profile(LLAMA, H100)
    s, cp, tp = 8192, 4, 2
    per = 1 * (s // cp) / tp * 2  # b · s/cp / tp · bytes
    # q, k, v in and the output back, each an all-to-all of the rank's chunk: all-gather's factors on it
    want = sum(profile.collective_time("all_gather", per * w, cp, "intra_node") for w in (4096, 1024, 1024, 4096))
    f, b = cp_comm_time(profile, LLAMA, 1, s, tp, cp, "all-to-all", "bf16", "intra_node", 1.0, 1.0)
    assert f == pytest.approx(want) and b == pytest.approx(want)


def test_all_gather_comm_gather_and_reduce_scatter_exposed():
    """Llama 3 §3.3.2: K and V all-gathered before attention, exposed whatever the attention's length;
    backward gathers them again and reduce-scatters dK, dV of the same size. collective_factors' M is the
    gathered tensor."""
    profile = preset_profile(LLAMA, H100)
    s, cp, tp = 131072, 16, 8
    gathered = cp * 2 * (s // cp) * 1024 / tp * 2  # cp KV blocks: 2 · s/cp · kv_dim/tp · 2 B
    f, b = cp_comm_time(profile, LLAMA, 1, s, tp, cp, "all-gather", "bf16", "inter_node", 10.0, 10.0)
    assert f == pytest.approx(profile.collective_time("all_gather", gathered, cp, "inter_node"))
    assert b == pytest.approx(f + profile.collective_time("reduce_scatter", gathered, cp, "inter_node"))
    assert f > 0 and b > f


def test_all_gather_activations_and_recompute_by_hand():
    profile = preset_profile(LLAMA, H100)
    base = Terms(LLAMA, profile, 32768, "bf16")
    ag, ring = CPTerms(base, 4, "all-gather", "intra_node"), CPTerms(base, 4, "ring", "intra_node")
    # only the local K, V are kept (backward gathers again), as under ring, with or without recompute
    assert ag.kind("block", 1, 2)[3] == pytest.approx(ring.kind("block", 1, 2)[3])
    assert ag.kind("block", 1, 2)[0] == pytest.approx(ring.kind("block", 1, 2)[0])  # same compute split
    for mode in ("selective", "full"):
        assert ag.recompute(1, 2, mode)[1] == pytest.approx(ring.recompute(1, 2, mode)[1])
    # per block: forward gather f, backward gather f and reduce-scatter; full recompute gathers in its
    # recompute instead of in backward (net 0); selective reruns the local core only
    f, g = ag.cp_comm(1, 2)
    for mode in ("none", "selective", "full"):
        assert ag.side_comm(1, 2, mode)["cp"] == (f + g, 0.0)


def test_block_compute_on_a_flop_profile_by_hand():
    """CPU preset (FLOP-fitted): the block at s/cp tokens plus the attention core's extra FLOPs, the core
    at 4·b·s·(s/cp)·q_dim/tp: 1/cp of the full core (layer_forward_flops' count)."""
    model = builtin_model("gpt-20m")
    profile = preset_profile(model, parse_cluster("4xcpu"), "fp32")
    s, cp = 1024, 4
    f, g, af, ab = block_compute_time(profile, model, 2, s, 1, cp, "all-to-all")
    fl, gl = compute_time(profile, "block", 2, s // cp, 1)
    q = model.num_heads * model.head_dim
    local = layer_forward_flops(model, "block", 2, s // cp, 1)
    cp_flops = local - 4 * 2 * (s // cp) ** 2 * q + 4 * 2 * s * (s // cp) * q
    assert f == pytest.approx(fl * cp_flops / local) and g == pytest.approx(gl * cp_flops / local)
    # per rank, the block's FLOPs are 1/cp of the whole sequence's
    assert cp_flops == pytest.approx(layer_forward_flops(model, "block", 2, s, 1) / cp)
    assert af == pytest.approx(f * 4 * 2 * s * (s // cp) * q / cp_flops)
    assert ab == pytest.approx(g * af / f)


def test_block_compute_on_gpu_preset_ring_and_all_to_all():
    profile = preset_profile(LLAMA, H100)
    rl = profile.roofline
    s, cp, tp = 65536, 4, 2
    f1, g1, _, _ = block_compute_time(profile, LLAMA, 1, s, tp, 1, "ring")
    f, g, af, ab = block_compute_time(profile, LLAMA, 1, s, tp, cp, "ring")
    # ring: the causal core's FLOPs / cp at flash-attention's rate for s/cp-long blocks, backward 2.5x
    flops = causal_core_flops(LLAMA, 1, s, tp) / cp
    assert af == pytest.approx(flops / (rl.flash_rate(s // cp, 128) * rl.pace))
    assert ab == pytest.approx(2.5 * af)
    lf, lb = rl.attention_core(LLAMA, 1, s // cp, tp)
    fl, gl = compute_time(profile, "block", 1, s // cp, tp)
    assert f == pytest.approx(fl - lf + af) and g == pytest.approx(gl - lb + ab)
    # a CP rank does a bit more than 1/cp of the whole block (the blocks are shorter: slower flash)
    assert f1 / cp < f < f1 / cp * 1.3
    # all-to-all: the roofline's core on the whole sequence with heads / (tp·cp)
    _, _, af2, _ = block_compute_time(profile, LLAMA, 1, s, tp, cp, "all-to-all")
    assert af2 == pytest.approx(rl.attention_core(LLAMA, 1, s, tp * cp)[0])


def test_cp_terms_scale_activations_and_hop():
    profile = preset_profile(LLAMA, H100)
    base = Terms(LLAMA, profile, 32768, "bf16")
    cpt = CPTerms(base, 4, "ring", "intra_node")
    assert cpt.kind("block", 1, 2)[3] == pytest.approx(
        profile.activation_bytes("block", 1, 8192, 2, "none", True))
    assert cpt.kind("head", 1, 2)[3] == pytest.approx(base.kind("head", 1, 2)[3] / 4, rel=1e-6)
    assert cpt.hop(1, 2, "inter_node") < base.hop(1, 2, "inter_node")


def test_mode_fits_and_degrees():
    assert mode_fits(LLAMA, 8192, 2, 4, "all-to-all")  # 8 kv heads / (2·4)
    assert not mode_fits(LLAMA, 8192, 4, 4, "all-to-all")  # 8 kv heads, tp·cp = 16
    assert mode_fits(LLAMA, 8192, 4, 4, "ring")
    assert not mode_fits(LLAMA, 8190, 1, 2, "ring")
    assert mode_fits(LLAMA, 8192, 8, 8, "all-gather") and not mode_fits(LLAMA, 8200, 1, 8, "all-gather")
    c = Constraints(global_batch_size=8, seq_len=2048)
    assert cp_degrees(LLAMA, H100, c, 1) == [1]  # short sequences: no cp unless pinned
    assert cp_degrees(LLAMA, H100, Constraints(global_batch_size=8, seq_len=2048, cp=2), 1) == [2]
    assert cp_degrees(LLAMA, H100, Constraints(global_batch_size=8, seq_len=131072), 2) == [1, 2, 4]
    cpu = parse_cluster("4xcpu")  # ring has no CPU implementation: all-gather and all-to-all
    cands = [x for x in candidates(builtin_model("tiny"), cpu, Constraints(global_batch_size=4, seq_len=64, cp=2,
                                                                          dtype="fp32"), Placer(cpu))]
    assert cands and {x.cp_mode for x in cands} == {"all-gather", "all-to-all"} and {x.cp for x in cands} == {2}


def test_build_problem_with_cp_shards_state_over_dp_cp():
    profile = preset_profile(LLAMA, H100)
    placer = Placer(H100)
    cuts = [True] * len(LLAMA.layers)
    common = dict(tp=2, pp=1, v=1, schedule="1f1b", b=1, m=8, zero=3, recompute="full")
    no_cp = Candidate(dp=4, **common)
    cp = Candidate(dp=1, cp=4, cp_mode="ring", **common)
    p0 = build_problem(LLAMA, profile, no_cp, 32768, "bf16", placer.links(1, 4, 2, no_cp.order), 1e12, cuts)
    p1 = build_problem(LLAMA, profile, cp, 32768, "bf16", placer.links(1, 1, 2, cp.order, 4), 1e12, cuts)
    assert p1.state == pytest.approx(p0.state)  # ZeRO-3 over dp·cp = 4 ranks either way
    assert p1.act[1] < p0.act[1] / 3.9  # a quarter of the tokens
    assert p1.fwd[1] < p0.fwd[1]  # fewer tokens per rank per micro-batch
    assert p1.ws.act[0] > 0


def test_planner_considers_cp_for_long_sequences_and_pins():
    plan = find_plan(LLAMA, H100, Constraints(global_batch_size=8, seq_len=131072))
    assert plan.parallel.cp > 1  # 131072 tokens of llama3-8b do not fit without sharding the sequence
    assert plan.mesh.shape[2] == plan.parallel.cp and plan.placement.order.index("cp") == 2
    assert "cp" in plan.predicted.exposed_communication_s
    assert plan.cp_notes and "cp=1" in plan.cp_notes[0]
    pinned = find_plan(LLAMA, H100, Constraints(global_batch_size=8, seq_len=131072, cp=4, cp_mode="all-to-all"))
    assert (pinned.parallel.cp, pinned.parallel.cp_mode) == (4, "all-to-all")
    assert pinned.world_size == 8
    gathered = find_plan(LLAMA, H100, Constraints(global_batch_size=8, seq_len=131072, cp=4, cp_mode="all-gather"))
    assert (gathered.parallel.cp, gathered.parallel.cp_mode) == (4, "all-gather")
    assert gathered.predicted.exposed_communication_s["cp"] > 0


def test_cp_pins_validated():
    with pytest.raises(InputError, match="--cp"):
        Constraints(global_batch_size=8, seq_len=8190, cp=2, cp_mode="ring").validate(LLAMA, H100)
    with pytest.raises(InputError, match="all-gather context parallelism splits"):
        Constraints(global_batch_size=8, seq_len=8196, cp=4, cp_mode="all-gather").validate(LLAMA, H100)
    with pytest.raises(InputError, match="scatters heads"):
        Constraints(global_batch_size=8, seq_len=8192, cp=2, tp=8, cp_mode="all-to-all").validate(
            LLAMA, parse_cluster("2x8xh100-80gb"))


def test_cp_notes_never_show_a_degree_faster_than_the_choice():
    """Each other CP degree is reported by the best time solved for it, or by what its candidates can reach,
    which is never below the chosen plan (a lower bound under it would read as a better degree missed)."""
    import re

    plan = find_plan(LLAMA, parse_cluster("8xh100-80gb"), Constraints(global_batch_size=16, seq_len=8192))
    note = plan.cp_notes[0]
    chosen = plan.predicted.iteration_time_s
    shown = re.findall(r"cp=(\d+): (?:best|>=) ([\d.]+) (ms|s)", note)
    assert shown and f"cp={plan.parallel.cp}: chosen" in note
    for _, value, unit in shown:
        assert float(value) * (1e-3 if unit == "ms" else 1.0) >= chosen * 0.995  # printed to 3 digits
