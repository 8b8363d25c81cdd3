"""The per-operation preset model and the topology against hand calculations from their sources."""

import json
import math
from dataclasses import asdict

import pytest
from meshplan.planner.cluster_spec import parse_cluster
from meshplan.planner.model_sources import builtin_model
from meshplan.planner.topology import group_class
from meshplan.profiler.analytic import layer_activation_bytes
from meshplan.profiler.presets import device_roofline, preset_profile

A100 = device_roofline(parse_cluster("1xa100-80gb"), "bf16")  # one GPU: no group pace


def test_gemm_tile_and_wave_quantisation():
    """4096³ on A100: 16 x 32 = 512 tiles of 256x128 in ceil(512/108) = 5 waves, 0.9481 of the slots
    used; K = 4096 runs at 4096/(4096 + 99) of the K-loop share MAMF's K (13312) has; 2·4096³ FLOPs at
    312 TFLOP/s x MAMF 271.2/312 x 0.9481 x that = 0.5434 ms (above the HBM bound)."""
    used = 4096 * 4096 / (5 * 108 * 256 * 128)
    k_share = 4096 / (4096 + 99) * (13312 + 99) / 13312
    expected = 2 * 4096**3 / (271.2e12 * used * k_share)
    assert A100.gemm(4096, 4096, 4096) == pytest.approx(expected, rel=1e-9)
    assert expected == pytest.approx(0.5434e-3, rel=1e-3)
    # one tile: a wave of 108 slots with 1 used; tiny K makes it memory bound or launch bound
    assert A100.gemm(256, 128, 64) >= A100.launch_s


def test_gemm_tile_fixed_cost_on_h100_and_a100():
    """H100: throughput ∝ K/(K + 198), equal to MAMF at its K (13312). 4096x4096x1024 against the same at
    K = 4096: 0.8782 of it, the ratio of XLA's measured table (685.2 / 780.2 TFLOP/s) that K0 comes from;
    MAMF's own shape and longer K run at MAMF. A100 (no published sweep): K0 derived as half of H100's,
    clock for clock half the matrix rate per SM for the same fixed tile cost (planner/cluster_spec.py)."""
    from meshplan.planner.cluster_spec import A100_GEMM_K0_DERIVED, H100_GEMM_K0

    h100 = device_roofline(parse_cluster("1xh100-80gb"), "bf16")
    assert h100.k_efficiency(1024) / h100.k_efficiency(4096) == pytest.approx(685.2 / 780.2, rel=2e-3)
    assert h100.k_efficiency(13312) == pytest.approx(1.0) and h100.k_efficiency(65536) == 1.0
    t1, t4 = h100.gemm(4096, 4096, 1024), h100.gemm(4096, 4096, 4096)
    assert (4 * t1) / t4 == pytest.approx(780.2 / 685.2, rel=2e-3)
    assert A100_GEMM_K0_DERIVED == H100_GEMM_K0 / 2 == 99.0
    assert A100.k_efficiency(1024) == pytest.approx(1024 / 1123 * 13411 / 13312)
    assert A100.k_efficiency(13312) == pytest.approx(1.0)


def test_small_k_gemms_bound_by_bytes_or_the_tile_fixed_cost():
    """QKᵀ of 32 heads on A100 80GB (s = 2048): head_dim 64 is HBM bound, its s² bf16 outputs (165 us at
    1.725 TB/s) above the compute at 64/(64 + 99) of MAMF's K-loop share (160 us); head_dim 128 is bound
    by the tiles' fixed cost: 2·s²·128·32 FLOPs at 271.2 TFLOP/s x 128/227 (x 1.007, x 0.998 of the slots
    used in 38 waves) = 224 us, above its 175 us of bytes."""
    s, heads = 2048, 32
    used = (8 * 16 * heads) / (38 * 108)
    for d, bound in ((64, "bytes"), (128, "compute")):
        bytes_time = (s * d + d * s + s * s) * 2 * heads / 1.725e12
        compute = 2 * s * s * d * heads / (271.2e12 * used * d / (d + 99) * 13411 / 13312)
        assert A100.gemm(s, s, d, heads) == pytest.approx(max(bytes_time, compute), rel=1e-9)
        assert (bytes_time > compute) == (bound == "bytes")


def test_eager_fp32_rmsnorm_moves_its_ops_bytes():
    """profiler/roofline.NORM: torchtitan's eager RMSNorm on an fp32 copy moves (2 + 4) + 8 + 4 + 8 + (4 + 2)
    + 4 = 36 bytes per element in bf16 against a fused norm's 4; a block has two norms, so its forward's
    memory-bound time grows by 2 x 32 bytes x h per token (llama3-8b, b = 1, s = 2048, one GPU)."""
    from dataclasses import replace

    from meshplan.profiler.roofline import norm_bytes

    assert norm_bytes("eager-fp32", 2) == 36 and norm_bytes("fused", 2) == 4
    model = builtin_model("llama3-8b")
    eager = replace(A100, norm="eager-fp32")
    extra = eager.elementwise(model, 1, 2048, 1, False) - A100.elementwise(model, 1, 2048, 1, False)
    assert extra == pytest.approx(2 * 2048 * 32 * model.hidden_size / 1.725e12)


def test_qk_norm_moves_a_norm_over_q_and_k():
    """Qwen3's and OLMo 2's norm over each head of q and of k: a fused norm's 4 bytes per element of q and k
    (llama3-8b's q = 4,096 and kv = 1,024 per token, b = 1, s = 2048, one A100 at 1.725 TB/s achievable)."""
    from dataclasses import replace

    model = builtin_model("llama3-8b")
    normed = replace(model, qk_norm=True, layers=())
    extra = A100.elementwise(normed, 1, 2048, 1, False) - A100.elementwise(model, 1, 2048, 1, False)
    assert extra == pytest.approx(2048 * 4 * (4096 + 1024) / 1.725e12)


