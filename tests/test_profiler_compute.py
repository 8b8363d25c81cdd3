"""Measured layer times: they grow with the micro-batch size and shrink with the TP degree (shard shapes)."""

import pytest
import torch
from meshplan.planner.model_sources import builtin_model
from meshplan.planner.model_spec import ModelSpec
from meshplan.profiler.compute import TimingConfig, grid, measure_sample, median, quantile, spread, time_passes, typical
from meshplan.profiler.layers import build_case, forward, shard_spec, tp_degrees
from meshplan.profiler.measure import chain_round_positions
from meshplan.profiler.wrappers import chain_pass_times, measure_chains

CPU = torch.device("cpu")
# Big enough that the matmuls, not Python overhead, dominate; small enough for ~1 s per test on one core.
BLOCK = ModelSpec(name="bench-block", arch="llama", vocab_size=512, hidden_size=256, num_layers=1, num_heads=8,
                  num_kv_heads=4, ffn_hidden_size=1024, max_seq_len=128)
CFG = TimingConfig(warmup=2, repeats=7)


@pytest.fixture(autouse=True)
def one_thread():
    """Other work shares this machine's cores: one intra-op thread keeps the comparison about FLOPs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def total(kind: str, b: int, s: int, tp: int) -> float:
    """Fastest forward + backward of the repeats: the profile keeps the median, but on a machine shared with
    other jobs the minimum is the estimate least disturbed by them, which a comparison test needs."""
    fwds, bwds = time_passes(BLOCK, kind, b, s, tp, "fp32", CPU, CFG)
    return min(f + g for f, g in zip(fwds, bwds))


def test_block_time_grows_with_micro_batch_size():
    t1, t4 = total("block", 1, 128, 1), total("block", 4, 128, 1)
    assert t4 > 2.0 * t1  # 4x the FLOPs


def test_block_time_shrinks_with_tp():
    full, quarter = total("block", 4, 128, 1), total("block", 4, 128, 4)
    assert quarter < 0.6 * full  # ~1/4 of the matmul FLOPs (norms and rotary are not sharded)


def test_head_time_shrinks_with_tp():
    assert total("head", 4, 128, 4) < 0.75 * total("head", 4, 128, 1)


def test_sample_has_recompute_timings_and_spread():
    s = measure_sample(builtin_model("tiny"), "block", 2, 32, 1, "fp32", CPU, TimingConfig(1, 3))
    assert s.forward_s > 0 and s.backward_s > 0 and s.spread >= 0
    assert s.backward_full_s > 0 and s.backward_selective_s > 0
    assert s.forward_full_s > 0 and s.forward_selective_s > 0
    head = measure_sample(builtin_model("tiny"), "head", 2, 32, 2, "bf16", CPU, TimingConfig(1, 2))
    assert head.backward_full_s == 0 and head.forward_s > 0


def test_shard_shapes():
    spec = builtin_model("tiny")  # heads 4, kv 2, ffn 128, vocab 256
    blk = shard_spec(spec, "block", 2)
    assert (blk.num_heads, blk.num_kv_heads, blk.ffn_hidden_size, blk.hidden_size) == (2, 1, 64, 64)
    assert blk.head_dim == spec.head_dim
    assert shard_spec(spec, "head", 2).vocab_size == 128
    assert tp_degrees(spec, 8) == [1, 2]
    case = build_case(spec, "block", 2, 8, 2, "fp32", CPU)
    assert case.module.attention.wq.weight.shape == (32, 64)
    x = case.make_input()
    for mode in ("none", "selective", "full"):
        out = forward(case, x, mode)
        case.backward(out)
        assert x.grad is not None and out.shape == (2, 8, 64)


def test_grid_and_statistics():
    points = grid([1, 2], [16, 32], [1, 2])
    assert sum(p.kind == "embedding" for p in points) == 4  # not sharded: t = 1 only
    assert sum(p.kind == "block" for p in points) == 8
    assert median([3, 1, 2]) == 2 and median([1, 2, 3, 4]) == 2.5
    assert quantile([0, 10], 0.9) == pytest.approx(9)
    assert spread([1.0, 1.0, 1.0]) == 0


def test_typical_pass_is_the_mean_on_cpu_and_the_median_on_gpu():
    """Time-sliced CPU ranks: passes are bimodal (whole slices at full speed, others waiting one out); a long
    run pays the mean, which the median misses by either mode."""
    bimodal = [2.0, 2.0, 2.0, 6.0, 6.0]
    assert typical(bimodal, CPU) == pytest.approx(3.6)
    assert typical(bimodal, torch.device("cuda")) == 2.0


@pytest.mark.parametrize("tied", [False, True])
def test_wrapped_units_count_the_cut_models_parameters(tied):
    """The in-situ DP factor divides the measured reduction by the link time of these units: they must be
    the parameters the cut model really has (a tied head's weight is the embedding's, counted once)."""
    from dataclasses import replace

    from meshplan.planner.model_spec import wrapped_unit_params as unit_params
    from meshplan.profiler.wrappers import _model

    spec = replace(builtin_model("tiny"), tied_embeddings=tied, layers=())
    model = _model(spec, 2, torch.device("cpu"), "fp32")
    blocks = [sum(p.numel() for p in block.parameters()) for block in model.blocks.values()]
    root = sum(p.numel() for p in model.parameters()) - sum(blocks)
    assert unit_params(spec, 2) == blocks + [root]


def test_recompute_passes_run_the_executors_checkpoints():
    """The profiler's full recompute is the executor's checkpoint wrapper (only the block input is kept,
    so nothing of the block's internals is saved outside it); selective checkpoints the attention core
    through the executor's own switch, which is off again afterwards."""
    from meshplan.profiler.memory import saved_bytes
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    case = build_case(builtin_model("tiny"), "block", 2, 16, 1, "fp32", CPU)
    x = case.make_input()
    counts = {}
    for mode in ("none", "selective", "full"):
        counter, out = saved_bytes(lambda c, m=mode: forward(case, x, m, on_kept=c.add_all), case.parameters())
        counts[mode] = counter.bytes
        case.backward(out)
    assert isinstance(case.checkpointed(), CheckpointWrapper)
    assert case.module.attention.recompute_core is False
    assert counts["full"] == x.numel() * 4 < counts["selective"] <= counts["none"]


def test_recompute_time_counts_the_checkpointed_forward():
    """Extra time of a recomputed block = the backward's extra (the forward again) + the checkpointed
    forward's extra over the plain one; a profile without the latter (older) counts the backward's only."""
    from meshplan.planner.cluster_spec import parse_cluster
    from meshplan.profiler.presets import preset_profile
    from meshplan.profiler.profile import ComputeSample

    spec = builtin_model("tiny")
    profile = preset_profile(spec, parse_cluster("1xcpu"), "fp32")
    sample = ComputeSample("block", 2, 16, 1, forward_s=1.0, backward_s=2.0, backward_full_s=3.0, forward_full_s=1.5,
                           backward_selective_s=2.25, forward_selective_s=1.25)
    profile.compute = [c for c in profile.compute if c.kind != "block"] + [sample]
    profile.chains = []
    fwd, _ = profile.layer_time("block", 2, 16, 1)
    assert profile.recompute_time("block", 2, 16, 1, "full") == pytest.approx(fwd * 1.5)
    assert profile.recompute_time("block", 2, 16, 1, "selective") == pytest.approx(fwd * 0.5)
    sample.forward_full_s = 0.0
    assert profile.recompute_time("block", 2, 16, 1, "full") == pytest.approx(fwd * 1.0)


def test_a_whole_model_chain_keeps_the_median_of_its_rounds():
    """The chain scales every layer of a plan, so one round caught in a transient must not set it: with
    two earlier rounds that agree, they win; with one below and one above, this round's time is kept."""
    tiny = builtin_model("tiny")
    cfg = TimingConfig(1, 2)
    slow = measure_chains(tiny, [1, 2], 16, "fp32", CPU, cfg, earlier=[[100.0, 200.0], [100.0, 200.0]])
    assert [c.seconds for c in slow] == [100.0, 200.0]
    assert all(c.split_extra_s >= 0 and c.tp == 1 for c in slow)
    kept = measure_chains(tiny, [1], 16, "fp32", CPU, cfg, earlier=[[0.0], [100.0]])
    assert 0.0 < kept[0].seconds < 1.0  # the round measured now: tiny's cut model takes milliseconds
    assert chain_pass_times(tiny, [1, 2], 16, "fp32", CPU, cfg)[0] < 1.0


def test_cpu_profiles_spread_the_chain_rounds_over_the_compute_grid():
    assert chain_round_positions("cpu", 10) == {0, 5}  # and the round after the grid: three in all
    assert chain_round_positions("cuda", 10) == set()
    assert chain_round_positions("cpu", 0) == set()


def test_hook_cost_from_cpu_time_where_the_hooks_only_compute():
    from meshplan.profiler.wrappers import _hook_seconds

    # 4 ranks on 2 cores: the bare pass got half a core (wall 8 ms, CPU 4 ms); the wrapped pass's CPU
    # time says 3 units added 1.5 CPU-ms, whatever its wall time swung to
    assert _hook_seconds(0.008, 0.007, 0.004, 0.0055, 3, cpu_bound=True) == pytest.approx(0.001)
    assert _hook_seconds(0.008, 0.011, 0.004, 0.0055, 3, cpu_bound=False) == pytest.approx(0.001)  # ZeRO-3, GPU
    assert _hook_seconds(0.008, 0.011, 0.004, 0.0030, 3, cpu_bound=True) == 0.0
    assert _hook_seconds(0.004, 0.0055, 0.004, 0.0055, 3, cpu_bound=True) == pytest.approx(0.0005)  # own core
