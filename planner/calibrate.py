"""`plan calibrate METRICS.jsonl... --profile P.json`: fold measured step times back into a profile.

Each metrics file (from `torchrun -m meshplan.executor PLAN.json --metrics FILE`) ends with a summary line holding
the measured median iteration time and the plan it ran. The cost model predicts each of those plans again
— the same stage cut and recompute counts — as a function of per-term correction factors (compute, tp_comm,
pp_comm, dp_comm, optimizer: the factors profile.correction() applies), and the factors are fitted by
Gauss–Newton on log(predicted / measured), with a small pull towards 1 so that a term no run exercises
keeps its factor. The fitted factors multiply the profile's existing ones.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
from meshplan.planner.candidate import Candidate
from meshplan.planner.cli import _Parser
from meshplan.planner.constraints import Constraints
from meshplan.planner.cost_model import evaluate
from meshplan.planner.errors import InputError
from meshplan.planner.plan import Plan, load_plan
from meshplan.profiler.profile import CORRECTION_TERMS, Profile, load_profile, save_profile

RIDGE = 0.05  # weight of log(factor)^2: keeps factors no run constrains at 1
STEP = 0.05  # finite-difference step in log(factor)


@dataclass
class Run:
    plan: Plan
    measured_s: float
    source: str


def predict(plan: Plan, profile: Profile) -> float:
    """Iteration time the planner predicts for exactly this plan under `profile` (shared CPU cores included)."""
    from meshplan.planner.search import Search

    p = plan.parallel
    constraints = Constraints(global_batch_size=p.global_batch_size, seq_len=p.seq_len, dtype=p.dtype)
    search = Search(plan.model, plan.cluster, constraints, profile)
    order = tuple(d for d in plan.placement.order if d != "cp") if plan.placement else ("pp", "dp", "tp")
    cand = Candidate(dp=p.dp, tp=p.tp, pp=p.pp, v=p.virtual_stages, schedule=p.schedule, b=p.micro_batch_size,
                     m=p.num_micro_batches, zero=p.zero, recompute=p.recompute, order=order)
    bounds = [s.layers[0] for s in plan.stages] + [plan.stages[-1].layers[1]]
    recompute = [s.recompute_layers for s in plan.stages]
    return search.shared_time(cand, evaluate(search.problem(cand), bounds, recompute))


def with_factors(profile: Profile, log_factors: np.ndarray) -> Profile:
    corrections = dict(profile.corrections)
    for term, g in zip(CORRECTION_TERMS, log_factors):
        corrections[term] = profile.correction(term) * math.exp(g)
    return replace(profile, corrections=corrections)


def fit(runs: Sequence[Run], profile: Profile, iterations: int = 6) -> dict[str, float]:
    """Factors (multiplying the profile's) that bring the predictions closest to the measurements."""
    k = len(CORRECTION_TERMS)
    g = np.zeros(k)
    target = np.log([r.measured_s for r in runs])
    for _ in range(iterations):
        base = np.log([predict(r.plan, with_factors(profile, g)) for r in runs])
        jac = np.zeros((len(runs), k))
        for j in range(k):
            step = g.copy()
            step[j] += STEP
            jac[:, j] = (np.log([predict(r.plan, with_factors(profile, step)) for r in runs]) - base) / STEP
        # Minimise |base + J d - target|^2 + RIDGE |g + d|^2.
        a = np.vstack([jac, math.sqrt(RIDGE) * np.eye(k)])
        rhs = np.concatenate([target - base, -math.sqrt(RIDGE) * g])
        delta = np.linalg.lstsq(a, rhs, rcond=None)[0]
        g = np.clip(g + delta, math.log(0.02), math.log(50.0))
        if np.max(np.abs(delta)) < 1e-4:
            break
    return {term: float(math.exp(v)) for term, v in zip(CORRECTION_TERMS, g)}


def read_run(path: str, plan_path: str | None) -> Run:
    """The summary line of a metrics file and the plan it names (or `plan_path`)."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = [json.loads(line) for line in fh if line.strip()]
    except OSError as exc:
        raise InputError(f"METRICS: cannot read '{path}': {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"METRICS: '{path}' is not JSON lines: {exc}") from None
    summary = next((x for x in lines if isinstance(x, dict) and x.get("summary")), None)
    if summary is None:
        raise InputError(f"METRICS: '{path}' has no summary line (did the run finish?)")
    measured = summary.get("measured_iteration_time_s")
    if not isinstance(measured, (int, float)) or measured <= 0:
        raise InputError(f"{path}: summary.measured_iteration_time_s: expected a positive number, got {measured!r}")
    plan_path = plan_path or summary.get("plan")
    if not plan_path:
        raise InputError(f"{path}: summary.plan: missing; pass the plan with --plan")
    if not os.path.isabs(plan_path) and not os.path.exists(plan_path):
        plan_path = os.path.join(os.path.dirname(os.path.abspath(path)), plan_path)
    return Run(load_plan(plan_path), float(measured), path)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="plan calibrate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("metrics", nargs="+", metavar="METRICS.jsonl", help="metrics files of executor runs")
    p.add_argument("--profile", required=True, metavar="P.json", help="the profile the plans were made with")
    p.add_argument("--plan", action="append", metavar="PLAN.json",
                   help="the plan of each metrics file, in order (default: the one its summary names)")
    p.add_argument("-o", "--output", metavar="PATH", help="write the calibrated profile here (default: in place)")
    return p


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(list(argv))
    if args.plan and len(args.plan) != len(args.metrics):
        raise InputError(f"--plan: {len(args.plan)} given for {len(args.metrics)} metrics files; give one each")
    runs = [read_run(m, args.plan[i] if args.plan else None) for i, m in enumerate(args.metrics)]
    profile = load_profile(args.profile, model=runs[0].plan.model)
    for run in runs[1:]:
        load_profile(args.profile, model=run.plan.model)
    before = [predict(r.plan, profile) for r in runs]
    factors = fit(runs, profile)
    calibrated = with_factors(profile, np.log([factors[t] for t in CORRECTION_TERMS]))
    after = [predict(r.plan, calibrated) for r in runs]
    save_profile(calibrated, args.output or args.profile)
    print("run                                  measured ms   before ms   after ms")
    for r, b, a in zip(runs, before, after):
        print(f"{os.path.basename(r.source)[:36]:36} {r.measured_s * 1e3:11.1f} {b * 1e3:11.1f} {a * 1e3:10.1f}")
    print("factors: " + ", ".join(f"{t} x{f:.3g}" for t, f in factors.items()))
    print(f"calibrated profile written to {args.output or args.profile}")
    return 0
