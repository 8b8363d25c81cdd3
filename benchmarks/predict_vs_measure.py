"""Predicted vs measured iteration time and memory across the plan space, end to end.

    python benchmarks/predict_vs_measure.py --cluster 2xcpu --model tiny

profile -> plan --top-k K -> for each distinct plan: re-plan it pinned, run it with torchrun for a few
steps, in --rounds interleaved rounds (the machine drifts; one run of each plan would rank the minutes
they ran in as much as the plans) -> table of predicted vs measured time and peak memory, then median
absolute error, Spearman rank correlation and the regret of the planner's choice (measured time of the
chosen plan / best measured).
Before every run a one-thread probe times one of the model's blocks in this process (a few seconds, while
nothing else runs, and once right after profiling): how fast the machine does this work at that moment.
The summary reports how far identical runs of one plan differed and how well those differences follow the
probe, which tells the model's error apart from the machine's drift (a shared cloud machine's speed on
small operators moved x1.25-x2.7 within one minute here, one process on an otherwise idle machine).
Uses only the public command line (plan, plan profile, torchrun -m meshplan.executor), as a user would.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from rich.console import Console
from rich.table import Table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the repository's own modules (the executor's warm-up rule, calibrate's predict)


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run(cmd: list[str], timeout: float = 900) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return proc.stdout


def sweep(world: int, gbs: int) -> list[dict]:
    """Pins spanning the plan space: every (dp, tp, pp) mesh, two micro-batch sizes, each pipeline
    schedule, and full recompute — so the comparison is not only the planner's near-identical top few.
    Taken round-robin over the meshes, so a --max-plans cut still covers every (dp, tp, pp)."""
    per_mesh: list[list[dict]] = []
    for tp in (d for d in range(1, world + 1) if world % d == 0):
        for pp in (d for d in range(1, world // tp + 1) if (world // tp) % d == 0):
            dp = world // (tp * pp)
            out: list[dict] = []
            per_mesh.append(out)
            per_replica = gbs // dp
            sizes = sorted({1, max(1, per_replica // 4), per_replica})
            scheds = [("1f1b", 1)] if pp == 1 else [("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2),
                                                      ("zero-bubble", 2)]
            for b in sizes:
                for schedule, v in scheds:
                    out.append(dict(dp=dp, tp=tp, pp=pp, micro_batch_size=b, schedule=schedule,
                                    virtual_stages=v, recompute="none"))
            out.insert(1, dict(dp=dp, tp=tp, pp=pp, micro_batch_size=sizes[1], schedule="1f1b", virtual_stages=1,
                               recompute="full"))
    longest = max(len(x) for x in per_mesh)
    return [mesh[i] for i in range(longest) for mesh in per_mesh if i < len(mesh)]


def pin_flags(pins: dict) -> list[str]:
    return [x for k, v in pins.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def try_plan(cmd: list[str]) -> dict | None:
    """The plan JSON, or None when those pins admit no plan (exit 2/3)."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=600)
    return json.loads(proc.stdout) if proc.returncode == 0 else None


def pins(parallel: dict) -> list[str]:
    """Flags that pin every dimension of a plan, so the planner rebuilds exactly that plan in full."""
    return ["--dp", str(parallel["dp"]), "--tp", str(parallel["tp"]), "--pp", str(parallel["pp"]),
            "--micro-batch-size", str(parallel["micro_batch_size"]), "--schedule", parallel["schedule"],
            "--virtual-stages", str(parallel["virtual_stages"]), "--recompute", parallel["recompute"],
            "--zero", str(parallel["zero"])]


def label(p: dict) -> str:
    text = f"dp{p['dp']} tp{p['tp']} pp{p['pp']} b{p['micro_batch_size']}x{p['num_micro_batches']}"
    if p["pp"] > 1:
        text += f" {p['schedule']}" + (f" v{p['virtual_stages']}" if p["virtual_stages"] > 1 else "")
    if p["zero"]:
        text += f" z{p['zero']}"
    if p["recompute"] != "none":
        text += f" rc-{p['recompute']}"
    return text


