"""Human-readable summary of a plan for the terminal (rich)."""

from __future__ import annotations

from meshplan.planner.plan import Plan
from rich.console import Console
from rich.table import Table


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def human_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


def print_plan(plan: Plan, console: Console | None = None) -> None:
    console = console or Console()
    p, pred = plan.parallel, plan.predicted
    console.print(
        f"[bold]{plan.model.name}[/] ({human_count(plan.model.num_parameters)} params) on "
        f"[bold]{plan.cluster.name}[/] ({plan.world_size} devices)"
    )
    console.print(
        f"mesh pp={p.pp} dp={p.dp} tp={p.tp}  zero={p.zero}  schedule={p.schedule}"
        + (f" v={p.virtual_stages}" if p.virtual_stages > 1 else "")
        + f"  micro-batch {p.micro_batch_size} x {p.num_micro_batches}  global batch {p.global_batch_size}"
        + f"  seq {p.seq_len}  recompute={p.recompute}  {p.dtype}"
    )
    table = Table(title="stages", show_lines=False)
    for col in ("stage", "pp rank", "layers", "recompute", "time/iter", "memory (rank)"):
        table.add_column(col, justify="right")
    for s in plan.stages:
        table.add_row(
            str(s.stage), str(s.pp_rank), f"[{s.layers[0]}, {s.layers[1]})", str(s.recompute_layers),
            f"{s.predicted_time_s.get('total', 0.0) * 1e3:.1f} ms",
            human_bytes(s.predicted_memory_bytes.get("total", 0)),
        )
    console.print(table)
    console.print(
        f"predicted: iteration {pred.iteration_time_s * 1e3:.1f} ms, {pred.tokens_per_s:,.0f} tokens/s, "
        f"bubble {pred.bubble_fraction:.1%}, peak memory {human_bytes(pred.peak_memory_bytes)} of "
        f"{human_bytes(plan.cluster.device.memory_bytes)}, MFU {pred.mfu:.1%}"
    )
    for i, alt in enumerate(plan.alternatives, 1):
        a = alt.parallel
        console.print(
            f"  runner-up {i}: pp={a.pp} dp={a.dp} tp={a.tp} zero={a.zero} {a.schedule} b={a.micro_batch_size} "
            f"m={a.num_micro_batches} recompute={a.recompute}: {alt.predicted.iteration_time_s * 1e3:.1f} ms"
            + (f" ({alt.note})" if alt.note else "")
        )
    if plan.placement is not None:
        console.print(f"placement: mesh order {' > '.join(plan.placement.order)} (outermost first; tp on the fastest "
                      "links)")
    s = plan.search
    per = s.seconds / s.candidates * 1e6 if s.candidates else 0.0
    console.print(f"search: {s.candidates} candidates ({per:.0f} us each), {s.feasible} solved feasible, "
                  f"{s.seconds:.2f} s, solver {s.solver}")
