"""Pipeline terms: point-to-point transfers and the engine's per-crossing cost, the bubble of each
schedule, and the micro-batches a rank holds in flight at each moment of its step."""

from __future__ import annotations

import functools

from meshplan.profiler.analytic import DTYPE_BYTES


def pp_comm_time(profile, b: int, s: int, h: int, tp: int, dtype: str, sequence_parallel: bool,
                 link_class: str) -> float:
    """One boundary per micro-batch: a stage sends its output forward and its input gradient backward,
    b·s·h values each (÷tp when sequence-parallel activations stay sharded), Narayanan et al. SC'21 §3.2.
    Returned per side of a boundary: each stage pays it once per neighbour; with a blocking pipeline engine
    (profiler/roofline.P2P) both transfers, whole."""
    r = getattr(profile, "roofline", None)
    blocking = r is not None and r.p2p == "blocking"
    nbytes = b * s * h * DTYPE_BYTES[dtype] / (tp if sequence_parallel and not blocking else 1)
    one = profile.collective_time("send_recv", nbytes, 2, link_class) * profile.correction("pp_comm")
    return 2 * one if blocking else one


def pipeline_stage_time(profile, hop: float, crossings: int, schedule: str, unfused: float = 0.0,
                        b: int | None = None) -> float:
    """Per stage and micro-batch: the pipeline's cost for a stage with `crossings` neighbours on other
    ranks. Measured in situ per schedule and crossing (torch.distributed.pipelining's bookkeeping, P2P
    and waits; zero-bubble's extra actions), else the link fit's `hop` per neighbour. 1F1B's figure is
    its steady state; the `unfused` share of its micro-batches pays GPipe's (see `unfused_share`). `b`:
    the micro-batch size, whose message the P2P carries."""
    overhead = profile.pipeline_overhead(schedule, b)
    if schedule == "1f1b" and unfused > 0:
        overhead = (1 - unfused) * overhead + unfused * profile.pipeline_overhead("gpipe", b)
    if overhead > 0:
        return overhead * profile.correction("pp_comm") * crossings
    return hop * crossings


def pipeline_busy_wait(profile, schedule: str, unfused: float = 0.0, b: int | None = None) -> tuple[float, float]:
    """Per crossing and micro-batch, (the rank's own work, the wait on the hop) within 1F1B's in-situ
    figure, for the shared-core simulation; (0, 0) for other schedules or unmeasured profiles (their
    figure is all the rank's work). In the in-situ pairs GPipe streams its micro-batches, so its figure
    is one side's bookkeeping per micro-batch; 1F1B's steady state alternates forward and backward, so
    each micro-batch waits a round trip with both sides' bookkeeping in series. A 1F1B crossing is then
    GPipe's work on each side and, on the hops, its figure beyond twice GPipe's: that part is waiting, not
    work, and the simulation waits there only where the real order makes it wait."""
    if schedule != "1f1b":
        return 0.0, 0.0
    gpipe, steady = profile.pipeline_overhead("gpipe", b), profile.pipeline_overhead("1f1b", b)
    if gpipe <= 0 or steady <= 0:
        return 0.0, 0.0
    corr = profile.correction("pp_comm")
    return gpipe * corr, (1 - unfused) * max(0.0, steady - 2 * gpipe) * corr


def pipeline_stage_split(profile, hop: float, crossings: int, schedule: str, unfused: float = 0.0,
                         b: int | None = None) -> tuple[float, float, float]:
    """(`pipeline_stage_time`, the part of it that is not the stage's own work in the shared-core
    simulation, the wait per crossing it puts on the hops instead): the one rule for build_problem's
    boundaries and Search.bounds' sums."""
    t = pipeline_stage_time(profile, hop, crossings, schedule, unfused, b)
    busy, wait = pipeline_busy_wait(profile, schedule, unfused, b)
    return t, (max(0.0, t - busy * crossings) if busy > 0 else 0.0), wait


