"""The GPU check script runs end to end (on CPU here, with the tiny model), and its model is exact."""

import subprocess
import sys
from pathlib import Path

from meshplan.planner.model_sources import builtin_model

ROOT = Path(__file__).resolve().parents[1]


def test_llama32_1b_parameter_count():
    """meta-llama/Llama-3.2-1B: 1,235,814,400 parameters (tied embeddings)."""
    assert builtin_model("llama3.2-1b").num_parameters == 1_235_814_400


def test_gpu_check_runs_on_cpu(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--model", "tiny", "--cluster", "1xcpu",
         "--preset-cluster", "1xcpu", "--seq-len", "64", "--global-batch-size", "4", "--steps", "4", "--dtype",
         "fp32", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "measured profile" in done.stdout and "presets" in done.stdout and "meas/pred" in done.stdout


def test_gemm_sustained_runs_on_cpu():
    """The sustained-GEMM probe keeps one matmul running in windows and reports each one's rate."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gemm_sustained.py"), "--seconds", "1.5", "--window", "0.5",
         "--shape", "128", "128", "128"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "TFLOP/s" in done.stdout and "last third (median)" in done.stdout
