"""ParallelDims: the plan's (pp, dp, cp, tp) degrees, this process's place in them, and the DeviceMesh.

Rank layout is the plan's placement (`plan.placement.ranks`, the global rank of every [pp, dp, cp, tp]
mesh position, chosen by the planner on the cluster graph) or, without one, row-major over
("pp", "dp", "cp", "tp"): tp innermost, so tensor-parallel groups are consecutive ranks, i.e. inside one
node under torchrun.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from meshplan.planner.plan import MESH_DIMS, Plan
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass
class ParallelDims:
    pp: int
    dp: int
    tp: int
    device: torch.device
    mesh: DeviceMesh
    cp: int = 1

    @property
    def device_type(self) -> str:
        return self.device.type

    @property
    def pp_rank(self) -> int:
        return self.mesh["pp"].get_local_rank()

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank()

    @property
    def cp_rank(self) -> int:
        return self.mesh["cp"].get_local_rank()

    @property
    def tp_rank(self) -> int:
        return self.mesh["tp"].get_local_rank()

    @property
    def dp_cp_mesh(self) -> DeviceMesh:
        """The ranks that hold the same parameters and average their gradients: dp x cp flattened (context
        parallel ranks see other tokens of the same sequences, as torchtitan's dp_shard_cp); "dp" when cp = 1."""
        if self.cp == 1:
            return self.mesh["dp"]
        return self.mesh["dp", "cp"]._flatten("dp_cp")


def build_parallel_dims(plan: Plan, device: torch.device) -> ParallelDims:
    """One mesh per plan over the already initialised default process group. With gloo the mesh is
    built with device_type="cpu" even where GPUs exist (FSDP2 would otherwise move parameters to CUDA)."""
    p = plan.parallel
    if dist.get_world_size() != p.world_size:
        raise RuntimeError(f"world size {dist.get_world_size()} != plan's {p.world_size}")
    if plan.placement is not None:
        mesh = DeviceMesh(device.type, torch.tensor(plan.placement.ranks, dtype=torch.int64),
                          mesh_dim_names=tuple(MESH_DIMS))
    else:
        mesh = init_device_mesh(device.type, (p.pp, p.dp, p.cp, p.tp), mesh_dim_names=tuple(MESH_DIMS))
    return ParallelDims(pp=p.pp, dp=p.dp, tp=p.tp, device=device, mesh=mesh, cp=p.cp)