def unfused_share(schedule: str, pp: int, m: int, rank: int) -> float:
    """Share of a 1F1B rank's micro-batches outside the steady state. Schedule1F1B fuses each backward's
    send with the next forward's receive (and the reverse) only in its 1B1F phase; the min(m, pp − rank)
    warm-up forwards and their cool-down backwards send and receive one by one, as GPipe does
    (torch/distributed/pipelining/schedules.py). With m ≤ pp − rank the whole step is GPipe's."""
    if schedule != "1f1b" or m < 1:
        return 0.0
    return min(m, pp - rank) / m


def split_backward_factor(profile, schedule: str, b: int) -> float:
    """Zero-bubble schedules split every backward into input- and weight-grad passes; what that costs
    over the whole backward, measured on the cut model (1 for other schedules or when not measured)."""
    return profile.split_backward_factor(b) if schedule == "zero-bubble" else 1.0


def bubble_micro_batches(schedule: str, pp: int, v: int, zb_ratio: float) -> float:
    """Idle time of the bottleneck rank, in micro-batch times: (p−1) for GPipe and 1F1B (Huang et al.
    2019; Narayanan et al. SC'21), (p−1)/v interleaved (Narayanan et al. SC'21 §2.2), and for zero-bubble
    the ZB-H1 bubble (p−1)·(T_F + T_B − T_W)/(T_F + T_B + T_W) (Qi et al. 2023, §3), ≈ (p−1)/3 when the
    backward splits evenly into input gradient B and weight gradient W."""
    if pp <= 1:
        return 0.0
    if schedule in ("gpipe", "1f1b"):
        return float(pp - 1)
    if schedule == "interleaved-1f1b":
        return (pp - 1) / v
    if schedule == "zero-bubble":
        return (pp - 1) * zb_ratio
    raise ValueError(f"unknown schedule {schedule!r}")


def zb_ratio(forward: float, backward: float) -> float:
    """(T_F + T_B − T_W)/(T_F + T_B + T_W) with B = W = backward/2 (Qi et al. 2023, Table 1)."""
    total = forward + backward
    return forward / total if total > 0 else 1.0 / 3.0


def in_flight(schedule: str, pp: int, v: int, m: int, rank: int) -> float:
    """Micro-batches of a rank's layers whose activations are alive at the peak, as a multiple of one
    micro-batch of all the rank's layers.
    GPipe: all m (Huang et al. 2019). 1F1B: pp − rank (Narayanan et al. SC'21 §2.2). Interleaved:
    Megatron-LM's warm-up 2·(pp − rank − 1) + (v − 1)·pp + 1 chunk micro-batches spread over v chunks
    (= pp·(1 + (pp−1)/(pp·v)) on rank 0, Korthikanti et al. 2022 §4.2.3). Zero-bubble V (ZB-V): pp
    micro-batches on every rank, the 1F1B peak (Qi et al. 2023, §4)."""
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(pp - rank, m))
    if schedule == "interleaved-1f1b":
        return min(2 * (pp - rank - 1) + (v - 1) * pp + 1, m * v) / v
    if schedule == "zero-bubble":
        return float(min(pp, m))
    raise ValueError(f"unknown schedule {schedule!r}")


def _walk(schedule: str, pp: int, v: int, m: int, rank: int) -> tuple[tuple[tuple[float, float], ...], float]:
    if schedule != "zero-bubble":
        return _looped_moments(schedule, pp, v, m, rank)
    # From 2·pp micro-batches on, ZB-V's warm-up and both chunks' first backwards are the same and only
    # the steady phase grows, which neither raises the activations nor allocates gradients: walk at most
    # 4·pp (tests/test_cost_model.py checks the walks agree), not the thousands a large batch has
    return _walks(schedule, pp, v, min(m, 4 * pp))[rank]


