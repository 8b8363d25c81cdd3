"""What the planner's output says about context parallelism: the CP group and where it lands, the
exposed CP communication, which engines run the mode, and why the search chose this CP degree."""

from __future__ import annotations

import math

from meshplan.planner.export_cp import engines_line
from meshplan.planner.plan import ParallelConfig, Plan
from meshplan.planner.report import human_bytes


def cp_tag(p: ParallelConfig) -> str:
    """' cp=4 (ring)' for a mesh line, '' without CP."""
    return f" cp={p.cp} ({p.cp_mode})" if p.cp > 1 else ""


def _secs(s: float) -> str:
    return f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.3g} ms"


def cp_group_text(plan: Plan) -> str:
    """The first CP group's devices and whether CP groups stay inside a node."""
    p, c = plan.parallel, plan.cluster
    if plan.placement is not None:
        group = [int(r) for r in [row[0] for row in plan.placement.ranks[0][0]]]
        groups = [[int(x[0]) for x in dp_row] for pp_row in plan.placement.ranks for dp_row in pp_row]
    else:  # row-major [pp, dp, cp, tp]
        group = [k * p.tp for k in range(p.cp)]
        groups = [[(g * p.cp + k) * p.tp for k in range(p.cp)] for g in range(p.pp * p.dp)]
    inside = all(len({c.node_of(r) for r in g}) == 1 for g in groups)
    where = "each inside one node" if inside else "spanning nodes"
    return f"CP groups of {p.cp} ranks {where} (first: devices {group}, with their tp peers)"


def cp_lines(plan: Plan) -> list[str]:
    """Lines for `plan` and `plan show` on a plan with cp > 1 (none otherwise)."""
    p = plan.parallel
    if p.cp == 1:
        return []
    exposed = plan.predicted.exposed_communication_s.get("cp")
    comm = {"ring": f"ring: {p.cp - 1} KV exchanges per layer, overlapped with attention blocks",
            "all-gather": "all-gather: K and V gathered before each layer's attention, dK and dV "
                          "reduce-scattered after it, exposed",
            "all-to-all": "all-to-all: 4 all-to-alls per layer forward and backward"}[p.cp_mode]
    lines = [f"context parallelism: cp={p.cp} ({comm}); {p.seq_len // p.cp} of {p.seq_len} tokens per rank, "
             f"activations and loss / {p.cp}",
             f"  {cp_group_text(plan)}"
             + (f"; exposed CP communication {_secs(exposed)} per iteration" if exposed is not None else "")]
    lines.append("  " + engines_line(plan))
    return lines


def cp_choice_notes(search, plan: Plan) -> list[str]:
    """Why this CP degree: per CP degree the search enumerated, the best time it solved for it, else the least
    lower bound of its candidates (the sharper one where the search computed it), never below the chosen
    plan: the search left them because their bounds could not enter the ranking. Or that nothing fits.
    Empty when only one degree was enumerated."""
    per: dict[int, list] = {}
    for bound, memory, cand in search.bounds_seen:
        bound = math.inf if bound is None else max(bound, search.refined_bounds.get(cand, bound))
        per.setdefault(cand.cp, []).append((bound, memory, search.limit(cand), cand))
    if len(per) <= 1:
        return []
    best: dict[int, float] = {}
    for cand, seconds in search.ranked_times.items():
        best[cand.cp] = min(best.get(cand.cp, math.inf), seconds)
    unsolvable = {cand for flag, _, cand in search.memory_pruned if flag is not None}  # no partition fits
    chosen, chosen_s = plan.parallel.cp, plan.predicted.iteration_time_s
    parts = []
    for cp in sorted(per):
        rows = per[cp]
        fits = [(b, c) for b, m, limit, c in rows if m <= limit * (1 + 1e-9)]
        left = [b for b, c in fits if c not in unsolvable]
        if cp == chosen:
            parts.append(f"cp={cp}: chosen, {_secs(chosen_s)}")
        elif cp in best:
            parts.append(f"cp={cp}: best {_secs(best[cp])}")
        elif left:
            parts.append(f"cp={cp}: >= {_secs(max(min(left), chosen_s))}")
        elif fits:
            parts.append(f"cp={cp}: none fits (no stage partition within memory)")
        else:
            _, need, usable, _ = min(rows, key=lambda row: row[1] - row[2])
            parts.append(f"cp={cp}: none fits (least {human_bytes(need)} > {human_bytes(usable)} usable)")
    return ["context parallelism weighed (" + "; ".join(parts) + ")"]
