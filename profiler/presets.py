"""Profiles for hardware that is not present: compute from FLOPs at documented peak × efficiency, links
from documented bandwidths and latencies (planner/cluster_spec.py cites the figures)."""

from __future__ import annotations

import torch
from meshplan.planner.cluster_spec import ClusterSpec
from meshplan.planner.model_spec import ModelSpec
from meshplan.profiler.analytic import layer_forward_flops
from meshplan.profiler.profile import LINK_OPS, ComputeSample, LinkFit, Profile

# AdamW with mixed precision touches ~36 bytes per parameter per step (read param, grad, 2 moments and the
# fp32 master copy; write back param, moments, master): memory-bound, so bytes / memory bandwidth.
ADAM_BYTES_PER_PARAM = 36.0
# The executor clips by the global norm first (executor.train.clip_and_step, as measured profiles time it):
# the norm reads every fp32 gradient once and the scaling reads and writes it again.
CLIP_BYTES_PER_PARAM = 12.0


def preset_profile(model: ModelSpec, cluster: ClusterSpec, dtype: str = "bf16") -> Profile:
    device = cluster.device
    rate = device.peak_flops[dtype] * device.efficiency
    s = min(model.max_seq_len, 2048)
    compute = []
    for kind in ("embedding", "block", "head"):
        flops = layer_forward_flops(model, kind, 1, s, 1)
        compute.append(ComputeSample(kind, 1, s, 1, forward_s=flops / rate, backward_s=2 * flops / rate))
    links = {
        name: {op: LinkFit(alpha_s=link.latency_s, beta_s_per_byte=1.0 / link.bandwidth_Bps) for op in LINK_OPS}
        for name, link in (("intra_node", cluster.intra_node), ("inter_node", cluster.inter_node))
    }
    return Profile(
        model=model, dtype=dtype, source="preset", device_kind=device.kind, device_name=device.type,
        torch_version=torch.__version__, compute=compute, links=links,
        optimizer_s_per_param=(ADAM_BYTES_PER_PARAM + CLIP_BYTES_PER_PARAM) / device.memory_bandwidth_Bps,
        concurrent_ranks=cluster.devices_per_node,
    )
