"""Forward and backward time per layer kind, micro-batch size, sequence length and TP degree.

GPU: CUDA events around each pass and a synchronize before reading them; CPU: the monotonic
perf_counter. Each point gets warm-up passes, then `repeats` timed passes; the sample keeps their typical
time (`typical`: the mean on CPU, the median on GPU) and the spread (p90 - p10) / median so that the
planner (and the user) can see how noisy it was.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from meshplan.planner.model_spec import ModelSpec
from meshplan.profiler.layers import build_case, build_tp_case, forward
from meshplan.profiler.profile import ComputeSample


@dataclass
class TimingConfig:
    """`repeats` timed passes at least; cheap points keep going (up to `max_repeats`) while their timed
    passes total less than `budget_s`, so that their typical time covers many scheduler time slices."""

    # Fewer warm-up and timed passes leave small CPU samples non-monotonic in the micro-batch size (first-touch
    # allocation and kernel selection land in the timed passes); 10 and 15 give monotonic samples.
    warmup: int = 10
    repeats: int = 15
    max_repeats: int = 25
    budget_s: float = 0.2


class Stopwatch:
    """Elapsed seconds of a region: CUDA events on GPU (the host only enqueues kernels), perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def time(self, fn: Callable[[], object]) -> tuple[object, float]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize()
            return out, start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0


def typical_time(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int,
                 between: Callable[[], object] | None = None) -> float:
    """Typical seconds of `repeats` calls of `fn` after `warmup` untimed ones: a fixed count, so ranks that
    run collectives together stay in lockstep. `between` runs after each call, outside the timing."""
    watch = Stopwatch(device)
    times = []
    for i in range(warmup + repeats):
        _, t = watch.time(fn)
        if between is not None:
            between()
        if i >= warmup:
            times.append(t)
    return typical(times, device)


def typical(xs: list[float], device: torch.device) -> float:
    """What one pass costs within a long run of them. CPU: the mean. When the ranks outnumber the cores the
    kernel time-slices them, and a pass shorter than a slice often runs whole at full speed while another
    waits out a slice: per-pass times are bimodal and their median lands on either mode, so ranks timing
    the same layer disagree by a factor of two or more, while their means agree. A training step is a long
    run of passes and pays the mean.
    GPU: the median (CUDA events time the kernels, not the host's scheduling; a rare stall is noise)."""
    return sum(xs) / len(xs) if device.type == "cpu" else median(xs)


def median(xs: list[float]) -> float:
    ys = sorted(xs)
    n = len(ys)
    return ys[n // 2] if n % 2 else 0.5 * (ys[n // 2 - 1] + ys[n // 2])


def quantile(xs: list[float], q: float) -> float:
    ys = sorted(xs)
    pos = q * (len(ys) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ys) - 1)
    return ys[lo] + (ys[hi] - ys[lo]) * (pos - lo)


def spread(xs: list[float]) -> float:
    m = median(xs)
    return (quantile(xs, 0.9) - quantile(xs, 0.1)) / m if m > 0 else 0.0


def time_passes(spec: ModelSpec, kind: str, b: int, s: int, tp: int, dtype: str, device: torch.device,
                cfg: TimingConfig, recompute: str = "none", tp_mesh=None) -> tuple[list[float], list[float]]:
    """Forward and backward seconds of each timed repeat of one layer: the shard one TP rank computes,
    or with `tp_mesh` the real tensor-parallel layer across that mesh's ranks (a fixed number of passes,
    so that every rank of the mesh runs the same collectives)."""
    if tp_mesh is not None:
        case = build_tp_case(spec, kind, b, s, tp_mesh, dtype, device)
    else:
        case = build_case(spec, kind, b, s, tp, dtype, device)
    watch = Stopwatch(device)
    fwds, bwds = [], []
    if device.type == "cuda":
        torch.cuda.synchronize()
    i = 0
    while i < cfg.warmup + cfg.repeats or (tp_mesh is None and i < cfg.warmup + cfg.max_repeats
                                           and sum(fwds) + sum(bwds) < cfg.budget_s):
        x = case.make_input()
        out, t_fwd = watch.time(lambda: forward(case, x, recompute))
        _, t_bwd = watch.time(lambda o=out: case.backward(o))
        for p in case.parameters():
            p.grad = None
        del out
        if i >= cfg.warmup:
            fwds.append(t_fwd)
            bwds.append(t_bwd)
        i += 1
    return fwds, bwds


def measure_sample(spec: ModelSpec, kind: str, b: int, s: int, tp: int, dtype: str, device: torch.device,
                   cfg: TimingConfig, recompute_modes: tuple[str, ...] = ("full", "selective"),
                   tp_mesh=None) -> ComputeSample:
    """One ComputeSample; for blocks also the forward and backward times with each recompute mode (the
    checkpoint's forward costs more than the plain one: it records what to replay). With `tp_mesh`
    (of size tp) the layer runs tensor-parallel across it and the times include its collectives."""
    fwds, bwds = time_passes(spec, kind, b, s, tp, dtype, device, cfg, tp_mesh=tp_mesh)
    sample = ComputeSample(kind, b, s, tp, forward_s=typical(fwds, device), backward_s=typical(bwds, device),
                           spread=spread([f + g for f, g in zip(fwds, bwds)]),
                           with_collectives=tp_mesh is not None)
    if kind == "block":
        for mode in recompute_modes:
            fwd_mode, bwd_mode = time_passes(spec, kind, b, s, tp, dtype, device, cfg, recompute=mode,
                                             tp_mesh=tp_mesh)
            setattr(sample, f"forward_{mode}_s", typical(fwd_mode, device))
            setattr(sample, f"backward_{mode}_s", typical(bwd_mode, device))
    return sample


@dataclass(frozen=True)
class Point:
    kind: str
    b: int
    s: int
    tp: int

    def label(self) -> str:
        return f"{self.kind} b={self.b} s={self.s} t={self.tp}"


def grid(micro_batch_sizes: list[int], seq_lens: list[int], tps: list[int], embedding_tps: bool = False
         ) -> list[Point]:
    """The (kind, b, s, t) points to measure. A rank's embedding shard costs about what the whole one
    does (a lookup), so it is measured at t = 1 only, unless `embedding_tps` (measured across TP ranks,
    where its all-reduce counts)."""
    points = []
    for kind in ("embedding", "block", "head"):
        for tp in tps if kind != "embedding" or embedding_tps else [1]:
            for s in seq_lens:
                for b in micro_batch_sizes:
                    points.append(Point(kind, b, s, tp))
    return points
