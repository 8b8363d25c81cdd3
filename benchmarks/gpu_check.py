"""Predicted against measured on this machine's accelerator, for a measured profile and for the presets.

    python benchmarks/gpu_check.py [--model llama3.2-1b] [--preset-cluster 1xh200-141gb] [--steps 30]

One command, at most a few minutes on one GPU: profile the model here (`plan profile`), plan it for this
machine with that profile and for the preset cluster without one, run each plan with the executor for
`--steps` steps, and print per plan the predicted and measured step time (median after warm-up), the
predicted and measured peak memory, and the measured MFU (model FLOPs, dense bf16 peak of the preset).
Runs on CPU too (`--model tiny --cluster 1xcpu --preset-cluster 1xcpu`), which is how the tests check it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table


def run(cmd: list[str], timeout: float) -> None:
    start = time.perf_counter()
    print("$ " + " ".join(cmd), flush=True)
    done = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True)
    if done.returncode:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
        raise SystemExit(f"failed ({done.returncode}) after {time.perf_counter() - start:.0f} s: {' '.join(cmd)}")
    print(f"  ok in {time.perf_counter() - start:.0f} s", flush=True)


def summary(metrics: Path) -> tuple[dict, list[dict]]:
    lines = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    return next(x for x in lines if x.get("summary")), [x for x in lines if "step" in x]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3.2-1b")
    ap.add_argument("--cluster", default="local", help="this machine (default: local)")
    ap.add_argument("--preset-cluster", default="1xh200-141gb", help="the preset of this machine's GPU")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--global-batch-size", type=int, default=8)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--out", default="gpu_check_out")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per command")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan_cmd = [sys.executable, "-m", "meshplan.planner.cli"]
    common = ["--seq-len", str(args.seq_len), "--dtype", args.dtype]
    run(plan_cmd + ["profile", args.model, "--cluster", args.cluster, *common, "--force",
                    "-o", str(out / "profile.json")], args.timeout)
    plans = {"measured profile": out / "plan_measured.json", "presets": out / "plan_preset.json"}
    run(plan_cmd + [args.model, "--cluster", args.cluster, "--profile", str(out / "profile.json"), *common,
                    "--global-batch-size", str(args.global_batch_size), "-o", str(plans["measured profile"])],
        args.timeout)
    run(plan_cmd + [args.model, "--cluster", args.preset_cluster, *common, "--global-batch-size",
                    str(args.global_batch_size), "-o", str(plans["presets"])], args.timeout)

    from meshplan.planner.cluster_spec import parse_cluster
    from meshplan.planner.cost_compute import model_flops_per_iteration
    from meshplan.planner.plan import load_plan

    peak_flops = parse_cluster(args.preset_cluster).device.peak_flops[args.dtype]
    table = Table(title=f"{args.model}: predicted vs measured ({args.steps} steps)")
    for col in ("plan from", "layout", "pred s", "meas s", "meas/pred", "pred GiB", "meas GiB", "MFU meas",
                "MFU pred"):
        table.add_column(col, justify="right")
    for name, path in plans.items():
        plan = load_plan(str(path))
        if plan.world_size != args.nproc:
            table.add_row(name, f"needs {plan.world_size} ranks", *[""] * 7)
            continue
        metrics = out / f"{path.stem}.jsonl"
        run(["torchrun", "--standalone", "--nproc-per-node", str(args.nproc), "-m", "meshplan.executor", str(path),
             "--steps", str(args.steps), "--metrics", str(metrics)], args.timeout)
        s, steps = summary(metrics)
        p = plan.parallel
        measured = s["measured_iteration_time_s"]
        predicted = plan.predicted.iteration_time_s
        peak = max(x.get("peak_memory_bytes", 0) for x in steps)
        flops = model_flops_per_iteration(plan.model, p.global_batch_size, p.seq_len)
        mfu = flops / (measured * peak_flops * plan.world_size)
        predicted_gib = plan.predicted.peak_memory_bytes / 2**30
        table.add_row(name, f"dp{p.dp} tp{p.tp} pp{p.pp} b{p.micro_batch_size} {p.recompute}", f"{predicted:.4f}",
                      f"{measured:.4f}", f"{measured / predicted:.2f}", f"{predicted_gib:.2f}",
                      f"{peak / 2**30:.2f}", f"{mfu:.1%}", f"{plan.predicted.mfu:.1%}")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
