"""Device memory that the tensors of the cost model cannot use (issue 21 item 4).

The memory model counts what PyTorch's caching allocator hands out: parameters, gradients, optimizer
state, activations and workspaces (planner/cost_memory.py). A GPU also holds memory outside the
allocator from the start: the CUDA context and NCCL's buffers, one set per communicator (the device's
`context_bytes` and `communicator_bytes`, sourced in planner/cluster_spec.py). torch creates a
communicator per process group at its first collective: the world group (initialisation, barriers) and
one per parallel dimension above 1.
What is left is shared with the caching allocator's fragmentation, which has no fixed size (GMLake, arXiv
2401.08156: 9.2 GB on average of an A100-80GB over eight LLM set-ups chosen to stress it; expandable
segments remove most of it, and the executor turns them on as torchtitan's launcher does). That share is
the user's `--memory-margin`.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.planner.cluster_spec import DeviceSpec


@dataclass(frozen=True)
class Reserve:
    """Bytes a rank's device holds outside the caching allocator."""

    context: float
    communicators: int
    nccl: float

    @property
    def total(self) -> float:
        return self.context + self.nccl

    def describe(self) -> str:
        if not self.communicators:
            return "CUDA context"
        return f"CUDA context and {self.communicators} NCCL communicator{'s' * (self.communicators != 1)}"


def communicators(tp: int, pp: int, dp: int, cp: int = 1, ep: int = 1) -> int:
    """NCCL communicators one rank creates: the world group, one per parallel dimension above 1, and the
    expert-parallel and expert-data-parallel groups of a MoE plan (executor/expert_parallel.py). A single
    process runs no collective, so creates none."""
    dims = (tp, pp, dp, cp)
    if all(d == 1 for d in dims):
        return 0
    count = 1 + sum(d > 1 for d in dims)
    if ep > 1:
        count += 1 + (dp * cp // ep > 1)
    return count


def reserve(device: DeviceSpec, tp: int, pp: int, dp: int, cp: int = 1, ep: int = 1) -> Reserve:
    """The reserve of one rank of a plan with these degrees."""
    n = communicators(tp, pp, dp, cp, ep)
    return Reserve(device.context_bytes, n, n * device.communicator_bytes)


def usable_bytes(capacity: float, margin: float, res: Reserve) -> float:
    """What the allocator may hand out: the capacity less the reserve, less the margin's share of the rest."""
    return max(0.0, capacity - res.total) * (1.0 - margin)
