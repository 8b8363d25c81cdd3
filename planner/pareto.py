"""Predicted time vs memory of the candidates the planner considered, with the chosen plan marked.

`write_pareto` takes (predicted_time_s, peak_memory_bytes, label) tuples so the search can hand over
whatever it enumerated; `plan_candidates` rebuilds them from a saved plan (chosen + alternatives).
"""

from __future__ import annotations

from collections.abc import Sequence

from meshplan.planner.errors import InputError
from meshplan.planner.plan import Plan

Candidate = tuple[float, float, str]
GIB = 1024**3


def pareto_front(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Candidates no other candidate beats on both time and memory, fastest first."""
    front: list[Candidate] = []
    for c in sorted(candidates, key=lambda c: (c[0], c[1])):
        if not front or c[1] < front[-1][1]:
            front.append(c)
    return front


def plan_candidates(plan: Plan) -> tuple[list[Candidate], Candidate]:
    """The chosen plan and its alternatives as candidates (what a saved plan still knows)."""
    def label(p) -> str:
        return f"pp{p.pp} dp{p.dp} tp{p.tp} z{p.zero} {p.schedule} b{p.micro_batch_size} {p.recompute}"

    chosen = (plan.predicted.iteration_time_s, plan.predicted.peak_memory_bytes, label(plan.parallel))
    alts = [(a.predicted.iteration_time_s, a.predicted.peak_memory_bytes, label(a.parallel))
            for a in plan.alternatives]
    return [chosen, *alts], chosen


def write_pareto(candidates: Sequence[Candidate], chosen: Candidate, path: str,
                 capacity_bytes: float | None = None, title: str = "") -> None:
    """Scatter of predicted iteration time against peak memory per device; the Pareto front as a line,
    the chosen candidate as a red star, the device capacity (if given) as a dashed line."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise InputError("--pareto: drawing a PNG needs matplotlib (pip install 'meshplan[plot]')") from None
    if not candidates:
        raise InputError("--pareto: no candidates to draw")
    fig = Figure(figsize=(8, 5.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.scatter([c[0] for c in candidates], [c[1] / GIB for c in candidates], s=14, color="#8c8c8c",
               alpha=0.6, label=f"candidates ({len(candidates)})")
    front = pareto_front(candidates)
    ax.plot([c[0] for c in front], [c[1] / GIB for c in front], "-o", color="#4C72B0", markersize=4,
            label="Pareto front")
    ax.scatter([chosen[0]], [chosen[1] / GIB], marker="*", s=220, color="#C44E52", zorder=5,
               label=f"chosen: {chosen[2]}")
    if capacity_bytes:
        ax.axhline(capacity_bytes / GIB, linestyle="--", color="#C44E52", linewidth=1, label="device memory")
    ax.set_xlabel("predicted iteration time (s)")
    ax.set_ylabel("predicted peak memory per device (GiB)")
    ax.set_title(title or "candidates: time vs memory")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as exc:
        raise InputError(f"--pareto: cannot write '{path}': {exc.strerror}") from None
