"""apply_pp: this rank's pipeline stages (the plan's layer ranges, virtual stages included) and the
plan's schedule from torch.distributed.pipelining.

Placement comes from the plan (StagePlan.pp_rank): looped (stage k on rank k % pp) for GPipe, 1F1B,
interleaved 1F1B and zero-bubble with v != 2; V-shaped for zero-bubble with v = 2 (ScheduleZBVZeroBubble).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from meshplan.executor.model import Transformer
from meshplan.executor.parallel_dims import ParallelDims
from meshplan.planner.plan import Plan, StagePlan
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
    _PipelineSchedule,
)


def local_stages(plan: Plan, pp_rank: int) -> list[StagePlan]:
    """The stages this pipeline rank runs, in stage order."""
    return [s for s in plan.stages if s.pp_rank == pp_rank]


def schedule_class(plan: Plan) -> type[_PipelineSchedule]:
    p = plan.parallel
    if p.schedule == "gpipe":
        return ScheduleGPipe
    if p.schedule == "1f1b":
        return Schedule1F1B
    if p.schedule == "interleaved-1f1b":
        return ScheduleInterleaved1F1B
    return ScheduleZBVZeroBubble if p.virtual_stages == 2 else ScheduleInterleavedZeroBubble


def is_multi(plan: Plan) -> bool:
    return schedule_class(plan) not in (ScheduleGPipe, Schedule1F1B)


def apply_pp(plan: Plan, dims: ParallelDims, modules: list[Transformer],
             loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> _PipelineSchedule:
    """Wrap this rank's stage modules (already parallelised and materialised) in PipelineStages and
    build the plan's schedule. Gradients are scaled by 1/num_micro_batches (scale_grads) so that, with
    a per-micro-batch mean loss, they equal those of the mean over the rank's batch."""
    stages_plan = local_stages(plan, dims.pp_rank)
    group = dims.mesh["pp"].get_group()
    stages = [PipelineStage(m, s.stage, len(plan.stages), dims.device, group=group)
              for m, s in zip(modules, stages_plan)]
    cls = schedule_class(plan)
    n = plan.parallel.num_micro_batches
    if is_multi(plan):
        return cls(stages, n_microbatches=n, loss_fn=loss_fn, scale_grads=True)
    return cls(stages[0], n_microbatches=n, loss_fn=loss_fn, scale_grads=True)
