"""Activations kept as this rank's shard and gathered again when backward needs them.

A forward that gathers a tensor over a group and feeds it to ops that save it for backward would keep the
whole gathered tensor alive until then. Under `regathering`, every saved tensor that is a view of a
registered gathered tensor is packed as a reference to the local shard plus the view's geometry; the
first unpack gathers the shard again (or waits for a gather started earlier) and every other view of it
reads the same result, until the last of them is released. Megatron-LM keeps sequence-parallel Linear
inputs this way (Korthikanti et al. 2022, Eq. 5), Transformer Engine its all-gather context
parallelism's K and V.

Tensor-parallel Linears save DTensors: a saved DTensor whose local tensor is such a view comes back as a
DTensor of the same spec over the regathered data.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from meshplan.executor.collectives import wait
from torch.distributed.tensor import DTensor


class Gathered:
    """The shard that stands in for a gathered tensor, and the tensor once gathered again."""

    __slots__ = ("local", "full", "__weakref__")

    def __init__(self, local: torch.Tensor):
        self.local, self.full = local, None


class Regathered:
    """A saved view of a gathered tensor: its source, the view's geometry, and its DTensor spec if it was one."""

    __slots__ = ("source", "size", "stride", "offset", "dtensor")

    def __init__(self, source: Gathered, view: torch.Tensor, dtensor: DTensor | None = None):
        self.source, self.size, self.stride, self.offset = source, view.size(), view.stride(), view.storage_offset()
        self.dtensor = None if dtensor is None else (dtensor.device_mesh, dtensor.placements, dtensor.size(),
                                                      dtensor.stride())


def storage_of(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage: never a gathered one
        return -1


def whole(t: torch.Tensor) -> bool:
    """Whether t is all of its storage, contiguous from its start: what a gather returns, so that a gather
    again lays the data out the same way and a saved view's geometry applies to it."""
    return (t.is_contiguous() and t.storage_offset() == 0
            and t.numel() * t.element_size() == t.untyped_storage().nbytes())


_paused = 0
_observers: list[Callable[[torch.Tensor], None]] = []  # see what the hooks keep (profiler/memory.py)


@contextmanager
def paused() -> Iterator[None]:
    """No regathering inside: a block recomputed whole (its checkpoint's forward and recompute) keeps only
    its input, and its recompute gathers again anyway. Saved-tensor hooks nest innermost-first, so
    regathering there would take the saved tensors from the checkpoint."""
    global _paused
    _paused += 1
    try:
        yield
    finally:
        _paused -= 1


def is_paused() -> bool:
    return _paused > 0


@contextmanager
def observed(keep: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """`keep(t)` for each tensor the hooks keep for backward: the saved tensor, or the shard standing in for
    a gathered one. Saved-tensor hooks nest innermost-first, so an outer hook that counts what backward
    keeps sees none of these."""
    _observers.append(keep)
    try:
        yield
    finally:
        _observers.remove(keep)


@contextmanager
def regathering(sources: dict[int, Gathered], gather: Callable[[torch.Tensor], torch.Tensor],
                on_gather: Callable[[], None] | None = None) -> Iterator[None]:
    """Saved-tensor hooks for the forward that uses the gathered tensors of `sources` (keyed by their
    storage): `gather(local)` rebuilds one, without autograd, when backward first needs it (it may return
    the gather still in flight: unpack waits, as for one started earlier)."""

    def pack(t: torch.Tensor):
        local = t._local_tensor if isinstance(t, DTensor) else t
        source = sources.get(storage_of(local))
        for keep in _observers:
            keep(t if source is None else source.local)
        if source is None:
            return t
        return Regathered(source, local, t if isinstance(t, DTensor) else None)

    def unpack(saved):
        if not isinstance(saved, Regathered):
            return saved
        source = saved.source
        if source.full is None:
            if on_gather is not None:
                on_gather()
            source.full = gather(source.local)
        source.full = wait(source.full)  # a gather started earlier, asynchronously
        view = source.full.as_strided(saved.size, saved.stride, saved.offset)
        if saved.dtensor is None:
            return view
        mesh, placements, shape, stride = saved.dtensor
        return DTensor.from_local(view, mesh, placements, run_check=False, shape=shape, stride=stride)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
