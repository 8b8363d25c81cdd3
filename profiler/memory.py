"""Activation bytes saved for backward, and parameter / gradient / optimizer-state bytes, per layer.

Activations: every tensor autograd saves during the forward passes through a
`torch.autograd.graph.saved_tensors_hooks` pack hook; we count each underlying storage once (views and
tensors saved by several ops share one), and skip the parameters' storages (weights are model state,
not activations). What a checkpoint keeps alive (its inputs) is added explicitly, since checkpointing
replaces the saved tensors inside it. On CUDA the growth of `memory_allocated` over the forward,
minus the output, is recorded next to it as a cross-check.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from meshplan.executor.regather import observed
from meshplan.planner.model_spec import ModelSpec
from meshplan.profiler.layers import TORCH_DTYPES, build_case, forward
from meshplan.profiler.profile import MemorySample, StateSample
from torch.distributed.tensor import DTensor


@dataclass
class SavedTensorCounter:
    """Distinct storages saved for backward, excluding `ignore` (parameter storages)."""

    ignore: set[int] = field(default_factory=set)
    storages: dict[int, int] = field(default_factory=dict)  # data_ptr -> nbytes

    def add(self, t: torch.Tensor) -> None:
        if isinstance(t, DTensor):  # tensor-parallel layers save DTensors: count this rank's shard
            t = t._local_tensor
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.ignore or storage.nbytes() == 0:
            return
        self.storages[ptr] = max(self.storages.get(ptr, 0), storage.nbytes())

    def add_all(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            self.add(t)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.add(t)
        return t

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    @property
    def count(self) -> int:
        return len(self.storages)


def saved_bytes(fn: Callable[[SavedTensorCounter], torch.Tensor], params: list[torch.Tensor]) -> tuple[
        SavedTensorCounter, torch.Tensor]:
    """Run fn (a forward) under the counting hook; returns the counter and fn's output (kept alive so
    that what it saved is still alive when counted)."""
    counter = SavedTensorCounter(ignore={p.untyped_storage().data_ptr() for p in params})
    # the executor's own saved-tensor hooks (sequence-parallel inputs kept as shards) report what they keep
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t), observed(counter.add):
        out = fn(counter)
    return counter, out


def measure_activations(spec: ModelSpec, kind: str, b: int, s: int, tp: int, dtype: str, device: torch.device,
                        recompute: str = "none") -> MemorySample:
    case = build_case(spec, kind, b, s, tp, dtype, device)
    x = case.make_input()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    counter, out = saved_bytes(lambda c: forward(case, x, recompute, on_kept=c.add_all), case.parameters())
    allocated = peak = 0.0
    if cuda:
        torch.cuda.synchronize()
        grown = torch.cuda.memory_allocated(device) - before
        # the output is allocated but only counts as this layer's activation if it was saved
        out_ptr = out.untyped_storage().data_ptr()
        allocated = float(grown - (0 if out_ptr in counter.storages else out.untyped_storage().nbytes()))
        peak = float(torch.cuda.max_memory_allocated(device) - before)  # + transient workspace
    sample = MemorySample(kind, b, s, tp, recompute, float(counter.bytes), saved_tensors=counter.count,
                          allocated_bytes=max(0.0, allocated), peak_bytes=max(0.0, peak))
    del out, counter
    return sample


def measure_state(spec: ModelSpec, kind: str, tp: int, dtype: str, device: torch.device) -> StateSample:
    """Bytes of parameters, gradients and AdamW state of one layer on one TP rank, as torch allocates them.
    With a 16-bit dtype the optimizer steps an fp32 master copy (mixed precision), whose bytes count as
    optimizer state, as in ZeRO's 2 + 2 + 12 bytes per parameter."""
    case = build_case(spec, kind, 1, 1, tp, dtype, device)
    params = case.parameters()
    n = sum(p.numel() for p in params)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    grad_bytes = sum(p.numel() * TORCH_DTYPES[dtype].itemsize for p in params)
    mixed = TORCH_DTYPES[dtype] != torch.float32
    master = [p.detach().float().clone().requires_grad_(True) for p in params] if mixed else params
    for p in master:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(master, lr=1e-4)
    opt.step()
    opt_bytes = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
                    if isinstance(t, torch.Tensor))
    if mixed:
        opt_bytes += sum(p.numel() * p.element_size() for p in master)
    return StateSample(kind, tp, n, param_bytes, grad_bytes, opt_bytes)
