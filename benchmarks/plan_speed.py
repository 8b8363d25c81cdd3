"""Planning speed: candidates considered, ILPs solved and seconds, as a table.

    PYTHONPATH=. python benchmarks/plan_speed.py [--quick]

Targets: gpt3-175b on 128x8xa100-80gb (1024 A100s, global batch 1536, seq 2048) under 5 s, a
1T-parameter GPT on 384x8xa100-80gb (3072 A100s) under 20 s, on a 2-core machine; the run prints whether
each is met, by `total s`. `search s` is find_plan's own time (model, cluster and profile are built
before; importing torch for the preset profile is not counted); `total s` includes building the model,
cluster and preset profile.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from meshplan.planner.cluster_spec import parse_cluster
from meshplan.planner.constraints import Constraints
from meshplan.planner.model_sources import builtin_model
from meshplan.planner.model_spec import ModelSpec
from meshplan.planner.search import find_plan
from meshplan.profiler.presets import preset_profile
from rich.console import Console
from rich.table import Table


def model_1t() -> ModelSpec:
    """The 1T-parameter GPT of Narayanan et al. SC'21 (Table 1): 128 layers, h=25600, 160 heads."""
    base = builtin_model("gpt3-175b")
    return replace(base, name="gpt-1t", hidden_size=25600, num_layers=128, num_heads=160, num_kv_heads=160,
                   ffn_hidden_size=4 * 25600, head_dim=0, vocab_size=51200, layers=())


TARGETS_S = {"gpt3-175b": 5.0, "gpt-1t": 20.0}  # by total seconds (module docstring)
CASES = [
    ("llama3-8b", "8xa100-80gb", 16, 8192),
    ("llama3-70b", "8x8xh100-80gb", 512, 8192),
    ("gpt3-175b", "128x8xa100-80gb", 1536, 2048),
    ("gpt-1t", "384x8xa100-80gb", 3072, 2048),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the two smaller cases")
    args = parser.parse_args()
    table = Table(title="plan speed (preset profiles)")
    for col in ("model", "cluster", "GBS", "seq", "candidates", "ILPs", "search s", "us/candidate", "total s",
                "plan", "iteration s", "MFU"):
        table.add_column(col, justify="right")
    totals: dict[str, float] = {}
    for name, cluster_text, gbs, seq in CASES[:2] if args.quick else CASES:
        start = time.perf_counter()
        model = model_1t() if name == "gpt-1t" else builtin_model(name)
        cluster = parse_cluster(cluster_text)
        profile = preset_profile(model, cluster)
        plan = find_plan(model, cluster, Constraints(global_batch_size=gbs, seq_len=seq), profile)
        total = time.perf_counter() - start
        totals[name] = total
        s, p = plan.search, plan.parallel
        ilps = s.solver.split("(")[1].split(" ILPs")[0] if "(" in s.solver else "?"
        desc = f"tp{p.tp} pp{p.pp} dp{p.dp}" + (f" cp{p.cp}" if p.cp > 1 else "") + (f" ep{p.ep}" if p.ep > 1 else "")
        desc += f" z{p.zero} {p.schedule}" + (f" v{p.virtual_stages}" if p.virtual_stages > 1 else "")
        desc += f" b{p.micro_batch_size}"
        table.add_row(name, cluster_text, str(gbs), str(seq), str(s.candidates), ilps, f"{s.seconds:.2f}",
                      f"{s.seconds / max(1, s.candidates) * 1e6:.0f}", f"{total:.2f}", desc,
                      f"{plan.predicted.iteration_time_s:.2f}", f"{plan.predicted.mfu:.1%}")
    console = Console(width=170)
    console.print(table)
    for line in target_lines(totals):
        console.print(line)


def target_lines(totals: dict[str, float]) -> list[str]:
    """One line per target: met, missed, or not run (--quick skips the large cases)."""
    lines = []
    for name, limit in TARGETS_S.items():
        case = next(c for c in CASES if c[0] == name)
        if name not in totals:
            lines.append(f"target {name} on {case[1]} < {limit:.0f} s: not run")
        else:
            verdict = "met" if totals[name] < limit else "MISSED"
            lines.append(f"target {name} on {case[1]} < {limit:.0f} s: {totals[name]:.2f} s, {verdict}")
    return lines


if __name__ == "__main__":
    main()
