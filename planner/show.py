"""`plan show PLAN.json`: what a plan does and why, so a user can decide whether to trust it.

Prints the mesh and placement, each stage's layers, predicted time and memory against the device's
capacity, the prediction (iteration, tokens/s, bubble, MFU), the pipeline timeline of one iteration
simulated from the stages' own times (planner/schedule.py), and why each runner-up lost.
"""

from __future__ import annotations

import argparse
import io
import shutil
from collections.abc import Sequence

from meshplan.planner.cli import _Parser
from meshplan.planner.cp_report import cp_lines, cp_tag
from meshplan.planner.errors import InputError
from meshplan.planner.model_spec import ModelSpec
from meshplan.planner.plan import Alternative, ParallelConfig, Plan, load_plan
from meshplan.planner.report import exposed_lines, human_bytes, human_count
from meshplan.planner.schedule import Timeline, plan_timeline
from meshplan.planner.show_moe import moe_lines
from meshplan.planner.timeline import render_text, write_png
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

BAR_WIDTH = 8


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="plan show", description="Human summary of a plan: placement, per-stage time and memory, "
                "pipeline timeline and why the runner-up plans lost.")
    p.add_argument("plan", metavar="PLAN.json", help="a plan written by `plan MODEL ... -o PLAN.json`")
    p.add_argument("--timeline", metavar="OUT.png", help="also draw the pipeline timeline as a PNG (matplotlib)")
    p.add_argument("--pareto", metavar="OUT.png",
                   help="also draw predicted time vs memory of the chosen plan and its runner-ups")
    p.add_argument("--width", type=int, metavar="COLS", help="text width (default: the terminal's, 80..160)")
    return p


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(list(argv))
    plan = load_plan(args.plan)
    width = args.width or min(160, max(80, shutil.get_terminal_size((100, 24)).columns))
    if width < 60:
        raise InputError(f"--width: expected at least 60 columns, got {width}")
    timeline = _timeline(plan)
    if args.timeline and timeline is None:
        raise InputError("--timeline: the plan's stages carry no forward/backward times to draw a timeline from")
    console = Console(width=width, highlight=False)
    for part in summary(plan, timeline, width):
        console.print(part)
    if args.timeline:
        write_png(timeline, args.timeline, title=_title(plan))
        print(f"timeline written to {args.timeline}")
    if args.pareto:
        from meshplan.planner.pareto import plan_candidates, write_pareto

        candidates, chosen = plan_candidates(plan)
        write_pareto(candidates, chosen, args.pareto, capacity_bytes=plan.cluster.device.memory_bytes,
                     title=_title(plan))
        print(f"time vs memory written to {args.pareto}")
    return 0


def _timeline(plan: Plan) -> Timeline | None:
    """The simulated iteration, or None when the plan's stages carry no times or the schedule cannot
    be simulated (the summary then says so instead of drawing)."""
    if not any(s.predicted_time_s.get(k, 0.0) for s in plan.stages for k in ("forward", "backward")):
        return None
    try:
        return plan_timeline(plan)
    except ValueError:
        return None


def _title(plan: Plan) -> str:
    return f"{plan.model.name} on {plan.cluster.name}"


def render(plan: Plan, timeline: Timeline | None = None, width: int = 100) -> str:
    """The whole summary as plain text (what `plan show` prints, without colour)."""
    timeline = timeline or _timeline(plan)
    buf = io.StringIO()
    console = Console(file=buf, width=width, color_system=None, highlight=False, force_terminal=False)
    for part in summary(plan, timeline, width):
        console.print(part)
    return buf.getvalue()


