"""Context parallelism (issue 22): all-to-all and all-gather CP plans on 4 gloo processes reproduce a
1-process loop (fp32, same seed, same global batch) within 1e-4; a ring plan is refused on gloo before start."""

import os
import subprocess
import sys
from dataclasses import replace
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from meshplan.executor.context_parallel import AllGatherAttention, chunk_positions
from meshplan.planner.model_sources import builtin_model
from meshplan.planner.plan import save_plan

from tests.executor_worker import assert_matches_reference, repo_root, run_plans, spawn_ranks
from tests.helpers import make_plan

STEPS, SEED = 3, 5

# tiny has 4 query and 2 key/value heads: all-to-all CP scatters heads, so tp x cp must divide both;
# plans with tp x cp = 4 use tiny with 4 key/value heads ("mha")
PLANS = {
    "cp2xdp2": dict(cp=2, dp=2, zero=1, micro_batch_size=1, num_micro_batches=2),
    "cp2xtp2-sp-selective": dict(mha=True, cp=2, tp=2, sequence_parallel=True, recompute="selective",
                                 micro_batch_size=2, num_micro_batches=2),
    "cp2xpp2": dict(cp=2, pp=2, micro_batch_size=1, num_micro_batches=4),
    "cp4": dict(mha=True, cp=4, micro_batch_size=2, num_micro_batches=2),
    # all-gather CP: grouped-query k and v gathered whole, head-tail chunks under a positional mask
    "allgather-cp2xtp2-sp-selective": dict(cp_mode="all-gather", cp=2, tp=2, sequence_parallel=True,
                                           recompute="selective", micro_batch_size=2, num_micro_batches=2),
    "allgather-cp4": dict(cp_mode="all-gather", cp=4, micro_batch_size=2, num_micro_batches=2),
    "allgather-cp2xdp2-full": dict(cp_mode="all-gather", cp=2, dp=2, zero=1, recompute="full", micro_batch_size=1,
                                   num_micro_batches=2),
    # zero-bubble (ZB-V): the backward split into input and weight passes, K and V gathered again in between
    "allgather-cp2xpp2-zbv": dict(cp_mode="all-gather", cp=2, pp=2, virtual_stages=2, schedule="zero-bubble",
                                  micro_batch_size=1, num_micro_batches=4),
    # GPT-NeoX's block: a quarter of each head rotated at its global positions, a parallel residual
    "neox-allgather-cp2xdp2": dict(neox=True, cp_mode="all-gather", cp=2, dp=2, micro_batch_size=1,
                                   num_micro_batches=2),
    # Qwen3's norms over each head of q and k, on a CP rank's tokens and a TP rank's heads
    "qwen3-allgather-cp2xtp2-sp": dict(qwen3=True, cp_mode="all-gather", cp=2, tp=2, sequence_parallel=True,
                                       micro_batch_size=2, num_micro_batches=2),
}


def build(mha: bool = False, neox: bool = False, qwen3: bool = False, cp_mode: str = "all-to-all", **kwargs):
    plan = make_plan(cluster="4xcpu", seq_len=32, cp_mode=cp_mode, **kwargs)
    if qwen3:
        plan.model = replace(builtin_model("tiny"), name="tiny-qwen3", qk_norm=True, layers=())
    if mha:
        plan.model = replace(builtin_model("tiny"), name="tiny-mha", num_kv_heads=4, layers=())
    if neox:
        plan.model = replace(builtin_model("tiny"), name="tiny-neox", norm="layernorm", mlp="gelu", linear_bias=True,
                             parallel_residual=True, rotary_dim=4, layers=())
    return plan


def test_chunk_positions_cover_the_sequence():
    for mode in ("all-to-all", "ring", "all-gather"):
        for cp in (1, 2, 4):
            got = torch.cat([chunk_positions(32, cp, r, mode) for r in range(cp)])
            assert sorted(got.tolist()) == list(range(32))
    # ring: head-tail pairs (torch's _HeadTailLoadBalancer), each rank the same causal work
    assert chunk_positions(16, 2, 0, "ring").tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert chunk_positions(16, 2, 1, "ring").tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert chunk_positions(16, 4, 1, "all-to-all").tolist() == [4, 5, 6, 7]