@dataclass
class Row:
    label: str
    predicted_s: float
    measured_s: float
    predicted_mem: float
    measured_mem: float
    chosen: bool

    @property
    def error(self) -> float:
        return (self.predicted_s - self.measured_s) / self.measured_s


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    if len(a) < 2 or ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def measure(plan_path: str, nproc: int, steps: int, workdir: str, tag: str) -> tuple[list[float], float]:
    """One run of the plan: the step times its executor's median is taken over (after the warm-up, without
    the step the CPU memory probe instrumented), and its measured peak memory."""
    from meshplan.executor.metrics import timed_step_times

    metrics = os.path.join(workdir, f"{tag}.jsonl")
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
         "-m", "meshplan.executor", plan_path, "--steps", str(steps), "--metrics", metrics])
    with open(metrics) as fh:
        lines = [json.loads(line) for line in fh if line.strip()]
    summary = next(x for x in lines if x.get("summary"))
    # CPU: tensor bytes tracked by the executor's memory probe (peak RSS would count the interpreter)
    peak = summary.get("peak_tensor_bytes") or max(x.get("peak_memory_bytes", 0) for x in lines if "step" in x)
    return timed_step_times(lines), peak


@dataclass
class Runs:
    """One plan's runs: each run's timed step seconds, the machine probe taken just before it (when
    probing), and the largest measured peak memory."""

    steps: list[list[float]] = field(default_factory=list)
    probes: list[float] = field(default_factory=list)
    peak: float = 0.0

    @property
    def median_s(self) -> float:
        """The median step over all runs pooled."""
        return float(np.median([t for run in self.steps for t in run]))

    def run_medians(self) -> list[float]:
        return [float(np.median(run)) for run in self.steps if run]


def measure_rounds(paths: list[str], nproc: list[int], labels: list[str], steps: int, rounds: int, workdir: str,
                   console: Console, probe: Callable[[], float] | None = None) -> list[Runs]:
    """Every plan's runs, taken in `rounds` interleaved rounds (forward, then backward order, ...) so that
    the machine's drift over the benchmark spreads over all plans instead of favouring the ones run in a
    quiet minute; `probe`, when given, runs before each run."""
    runs = [Runs() for _ in paths]
    for r in range(rounds):
        order = range(len(paths)) if r % 2 == 0 else reversed(range(len(paths)))
        for i in order:
            console.print(f"round {r + 1}/{rounds}, plan {i + 1}/{len(paths)}: running {labels[i]} ...", markup=False)
            if probe is not None:
                runs[i].probes.append(probe())
            step_times, peak = measure(paths[i], nproc[i], steps, workdir, run_tag(i, r))
            runs[i].steps.append(step_times)
            runs[i].peak = max(runs[i].peak, peak)
    return runs


def machine_probe(model: dict, seq_len: int, dtype: str, seconds: float = 2.0) -> Callable[[], float] | None:
    """A probe of the machine's current speed: the median seconds of one forward + backward of one of the
    model's blocks at micro-batch size 1, on one thread, timed by the profiler's own loop for about
    `seconds`; None when the profiler cannot build the model's layers (a factory model). Run between
    runs, never beside one."""
    import torch
    from meshplan.planner.errors import InputError
    from meshplan.planner.model_spec import ModelSpec
    from meshplan.profiler.compute import TimingConfig, median, time_passes
    from meshplan.profiler.layers import check_buildable

    spec = ModelSpec.from_dict(model)
    try:
        check_buildable(spec)
    except InputError:
        return None
    timing = TimingConfig(warmup=5, repeats=3, max_repeats=10**9, budget_s=seconds)

    def probe() -> float:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        gc.disable()
        try:
            fwds, bwds = time_passes(spec, "block", 1, seq_len, 1, dtype, torch.device("cpu"), timing)
            return median([f + b for f, b in zip(fwds, bwds)])
        finally:
            gc.enable()
            torch.set_num_threads(threads)

    return probe


