"""Metrics JSONL (DESIGN §4) and the console log, both written by global rank 0 only.

Step lines hold exactly step, loss, step_time_s, tokens_per_s, peak_memory_bytes; the final summary
line holds the plan's predicted iteration time and the measured median after warm-up, the plan's path,
and on CPU `peak_tensor_bytes`: the most tensor memory any rank held during the second step, tracked
by watching every op through a TorchDispatchMode (CPU has no allocator statistics, and peak RSS counts
the interpreter and libraries). That step runs instrumented, so its time is left out of the median.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
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


def _storages(tree, into: dict[int, torch.UntypedStorage]) -> None:
    """The untyped storages behind the tensors in an op's arguments or results (a wrapper subclass such as
    DTensor: the storages of the tensors it wraps, e.g. the local shard)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    from torch.utils._pytree import tree_leaves

    pending = [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]
    while pending:
        t = pending.pop()
        if is_traceable_wrapper_subclass(t):
            pending.extend(x for x in (getattr(t, a) for a in t.__tensor_flatten__()[0]) if isinstance(x, torch.Tensor))
        elif t.device.type != "meta" and t.layout == torch.strided:
            st = t.untyped_storage()
            into[id(st)] = st


class _LiveTensorBytes:
    """Bytes of tensor storage allocated since the start and still alive, and their peak. A storage counts
    from the op that returns it without having received it (a new tensor), and from an in-place resize
    (FSDP frees and re-allocates unsharded parameters with `UntypedStorage.resize_`) by what it grew above
    its size before; it stops counting when it shrinks back or is garbage-collected (a weak reference on
    the storage, which torch keeps alive exactly as long as a tensor uses it)."""

    def __init__(self):
        self.live = self.peak = 0
        self.counted: dict[int, list] = {}  # id(storage) -> [bytes counted, bytes before the start, weakref]

    def count(self, st: torch.UntypedStorage, before: int = 0) -> None:
        import weakref

        key = id(st)
        entry = self.counted.get(key)
        if entry is None:
            def gone(_ref, key=key):
                dead = self.counted.pop(key, None)
                if dead is not None:
                    self.live -= dead[0]

            entry = self.counted[key] = [0, before, weakref.ref(st, gone)]
        nbytes = max(0, st.nbytes() - entry[1])
        self.live += nbytes - entry[0]
        entry[0] = nbytes
        self.peak = max(self.peak, self.live)

    def op(self, args, kwargs, out) -> None:
        given: dict[int, torch.UntypedStorage] = {}
        _storages((args, kwargs), given)
        made: dict[int, torch.UntypedStorage] = {}
        _storages(out, made)
        for key, st in made.items():
            if key in self.counted:  # follow a size change (an out= argument resized)
                self.count(st)
            elif key not in given:
                self.count(st)


@contextmanager
def track_cpu_allocations():
    """Peak bytes of tensor memory allocated inside the block above what was live before it (CPU tensors
    have no allocator statistics). Every aten op is seen through a TorchDispatchMode: its outputs that are
    not among its inputs are new storages, counted until they are garbage-collected. Tensors freed here
    that were allocated before are not subtracted (their size is not known here): an upper bound. Not seen:
    scratch memory inside a kernel, and temporaries inside a DTensor op's own redistribution. Unlike the
    torch profiler's memory tracking, this prints nothing and starts no profiler thread."""
    from torch.utils._python_dispatch import TorchDispatchMode

    tracker = _LiveTensorBytes()

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            tracker.op(args, kwargs, out)
            return out

    original_resize = torch.UntypedStorage.resize_

    def resize_(st, size):
        before = st.nbytes()
        result = original_resize(st, size)
        tracker.count(st, before)
        return result

    out = {"peak": 0}
    torch.UntypedStorage.resize_ = resize_
    try:
        with Mode():
            yield out
    finally:
        torch.UntypedStorage.resize_ = original_resize
    out["peak"] = tracker.peak


def warmup_steps(n: int) -> int:
    """Steps left out of the measured median: the first (shape inference, allocator, lazy init), and a
    tenth of a long run."""
    return 0 if n <= 1 else max(1, n // 10)


def measured_steps(step_times: list[float]) -> list[float]:
    """The timed steps (instrumented ones already left out) that count: those after the warm-up."""
    return step_times[warmup_steps(len(step_times)):]


def timed_step_times(records: list[dict]) -> list[float]:
    """From a metrics file's records, the step times the executor's own median is taken over: steps the
    CPU memory probe instrumented (`"timed": false`, slower, every op seen from Python) and
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

