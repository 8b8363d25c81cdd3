"""Collective timings over the ranks that exist, and the α-β fit per link class and operation.

time(op, M, n) = α·steps(op, n) + β·factor(op, n)·M (profile.collective_factors: ring algorithms).
For a fixed group size n this is a line in M, so a least-squares line over the message sizes gives
intercept = α·steps and slope = β·factor. Message sizes run from 4 KiB to 256 MiB by factors of 4.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from meshplan.profiler.compute import Stopwatch, median, spread
from meshplan.profiler.profile import LINK_OPS, LinkFit, _fit_line, collective_factors

KiB, MiB = 1024, 1024**2


def message_sizes(min_bytes: int = 4 * KiB, max_bytes: int = 256 * MiB) -> list[int]:
    sizes, m = [], min_bytes
    while m <= max_bytes:
        sizes.append(m)
        m *= 4
    return sizes


@dataclass
class LinkTiming:
    op: str
    group_size: int
    nbytes: int
    seconds: list[float]  # timed repeats


def fit_link(op: str, n: int, sizes: list[int], times: list[float], spreads: list[float] | None = None) -> LinkFit:
    """α, β for one op over a group of n ranks from (message bytes, median seconds) pairs."""
    steps, factor = collective_factors(op, n)
    intercept, slope = fit_relative([float(m) for m in sizes], times)
    fit = LinkFit(alpha_s=intercept / steps, beta_s_per_byte=slope / factor, measured_group_size=n)
    predicted = [intercept + slope * m for m in sizes]
    fit.fit_error = max(abs(p - t) / t for p, t in zip(predicted, times) if t > 0) if times else 0.0
    fit.spread = median(spreads) if spreads else 0.0
    return fit


def fit_relative(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """y = a + c·x with a, c >= 0 minimising the squared *relative* error Σ((a + c·x - y) / y)²: sizes span
    five orders of magnitude, and an unweighted fit would let the largest messages decide the latency."""
    w = [1.0 / (y * y) if y > 0 else 0.0 for y in ys]
    sw, swx, swy = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * y for wi, y in zip(w, ys))
    swxx = sum(wi * x * x for wi, x in zip(w, xs))
    swxy = sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    det = sw * swxx - swx * swx
    if sw > 0 and det > 0:
        c = (sw * swxy - swx * swy) / det
        a = (swy - c * swx) / sw
        if a >= 0 and c >= 0:
            return a, c
        if c < 0:  # times do not grow with size: pure latency
            return swy / sw, 0.0
        return 0.0, (swxy / swxx if swxx > 0 else 0.0)  # a < 0: through the origin
    return _fit_line(xs, ys)


def fit_timings(timings: list[LinkTiming]) -> dict[str, LinkFit]:
    by_op: dict[str, list[LinkTiming]] = {}
    for t in timings:
        by_op.setdefault(t.op, []).append(t)
    fits = {}
    for op, rows in by_op.items():
        rows.sort(key=lambda r: r.nbytes)
        fits[op] = fit_link(op, rows[0].group_size, [r.nbytes for r in rows], [median(r.seconds) for r in rows],
                            [spread(r.seconds) for r in rows])
    return fits


def _op_runner(op: str, nbytes: int, group: dist.ProcessGroup, ranks: list[int], device: torch.device,
               ) -> Callable[[], None]:
    """A closure running one collective of `nbytes` (the full tensor) over `group`."""
    n = len(ranks)
    rank = dist.get_rank()
    numel = max(n, nbytes // 4) // n * n  # fp32 elements, divisible by the group size
    if op == "all_reduce":
        buf = torch.ones(numel, device=device)
        return lambda: dist.all_reduce(buf, group=group)
    if op == "all_gather":
        out, inp = torch.empty(numel, device=device), torch.ones(numel // n, device=device)
        gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
        return lambda: gather(out, inp, group=group)
    if op == "reduce_scatter":
        out, inp = torch.empty(numel // n, device=device), torch.ones(numel, device=device)
        scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
        return lambda: scatter(out, inp, group=group)
    if op == "send_recv":
        buf = torch.ones(numel, device=device)
        a, b = ranks[0], ranks[1]
        if rank == a:
            return lambda: (dist.send(buf, b), dist.recv(buf, b))
        if rank == b:
            return lambda: (dist.recv(buf, a), dist.send(buf, a))
        return lambda: None
    raise ValueError(f"unknown collective {op!r}")


def time_ops(group: dist.ProcessGroup, ranks: list[int], device: torch.device, sizes: list[int],
             ops: tuple[str, ...] = LINK_OPS, budget_s: float = 0.5, max_repeats: int = 10,
             progress: Callable[[str], None] | None = None) -> list[LinkTiming]:
    """Time each op at each size on the ranks of `group` (every rank of the job must call this, those
    outside the group only take part in the barriers). Repeats adapt to the first pass's duration so
    that large messages do not dominate: at least 2, at most `max_repeats`, about `budget_s` each (a first
    pass longer than `budget_s` is kept as a sample instead of being a discarded warm-up).
    send/recv is timed as a ping-pong between the group's first two ranks and halved."""
    rank = dist.get_rank()
    member = rank in ranks
    watch = Stopwatch(device)
    out = []
    for op in ops:
        for nbytes in sizes:
            if progress is not None:
                progress(f"{op} {nbytes / MiB:g} MiB on {len(ranks)} ranks")
            run = _op_runner(op, nbytes, group, ranks, device) if member else (lambda: None)
            dist.barrier()
            _, first = watch.time(run)  # warm-up (connection setup, allocation)
            # every rank must agree on the repeat count: take rank ranks[0]'s choice
            repeats = max(2, min(max_repeats, int(budget_s / max(first, 1e-6))))
            choice = torch.tensor([repeats, int(first > budget_s)], dtype=torch.int64, device=device)
            dist.broadcast(choice, src=ranks[0])
            repeats, keep_first = (int(v) for v in choice.tolist())
            # a pass longer than the budget is dominated by the transfer, not by set-up: it counts as a sample
            seconds = [first / 2 if op == "send_recv" else first] if keep_first else []
            for _ in range(repeats - len(seconds)):
                dist.barrier()
                _, t = watch.time(run)
                seconds.append(t / 2 if op == "send_recv" else t)
            out.append(LinkTiming(op, len(ranks), nbytes, seconds))
            del run
    return out