def summary(plan: Plan, timeline: Timeline | None, width: int) -> list:
    p, pred, dev = plan.parallel, plan.predicted, plan.cluster.device
    cap = dev.memory_bytes
    out: list = [
        Text(f"{plan.model.name} ({human_count(plan.model.num_parameters)} parameters, "
             f"{len(plan.model.layers)} layers) on {plan.cluster.name}: {plan.world_size} of "
             f"{plan.cluster.world_size} devices ({dev.type}, {human_bytes(cap)} each)", style="bold"),
        Text(f"mesh [pp, dp, tp] = [{p.pp}, {p.dp}, {p.tp}]: {_placement(plan)}" if p.cp == 1 else
             f"mesh [pp, dp, cp, tp] = [{p.pp}, {p.dp}, {p.cp}, {p.tp}]: {_placement(plan)}"),
        Text(f"{describe_parallel(p)}; global batch {p.global_batch_size} x {p.seq_len} tokens = "
             f"dp {p.dp} x micro-batch {p.micro_batch_size} x {p.num_micro_batches} micro-batches"),
        *moe_lines(plan),
        Text(""),
        _stage_table(plan, cap, width),
        Text(f"predicted: iteration {_secs(pred.iteration_time_s)}, {pred.tokens_per_s:,.0f} tokens/s, "
             f"MFU {pred.mfu:.1%}, bubble {pred.bubble_fraction:.1%}"
             + (f" (timeline below: {timeline.bubble_fraction:.1%})" if timeline else "")
             + f", peak memory {human_bytes(pred.peak_memory_bytes)} of {human_bytes(cap)} "
             f"({pred.peak_memory_bytes / cap:.0%}"
             + (f"; {human_bytes(pred.usable_memory_bytes)} usable" if pred.usable_memory_bytes else "") + ")"),
        *exposed_lines(pred.exposed_communication_s, pred.iteration_time_s),
        *[Text(line) for line in cp_lines(plan)],
        Text(""),
    ]
    if timeline is None:
        out.append(Text("no pipeline timeline: the stages carry no forward/backward times, or the schedule "
                        "cannot be simulated"))
    else:
        out.append(Text(f"pipeline timeline of one iteration ({p.schedule}, {p.num_micro_batches} micro-batches, "
                        f"simulated from the stage times: {_secs(timeline.makespan)})", style="bold"))
        label_width = max(len(f"rank {r} (stage {','.join('0' * 3 for _ in range(p.virtual_stages))})")
                          for r in range(p.pp))
        out.append(render_text(timeline, width=max(20, width - label_width - 6)))
    out += why_not(plan)
    s = plan.search
    if s.candidates or s.solver:
        out.append(Text(f"search: {s.candidates} candidates, {s.feasible} feasible, {s.seconds:.2f} s"
                        + (f", solver {s.solver}" if s.solver else "")
                        + (f"; costed as {s.software} runs it (GPU presets)" if s.software else "")
                        + (f"; stages split {s.stage_split}" if s.stage_split != "free" else "")))
    return out


def describe_parallel(p: ParallelConfig) -> str:
    parts = [f"ZeRO-{p.zero}", f"schedule {p.schedule}" + (f" (v={p.virtual_stages})" if p.virtual_stages > 1 else ""),
             f"recompute {p.recompute}", p.dtype + (f" with FP8 Linears ({p.fp8} scaling)" if p.fp8 != "none" else "")]
    if p.sequence_parallel:
        parts.append("sequence parallel")
    return ", ".join(parts)


def _placement(plan: Plan) -> str:
    """Where the mesh lands: rank = (pp_rank x dp + dp_rank) x tp + tp_rank, as the executor builds it."""
    p, c = plan.parallel, plan.cluster
    block = p.dp * p.cp * p.tp
    text = f"pp rank i holds devices [{block}i, {block}i+{block})" if p.pp > 1 else f"devices 0-{block - 1}"
    if c.num_nodes > 1:
        nodes = {c.node_of(r) for r in range(plan.world_size)}
        text += f" on {len(nodes)} of {c.num_nodes} nodes"
    if p.tp > 1:
        inside = c.devices_per_node % p.tp == 0
        text += f"; tp groups of {p.tp} {'stay inside a node' if inside else 'cross nodes'}"
    return text


def layer_span(model: ModelSpec, start: int, end: int) -> str:
    """'embedding + blocks 0-6', 'blocks 7-15 + head' for the half-open layer range [start, end)."""
    layers = model.layers[start:end]
    blocks = [int(layer.name.split(".")[-1]) for layer in layers if layer.kind == "block"]
    parts = []
    if layers and layers[0].kind == "embedding":
        parts.append("embedding")
    if blocks:
        parts.append(f"block {blocks[0]}" if len(blocks) == 1 else f"blocks {blocks[0]}-{blocks[-1]}")
    if layers and layers[-1].kind == "head":
        parts.append("head")
    return " + ".join(parts)


def _bar(used: float, capacity: float) -> str:
    frac = used / capacity if capacity else 0.0
    filled = min(BAR_WIDTH, round(frac * BAR_WIDTH))
    return "█" * filled + "░" * (BAR_WIDTH - filled) + ("!" if frac > 1 else " ") + f"{frac:>4.0%}"


