"""Context parallelism (issue 22): all-to-all CP plans on 4 gloo processes reproduce a 1-process loop
(fp32, same seed, same global batch) within 1e-4; a ring plan is refused on gloo before start."""

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from meshplan.executor.context_parallel import chunk_positions
from meshplan.planner.model_sources import builtin_model
from meshplan.planner.plan import save_plan

from tests.executor_worker import assert_matches_reference, repo_root, run_plans
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
}


def build(mha: bool = False, **kwargs):
    plan = make_plan(cluster="4xcpu", seq_len=32, cp_mode="all-to-all", **kwargs)
    if mha:
        plan.model = replace(builtin_model("tiny"), name="tiny-mha", num_kv_heads=4, layers=())
    return plan


def test_chunk_positions_cover_the_sequence():
    for mode in ("all-to-all", "ring"):
        for cp in (1, 2, 4):
            got = torch.cat([chunk_positions(32, cp, r, mode) for r in range(cp)])
            assert sorted(got.tolist()) == list(range(32))
    # ring: head-tail pairs (torch's _HeadTailLoadBalancer), each rank the same causal work
    assert chunk_positions(16, 2, 0, "ring").tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert chunk_positions(16, 2, 1, "ring").tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert chunk_positions(16, 4, 1, "all-to-all").tolist() == [4, 5, 6, 7]


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