def _all_gather_worker(rank: int, world: int, store: str, kv_heads: int, selective: bool) -> None:
    """One CP rank: AllGatherAttention on its head-tail chunk against causal SDPA over the whole sequence."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        b, heads, s, d = 2, 4, 16, 8
        q = torch.randn(b, heads, s, d, requires_grad=True)
        k, v = (torch.randn(b, kv_heads, s, d, requires_grad=True) for _ in range(2))
        w = torch.randn(b, heads, s, d)
        gqa = kv_heads != heads
        (F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa) * w).sum().backward()
        idx = chunk_positions(s, world, rank, "all-gather")
        lq, lk, lv = (t.detach()[:, :, idx].clone().requires_grad_() for t in (q, k, v))
        attention = AllGatherAttention(init_device_mesh("cpu", (world,)), s)
        core = partial(F.scaled_dot_product_attention, is_causal=True, enable_gqa=gqa)
        if selective:  # the executor's selective recompute: the core checkpointed
            core = partial(torch.utils.checkpoint.checkpoint, core, use_reentrant=False, preserve_rng_state=False)
        out = attention(core, lq, lk, lv)
        (out * w[:, :, idx]).sum().backward()
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
                                   .detach()[:, :, idx])
        for local, full in ((lq, q), (lk, k), (lv, v)):  # dK, dV summed over the ranks by the reduce-scatter
            torch.testing.assert_close(local.grad, full.grad[:, :, idx], rtol=1e-5, atol=1e-5)
        if not gqa:  # the math kernel saves k and v as given: backward gathered each again, once
            assert attention.regathers == 2
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kv_heads, selective", [(4, False), (2, False), (4, True)])
def test_all_gather_attention_matches_causal_sdpa(tmp_path, kv_heads, selective):
    """Outputs and gradients of q, k, v on 2 gloo ranks equal the whole sequence's; with k and v saved as
    local chunks (the checkpoint's inputs too), backward gathers each of them again once."""
    spawn_ranks(_all_gather_worker, 2, str(tmp_path / "store"), kv_heads, selective)


def test_ring_plan_refused_on_gloo(tmp_path):
    path = str(tmp_path / "ring.json")
    save_plan(make_plan(cluster="2xcpu", cp=2, cp_mode="ring", seq_len=32), path)
    env = {**os.environ, "PYTHONPATH": repo_root(), "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    proc = subprocess.run([sys.executable, "-m", "meshplan.executor", path, "--steps", "1"], env=env,
                          capture_output=True, text=True, timeout=120, cwd=repo_root())
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "cp_mode" in lines[0] and "all-to-all" in lines[0], proc.stderr


def test_all_to_all_needs_heads_divisible(tmp_path):
    from meshplan.executor.checks import check_supported
    from meshplan.planner.errors import InputError

    with pytest.raises(InputError, match="tp x cp = 4"):
        check_supported(build(cp=2, tp=2))  # tiny: 2 key/value heads


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    plans = {name: build(**kwargs) for name, kwargs in PLANS.items()}
    return run_plans(tmp_path_factory.mktemp("cp"), plans, "executor_worker.py", STEPS, SEED, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS))
def test_cp_plan_matches_single_process(results, name):
    assert_matches_reference(results, name, STEPS, SEED, rel=1e-4)


def test_sliding_window_under_cp_is_refused():
    """The CP wrappers attend over whole chunks: a plan whose sliding window binds is refused before start."""
    from meshplan.executor.checks import check_supported
    from meshplan.planner.errors import InputError

    plan = build(cp=2, dp=2, micro_batch_size=1, num_micro_batches=2)
    plan.model = replace(builtin_model("tiny"), name="tiny-window", sliding_window=8, layers=())
    with pytest.raises(InputError, match="sliding window"):
        check_supported(plan)
    plan.model = replace(plan.model, sliding_window=32)  # as long as the sequence: no window binds
    check_supported(plan)


def test_alibi_keeps_context_parallelism_out():
    """ALiBi's bias is not in the CP wrappers: the search weighs no CP mode for it, a pinned --cp is refused in
    one line, and the executor refuses such a plan."""
    from meshplan.executor.checks import check_supported
    from meshplan.planner.cluster_spec import parse_cluster
    from meshplan.planner.constraints import Constraints
    from meshplan.planner.cost_cp import mode_fits
    from meshplan.planner.errors import InputError

    bloomish = replace(builtin_model("tiny"), name="tiny-bloom", position="alibi", embedding_norm=True, layers=())
    assert not any(mode_fits(bloomish, 32, 1, 2, m) for m in ("ring", "all-gather", "all-to-all"))
    with pytest.raises(InputError, match="ALiBi"):
        Constraints(global_batch_size=8, seq_len=32, cp=2).validate(bloomish, parse_cluster("4xcpu"))
    plan = build(cp=2, dp=2, micro_batch_size=1, num_micro_batches=2)
    plan.model = bloomish
    with pytest.raises(InputError, match="ALiBi"):
        check_supported(plan)
