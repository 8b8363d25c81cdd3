"""Human-readable summary of a plan for the terminal (rich)."""

from __future__ import annotations

from meshplan.planner.plan import Plan
from meshplan.planner.stage_split import SPLIT_WORDS
from rich.console import Console
from rich.table import Table
from rich.text import Text


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
    from meshplan.planner.cp_report import cp_lines, cp_tag
    from meshplan.planner.show_moe import ep_tag, moe_lines

    console = console or Console()
    p, pred = plan.parallel, plan.predicted
    console.print(
        f"[bold]{plan.model.name}[/] ({human_count(plan.model.num_parameters)} params) on "
        f"[bold]{plan.cluster.name}[/] ({plan.world_size} devices)"
    )
    console.print(
        f"mesh pp={p.pp} dp={p.dp}{cp_tag(p)}{ep_tag(p)} tp={p.tp}  zero={p.zero}  schedule={p.schedule}"
        + (f" v={p.virtual_stages}" if p.virtual_stages > 1 else "")
    )  # two lines: each fits an 80-column terminal
    console.print(
        f"micro-batch {p.micro_batch_size} x {p.num_micro_batches}  global batch {p.global_batch_size}"
        + f"  seq {p.seq_len}  recompute={p.recompute}  {p.dtype}" + ("+fp8" if p.fp8 != "none" else "")
    )
    for line in moe_lines(plan):  # experts per rank, EP groups (planner/show_moe.py)
        console.print(line)
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
        f"bubble {pred.bubble_fraction:.1%},\n  peak memory {human_bytes(pred.peak_memory_bytes)} of "
        + (f"{human_bytes(pred.usable_memory_bytes)} usable ({human_bytes(plan.cluster.device.memory_bytes)} "
           "device)" if pred.usable_memory_bytes else human_bytes(plan.cluster.device.memory_bytes))
        + f", MFU {pred.mfu:.1%}"
    )
    for line in exposed_lines(pred.exposed_communication_s, pred.iteration_time_s):
        console.print(line)
    for i, alt in enumerate(plan.alternatives, 1):
        a = alt.parallel
        # two lines, each within 80 columns: the time (and the planner's note), then the layout
        console.print(Text(f"  runner-up {i}: {alt.predicted.iteration_time_s * 1e3:.1f} ms"
                           + (f" ({alt.note})" if alt.note else "")))
        console.print(Text(f"    pp={a.pp} dp={a.dp}{cp_tag(a)} tp={a.tp} zero={a.zero} {a.schedule}"
                           + (f" v={a.virtual_stages}" if a.virtual_stages > 1 else "")
                           + f" b={a.micro_batch_size} m={a.num_micro_batches} recompute={a.recompute}"))
    if plan.placement is not None:
        console.print(f"placement: {' > '.join(plan.placement.order)}, outermost first (tp on the fastest links)")
    for line in cp_lines(plan) + list(getattr(plan, "cp_notes", [])):
        console.print(line)
    s = plan.search
    per = s.seconds / s.candidates * 1e6 if s.candidates else 0.0
    console.print(f"search: {s.candidates} candidates ({per:.0f} us each), {s.feasible} solved feasible, "
                  f"{s.seconds:.2f} s,\n  solver {s.solver}")
    if s.software == "meshplan":  # GPU presets' default: say how to cost another engine's run
        console.print("  costed as meshplan's executor runs it; for another engine's run:\n"
                      "  --software megatron, megatron-bridge or torchtitan")
    elif s.software:  # plan --software
        console.print(f"  costed as {s.software} runs it")
    if s.stage_split != "free":
        console.print(f"  stages: {SPLIT_WORDS[s.stage_split]} (--stage-split {s.stage_split})")


def exposed_lines(exposed: dict[str, float], iteration: float) -> list:
    """One line: the communication left on the critical path per term (plan JSON
    predicted.exposed_communication_s), largest first; nothing for plans written without it."""
    if not exposed:
        return []
    names = {"tp": "tensor", "pp": "pipeline P2P", "dp": "data-parallel grads", "fsdp_gather": "ZeRO-3 gathers",
             "cp": "context", "ep": "expert all-to-all"}
    parts = [f"{names.get(k, k)} {_seconds(v)}" for k, v in sorted(exposed.items(), key=lambda kv: -kv[1]) if v > 0]
    total = sum(exposed.values())
    share = f" ({total / iteration:.0%} of the iteration)" if iteration > 0 else ""
    return [Text(f"exposed communication {_seconds(total)}{share}: " + (", ".join(parts) or "none"))]


def _seconds(x: float) -> str:
    return f"{x:.2f} s" if x >= 1 else f"{x * 1e3:.1f} ms"