def drift_summary(runs: list[Runs], predicted: list[float], at_profile: float | None = None) -> str | None:
    """How far identical runs of one plan differed, and how well each run's deviation from its plan's
    typical (log) ratio measured/predicted follows the probe's deviation (Pearson over runs); with
    `at_profile`, the probe taken right after profiling against its median over the runs (the profile
    is a snapshot of the machine at that time)."""
    spreads = [max(m) / min(m) for r in runs if len(m := r.run_medians()) > 1 and min(m) > 0]
    if not spreads:
        return None
    text = (f"identical runs of one plan differed x{np.median(spreads):.2f} (median over plans; "
            f"largest x{max(spreads):.2f})")
    xs, ys = [], []
    for r, pred in zip(runs, predicted):
        meds = r.run_medians()
        if len(r.probes) != len(meds) or len(meds) < 2 or pred <= 0 or min(r.probes) <= 0:
            continue
        lr = np.log(np.array(meds) / pred)
        lp = np.log(np.array(r.probes))
        xs += list(lp - lp.mean())
        ys += list(lr - lr.mean())
    probes = [p for r in runs for p in r.probes]
    if probes:
        text += f"; machine probe ranged x{max(probes) / min(probes):.2f} over the runs"
        if at_profile is not None:
            text += f" and was x{at_profile / np.median(probes):.2f} of their median right after profiling"
    if len(xs) >= 3 and np.std(xs) > 0 and np.std(ys) > 0:
        text += f", run-to-run changes follow it with Pearson {float(np.corrcoef(xs, ys)[0, 1]):+.2f} ({len(xs)} runs)"
    return text


def run_tag(plan: int, round_: int) -> str:
    return f"plan{plan}" if round_ == 0 else f"plan{plan}.r{round_ + 1}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cluster", default="2xcpu")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--global-batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--top-k", type=int, default=4, help="the planner's runner-ups to run besides the sweep")
    ap.add_argument("--max-plans", type=int, default=16, help="at most this many distinct plans are run")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2,
                    help="runs of every plan, in interleaved rounds; its time is the median step over all of them")
    ap.add_argument("--profile", help="use this profile instead of measuring one")
    ap.add_argument("--workdir", help="keep plans, metrics and the profile here")
    ap.add_argument("--no-probe", dest="probe", action="store_false",
                    help="skip the machine probe before each run (a one-thread block pass timed for 2 s)")
    ap.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                    help="skip fitting `plan calibrate` on half the runs and checking the other half")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        print(f"predict_vs_measure: --rounds: expected a positive number of runs per plan, got {args.rounds}",
              file=sys.stderr)
        return 2
    console = Console()
    workdir = args.workdir or tempfile.mkdtemp(prefix="meshplan-pvm-")
    os.makedirs(workdir, exist_ok=True)
    plan_cmd = [sys.executable, "-m", "meshplan.planner"]
    profile = args.profile or os.path.join(workdir, "profile.json")
    if not args.profile:
        # every micro-batch size the sweep can plan (powers of two up to the global batch), so the
        # planner interpolates the measured times rather than extrapolating them
        sizes = [str(2 ** i) for i in range(args.global_batch_size.bit_length()) if 2 ** i <= args.global_batch_size]
        console.print(f"profiling {args.model} on {args.cluster} (micro-batch sizes {' '.join(sizes)}) ...")
        # --force: this run's machine, not a cached profile measured in other minutes (or beside other work)
        run(plan_cmd + ["profile", args.model, "--cluster", args.cluster, "-o", profile, "--dtype", args.dtype,
                        "--seq-len", str(args.seq_len), "--micro-batch-sizes", *sizes, "--force"])
    probe = None
    if args.probe:
        with open(profile) as fh:
            probe = machine_probe(json.load(fh)["model"], args.seq_len, args.dtype)
    at_profile = probe() if probe is not None and not args.profile else None  # right after profiling
    common = [args.model, "--cluster", args.cluster, "--profile", profile, "--dtype", args.dtype,
              "--global-batch-size", str(args.global_batch_size), "--seq-len", str(args.seq_len)]
    best = json.loads(run(plan_cmd + common + ["--top-k", str(args.top_k), "--json"]))
    nproc = best["world_size"]
    plans, seen = [], set()
    requests = [pins(best["parallel"])] + [pins(a["parallel"]) for a in best["alternatives"]]
    requests += [pin_flags(p) for p in sweep(nproc, args.global_batch_size)]
    for flags in requests:
        if len(plans) >= args.max_plans:
            break
        plan = try_plan(plan_cmd + common + flags + ["--top-k", "1", "--json"])
        key = plan and json.dumps(plan["parallel"], sort_keys=True)
        if plan and key not in seen:
            seen.add(key)
            plans.append(plan)
    paths = [os.path.join(workdir, f"plan{i}.json") for i in range(len(plans))]
    for path, plan in zip(paths, plans):
        with open(path, "w") as fh:
            json.dump(plan, fh)
    runs = measure_rounds(paths, [p["world_size"] for p in plans], [label(p["parallel"]) for p in plans],
                          args.steps, args.rounds, workdir, console, probe)
    rows = [Row(label(plan["parallel"]), plan["predicted"]["iteration_time_s"], r.median_s,
                plan["predicted"]["peak_memory_bytes"], r.peak, chosen=i == 0)
            for i, (plan, r) in enumerate(zip(plans, runs))]
    all_probes = [p for r in runs for p in r.probes]
    table = Table(title=f"{args.model} on {args.cluster} ({nproc} ranks), {args.steps} steps x {args.rounds} "
                        f"rounds each")
    columns = ["plan", "predicted ms", "measured ms", "error", "pred. peak MiB", "meas. peak MiB"]
    for col in columns + (["machine"] if all_probes else []):
        table.add_column(col, justify="right")
    for r, plan_runs in zip(rows, runs):
        cells = [("* " if r.chosen else "") + r.label, f"{r.predicted_s * 1e3:.1f}", f"{r.measured_s * 1e3:.1f}",
                 f"{r.error:+.0%}", f"{r.predicted_mem / 2**20:.1f}", f"{r.measured_mem / 2**20:.1f}"]
        if all_probes:  # the probe's seconds before this plan's runs over its median over the benchmark
            cells.append(f"x{np.median(plan_runs.probes) / np.median(all_probes):.2f}")
        table.add_row(*cells)
    console.print(table)
    errors = [abs(r.error) for r in rows]
    measured = [r.measured_s for r in rows]
    regret = rows[0].measured_s / min(measured)
    rho = spearman([r.predicted_s for r in rows], measured)
    console.print(f"median |error| {np.median(errors):.1%}   Spearman {rho:.2f}"
                  f"   regret {regret:.2f}   ({len(rows)} plans; * = the planner's choice; files in {workdir})")
    drift = drift_summary(runs, [r.predicted_s for r in rows], at_profile)
    if drift:
        console.print(f"noise: {drift}" + ("; machine: the probe's time before the plan's runs over its median"
                                            if all_probes else ""))
    if args.calibrate and len(rows) >= 4:
        calibrate_held_out(console, plan_cmd, workdir, profile, rows, args.rounds)
    return 0