def _looped_moments(schedule: str, pp: int, v: int, m: int, rank: int
                    ) -> tuple[tuple[tuple[float, float], ...], float]:
    """`_walks` in closed form for GPipe, 1F1B and interleaved 1F1B (tests check it against the walk).
    Before backward k the rank holds its peak N chunk micro-batches through the steady phase (S backwards),
    then one fewer per backward; backwards run chunk v−1 for a round of g micro-batches, then chunk v−2, …
    (ScheduleInterleaved1F1B's rounds, g = m // max(1, m // pp)). Chunk j's gradients appear at
    backward j·g, so the most activations seen with j + 1 chunks' gradients are those before backward
    j·g + 1 (or after j·g when it is the last)."""
    v = v if schedule == "interleaved-1f1b" else 1
    chunks, peak = m * v, round(in_flight(schedule, pp, v, m, rank) * v)
    steady = chunks - peak + 1
    group = m // max(1, m // pp) if v > 1 else m

    def alive(k: int) -> int:
        return peak - max(0, k - steady + 1)
    front = [(float(peak), 0.0)]
    for j in range(v):
        k = j * group
        n = alive(k + 1) if k + 1 < chunks else alive(k) - 1
        if n == front[-1][0]:
            front[-1] = (float(n), (j + 1) / v)
        else:
            front.append((float(n), (j + 1) / v))
    emb = alive((v - 1) * group) - 1
    return tuple((n / v, share) for n, share in front), emb / v


@functools.lru_cache(maxsize=1024)
def _walks(schedule: str, pp: int, v: int, m: int) -> list[tuple[tuple[tuple[float, float], ...], float]]:
    """Walk the rank's actions as torch.distributed.pipelining orders them (planner/schedule.rank_actions):
    a forward adds a chunk micro-batch of activations; the pass that ends a micro-batch's backward on a
    chunk (B; W under zero-bubble, whose input-grad I leaves the saved inputs for W) frees it, and the
    first such pass of a chunk allocates that chunk's gradients. Returns the Pareto front of (chunk
    micro-batches alive, gradient share) at the start and end of every freeing pass, most activations
    first, and the activations left after the first freeing pass of the rank's first chunk (the stage
    with the embedding on rank 0)."""
    from meshplan.planner.schedule import rank_actions  # schedule imports the plan types, not this module

    v = v if schedule in ("interleaved-1f1b", "zero-bubble") else 1
    frees = "W" if schedule == "zero-bubble" else "B"
    out = []
    for rank, order in enumerate(rank_actions(schedule, pp, v, m)):
        n, done, points, emb = 0, set(), [], None
        for act in order:
            if act.kind == "F":
                n += 1
            elif act.kind == frees:
                points.append((n, len(done) / v))
                done.add(act.stage)
                n -= 1
                points.append((n, len(done) / v))
                if emb is None and act.stage == rank:
                    emb = n
        front: list[tuple[float, float]] = []
        for k, share in sorted(set(points), key=lambda p: (-p[0], -p[1])):
            if not front or share > front[-1][1]:
                front.append((k / v, share))
        out.append((tuple(front), (emb or 0) / v))
    return out


@functools.lru_cache(maxsize=65536)
def grad_moments(schedule: str, pp: int, v: int, m: int, rank: int) -> tuple[tuple[float, float], ...]:
    """The moments of a rank's step that can set its peak, as (activations alive in `in_flight` units,
    share of the rank's gradients allocated), the activation peak first, dominated moments dropped. The
    executor frees gradients at every step (zero_grad(set_to_none=True)); a chunk's gradients appear with
    its first backward, which also frees that micro-batch's activations (`_walk`). The peak is
    `in_flight`'s (the walk's can be lower: ZB-V with m < 2pp − 1)."""
    front, _ = _walk(schedule, pp, v, m, rank)
    return ((in_flight(schedule, pp, v, m, rank), front[0][1]), *front[1:])


def emb_in_flight(schedule: str, pp: int, v: int, m: int, rank: int) -> float:
    """Activations alive (`in_flight` units) when the rank's first chunk ends its first backward (on rank
    0: the embedding's), every gradient of the rank allocated by then in every schedule: one micro-batch
    below the peak for 1F1B and GPipe."""
    return _walk(schedule, pp, v, m, rank)[1]
