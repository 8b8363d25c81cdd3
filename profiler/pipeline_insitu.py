"""What torch.distributed.pipelining adds to every stage's micro-batch, measured in situ, per schedule.

A schedule step runs, per micro-batch and stage, the schedule's bookkeeping, shape checks and the P2P
send/recv of activations and gradients with each neighbour; zero-bubble schedules run the backward as
two actions (input-grad, weight-grad) and interleaved ones hold two stages per rank. On CPU with gloo
this costs milliseconds, far more than the send/recv link fit, and no layer micro-benchmark sees it.
This phase runs each real schedule on pairs of ranks (one stage per rank for GPipe and 1F1B, two for
interleaved 1F1B and zero-bubble V) over stages that do almost nothing (scale the b·s·h activation by
one learned scalar) with m1 and m2 micro-batches: the slope of the step time over m, divided by the
rank's stage boundaries that cross to the other rank, is the schedule's own cost per crossing and
micro-batch (a stage between two remote neighbours pays it twice), P2P of the real message size
included, with no compute (and, on CPU, no contention between the stages' compute) to subtract.
The split backward's extra compute on real layers is measured separately (ChainSample.split_extra_s).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from meshplan.planner.model_spec import ModelSpec
from meshplan.planner.plan import SCHEDULES, stage_rank
from meshplan.profiler.compute import TimingConfig, typical, typical_time
from meshplan.profiler.layers import TORCH_DTYPES

VIRTUAL_STAGES = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "zero-bubble": 2}  # as measured, per rank


class _Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out.float() - target.float()).square().mean()


def _schedule(name: str, modules: list[nn.Module], indices: list[int], num_stages: int, m: int,
              device: torch.device, group):
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as S

    stages = [PipelineStage(mod, k, num_stages, device, group=group) for mod, k in zip(modules, indices)]
    if name in ("gpipe", "1f1b"):
        cls = S.ScheduleGPipe if name == "gpipe" else S.Schedule1F1B
        return cls(stages[0], n_microbatches=m, loss_fn=_loss, scale_grads=True)
    cls = S.ScheduleInterleaved1F1B if name == "interleaved-1f1b" else S.ScheduleZBVZeroBubble
    return cls(stages, n_microbatches=m, loss_fn=_loss, scale_grads=True)


def measure_pipeline_overheads(spec: ModelSpec, b: int, s: int, dtype: str, device: torch.device,
                               cfg: TimingConfig, m1: int = 2, m2: int = 8) -> dict[str, float]:
    """Seconds per crossing stage boundary and micro-batch (>= 0) of every schedule, typical over the pairs
    (profiler.compute.typical). Every rank of the default group calls this together (an even number of
    ranks: consecutive pairs are the pipelines)."""
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    group = init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("pairs", "pp"))["pp"].get_group()
    pp_rank = rank % 2
    tdtype = TORCH_DTYPES[dtype]
    out: dict[str, float] = {}
    for name in SCHEDULES:
        v = VIRTUAL_STAGES[name]
        indices = [k for k in range(2 * v) if stage_rank(k, 2, name, v) == pp_rank]
        modules = [_Scale().to(device) for _ in indices]
        first, last = 0 in indices, 2 * v - 1 in indices
        crossings = sum(1 for k in indices for j in (k - 1, k + 1)
                        if 0 <= j < 2 * v and stage_rank(j, 2, name, v) != pp_rank)
        steps: dict[int, float] = {}
        for m in (m1, m2):
            schedule = _schedule(name, modules, indices, 2 * v, m, device, group)
            x = torch.randn(b * m, s, spec.hidden_size, device=device, dtype=tdtype)
            kwargs = {"target": x, "losses": []} if last else {}
            args = (x,) if first else ()
            dist.barrier()
            steps[m] = typical_time(lambda: schedule.step(*args, **kwargs), device, max(2, cfg.warmup // 2),
                                   cfg.repeats, between=lambda: [mod.zero_grad(set_to_none=True) for mod in modules])
        slope = torch.tensor([(steps[m2] - steps[m1]) / (m2 - m1) / crossings], dtype=torch.float64, device=device)
        gathered = [torch.zeros_like(slope) for _ in range(world)]
        dist.all_gather(gathered, slope)
        out[name] = max(0.0, typical([float(g) for g in gathered], device))
    return out
