"""Draw a simulated pipeline Timeline: as text for the terminal (rich) and as a matplotlib PNG.

One row per pipeline rank; time runs left to right over one iteration. Compute is coloured by kind,
point-to-point transfers show on the receiving rank, and what is left blank is the bubble.
"""

from __future__ import annotations

from meshplan.planner.errors import InputError
from meshplan.planner.schedule import COMPUTE_KINDS, Event, Timeline
from rich.text import Text

GLYPH = {"forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W", "recompute": "R"}
STYLE = {"forward": "blue", "backward": "green", "backward_input": "green", "backward_weight": "cyan",
         "recompute": "magenta", "p2p": "yellow", "idle": "dim"}
COLOR = {"forward": "#4C72B0", "backward": "#55A868", "backward_input": "#55A868", "backward_weight": "#64B5CD",
         "recompute": "#8172B2", "p2p": "#DD8452"}
LABEL = {"forward": "forward", "backward": "backward", "backward_input": "backward (input grad)",
         "backward_weight": "backward (weight grad)", "recompute": "recompute", "p2p": "p2p transfer"}
IDLE, WAIT = "·", "~"


def _stages_of(timeline: Timeline, rank: int) -> list[int]:
    return sorted({a.stage for a in timeline.actions[rank]})


def text_rows(timeline: Timeline, width: int = 80) -> list[tuple[str, str]]:
    """(label, cells) per rank: each of `width` cells shows what covers most of its time slice —
    F/B/I/W/R compute, ~ waiting on an incoming transfer, · idle (the bubble)."""
    span = timeline.makespan or 1.0
    rows = []
    for r in range(timeline.pp):
        compute = sorted(timeline.rank_events(r, compute_only=True), key=lambda e: e.start)
        comm = [e for e in timeline.rank_events(r) if e.kind not in COMPUTE_KINDS]
        cells, first = [], 0
        for c in range(width):
            lo, hi = span * c / width, span * (c + 1) / width
            while first < len(compute) and compute[first].end <= lo:  # events on a rank never overlap
                first += 1
            best, best_overlap, busy = None, 0.0, 0.0
            for e in compute[first:]:
                if e.start >= hi:
                    break
                overlap = min(hi, e.end) - max(lo, e.start)
                busy += overlap
                if overlap > best_overlap:
                    best, best_overlap = e, overlap
            if best is not None and busy >= (hi - lo) / 2:  # a cell is busy when compute fills half of it
                cells.append(GLYPH[best.kind])
            elif any(min(hi, e.end) > max(lo, e.start) for e in comm):
                cells.append(WAIT)
            else:
                cells.append(IDLE)
        stages = ",".join(str(s) for s in _stages_of(timeline, r))
        rows.append((f"rank {r} (stage {stages})", "".join(cells)))
    return rows


def render_text(timeline: Timeline, width: int = 80) -> Text:
    """The timeline as styled rich Text (plain text when printed without colour)."""
    rows = text_rows(timeline, width)
    pad = max(len(label) for label, _ in rows)
    out = Text()
    kind_of = {v: k for k, v in GLYPH.items()}
    for label, cells in rows:
        out.append(f"{label:<{pad}} |")
        for ch in cells:
            out.append(ch, style=STYLE[kind_of[ch]] if ch in kind_of else STYLE["p2p" if ch == WAIT else "idle"])
        out.append("|\n")
    kinds = _kinds_present(timeline)
    legend = "  ".join(f"{GLYPH[k]} {LABEL[k]}" for k in kinds if k in GLYPH)
    out.append(f"{'':<{pad}}  {legend}  {WAIT} waiting on p2p  {IDLE} idle (bubble)\n")
    out.append(f"{'':<{pad}}  0 s {'─' * max(0, width - 14)} {timeline.makespan:.4g} s\n")
    return out


def _kinds_present(timeline: Timeline) -> list[str]:
    present = {e.kind for e in timeline.events}
    return [k for k in COMPUTE_KINDS if k in present]


def write_png(timeline: Timeline, path: str, title: str = "") -> None:
    """Gantt chart of one iteration: a row per rank, a bar per computation labelled with its micro-batch."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise InputError("--timeline: drawing a PNG needs matplotlib (pip install 'meshplan[plot]')") from None
    pp = timeline.pp
    fig = Figure(figsize=(12, 1.2 + 0.6 * pp), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    scale, unit = _time_unit(timeline.makespan)
    spans: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for e in timeline.events:  # one bar collection per (rank, kind): thousands of events stay fast
        kind = e.kind if e.kind in COMPUTE_KINDS else "p2p"
        spans.setdefault((e.rank, kind), []).append((e.start * scale, e.duration * scale))
    thin = len(timeline.events) > 2000
    for (rank, kind), bars in spans.items():
        y = pp - 1 - rank
        if kind == "p2p":
            ax.broken_barh(bars, (y - 0.45, 0.1), facecolors=COLOR["p2p"])
        else:
            ax.broken_barh(bars, (y - 0.4, 0.7), facecolors=COLOR[kind], edgecolors="white",
                           linewidth=0 if thin else 0.4)
    if len(timeline.events) <= 600:
        for e in timeline.events:
            if e.kind in COMPUTE_KINDS:
                _label(ax, e, pp - 1 - e.rank, scale, timeline)
    ax.set_yticks(range(pp))
    ax.set_yticklabels([f"rank {r}" for r in reversed(range(pp))])
    ax.set_xlim(0, timeline.makespan * scale * 1.01 or 1)
    ax.set_ylim(-0.6, pp - 0.4)
    ax.set_xlabel(f"time ({unit})")
    head = title or f"{timeline.schedule}, pp={pp}, v={timeline.virtual_stages}, m={timeline.num_micro_batches}"
    ax.set_title(f"{head}: iteration {timeline.makespan * scale:.3g} {unit}, bubble {timeline.bubble_fraction:.1%}")
    kinds = _kinds_present(timeline) + (["p2p"] if any(e.kind not in COMPUTE_KINDS for e in timeline.events) else [])
    fig.legend(handles=[Patch(color=COLOR[k], label=LABEL[k]) for k in kinds], loc="lower center",
               ncol=len(kinds), frameon=False, fontsize=8)
    fig.tight_layout(rect=(0, 0.45 / fig.get_figheight(), 1, 1))
    try:
        fig.savefig(path)
    except OSError as exc:
        raise InputError(f"--timeline: cannot write '{path}': {exc.strerror}") from None


def _label(ax, e: Event, y: float, scale: float, timeline: Timeline) -> None:
    """Micro-batch number inside a bar when it is wide enough to read."""
    if e.duration * scale > timeline.makespan * scale / 60 and e.kind != "recompute":
        ax.text((e.start + e.duration / 2) * scale, y - 0.05, str(e.micro_batch), ha="center", va="center",
                fontsize=6, color="white")


def _time_unit(seconds: float) -> tuple[float, str]:
    if seconds >= 1:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "µs"
