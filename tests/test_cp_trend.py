"""benchmarks/cp_trend.py: the pinned FSDP + CP layouts plan, and the predicted throughput per GPU falls
as the sequence (and cp with it) grows, as torchtitan's published table does."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_cp_trend_runs_and_falls_with_the_sequence():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import cp_trend
    finally:
        sys.path.pop(0)
    tps = [cp_trend.predicted_tps(cp, seq, "all-gather" if cp > 1 else None) for cp, seq, _ in cp_trend.PUBLISHED]
    assert all(a > b > 0 for a, b in zip(tps, tps[1:]))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cp_trend.py")], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "262,144" in out.stdout and "predicted all-gather" in out.stdout
