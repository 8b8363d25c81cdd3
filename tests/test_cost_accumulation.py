"""The executor's gradient accumulation on presets, against a hand count of the bytes FSDP2 and autograd move."""

import pytest
from meshplan.planner.cluster_spec import parse_cluster
from meshplan.planner.cost_accumulation import accumulation_bytes, accumulation_time
from meshplan.planner.cost_model import GradSync
from meshplan.planner.model_sources import builtin_model
from meshplan.profiler.presets import preset_profile

HELD, EVERY = GradSync(full_grads=True, reductions=1), GradSync(full_grads=False, reductions=4)


def test_bytes_per_weight_as_fsdp2_and_autograd_move_them():
    """FSDP2 without sync, bf16: cast the first (2 + 4), add three more (2 + 4 + 4 each): 6 + 30 = 36 B.
    Reduce-scattered every micro-batch over 8 ranks: 3 later adds of 12 B on an eighth. One rank: 3 x 12 B."""
    assert accumulation_bytes(1.0, "bf16", 8, 4, HELD) == 36.0
    assert accumulation_bytes(1.0, "bf16", 8, 4, EVERY) == pytest.approx(36.0 / 8)
    assert accumulation_bytes(1.0, "bf16", 1, 4, HELD) == 36.0
    assert accumulation_bytes(1e9, "bf16", 8, 1, HELD) == 0.0  # one micro-batch: nothing to add up


def test_time_per_micro_batch_on_h100_and_only_for_the_executor():
    """1e9 weights, 4 micro-batches, FSDP2 without sync: 36 GB over H100's 2.97 TB/s achievable HBM,
    spread over the 4 micro-batches. Megatron-LM with fusion (a pass of 0 bytes) and measured profiles: 0."""
    spec = builtin_model("llama3-8b")
    cluster = parse_cluster("8xh100-80gb")
    executor = preset_profile(spec, cluster)
    assert accumulation_time(executor, 1e9, "bf16", 8, 4, HELD) == pytest.approx(36e9 / 2.97e12 / 4)
    fused = preset_profile(spec, cluster, grad_accum_bytes=0)
    assert fused.roofline.grad_accum == "pass" and accumulation_time(fused, 1e9, "bf16", 8, 4, HELD) == 0.0
    assert accumulation_time(object(), 1e9, "bf16", 8, 4, HELD) == 0.0  # no roofline: measured in situ


def test_plans_with_more_micro_batches_pay_it_in_the_backward():
    """The same layout with 8 micro-batches instead of 1: each micro-batch's backward grows by the layer's
    share, and nothing is added when the step has one micro-batch."""
    from meshplan.planner.constraints import Constraints
    from meshplan.planner.search import find_plan

    spec = builtin_model("llama3-8b")
    cluster = parse_cluster("8xh100-80gb")
    fused = preset_profile(spec, cluster, grad_accum_bytes=0)
    executor = preset_profile(spec, cluster)
    for m in (1, 8):
        c = Constraints(global_batch_size=8 * m, seq_len=4096, tp=1, pp=1, dp=8, zero=1, micro_batch_size=1,
                        recompute="full", top_k=1)
        t_exec = find_plan(spec, cluster, c, executor).predicted.iteration_time_s
        t_fused = find_plan(spec, cluster, c, fused).predicted.iteration_time_s
        extra = accumulation_bytes(spec.num_parameters, "bf16", 8, m, HELD) / 2.97e12 if m > 1 else 0.0
        assert t_exec - t_fused == pytest.approx(extra, rel=0.02, abs=1e-6)
