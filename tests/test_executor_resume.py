"""Checkpoints: a run (FSDP ZeRO-3: sharded model and optimizer) whose rank is killed mid-run and
restarted by torchrun (--max-restarts) resumes from the newest complete
checkpoint and reproduces the uninterrupted run's losses exactly."""

import json

import pytest
from meshplan.executor import checkpoint
from meshplan.planner.plan import save_plan

from tests.executor_worker import free_port, torchrun
from tests.helpers import make_plan


def losses(path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines()) if "step" in r}


@pytest.mark.slow
def test_killed_rank_resumes_exactly(tmp_path):
    plan = tmp_path / "plan.json"
    save_plan(make_plan(dp=2, zero=3, cluster="2xcpu", micro_batch_size=2, num_micro_batches=2), str(plan))
    common = ["-m", "meshplan.executor", str(plan), "--steps", "6", "--seed", "2"]
    straight = torchrun(common + ["--metrics", str(tmp_path / "a.jsonl")], nproc=2)
    assert straight.returncode == 0, straight.stderr[-3000:]

    ckpt = tmp_path / "ckpt"
    restart = ["--max-restarts", "1", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    resumed = torchrun(common + ["--metrics", str(tmp_path / "b.jsonl"), "--checkpoint-dir", str(ckpt),
                                 "--checkpoint-interval", "2", "--resume"], nproc=2, timeout=300,
                       extra_env={"MESHPLAN_FAIL_AT_STEP": "4:1"}, torchrun_args=restart)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    out = resumed.stdout + resumed.stderr
    assert "rank 1 killed at step 4" in out and "resumed from" in out and "step-00000002" in out
    assert losses(tmp_path / "b.jsonl") == losses(tmp_path / "a.jsonl")
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000004", "step-00000006"]
    assert checkpoint.latest(str(ckpt))[1]["step"] == 6


def test_latest_ignores_incomplete(tmp_path):
    assert checkpoint.latest(str(tmp_path)) is None
    (tmp_path / "step-00000009.tmp").mkdir()
    done = tmp_path / "step-00000003"
    done.mkdir()
    (done / "meta.json").write_text(json.dumps({"step": 3}))
    (tmp_path / "step-00000005").mkdir()  # no meta.json: never renamed into place by a finished save
    path, meta = checkpoint.latest(str(tmp_path))
    assert path.endswith("step-00000003") and meta["step"] == 3