def _stage_table(plan: Plan, capacity: float, width: int = 120) -> Table:
    """One row per stage; the rank column only when ranks hold several stages, ckpt only with recompute;
    the memory bar only where it fits (width ≥ 100), so that 80 columns show every number."""
    with_rank = plan.parallel.virtual_stages > 1
    with_ckpt = any(s.recompute_layers for s in plan.stages)
    longest = max((s.predicted_time_s.get("total", 0.0) for s in plan.stages), default=0.0)
    scale, unit = (1.0, "s") if longest >= 10 else (1e3, "ms")
    table = Table(title=f"stages: predicted {unit} per iteration, memory per device"
                  + (" (ckpt = layers recomputed)" if with_ckpt else ""),
                  box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 0), title_justify="left")
    cols = ["stage"] + (["rank"] if with_rank else []) + ["layers"] + (["ckpt"] if with_ckpt else []) \
        + ["fwd", "bwd", "recomp" if width >= 100 else "rec", "comm", "total",
           f"memory of {human_bytes(capacity)}" if width >= 100 else "memory"]
    for col in cols:
        table.add_column(col, justify="left" if col == "layers" else "right", no_wrap=True)
    for s in plan.stages:
        t, mem = s.predicted_time_s, s.predicted_memory_bytes.get("total", 0.0)
        row = [str(s.stage)] + ([str(s.pp_rank)] if with_rank else []) + [layer_span(plan.model, *s.layers)] \
            + ([str(s.recompute_layers)] if with_ckpt else []) \
            + [f"{t.get(k, 0.0) * scale:.4g}" for k in ("forward", "backward", "recompute", "communication", "total")]
        shown = f"{human_bytes(mem)} {_bar(mem, capacity)}" if width >= 100 else \
            f"{human_bytes(mem)} {mem / capacity:.0%}"
        table.add_row(*row, Text(shown, style="red" if mem > capacity else ""))
    return table


def why_not(plan: Plan) -> list[Text]:
    """One line per runner-up: slower by how much, or over memory by how much, plus the planner's note."""
    if not plan.alternatives:
        return [Text("no runner-up plans recorded")]
    lines = [Text("why not the runner-ups", style="bold")]
    for i, alt in enumerate(plan.alternatives, 1):
        lines.append(Text(f"  {i}. {_short(alt.parallel)}: {_verdict(plan, alt)}"
                          + (f" — {alt.note}" if alt.note else "")))
    return lines


def _short(p: ParallelConfig) -> str:
    return (f"pp={p.pp} dp={p.dp}{cp_tag(p)} tp={p.tp} zero={p.zero} {p.schedule}"
            + (f" v={p.virtual_stages}" if p.virtual_stages > 1 else "")
            + f" b={p.micro_batch_size} m={p.num_micro_batches} recompute={p.recompute}")


def _verdict(plan: Plan, alt: Alternative) -> str:
    cap = plan.cluster.device.memory_bytes
    mine, theirs = plan.predicted, alt.predicted
    if theirs.peak_memory_bytes > cap:
        return (f"does not fit: peak {human_bytes(theirs.peak_memory_bytes)} > {human_bytes(cap)} device memory "
                f"(over by {human_bytes(theirs.peak_memory_bytes - cap)})")
    mem = theirs.peak_memory_bytes - mine.peak_memory_bytes
    mem_txt = f"{human_bytes(abs(mem))} {'more' if mem > 0 else 'less'} memory" if mem else "same memory"
    if mine.iteration_time_s <= 0:
        return f"{_secs(theirs.iteration_time_s)} per iteration, {mem_txt}"
    ratio = theirs.iteration_time_s / mine.iteration_time_s - 1
    if ratio > 0:
        speed = f"{ratio:.1%} slower ({_secs(theirs.iteration_time_s)} vs {_secs(mine.iteration_time_s)})"
    elif ratio < 0:
        speed = f"{-ratio:.1%} faster ({_secs(theirs.iteration_time_s)}) but not chosen"
    else:
        speed = f"as fast ({_secs(theirs.iteration_time_s)})"
    return f"{speed}, {mem_txt}"


def _secs(s: float) -> str:
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    if s > 0:
        return f"{s * 1e6:.3g} µs"
    return "0"