def test_partial_rotary_moves_its_share_of_bytes():
    """GPT-NeoX rotates a quarter of each head: the rotary op reads and writes q and k in fp32, 2·(q+kv)·4·2
    bytes per token for all of them; with rotary_dim = head_dim/4 the block's forward saves 3/4 of that
    (llama3-8b: q = 4096, kv = 1024, b = 1, s = 2048, one A100 at 1.725 TB/s achievable)."""
    from dataclasses import replace

    model = builtin_model("llama3-8b")
    quarter = replace(model, rotary_dim=model.head_dim // 4, layers=())
    saved = A100.elementwise(model, 1, 2048, 1, False) - A100.elementwise(quarter, 1, 2048, 1, False)
    assert saved == pytest.approx(0.75 * 2048 * 2 * (4096 + 1024) * 4 * 2 / 1.725e12)


def test_fp8_linears_run_at_fp8_mamf():
    """Under an FP8 recipe a block's Linear GEMMs run at the FP8 MAMF (H100 SXM 1402.6 TFLOP/s at K = 14336,
    against 794.5 in bf16); at K = 14336 neither K efficiency binds (bf16: 14336/(14336 + 198) x (13312 + 198)
    /13312 > 1; FP8, K0 = 2 x 198, at its own MAMF K: 1), so a wave-filling GEMM is 1402.6/794.5 faster."""
    from dataclasses import replace

    h100 = device_roofline(parse_cluster("8xh100-80gb"), "bf16")
    fp8 = replace(h100, fp8="delayed").linear
    assert (fp8.peak_flops, fp8.gemm_k0, fp8.gemm_k_ref) == (1979e12, 396.0, 14336)
    m, n, k = 132 * 256, 1024, 14336  # eight full waves of 256 x 128 tiles, compute-bound
    assert h100.gemm(m, n, k) / fp8.gemm(m, n, k) == pytest.approx(1402.6 / 794.5)
    assert h100.linear is h100  # no recipe: the 16-bit rates


def test_fp8_casts_move_their_bytes():
    """Delayed scaling (profiler/roofline.FP8): forward casts the output projection's input (q) and the last
    MLP GEMM's input (f), backward each Linear's output gradient (q + 2kv, h, 2f for SwiGLU, h); each reads
    2 bytes and writes FP8 and its transpose, 4 bytes per element. Current scaling reads each once more, and
    also takes the amax of the two norm outputs (2 bytes per element each). llama3-8b, b = 1, s = 2048, one
    H100 (2.97 TB/s achievable)."""
    from dataclasses import replace

    model = builtin_model("llama3-8b")
    q, kv, f, h, T, bw = 4096, 1024, 14336, 4096, 2048, 2.97e12
    h100 = device_roofline(parse_cluster("8xh100-80gb"), "bf16")
    fwd, bwd = replace(h100, fp8="delayed").fp8_casts(model, 1, T, 1, False)
    assert fwd == pytest.approx(T * 4 * (q + f) / bw)
    assert bwd == pytest.approx(T * 4 * ((q + 2 * kv) + h + 2 * f + h) / bw)
    fwd_c, bwd_c = replace(h100, fp8="current").fp8_casts(model, 1, T, 1, False)
    assert fwd_c == pytest.approx(T * (6 * (q + f) + 2 * 2 * h) / bw)
    assert bwd_c == pytest.approx(bwd * 6 / 4)
    assert h100.fp8_casts(model, 1, T, 1, False) == (0.0, 0.0)


def test_fp8_activations_and_weight_cache():
    """Transformer Engine keeps the Linears' inputs in FP8: the two norm outputs and the last MLP GEMM's input
    drop from 2 bytes to 1, and the output projection adds a 1-byte copy of the attention output: per token
    -2h - f + q (llama3-8b: h = q = 4096, f = 14336). Below ZeRO-3 the FP8 weights and transposes add 2 bytes
    per parameter."""
    from dataclasses import replace

    from meshplan.planner.cost_memory import fp8_weight_bytes, state_bytes_per_param

    model, b, s = builtin_model("llama3-8b"), 1, 2048
    delta = (layer_activation_bytes(model, "block", b, s, 1, "bf16", fp8=True)
             - layer_activation_bytes(model, "block", b, s, 1, "bf16"))
    assert delta == b * s * (-2 * 4096 - 14336 + 4096)
    profile = preset_profile(model, parse_cluster("8xh100-80gb"), "bf16", fp8="delayed")
    assert fp8_weight_bytes(profile) == 2.0 and fp8_weight_bytes(replace(profile, roofline=None)) == 0.0
    assert state_bytes_per_param("bf16", 1, 8, fp8_weights=2.0)[0] == 2.0 + 2.0
    assert state_bytes_per_param("bf16", 3, 8, fp8_weights=2.0)[0] == 0.0
    # per layer: the blocks' Linears carry the cache, the 16-bit embedding and head do not
    from meshplan.planner.cost_model import Terms
    state = Terms(model, profile, s, "bf16").per_layer(1, 8, 1, "inter_node")[0]
    bf16 = Terms(model, replace(profile, roofline=replace(profile.roofline, fp8="none")), s, "bf16"
                 ).per_layer(1, 8, 1, "inter_node")[0]
    for layer, with_fp8, without in zip(model.layers, state, bf16):
        assert with_fp8 - without == pytest.approx(2.0 * layer.params if layer.kind == "block" else 0.0)


def test_fp8_parameters_replace_the_16bit_weights():
    """With FP8 parameters (Megatron-Core's --fp8-param-gather, `--software megatron`) a block's Linear weight is
    its FP8 copy and transpose, 2 bytes, with no 16-bit parameter beside it; only with a sharded optimizer
    (ZeRO >= 1): ZeRO-0 keeps 2 + 2. Megatron's bf16 gradients are fp32 (4 B), its optimizer 12 B over dp."""
    from dataclasses import replace

    from meshplan.planner.cost_memory import state_bytes
    from meshplan.profiler.software import software_settings

    model = builtin_model("llama3-8b")
    mcore = preset_profile(model, parse_cluster("8xh100-80gb"), "bf16", fp8="delayed", **software_settings("megatron"))
    assert state_bytes(mcore, "bf16", 1, 8) == (2.0, 4.0, 12.0 / 8)
    assert state_bytes(mcore, "bf16", 0, 8) == (2.0 + 2.0, 4.0, 12.0)
    assert state_bytes(mcore, "bf16", 1, 8, block=False) == (2.0, 4.0, 12.0 / 8)  # embedding, head: 16-bit
    ours = preset_profile(model, parse_cluster("8xh100-80gb"), "bf16", fp8="delayed")
    assert state_bytes(ours, "bf16", 1, 8) == (2.0 + 2.0, 4.0, 12.0 / 8)  # the executor casts each step
    bf16 = replace(mcore, roofline=replace(mcore.roofline, fp8="none"))
    assert state_bytes(bf16, "bf16", 1, 8) == (2.0, 4.0, 12.0 / 8)


def test_sliding_window_core_scores_its_band():
    """A sliding window w < s: the flash core computes the band, s·w − w²/2 pairs per head instead of s²/2,
    at the measured causal rate of a w-long sequence (mistral-7b's shape: 32 heads of 128, w = 4096, s = 32768,
    one A100); the FLOP count the CPU profiles use (analytic) drops the same way."""
    from dataclasses import replace

    from meshplan.profiler.analytic import layer_forward_flops

    model = replace(builtin_model("llama3-8b"), sliding_window=4096, layers=())
    s, w = 32768, 4096
    fwd, bwd = A100.attention_core(model, 1, s, 1)
    flops = 4 * (s * w - w * w / 2) * 32 * 128
    assert fwd == pytest.approx(flops / (A100.flash_rate(w, 128) * A100.pace))
    assert bwd == pytest.approx(2.5 * fwd)
    full = replace(model, sliding_window=0)
    attention = 4 * 32 * 128  # per query-key pair, forward, non-causal count (x2 pairs)
    assert layer_forward_flops(full, "block", 1, s) - layer_forward_flops(model, "block", 1, s) == \
        pytest.approx(attention * 2 * (s * s / 2 - (s * w - w * w / 2)))
    assert A100.attention_core(model, 1, w, 1) == A100.attention_core(full, 1, w, 1)  # a window as long: no change


def test_scaled_embedding_moves_its_pass():
    """Gemma scales the embedding by sqrt(h): one more pass over the gathered rows, read and write, 4·h·B bytes a
    token against the gather's 2·h·B + 8 (the token id); gemma-7b's h = 3072 in bf16, 2,048 tokens, one A100."""
    from dataclasses import replace

    model = replace(builtin_model("llama3-8b"), hidden_size=3072, embedding_scale=True, layers=())
    fwd, _ = A100.layer(model, "embedding", 1, 2048, 1)
    assert fwd == pytest.approx(2048 * (4 * 3072 * 2 + 8) / 1.725e12)


def test_flash_attention_rate_and_time():
    """Causal, head_dim 128: FA2 on A100 runs 155 TFLOP/s at 2k and 173 at 4k (fwd+bwd); at 3000 tokens
    the log2 interpolation gives 155 + 18·log2(3000/2048). One layer of 32 heads, b = 1, s = 2048:
    4·s²·32·128 / 2 FLOPs forward at 155 TFLOP/s, backward 2.5x."""
    assert A100.flash_rate(2048, 128) == pytest.approx(155e12)
    assert A100.flash_rate(3000, 128) == pytest.approx((155 + 18 * math.log2(3000 / 2048)) * 1e12)
    assert A100.flash_rate(100_000, 64) == pytest.approx(171e12)  # clamped beyond the table
    model = builtin_model("llama2-7b")
    fwd, bwd = A100.attention_core(model, 1, 2048, 1)
    flops = 4 * 2048**2 * 32 * 128 / 2
    assert fwd == pytest.approx(flops / 155e12) and bwd == pytest.approx(2.5 * flops / 155e12)


def test_bytes_over_achievable_hbm():
    """A100 80GB: 1.725 TB/s BabelStream Triad of the 2.039 TB/s datasheet."""
    assert A100.bytes_time(1.725e9) == pytest.approx(1e-3)
    assert A100.bytes_time(1.0) == A100.launch_s == 3.5e-6


def test_unfused_activations_match_korthikanti():
    """Korthikanti et al. 2022 Table 2 for GPT with sequence parallelism: sbh/t·(34 + 5as/h) without
    recompute, 34·sbh/t with selective recompute (fp16, 1-byte masks). Ours adds the norms' fp32
    statistics and the log-sum-exp: within 1 % at GPT-3 175B, t = 8."""
    spec = builtin_model("gpt3-175b")
    s, b, t, h, a = 2048, 1, 8, spec.hidden_size, spec.num_heads
    full = layer_activation_bytes(spec, "block", b, s, t, "fp16", "none", True, unfused_attention=True,
                                  sharded_inputs=True)
    assert full == pytest.approx(s * b * h / t * (34 + 5 * a * s / h), rel=0.01)
    sel = layer_activation_bytes(spec, "block", b, s, t, "fp16", "selective", True, unfused_attention=True,
                                 sharded_inputs=True)
    assert sel == pytest.approx(34 * s * b * h / t, rel=0.01)


def test_unfused_attention_is_slower_than_flash():
    spec = builtin_model("gpt3-175b")
    flash = preset_profile(spec, parse_cluster("8xa100-80gb"), "bf16")
    unfused = preset_profile(spec, parse_cluster("8xa100-80gb"), "bf16", attention="unfused")
    assert sum(unfused.layer_time("block", 1, 2048, 8)) > sum(flash.layer_time("block", 1, 2048, 8))
    # selective recompute runs the attention core again: more of a block under unfused attention
    assert unfused.recompute_time("block", 1, 2048, 8, "selective") > flash.recompute_time("block", 1, 2048, 8,
                                                                                          "selective")


def test_ring_all_reduce_on_nccl_bus_bandwidth():
    """Inside a node the collectives follow nccl-tests' all-reduce busbw by payload (8x A100: 229.04 GB/s
    at 1 GiB, 171.54 at 64 MiB); across nodes the NIC's busbw (HDR: 24 GB/s) and 4 us per ring step."""
    profile = preset_profile(builtin_model("tiny"), parse_cluster("2x8xa100-80gb"), "bf16")
    expected = 2 * 7 / 8 * 2**30 / 229.04e9
    assert profile.collective_time("all_reduce", 2**30, 8, "intra_node") == pytest.approx(expected, rel=1e-6)
    assert profile.collective_time("all_gather", 2**26, 8, "intra_node") == pytest.approx(7 / 8 * 2**26 / 171.54e9)
    # between the measured sizes, log-log interpolation: 96 MiB lies between 171.54 and 176.92 GB/s
    bw = 2 * 7 / 8 * 96 * 2**20 / profile.collective_time("all_reduce", 96 * 2**20, 8, "intra_node")
    assert 171.54e9 < bw < 176.92e9
    inter = profile.collective_time("all_reduce", 2**30, 16, "inter_node")
    assert inter == pytest.approx(30 * 4e-6 + 2 * 15 / 16 * 2**30 / 24e9)


def test_nvls_speeds_only_wide_all_reduces():
    """8x H200 (ml-engineering network/README.md, "NVLink SHARP"): NCCL reduces in the NVSwitch (NVLS) only
    for an all-reduce over more than 4 GPUs, 482.26 GB/s at 16 GiB with NVLS against 367.2 without;
    all-gather and reduce-scatter run the ring (361.4, 362.9). H100 has the same NVLink4 / NVSwitch."""
    profile = preset_profile(builtin_model("tiny"), parse_cluster("8xh100-80gb"), "bf16")
    big = 16 * 2**30
    assert profile.collective_time("all_reduce", big, 8, "intra_node") == pytest.approx(2 * 7 / 8 * big / 482.26e9)
    assert profile.collective_time("all_gather", big, 8, "intra_node") == pytest.approx(7 / 8 * big / 367.2e9)
    assert profile.collective_time("reduce_scatter", big, 8, "intra_node") == pytest.approx(7 / 8 * big / 367.2e9)
    assert profile.collective_time("all_reduce", big, 4, "intra_node") == pytest.approx(2 * 3 / 4 * big / 367.2e9)
    # below the ring's bandwidth the curve holds for every collective: NCCL runs ring LL up to 1 MiB
    assert profile.collective_time("all_gather", 2**20, 8, "intra_node") == pytest.approx(
        7 / 8 * 2**20 / 39.93e9)
    # A100 has no NVLS: its curve is the ring's, for every collective and group
    a100 = preset_profile(builtin_model("tiny"), parse_cluster("8xa100-80gb"), "bf16")
    assert a100.collective_time("all_gather", 2**30, 8, "intra_node") == pytest.approx(7 / 8 * 2**30 / 229.04e9)
    # a cluster file can say so for its own links; it survives the profile's JSON
    from meshplan.planner.cluster_spec import LinkSpec
    from meshplan.profiler.profile import Profile

    assert LinkSpec.from_dict({"bandwidth_Bps": 1e9, "latency_s": 0, "nvls_min_ranks": 5}, "x").nvls_min_ranks == 5
    from meshplan.planner.errors import InputError
    from meshplan.profiler.profile import LinkFit

    with pytest.raises(InputError, match=r"^x\.nvls_min_ranks: expected"):
        LinkSpec.from_dict({"bandwidth_Bps": 1e9, "latency_s": 0, "nvls_min_ranks": -1}, "x")
    with pytest.raises(InputError, match=r"^f\.nvls_min_ranks: expected"):
        LinkFit.from_dict({"alpha_s": 0, "beta_s_per_byte": 1e-9, "nvls_min_ranks": "five"}, "f")
    again = Profile.from_dict(json.loads(json.dumps(profile.to_dict())))
    assert again.collective_time("all_gather", big, 8, "intra_node") == pytest.approx(7 / 8 * big / 367.2e9)


def test_topology_link_classes():
    """NVL72: TP across compute trays stays on NVLink; DGX H100 SuperPOD: 32 nodes per scalable unit,
    so data parallelism over 64 nodes crosses the spine; oversubscription divides the spine's share."""
    import numpy as np

    nvl = parse_cluster("18x4xgb200-186gb")
    g = nvl.graph()
    assert {g.nodes[r]["domain"] for r in range(72)} == {0}
    assert nvl.link(0, 71) == nvl.intra_node
    pod = parse_cluster("64x8xh100-80gb")
    assert pod.topology.nodes_per_leaf == 32 and pod.link(0, 8) == pod.inter_node
    dom = np.arange(64).repeat(8).reshape(64, 8)  # [dp over nodes, tp inside]
    su = dom // 32
    assert group_class(dom, su, 1) == "intra_node" and group_class(dom, su, 0) == "inter_leaf"
    assert group_class(dom[:32], su[:32], 0) == "inter_node"
    from dataclasses import replace

    over = replace(pod, topology=replace(pod.topology, oversubscription=2.0))
    fits = preset_profile(builtin_model("tiny"), over, "bf16").links
    assert fits["inter_leaf"]["all_reduce"].beta_s_per_byte == pytest.approx(2 / 47e9)
    assert fits["inter_node"]["all_reduce"].beta_s_per_byte == pytest.approx(1 / 47e9)


def test_cluster_file_topology(tmp_path):
    path = tmp_path / "pod.yaml"
    path.write_text("base: 8x8xh100-80gb\ntopology:\n  nodes_per_leaf: 4\n  oversubscription: 2\n")
    c = parse_cluster(str(path))
    assert c.topology.nodes_per_leaf == 4 and c.topology.oversubscription == 2.0
    from meshplan.planner.errors import InputError

    path.write_text("base: 8x8xh100-80gb\ntopology:\n  nvlink_domain: 12\n")
    with pytest.raises(InputError, match="topology.nvlink_domain"):
        parse_cluster(str(path))


def test_a_group_runs_at_its_slowest_gpu():
    """More than one GPU: compute at 95 % of one device's rates (5 % spread between the GPUs of a node)."""
    group = device_roofline(parse_cluster("8xa100-80gb"), "bf16")
    assert group.pace == pytest.approx(0.95) and A100.pace == 1.0
    assert group.gemm(4096, 4096, 4096) == pytest.approx(A100.gemm(4096, 4096, 4096) / 0.95)
    assert group.bytes_time(1e9) == A100.bytes_time(1e9)


def test_megatron_keeps_shards_and_fused_swiglu_input():
    """Megatron-LM keeps the norms' outputs as sequence shards (h/t each instead of the gathered h) and its
    fused SwiGLU keeps only its input (3f kept instead of torch eager's 4f): per token, the difference is
    2·h·B·(1 - 1/t) + f·B/t."""
    spec = builtin_model("llama3-8b")
    s, t, B = 4096, 8, 2
    ours = layer_activation_bytes(spec, "block", 1, s, t, "bf16", "none", True)
    megatron = layer_activation_bytes(spec, "block", 1, s, t, "bf16", "none", True, sharded_inputs=True)
    h, f = spec.hidden_size, spec.ffn_hidden_size
    assert ours - megatron == pytest.approx(s * (2 * h * B * (1 - 1 / t) + f * B / t))


def test_hierarchical_collective_uses_every_nic_of_the_group():
    """A group of 16 over 2 nodes with 8 members in each: NCCL reduces inside the node first, and 8 NICs
    carry the inter-node part, so the NIC fit sees 1/8 of the bytes; never faster than NVLink."""
    profile = preset_profile(builtin_model("tiny"), parse_cluster("2x8xh100-80gb"), "bf16")
    flat = profile.collective_time("all_gather", 2**30, 16, "inter_node")
    hier = profile.collective_time("all_gather", 2**30, 16, "inter_node/8")
    assert hier == pytest.approx(max(profile.collective_time("all_gather", 2**30, 16, "intra_node"),
                                     profile.collective_time("all_gather", 2**30 / 8, 16, "inter_node")))
    assert flat / 8 < hier < flat
    assert profile.collective_time("all_gather", 2**30, 16, "inter_node/1") == flat


def test_members_per_domain_and_overlap_tax():
    import numpy as np
    from meshplan.planner.cost_collectives import overlap_tax
    from meshplan.planner.topology import members_per_domain

    dom = np.arange(16).reshape(1, 16, 1, 1) // 8  # pp 1, dp 16 over two 8-GPU domains
    assert members_per_domain(dom, (1, 2)) == 8
    dom = (np.arange(16).reshape(1, 2, 1, 8) // 8)  # dp 2 across domains, tp 8 inside
    assert members_per_domain(dom, (1, 2)) == 1
    # an overlapped collective holds 24 of an H100's 132 SMs while it runs
    profile = preset_profile(builtin_model("tiny"), parse_cluster("8xh100-80gb"), "bf16")
    assert overlap_tax(profile) == pytest.approx(24 / 132)


def test_roofline_round_trip_and_pace_bounds():
    """A profile's roofline reloads unchanged; a pace outside (0, 1] is one error naming the field."""
    from meshplan.planner.errors import InputError
    from meshplan.profiler.roofline import Roofline

    rl = device_roofline(parse_cluster("16x8xh100-80gb"), "bf16")
    assert Roofline.from_dict(asdict(rl), "r") == rl
    ds = device_roofline(parse_cluster("16x8xh100-80gb"), "bf16", loss="megatron", p2p="blocking")
    assert Roofline.from_dict(asdict(ds), "r") == ds
    for bad in (0.0, 1.5):
        with pytest.raises(InputError, match=r"r\.pace: expected a number in \(0, 1\]"):
            Roofline.from_dict({**asdict(rl), "pace": bad}, "r")


def test_all_reduce_across_nodes_takes_the_faster_of_ring_and_tree():
    """NCCL's choice (src/graph/tuning.cc): over 128 nodes a 1 MiB all-reduce runs as a tree,
    2·log2(128) = 14 steps against the ring's 254; a 1 GiB one as a ring, which moves 2(n-1)/n·M per rank
    against the tree's 2·M/0.92. By hand from the NDR link (4 us per step, 47 GB/s busbw)."""
    from meshplan.profiler.profile import TREE_BW_SHARE

    cluster = parse_cluster("128x8xh100-80gb")
    profile = preset_profile(builtin_model("llama3-8b"), cluster, "bf16")
    alpha, bw = cluster.inter_node.latency_s, cluster.inter_node.bus_Bps
    n = 128
    small, large = 2.0**20, 2.0**30
    ring = lambda m: 2 * (n - 1) * alpha + 2 * (n - 1) / n * m / bw  # noqa: E731
    tree = lambda m: 14 * alpha + 2 * m / (TREE_BW_SHARE * bw)  # noqa: E731
    assert tree(small) < ring(small) and ring(large) < tree(large)
    assert profile.collective_time("all_reduce", small, n, "inter_node") == pytest.approx(tree(small))
    assert profile.collective_time("all_reduce", large, n, "inter_node") == pytest.approx(ring(large))
    # hierarchical: 8 members per node reduce inside first, the tree spans the 16 nodes
    hier = profile.collective_time("all_reduce", small, n, "inter_node/8")
    assert hier >= 8 * alpha + 2 * small / 8 / (TREE_BW_SHARE * bw) - 1e-12
    assert profile.collective_time("reduce_scatter", small, n, "inter_node") == pytest.approx(
        (n - 1) * alpha + (n - 1) / n * small / bw)


def test_bad_gemm_and_gradient_fields_are_one_line_errors():
    """The cluster file's GEMM tile cost and a profile roofline's gradient settings: one line naming the field."""
    from meshplan.planner.cluster_spec import DeviceSpec
    from meshplan.planner.errors import InputError
    from meshplan.profiler.roofline import Roofline

    gpu = asdict(parse_cluster("8xh100-80gb").device)
    assert DeviceSpec.from_dict(gpu, "d").gemm_k0 == 198.0
    for key in ("gemm_k0", "gemm_k_ref"):
        with pytest.raises(InputError, match=rf"^d\.{key}: expected a number >= 0\.0"):
            DeviceSpec.from_dict({**gpu, key: -1}, "d")
    data = A100.to_dict()
    with pytest.raises(InputError, match=r"^r\.grad_reduce: expected one of"):
        Roofline.from_dict({**data, "grad_reduce": "broadcast"}, "r")
    with pytest.raises(InputError, match=r"^r\.grad_bytes: expected"):
        Roofline.from_dict({**data, "grad_bytes": 0}, "r")
    assert Roofline.from_dict({**data, "grad_bytes": 2}, "r").grad_bytes == 2
    for key, bad in (("selective", "layer"), ("loss", "fp16"), ("fsdp_copies", "yes"), ("p2p", "async"),
                     ("sharded_accumulation", "yes"), ("norm", "eager")):
        with pytest.raises(InputError, match=rf"^r\.{key}: expected"):
            Roofline.from_dict({**data, key: bad}, "r")


def test_flash_attention_1_rates_for_software_that_ran_it():
    """attention "flash1": the same fused kernel, at FlashAttention-1's measured rates (the FlashAttention-2
    figures' "FlashAttention" bars): A100 causal hd128 at 16k 83 TFLOP/s against FlashAttention-2's 189."""
    from meshplan.planner.errors import InputError

    a100 = parse_cluster("8xa100-80gb")
    v1, v2 = device_roofline(a100, "bf16", attention="flash1"), device_roofline(a100, "bf16")
    assert v1.attention == "flash" and v1.to_dict()["attention_flops"] != v2.to_dict()["attention_flops"]
    assert v1.flash_rate(16384, 128) == pytest.approx(83e12) and v2.flash_rate(16384, 128) == pytest.approx(189e12)
    assert device_roofline(parse_cluster("8xh100-80gb"), "bf16", attention="flash1").flash_rate(512, 64) == \
        pytest.approx(104e12)
    spec = builtin_model("llama3-8b")
    assert v1.attention_core(spec, 1, 8192, 1)[0] == pytest.approx(
        v2.attention_core(spec, 1, 8192, 1)[0] * 182 / 80)  # hd128 causal at 8k: 182 against 80
    with pytest.raises(InputError, match="attention: no FlashAttention-1 measurement for b200-180gb"):
        device_roofline(parse_cluster("8xb200-180gb"), "bf16", attention="flash1")


def test_separate_gradient_accumulation_pass():
    """Software without gradient accumulation fusion adds each micro-batch's weight gradients in a pass of its
    own: Megatron-LM's 2021 local DDP hook main_grad.add_(grad) in fp16 reads 2 + 2 and writes 2 bytes per
    weight. A GPT-3 block at tp 8 holds 12·h²/8 weights: 6 B each over A100's 1.725 TB/s achievable HBM."""
    from dataclasses import replace

    from meshplan.planner.model_spec import vocab_shard

    spec = builtin_model("gpt3-175b")
    h = spec.hidden_size
    fused, fp16 = A100, replace(A100, grad_accum_bytes=6.0)
    f0, b0 = fused.layer(spec, "block", 1, 2048, 8)
    f1, b1 = fp16.layer(spec, "block", 1, 2048, 8)
    weights = (3 * h * h + h * h + 4 * h * h + 4 * h * h) / 8  # QKV, projection, two MLP matrices
    assert f1 == f0 and b1 - b0 == pytest.approx(sum(
        fp16.bytes_time(w * 6) for w in (3 * h * h / 8, h * h / 8, 4 * h * h / 8, 4 * h * h / 8)))
    assert b1 - b0 == pytest.approx(weights * 6 / 1.725e12)
    head = fp16.layer(spec, "head", 1, 2048, 8)[1] - fused.layer(spec, "head", 1, 2048, 8)[1]
    assert head == pytest.approx(vocab_shard(spec, 8) * h * 6 / 1.725e12)  # the rank's vocabulary entries
    assert fp16.recompute(spec, 1, 2048, 8, "full") == f0  # recomputing the forward adds nothing


def test_torchtitan_selective_policies():
    """torchtitan's selective AC (parallelize_llama.py at 1ea476e9f). 'op': the outputs of matmuls, SDPA and
    reduce-scatters are kept except every second matmul of a block in call order (wq, wk, wv, wo, w1, w3,
    w2), so backward reruns wk, wo and w3 and every memory-bound op. Llama 3 8B, b = 1, s = 8192, one A100
    rank: those three GEMMs' forward plus the block's elementwise forward; memory per token keeps the block
    input h, wq's q, wv's kv, SDPA's output q and fp32 log-sum-exp per head, w1's f and w2's h.
    Layer '2': full recompute of every second block, half a forward; memory halfway between none and full."""
    from dataclasses import replace

    spec = builtin_model("llama3-8b")
    h, f, b, s = spec.hidden_size, spec.ffn_hidden_size, 1, 8192
    q, kv, T = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, b * s
    op, layer = replace(A100, selective="every-second-mm"), replace(A100, selective="every-second-block")
    rerun = A100.gemm(T, kv, h) + A100.gemm(T, h, q) + A100.gemm(T, f, h) + A100.elementwise(spec, b, s, 1, False)
    assert op.recompute(spec, b, s, 1, "selective") == pytest.approx(rerun)
    assert layer.recompute(spec, b, s, 1, "selective") == pytest.approx(0.5 * A100.layer(spec, "block", b, s, 1)[0])
    assert A100.recompute(spec, b, s, 1, "selective") == A100.attention_core(spec, b, s, 1)[0]  # Megatron's
    kept = layer_activation_bytes(spec, "block", b, s, 1, "bf16", "selective", selective="every-second-mm")
    assert kept == pytest.approx(T * ((h + q + kv + q + f + h) * 2 + 4 * spec.num_heads))
    none, full = (layer_activation_bytes(spec, "block", b, s, 1, "bf16", r) for r in ("none", "full"))
    half = layer_activation_bytes(spec, "block", b, s, 1, "bf16", "selective", selective="every-second-block")
    assert half == pytest.approx((none + full) / 2) and full < kept < none


def test_torchtitan_selective_reruns_tensor_parallel_gathers():
    """Under torchtitan's selective policies a block's TP collectives rerun one all-reduce's worth on
    average (every second block both forward ones; or every block its two all-gathers, half an all-reduce
    each); Megatron's attention-core selective reruns none, full recompute two."""
    from meshplan.planner.cost_collectives import tp_comm_time

    spec, cluster = builtin_model("llama3-8b"), parse_cluster("8xh100-80gb")
    one = preset_profile(spec, cluster).collective_time("all_reduce", 1 * 4096 * 4096 * 2, 8, "intra_node")
    for selective, count in (("attention", 4), ("every-second-mm", 5), ("every-second-block", 5)):
        profile = preset_profile(spec, cluster, selective=selective)
        t = tp_comm_time(profile, "block", 1, 4096, 4096, 8, "bf16", "selective")
        assert t == pytest.approx(count * one)
    assert tp_comm_time(preset_profile(spec, cluster), "block", 1, 4096, 4096, 8, "bf16", "full") == \
        pytest.approx(6 * one)


def test_fsdp2_engine_copies():
    """FSDP2 copies each unshard's all-gather output into the parameters (read + write bf16: 4 B a
    parameter) and each reduction's gradients into the fp32 reduce buffer (read 2, write 4): 8·10⁹ weights
    on one A100 80GB (1.725 TB/s achievable) under ZeRO-3 with 3 micro-batches reducing every micro-batch:
    6 unshards and 3 reductions, 8e9·(6·4 + 3·6) B. A replicated mesh (zero 0) casts its fp32 copy first
    (read 4, write 2) and copies it (read 2, write 2); reducing once after micro-batches added up in fp32
    (FSDP2's accumulated gradient), its copy-in reads 4 bytes. Nothing for software without the copies,
    for one replica, or for a measured profile."""
    from dataclasses import replace

    from meshplan.planner.candidate import Candidate
    from meshplan.planner.cost_collectives import GradSync, engine_copy_time, grad_sync

    spec, cluster = builtin_model("llama3-8b"), parse_cluster("8x8xa100-80gb")
    profile = preset_profile(spec, cluster)
    w = 8e9
    z3 = GradSync(full_grads=False, reductions=3, gathers=6)
    assert engine_copy_time(profile, w, "bf16", 64, 3, z3) == pytest.approx(w * (6 * 4 + 3 * 6) / 1.725e12)
    one = GradSync(full_grads=True, reductions=1, gathers=1)
    assert engine_copy_time(profile, w, "bf16", 64, 0, one) == pytest.approx(w * (10 + 8) / 1.725e12)
    assert engine_copy_time(profile, w, "bf16", 1, 3, z3) == 0.0
    cand = Candidate(dp=64, tp=1, pp=1, v=1, schedule="1f1b", b=1, m=3, zero=3, recompute="none")
    assert grad_sync(cand) == z3 and grad_sync(replace(cand, zero=1)).gathers == 1
    megatron = preset_profile(spec, cluster, fsdp_copies=False)
    assert engine_copy_time(megatron, w, "bf16", 64, 3, z3) == 0.0
    assert engine_copy_time(replace(profile, roofline=None), w, "bf16", 64, 3, z3) == 0.0


def test_named_software_settings():
    """profiler/software.py: Megatron-LM of 2021 adds each micro-batch's gradients in a pass of its own, in
    16 bits under fp16 (read 2 + 2, write 2) and into the fp32 buffer under bf16 (read 2 + 4, write 4), and
    keeps 16-bit gradients only under fp16; the executor's settings are the preset model's defaults."""
    from meshplan.planner.errors import InputError
    from meshplan.profiler.software import software_settings

    fp16, bf16 = software_settings("megatron-2021", "fp16"), software_settings("megatron-2021", "bf16")
    assert (fp16["grad_bytes"], fp16["grad_accum_bytes"]) == (2, 6)
    assert "grad_bytes" not in bf16 and bf16["grad_accum_bytes"] == 10
    assert software_settings("meshplan") == {"software": "meshplan"}  # the executor's: the defaults
    a100 = parse_cluster("8xa100-80gb")
    assert device_roofline(a100, "bf16", **software_settings("megatron-2022")).attention == "unfused"
    with pytest.raises(InputError, match="--software: unknown software 'megatron-lm'"):
        software_settings("megatron-lm")


def test_fused_cross_entropy_loss():
    """A fused cross-entropy (flash-attn's, llm-foundry's default loss) reads the bf16 logits once forward
    and once backward, writing their bf16 gradient: T·V·2 and T·V·4 bytes against eager PyTorch's
    F.cross_entropy(logits.float()): the cast (2 + 4) and log_softmax (4 + 4) forward, nll_loss's zeroed
    gradient (4), log_softmax's backward (4 + 4 + 4) and the cast back (4 + 2) backward. It keeps the logits
    and a 4-byte log-sum-exp per token instead of the fp32 log-softmax, and its backward allocates only the
    bf16 gradient of the logits."""
    from dataclasses import replace

    from meshplan.planner.candidate import Candidate
    from meshplan.planner.cost_memory import step_transients

    spec, b, s = builtin_model("gpt2"), 8, 1024
    T, V, h = b * s, spec.vocab_size, spec.hidden_size
    fused = replace(A100, loss="fused")
    f32, f16 = A100.layer(spec, "head", b, s, 1), fused.layer(spec, "head", b, s, 1)
    assert f32[0] - f16[0] == pytest.approx(A100.bytes_time(T * V * 14) - A100.bytes_time(T * V * 2))
    assert f32[1] - f16[1] == pytest.approx(A100.bytes_time(T * V * 22) - A100.bytes_time(T * V * 4))
    kept = layer_activation_bytes(spec, "head", b, s, 1, "bf16", fused_loss=True)
    assert kept - layer_activation_bytes(spec, "head", b, s, 1, "bf16") == pytest.approx(T * (V * 2 + 4 - 4 * V))
    cand = Candidate(dp=1, tp=1, pp=1, v=1, schedule="1f1b", b=b, m=1, zero=0, recompute="none")
    plain, fast = (step_transients(spec, cand, s, "bf16", [0], f) for f in (False, True))
    # one replica of tied gpt2: a new fp32 table gradient (V·h·4) with the logits' gradient; fp32 loss:
    # the larger of that and the two fp32 gradients of its backward
    assert spec.tied_embeddings
    assert plain.act[0] == pytest.approx(max(2 * T * V * 4, T * V * 4 + V * h * 4))
    assert fast.act[0] == pytest.approx(T * V * 2 + V * h * 4)


def test_megatron_cross_entropy_loss():
    """Megatron-LM's vocab-parallel cross-entropy (megatron/core/tensor_parallel/cross_entropy.py on
    logits.float()), pass by pass over the rank's V/t logits: the cast (2 + 4), max (4), subtract (4 + 4),
    exp (4 + 4), sum (4), divide (4 + 4) = 38 bytes forward; an in-place multiply (4 + 4) and the cast back
    (4 + 2) = 14 backward. It keeps the fp32 softmax (as the eager loss keeps its log-softmax) and its
    backward allocates only the 16-bit gradient; named software Megatron-LM runs it."""
    from dataclasses import replace

    from meshplan.planner.cost_memory import loss_grad_16bit
    from meshplan.planner.model_spec import vocab_shard
    from meshplan.profiler.software import software_settings

    spec, b, s, tp = builtin_model("gpt2"), 4, 1024, 2
    T, V = b * s, vocab_shard(builtin_model("gpt2"), tp)
    mega = replace(A100, loss="megatron")
    f32, mg = A100.layer(spec, "head", b, s, tp), mega.layer(spec, "head", b, s, tp)
    assert mg[0] - f32[0] == pytest.approx(A100.bytes_time(T * V * 38) - A100.bytes_time(T * V * 14))
    assert mg[1] - f32[1] == pytest.approx(A100.bytes_time(T * V * 14) - A100.bytes_time(T * V * 22))
    cluster = parse_cluster("8xa100-80gb")
    for name in ("megatron", "megatron-2022", "megatron-2021", "megatron-deepspeed-2022"):
        profile = preset_profile(spec, cluster, "bf16", **software_settings(name, "bf16"))
        assert profile.roofline.loss == "megatron" and loss_grad_16bit(profile)
    assert not loss_grad_16bit(preset_profile(spec, cluster, "bf16", **software_settings("torchtitan", "bf16")))


def test_blocking_pipeline_transfers():
    """DeepSpeed's pipeline engine (megatron-deepspeed-2022) sends each stage output and input gradient whole
    from every tensor-parallel rank, in blocking calls: per neighbour and micro-batch a stage waits out both
    transfers of b·s·h values; the default (torch's pipelining, Megatron-LM's scatter-gather) pays one of
    b·s·h/t."""
    from meshplan.planner.cost_pipeline import pp_comm_time
    from meshplan.profiler.software import software_settings

    spec, cluster = builtin_model("gpt3-175b"), parse_cluster("4x8xa100-80gb")
    b, s, h, tp = 1, 2048, builtin_model("gpt3-175b").hidden_size, 8
    ds = preset_profile(spec, cluster, "bf16", **software_settings("megatron-deepspeed-2022", "bf16"))
    ours = preset_profile(spec, cluster, "bf16")
    assert ds.roofline.p2p == "blocking" and ours.roofline.p2p == "overlapped"
    whole, shard = b * s * h * 2, b * s * h * 2 / tp
    assert pp_comm_time(ds, b, s, h, tp, "bf16", True, "inter_node") == pytest.approx(
        2 * ds.collective_time("send_recv", whole, 2, "inter_node"))
    assert pp_comm_time(ours, b, s, h, tp, "bf16", True, "inter_node") == pytest.approx(
        ours.collective_time("send_recv", shard, 2, "inter_node"))
    # over one HDR NIC per GPU (24 GB/s bus bandwidth, 4 us a step): 2 x (4 us + 100.7 MB / 24 GB/s)
    assert pp_comm_time(ds, b, s, h, tp, "bf16", True, "inter_node") == pytest.approx(
        2 * (4.0e-6 + whole / 24e9), rel=0.05)


def test_moe_fp8_correction_removes_the_dense_casts_the_block_charged():
    """A MoE block is timed as a dense block plus phi · (MoE feed-forward − dense MLP); under FP8 the dense MLP's
    casts it removes are the ones `fp8_casts` charged: the last GEMM's output gradient (h values a token) on the
    sequence shard under sequence parallelism, h/tp."""
    from meshplan.profiler.moe_cost import block_ffn_time_correction, sparse_fraction

    model = builtin_model("mixtral-8x7b")
    r = preset_profile(model, parse_cluster("8xh100-80gb"), "bf16", fp8="delayed").roofline
    T, tp, h = 4096.0, 2, model.hidden_size
    n_up_f = 2 * model.ffn_hidden_size / tp
    full = block_ffn_time_correction(r, model, T, tp, False)[1]
    shard = block_ffn_time_correction(r, model, T, tp, True)[1]
    cast = r.fp8_cast_bytes
    want = sparse_fraction(model) * (r.bytes_time(cast * T * (n_up_f + h)) - r.bytes_time(cast * T * (n_up_f + h / tp)))
    assert shard - full == pytest.approx(want)


def test_roofline_refuses_bad_software_fields():
    """A profile's roofline names its MoE dispatcher and FP8 parameters; a bad value is one line naming the field."""
    from meshplan.planner.errors import InputError
    from meshplan.profiler.roofline import Roofline

    data = A100.to_dict()
    assert Roofline.from_dict(data, "profile.roofline") == A100
    with pytest.raises(InputError, match=r"profile\.roofline\.moe_dispatch: expected one of gathered, sharded"):
        Roofline.from_dict(data | {"moe_dispatch": "bogus"}, "profile.roofline")
    with pytest.raises(InputError, match=r"profile\.roofline\.fp8_params"):
        Roofline.from_dict(data | {"fp8_params": "yes"}, "profile.roofline")


def test_fp8_parameters_are_gathered_in_one_byte():
    """Megatron-Core's --fp8-param-gather "perform[s] the param all-gather in fp8" (megatron/training/
    arguments.py): with FP8 parameters a block's data-parallel all-gathers move 1 byte per parameter, the
    embedding's and head's their 16-bit 2; the gradient reductions are unchanged. Hand count: ZeRO-3 over 8
    H100s, two gathers per micro-batch, each at the ring's all-gather time of params x bytes."""
    from dataclasses import replace

    from meshplan.planner.cost_collectives import gather_bytes, sharded_dp_time
    from meshplan.planner.cost_model import Terms
    from meshplan.profiler.software import software_settings

    model = builtin_model("llama3-8b")
    cl = parse_cluster("8xh100-80gb")
    mcore = preset_profile(model, cl, "bf16", fp8="delayed", **software_settings("megatron"))
    assert gather_bytes(mcore, "bf16", 3, True) == 1.0 and gather_bytes(mcore, "bf16", 3, False) == 2.0
    assert gather_bytes(mcore, "bf16", 0, True) == 2.0  # FP8 parameters need a sharded optimizer
    w = 218e6
    assert sharded_dp_time(mcore, w, "bf16", 8, 3, "intra_node", 1.0) == pytest.approx(
        2 * mcore.collective_time("all_gather", w * 1.0, 8, "intra_node"))
    bf16 = replace(mcore, roofline=replace(mcore.roofline, fp8_params=False))
    fp8_rows = Terms(model, mcore, 4096, "bf16").per_layer(1, 8, 3, "intra_node")
    bf16_rows = Terms(model, bf16, 4096, "bf16").per_layer(1, 8, 3, "intra_node")
    for layer, a, b in zip(model.layers, fp8_rows[3], bf16_rows[3]):
        if layer.kind == "block":
            assert a < b and a == pytest.approx(sharded_dp_time(mcore, layer.params, "bf16", 8, 3, "intra_node", 1.0))
        else:
            assert a == pytest.approx(b)
