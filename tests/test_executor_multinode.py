"""Multi-node launch: two torchrun invocations (--nnodes 2, c10d rendezvous) on localhost, 2 processes
each, run a tp2 x dp2 plan (TP inside a "node", DP across) and match the 1-process losses."""

import json
import os
import subprocess
import sys

import pytest
from meshplan.planner.plan import save_plan

from tests.executor_worker import free_port, reference_losses, repo_root
from tests.helpers import make_plan


@pytest.mark.slow
def test_two_nodes_on_localhost(tmp_path):
    plan, metrics = tmp_path / "plan.json", tmp_path / "m.jsonl"
    save_plan(make_plan(cluster="4xcpu", tp=2, dp=2, micro_batch_size=2, num_micro_batches=2), str(plan))
    port = free_port()
    env = {**os.environ, "PYTHONPATH": repo_root(), "OMP_NUM_THREADS": "1"}
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
               "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", "meshplan-test", "-m", "meshplan.executor", str(plan), "--steps", "3", "--seed", "4",
               "--metrics", str(metrics)]
        procs.append(subprocess.Popen(cmd, env=env, cwd=repo_root(), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    got = [json.loads(ln)["loss"] for ln in metrics.read_text().splitlines()[:-1]]
    assert got == pytest.approx(reference_losses(str(plan), 3, 4), rel=1e-4)
    assert any("mesh pp=1 dp=2 tp=2" in o for o in outs)