def calibrate_held_out(console: Console, plan_cmd: list[str], workdir: str, profile: str, rows: list[Row],
                       rounds: int) -> None:
    """Fit `plan calibrate` on the even-numbered plans' runs (every round's); report the odd-numbered
    (held-out) plans' errors before and after, and the rank correlation over all plans with the
    calibrated profile."""
    from meshplan.planner.calibrate import predict
    from meshplan.planner.plan import load_plan
    from meshplan.profiler.profile import load_profile

    train = list(range(0, len(rows), 2))
    calibrated = os.path.join(workdir, "profile-calibrated.json")
    runs = [(i, r) for i in train for r in range(rounds)]
    flags = [x for i, _ in runs for x in ("--plan", os.path.join(workdir, f"plan{i}.json"))]
    run(plan_cmd + ["calibrate", *[os.path.join(workdir, f"{run_tag(i, r)}.jsonl") for i, r in runs],
                    "--profile", profile, "-o", calibrated, *flags])
    plans = [load_plan(os.path.join(workdir, f"plan{i}.json")) for i in range(len(rows))]
    cal = load_profile(calibrated, model=plans[0].model)
    after = [predict(p, cal) for p in plans]
    held = [i for i in range(len(rows)) if i % 2]
    before_err = [abs(rows[i].error) for i in held]
    after_err = [abs(after[i] / rows[i].measured_s - 1) for i in held]
    factors = ", ".join(f"{k} x{v:.2f}" for k, v in cal.corrections.items())
    console.print(f"calibrated on {len(train)} runs ({factors}); held-out median |error| "
                  f"{np.median(before_err):.1%} -> {np.median(after_err):.1%}; Spearman over all plans "
                  f"{spearman(after, [r.measured_s for r in rows]):.2f}")


if __name__ == "__main__":
    sys.exit(main())
