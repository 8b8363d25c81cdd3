"""The executor's command line: refusals (one line per rank, non-zero exit, no traceback), metrics JSONL
(DESIGN §4) and a token file given with --data."""

import json
import os
import subprocess
from dataclasses import replace

import numpy as np
import pytest
from meshplan.executor.cli import main
from meshplan.executor.data import TokenFile
from meshplan.planner.plan import save_plan

from tests.executor_worker import free_port, reference_losses, repo_root, torchrun
from tests.helpers import make_plan


@pytest.fixture
def run_executor(monkeypatch, capsys):
    """Call the executor's main() in this process (no interpreter start-up): a world of one."""
    def run(*args: str) -> subprocess.CompletedProcess:
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.delenv(key, raising=False)
        monkeypatch.setenv("RANK", "0")  # restored after the test, also what main() adds
        monkeypatch.setenv("WORLD_SIZE", "1")
        monkeypatch.setenv("LOCAL_RANK", "0")
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        code = main(list(args))
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out.out, out.err)
    return run


def one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("executor: error:")]
    assert lines, proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_world_size_mismatch_single_process(tmp_path, run_executor):
    path = tmp_path / "plan.json"
    save_plan(make_plan(dp=2, cluster="2xcpu"), str(path))
    one_line_error(run_executor(str(path)), "plan.world_size", "needs 2 processes", "1 were launched")


def test_invalid_plan_names_the_field(tmp_path, run_executor):
    path = tmp_path / "plan.json"
    data = make_plan(cluster="1xcpu").to_dict()
    data["parallel"]["schedule"] = "2f2b"
    path.write_text(json.dumps(data))
    one_line_error(run_executor(str(path)), "plan.parallel.schedule")
    one_line_error(run_executor(str(tmp_path / "missing.json")), "cannot read")


def test_gpu_plan_without_cuda_is_refused(tmp_path, run_executor):
    pytest.importorskip("torch")
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    path = tmp_path / "plan.json"
    save_plan(make_plan(cluster="1xa100-80gb"), str(path))
    one_line_error(run_executor(str(path)), "plan.cluster", "CUDA is not available")


def test_unsupported_combination_is_refused(tmp_path, run_executor, monkeypatch):
    path = tmp_path / "plan.json"
    save_plan(make_plan(pp=2, dp=2, zero=3, schedule="zero-bubble", virtual_stages=2, num_micro_batches=4),
              str(path))
    # what no launch can run is refused first, whatever the launch's size
    one_line_error(run_executor(str(path)), "plan.parallel.zero: zero-bubble")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main([str(path)]) == 2  # refused before any process group is created


@pytest.mark.slow
def test_every_rank_reports_under_torchrun(tmp_path):
    path = tmp_path / "plan.json"
    save_plan(make_plan(dp=4, cluster="4xcpu"), str(path))
    # torchrun stops the other workers once one has failed; monitoring every 5 s (not 0.1 s) lets the
    # slower rank reach its own check first on a loaded machine
    args = ["--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--monitor-interval", "5"]
    proc = torchrun(["-m", "meshplan.executor", str(path)], nproc=2, timeout=180, torchrun_args=args)
    assert proc.returncode != 0
    assert os.path.join(repo_root(), "executor") not in proc.stderr  # torchrun's own report only, no rank traceback
    for rank in (0, 1):
        assert f"executor: error: [rank {rank}] plan.world_size" in proc.stderr + proc.stdout


def test_metrics_jsonl_and_console(tmp_path, run_executor):
    path, metrics = tmp_path / "plan.json", tmp_path / "m.jsonl"
    save_plan(make_plan(cluster="1xcpu", micro_batch_size=2, num_micro_batches=2), str(path))
    proc = run_executor(str(path), "--steps", "3", "--seed", "1", "--metrics", str(metrics))
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(ln) for ln in metrics.read_text().splitlines()]
    assert [ln["step"] for ln in lines[:-1]] == [1, 2, 3]
    for ln in lines[:-1]:  # DESIGN §4; the step the CPU memory probe instrumented says it was not timed
        extra = {"timed"} if ln["step"] == 2 else set()
        assert set(ln) == {"step", "loss", "step_time_s", "tokens_per_s", "peak_memory_bytes"} | extra
        assert ln.get("timed", True) is (ln["step"] != 2)
        assert ln["step_time_s"] > 0 and ln["tokens_per_s"] > 0 and ln["peak_memory_bytes"] > 0
    assert lines[-1]["summary"] is True and lines[-1]["predicted_iteration_time_s"] == 0.01
    assert lines[-1]["measured_iteration_time_s"] > 0
    assert lines[-1]["plan"] == str(path.resolve())  # what `plan calibrate` reads the plan from
    want = reference_losses(str(path), 3, 1)
    assert [ln["loss"] for ln in lines[:-1]] == pytest.approx(want, rel=1e-4)
    assert "step     3 | loss" in proc.stdout and "predicted 0.0100 s/iter" in proc.stdout


NOISE = ("USDT", "CPUAllocator", "profiler_start", "profiler_stop", "Warning", "warn(")


def quiet_and_narrow(text: str) -> None:
    """Nothing from the torch profiler or the CPU allocator, and every line within 80 columns."""
    for line in text.splitlines():
        assert not any(n in line for n in NOISE), line
        assert len(line) <= 80, line


