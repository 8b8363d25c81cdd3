"""Adding up each micro-batch's gradients in the executor's software, on presets (a measured profile's
data-parallel hooks time it in situ, profiler/wrappers.py). Per weight, by how the step reduces
(`cost_model.grad_sync`), with B the training dtype's bytes:

- gradients held whole until the last micro-batch, data-parallel (FSDP2 without gradient sync): the first
  micro-batch's unsharded gradient is cast to the fp32 reduce dtype (read B, write 4), each later one is
  added to it (read 4 + B, write 4) (torch/distributed/fsdp/_fully_shard/_fsdp_param.py
  to_accumulated_grad_if_needed, accumulate_unsharded_grad_if_needed);
- reduce-scattered every micro-batch (ZeRO-2/3, no pipeline): the fp32 shard is added to from the second
  micro-batch on, read 4 + 4, write 4, on 1/dp of the weights (_fsdp_collectives.py, `+= new_sharded_grad`);
- one data-parallel rank (autocast over fp32 parameters): autograd adds each later micro-batch's fp32
  gradient in place (read 4 + 4, write 4).

Software with a pass of its own per micro-batch (a roofline's grad_accum "pass") pays it in the layer's
backward instead (profiler/roofline.py), as does none when its wgrad GEMM accumulates (0 bytes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshplan.profiler.analytic import DTYPE_BYTES

if TYPE_CHECKING:
    from meshplan.planner.cost_model import GradSync

FP32 = 4.0


def accumulation_bytes(params: float, dtype: str, dp: int, m: int, sync: GradSync) -> float:
    """Bytes one rank moves per iteration adding up `m` micro-batches' gradients of `params` weights."""
    if m <= 1:
        return 0.0
    if dp <= 1:
        return 3 * FP32 * (m - 1) * params
    if sync.reductions > 1:
        return 3 * FP32 * (m - 1) * params / dp
    b = DTYPE_BYTES[dtype]
    return ((b + FP32) + (m - 1) * (b + 2 * FP32)) * params


def accumulation_time(profile, params: float, dtype: str, dp: int, m: int, sync: GradSync) -> float:
    """Seconds per micro-batch (the iteration's accumulation spread over its m micro-batches) on a preset
    that runs the executor's software; 0 for measured profiles and other software."""
    r = getattr(profile, "roofline", None)
    if r is None or r.grad_accum != "executor":
        return 0.0
    nbytes = accumulation_bytes(params, dtype, dp, m, sync)
    return r.bytes_time(nbytes) / m if nbytes > 0 else 0.0
