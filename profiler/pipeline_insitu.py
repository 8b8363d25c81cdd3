"""What torch.distributed.pipelining adds to every stage's micro-batch, measured in situ.

A schedule step runs, per micro-batch and stage, the schedule's bookkeeping, shape checks and the P2P
send/recv of activations and gradients with each neighbour. On CPU with gloo this costs milliseconds,
far more than the send/recv link fit, and no layer micro-benchmark sees it. This phase runs the real
schedule (1F1B, pairs of ranks) over stages that do almost nothing (scale the b·s·h activation by one
learned scalar) with m1 and m2 micro-batches: the slope of the step time over m is the pipeline's own
cost per stage and micro-batch, P2P of the real message size included, with no compute (and, on CPU,
no contention between the two stages' compute) to subtract.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from planner.model_spec import ModelSpec
from profiler.compute import TimingConfig, median_time
from profiler.layers import TORCH_DTYPES


class _Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out.float() - target.float()).square().mean()


def measure_pipeline_overhead(spec: ModelSpec, b: int, s: int, dtype: str, device: torch.device,
                              cfg: TimingConfig, m1: int = 2, m2: int = 8) -> float:
    """Seconds per stage and micro-batch (>= 0), the median over the pairs. Every rank of the default
    group calls this together (an even number of ranks: consecutive pairs are the pipelines)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import Schedule1F1B

    world, rank = dist.get_world_size(), dist.get_rank()
    group = init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("pairs", "pp"))["pp"].get_group()
    stage = rank % 2
    module = _Scale().to(device)
    tdtype = TORCH_DTYPES[dtype]
    steps: dict[int, float] = {}
    for m in (m1, m2):
        pipe = PipelineStage(module, stage, 2, device, group=group)
        schedule = Schedule1F1B(pipe, n_microbatches=m, loss_fn=_loss, scale_grads=True)
        x = torch.randn(b * m, s, spec.hidden_size, device=device, dtype=tdtype)
        dist.barrier()
        step = (lambda: schedule.step(x)) if stage == 0 else (lambda: schedule.step(target=x, losses=[]))
        steps[m] = median_time(step, device, max(2, cfg.warmup // 2), cfg.repeats,
                               between=lambda: module.zero_grad(set_to_none=True))
    slope = torch.tensor([(steps[m2] - steps[m1]) / (m2 - m1)], dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(slope) for _ in range(world)]
    dist.all_gather(gathered, slope)
    slopes = sorted(float(g) for g in gathered)
    return max(0.0, slopes[len(slopes) // 2])
