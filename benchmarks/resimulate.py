"""Re-predict a finished predict_vs_measure run with this checkout's cost model: the same plans, the
run's own profile and its measured times, so a change to the model is checked against real runs
without running them again (the machine's drift between runs would hide a few percent).

    python benchmarks/resimulate.py WORKDIR [WORKDIR ...] [--profile PROFILE.json]

WORKDIR is a benchmark's --workdir (plan0.json..., their metrics files, and profile.json when the
benchmark profiled; else pass --profile). Prints per plan the prediction recorded in the plan, the one
made now and the measured median step, then median |error|, Spearman and regret for both; regret is
among the measured plans (the one predicted fastest), since a new model may choose a plan not run.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from dataclasses import asdict

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from meshplan.executor.metrics import timed_step_times  # noqa: E402
from meshplan.planner.calibrate import predict  # noqa: E402
from meshplan.planner.errors import InputError  # noqa: E402
from meshplan.planner.plan import load_plan  # noqa: E402
from meshplan.profiler.profile import load_profile  # noqa: E402
from predict_vs_measure import label, spearman  # noqa: E402


def measured_s(plan_path: str) -> float | None:
    """Median timed step over every run of the plan (plan3.jsonl, plan3.r2.jsonl, ...), as the benchmark pools them."""
    steps: list[float] = []
    stem = plan_path[:-len(".json")]
    for path in [stem + ".jsonl"] + glob.glob(stem + ".r*.jsonl"):
        if not os.path.exists(path):
            continue
        with open(path) as fh:
            steps += timed_step_times([json.loads(line) for line in fh if line.strip()])
    return float(np.median(steps)) if steps else None


def summary(pred: list[float], meas: list[float]) -> tuple[float, float, float]:
    errors = [abs(p / m - 1) for p, m in zip(pred, meas)]
    return float(np.median(errors)), spearman(pred, meas), meas[int(np.argmin(pred))] / min(meas)


def resimulate(workdir: str, profile_path: str | None) -> list[str]:
    numbered = {int(m.group(1)): p for p in glob.glob(os.path.join(workdir, "plan*.json"))
                if (m := re.search(r"plan(\d+)\.json$", p))}
    paths = [numbered[k] for k in sorted(numbered)]
    profile_path = profile_path or os.path.join(workdir, "profile.json")
    lines, then, now, meas = [], [], [], []
    for path in paths:
        m = measured_s(path)
        if m is None:
            continue
        plan = load_plan(path)
        t = predict(plan, load_profile(profile_path, plan.model))
        label_text = label(asdict(plan.parallel))
        then.append(plan.predicted.iteration_time_s)
        now.append(t)
        meas.append(m)
        lines.append(f"  {label_text:<40} recorded {then[-1] * 1e3:8.1f} ms ({then[-1] / m - 1:+.0%})   "
                     f"now {t * 1e3:8.1f} ms ({t / m - 1:+.0%})   measured {m * 1e3:8.1f} ms")
    if len(meas) < 2:
        return [f"{workdir}: fewer than two measured plans"]
    for name, pred in (("recorded", then), ("now", now)):
        err, rho, regret = summary(pred, meas)
        lines.append(f"  {name:>8}: median |error| {err:.1%}   Spearman {rho:.2f}   regret among these {regret:.2f}")
    return [f"{workdir} ({len(meas)} plans, profile {profile_path})"] + lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workdirs", nargs="+", metavar="WORKDIR")
    ap.add_argument("--profile", help="the profile the benchmark used (default: WORKDIR/profile.json)")
    args = ap.parse_args(argv)
    for workdir in args.workdirs:
        profile = args.profile
        if not os.path.isdir(workdir):
            print(f"resimulate: WORKDIR: '{workdir}' is not a directory (a predict_vs_measure --workdir)",
                  file=sys.stderr)
            return 2
        if profile is None and not os.path.exists(os.path.join(workdir, "profile.json")):
            print(f"resimulate: {workdir}: no profile.json; pass --profile", file=sys.stderr)
            return 2
        try:
            print("\n".join(resimulate(workdir, profile)))
        except InputError as exc:  # an unreadable profile or plan: one line, as the CLIs print it
            print(f"resimulate: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