def test_cpu_run_is_quiet_and_fits_80_columns(tmp_path, monkeypatch, capfd):
    """Step 2 runs the CPU memory probe; it used to start the torch profiler, whose kineto printed
    `USDT ... profiler_start/stop` and c10 a `CPUAllocator` warning straight to the file descriptors
    (capfd sees them, capsys would not)."""
    path = tmp_path / "plan.json"
    save_plan(make_plan(cluster="1xcpu", micro_batch_size=2, num_micro_batches=2), str(path))
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    assert main([str(path), "--steps", "3", "--metrics", str(tmp_path / "m.jsonl")]) == 0
    out, err = capfd.readouterr()
    quiet_and_narrow(out + err)
    assert "peak tensor memory" in out and err == ""
    assert len([ln for ln in out.splitlines() if ln.startswith("step ")]) == 3


@pytest.mark.slow
def test_two_rank_run_prints_once(tmp_path):
    """Under torchrun only rank 0 reports the steps and the summary; no rank prints profiler noise."""
    path = tmp_path / "plan.json"
    save_plan(make_plan(pp=2, cluster="2xcpu", num_micro_batches=2), str(path))
    proc = torchrun(["-m", "meshplan.executor", str(path), "--steps", "3"], nproc=2, timeout=180)
    assert proc.returncode == 0, proc.stderr
    quiet_and_narrow(proc.stdout + proc.stderr)
    assert [ln.split("|")[0].split() for ln in proc.stdout.splitlines() if ln.startswith("step ")] == \
        [["step", "1"], ["step", "2"], ["step", "3"]]
    assert proc.stdout.count("done: predicted") == 1 and "peak tensor memory" in proc.stdout


def test_a_lost_peer_is_recognised_through_wrapping():
    """A rank whose peer died reports one line instead of a traceback: gloo's error arrives wrapped by
    torch.distributed.pipelining ("[Stage 0] failed to run forward")."""
    from meshplan.executor.cli import lost_peer

    try:
        try:
            raise RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:40876")
        except RuntimeError as inner:
            raise RuntimeError("[Stage 0] failed to run forward") from inner
    except RuntimeError as exc:
        assert lost_peer(exc) == "Connection closed by peer"
    assert lost_peer(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None


def test_tied_head_is_one_parameter(tmp_path, run_executor):
    """Materialising from the meta device must keep the LM head tied to the embedding (to_empty alone
    gives each its own copy, which then trains apart from the reference)."""
    path, metrics = tmp_path / "plan.json", tmp_path / "m.jsonl"
    plan = make_plan(cluster="1xcpu", micro_batch_size=2, num_micro_batches=2)
    plan.model = replace(plan.model, name="tiny-tied", tied_embeddings=True, layers=())
    save_plan(plan, str(path))
    proc = run_executor(str(path), "--steps", "4", "--seed", "3", "--metrics", str(metrics))
    assert proc.returncode == 0, proc.stderr
    got = [json.loads(ln)["loss"] for ln in metrics.read_text().splitlines()[:-1]]
    assert got == pytest.approx(reference_losses(str(path), 4, 3), rel=2e-5)


def test_token_file(tmp_path, run_executor):
    path, metrics, tokens = tmp_path / "plan.json", tmp_path / "m.jsonl", tmp_path / "train.bin"
    plan = make_plan(cluster="1xcpu", micro_batch_size=2, num_micro_batches=2)
    save_plan(plan, str(path))
    rng = np.random.default_rng(0)
    rng.integers(0, plan.model.vocab_size, size=5000, dtype=np.uint16).tofile(tokens)
    proc = run_executor(str(path), "--steps", "2", "--data", str(tokens), "--metrics", str(metrics))
    assert proc.returncode == 0, proc.stderr
    got = [json.loads(ln)["loss"] for ln in metrics.read_text().splitlines()[:-1]]
    source = TokenFile(str(tokens), "uint16", plan.model.vocab_size, plan.parallel.seq_len,
                       plan.parallel.global_batch_size)
    assert got == pytest.approx(reference_losses(str(path), 2, 0, tokens=source), rel=1e-4)
    bad = tmp_path / "bad.bin"
    np.full(100, 300, dtype=np.uint16).tofile(bad)  # ids >= vocab 256
    one_line_error(run_executor(str(path), "--steps", "1", "--data", str(bad)), "--data", "vocab_size")


def test_training_pauses_automatic_collection_and_collects_every_gc_interval(tmp_path, run_executor, monkeypatch):
    """As torchtitan trains: automatic garbage collection off in the loop (it fires on allocation counts,
    and pipeline steps allocate many Python objects), one generation-1 collection every --gc-interval
    steps, and the interpreter's setting back afterwards."""
    import gc

    from meshplan.executor import train

    path = tmp_path / "plan.json"
    save_plan(make_plan(cluster="1xcpu", micro_batch_size=1, num_micro_batches=1, seq_len=8), str(path))
    seen = []
    step = train.Trainer.train_step
    monkeypatch.setattr(train.Trainer, "train_step", lambda self, i: (seen.append(gc.isenabled()), step(self, i))[1])
    collected = []
    monkeypatch.setattr(train.gc, "collect", lambda generation=2: collected.append(generation) or 0)
    assert run_executor(str(path), "--steps", "5", "--gc-interval", "2").returncode == 0
    assert seen == [False] * 5 and gc.isenabled()
    # entering the loop, before steps 3 and 5; then a full one before the process group is destroyed
    assert collected == [1, 1, 1, 2]
    seen.clear()
    assert run_executor(str(path), "--steps", "2", "--gc-interval", "0").returncode == 0
    assert seen == [True, True]
    one_line_error(run_executor(str(path), "--gc-interval", "-1"), "--gc-interval: expected >= 0, got -1")
