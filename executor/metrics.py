"""Metrics JSONL (DESIGN §4) and the console log, both written by global rank 0 only.

Step lines hold exactly step, loss, step_time_s, tokens_per_s, peak_memory_bytes; the final summary
line holds the plan's predicted iteration time and the measured median after warm-up, the plan's path,
and on CPU `peak_tensor_bytes`: the most tensor memory any rank held during the second step, tracked
with the torch profiler (CPU has no allocator statistics, and peak RSS counts the interpreter and
libraries). That step runs instrumented, so its time is left out of the median.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import warnings
from contextlib import contextmanager

import torch


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    """Peak memory of this process and where the figure comes from: the CUDA caching allocator's peak
    on GPU; on CPU the peak resident set size (getrusage ru_maxrss, kilobytes on Linux), which includes
    the Python interpreter and libraries (psutil has no peak RSS on Linux, so it is not used)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda.max_memory_allocated"
    scale = 1 if sys.platform == "darwin" else 1024
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale), "ru_maxrss (peak RSS)"


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind these tensors (DTensors: this rank's shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            local = _local(t)
            storage = local.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


PROFILER_USED = [False]  # set once the torch profiler (kineto) has run in this process: see executor/__main__.py


@contextmanager
def track_cpu_allocations():
    """Peak bytes allocated inside the block above what was live before it, from the torch profiler's
    CPU memory tracking (CPU tensors have no allocator statistics). Tensors freed here that were
    allocated before are not subtracted (the profiler does not know their size): an upper bound."""
    from torch.profiler import ProfilerActivity, profile

    out = {"peak": 0}
    PROFILER_USED[0] = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            yield out
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    out["peak"] = peak


def warmup_steps(n: int) -> int:
    """Steps left out of the measured median: the first (shape inference, allocator, lazy init), and a
    tenth of a long run."""
    return 0 if n <= 1 else max(1, n // 10)


def measured_steps(step_times: list[float]) -> list[float]:
    """The timed steps (instrumented ones already left out) that count: those after the warm-up."""
    return step_times[warmup_steps(len(step_times)):]


def timed_step_times(records: list[dict]) -> list[float]:
    """From a metrics file's records, the step times the executor's own median is taken over: steps the
    CPU memory probe instrumented (`"timed": false`, many times slower under the torch profiler) and
    the warm-up left out."""
    return measured_steps([r["step_time_s"] for r in records if "step" in r and r.get("timed", True)])


class Metrics:
    def __init__(self, path: str | None, enabled: bool, keep_until_step: int | None = None):
        self.enabled = enabled
        self.fh = None
        self.step_times: list[float] = []
        if enabled and path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            kept: list[str] = []
            if keep_until_step is not None and os.path.exists(path):  # resuming: drop steps redone
                with open(path, encoding="utf-8") as fh:
                    for line in fh:
                        try:
                            rec = json.loads(line)
                        except json.JSONDecodeError:
                            continue
                        if "step" in rec and rec["step"] <= keep_until_step:
                            kept.append(line if line.endswith("\n") else line + "\n")
            self.fh = open(path, "w", encoding="utf-8")
            self.fh.writelines(kept)
            self.fh.flush()

    def step(self, step: int, loss: float, step_time_s: float, tokens: int, peak_memory: int,
             timed: bool = True) -> None:
        """timed=False: a step slowed by instrumentation (the CPU memory probe), left out of the median."""
        if timed:
            self.step_times.append(step_time_s)
        if not self.enabled:
            return
        rec = {"step": step, "loss": loss, "step_time_s": step_time_s,
               "tokens_per_s": tokens / step_time_s if step_time_s > 0 else 0.0, "peak_memory_bytes": peak_memory}
        if not timed:  # DESIGN §4's five keys otherwise
            rec["timed"] = False
        if self.fh:
            self.fh.write(json.dumps(rec) + "\n")
            self.fh.flush()

    def measured(self) -> float:
        times = measured_steps(self.step_times)
        return statistics.median(times) if times else 0.0

    def summary(self, predicted_s: float, plan_path: str | None = None, peak_tensor_bytes: int | None = None) -> dict:
        rec = {"summary": True, "predicted_iteration_time_s": predicted_s,
               "measured_iteration_time_s": self.measured()}
        if plan_path:
            rec["plan"] = os.path.abspath(plan_path)
        if peak_tensor_bytes is not None:
            rec["peak_tensor_bytes"] = peak_tensor_bytes
        if self.enabled and self.fh:
            self.fh.write(json.dumps(rec) + "\n")
            self.fh.close()
            self.fh = None
        return rec


def log(enabled: bool, text: str) -> None:
    if enabled:
        print(text, flush=True)

