"""Profiles for hardware that is not present: compute from FLOPs at documented peak × efficiency, links
from documented bandwidths and latencies (planner/cluster_spec.py cites the figures)."""

from __future__ import annotations

import torch
from meshplan.planner.cluster_spec import FLASH1_PRESETS, ClusterSpec
from meshplan.planner.errors import InputError
from meshplan.planner.model_spec import ModelSpec
from meshplan.profiler.analytic import layer_forward_flops
from meshplan.profiler.profile import LINK_OPS, ComputeSample, LinkFit, Profile
from meshplan.profiler.roofline import OPT_BYTES, Roofline

# AdamW with mixed precision touches ~36 bytes per parameter per step (read param, grad, 2 moments and the
# fp32 master copy; write back param, moments, master): memory-bound, a streaming kernel like the others, so
# bytes / the bandwidth such kernels reach (DeviceSpec.memory_efficiency, BabelStream Triad's share).
ADAM_BYTES_PER_PARAM = 36.0


def adam_bytes(roofline: Roofline | None) -> float:
    """ADAM_BYTES_PER_PARAM for the software's optimizer state (Roofline.opt_bytes): the step reads and writes
    each byte of it once."""
    return ADAM_BYTES_PER_PARAM - (0.0 if roofline is None else 2 * (OPT_BYTES - roofline.opt_bytes))


# The executor clips by the global norm first (executor.train.clip_and_step, as measured profiles time it):
# the norm reads every fp32 gradient once and the scaling reads and writes it again.
CLIP_BYTES_PER_PARAM = 12.0


def device_roofline(cluster: ClusterSpec, dtype: str, attention: str = "flash", activations: str = "sharded",
                    grad_overlap: bool = True, sequence_parallel: bool = True, grad_bytes: int = 4,
                    grad_reduce: str = "reduce_scatter", grad_accum_bytes: float = 0.0,
                    selective: str = "attention", fsdp_copies: bool = True, loss: str = "fp32",
                    p2p: str = "overlapped", sharded_accumulation: bool = False, norm: str = "fused",
                    software: str = "meshplan", fp8: str = "none", moe_dispatch: str = "sharded",
                    fp8_params: bool = False, opt_bytes: float = OPT_BYTES) -> Roofline | None:
    """The per-operation model of a GPU preset (None for a CPU or a device without SM count); the
    software settings default to the executor's (profiler/roofline.py). attention "flash1": software that
    ran FlashAttention-1 (cluster_spec.FLASH1_PRESETS)."""
    d = cluster.device
    if fp8 != "none" and (d.peak_flops.get("fp8", 0) <= 0 or d.fp8_efficiency <= 0 or d.sm_count <= 0):
        raise InputError(f"--fp8: {d.type} has no FP8 tensor cores in its preset (FP8: h100-80gb, h200-141gb, "
                         f"b200-180gb, b300-288gb, gb200-186gb, gb300-288gb)")
    if fp8 != "none" and dtype != "bf16":
        raise InputError(f"--fp8: FP8 Linears run inside bf16 training; expected --dtype bf16, got {dtype}")
    if d.kind != "cuda" or d.sm_count <= 0 or not d.attention_flops or dtype == "fp32":
        return None
    table = d.attention_flops
    if attention == "flash1":  # the same fused kernel type, at FlashAttention-1's measured rates
        if d.type not in FLASH1_PRESETS:
            raise InputError(f"attention: no FlashAttention-1 measurement for {d.type}; expected one of "
                             f"{', '.join(FLASH1_PRESETS)}")
        table, attention = FLASH1_PRESETS[d.type], "flash"
    return Roofline(peak_flops=d.peak_flops[dtype], gemm_fraction=d.efficiency, sm_count=d.sm_count,
                    hbm_Bps=d.memory_bandwidth_Bps, hbm_fraction=d.memory_efficiency,
                    attention_flops=table, launch_s=d.kernel_launch_s, attention=attention,
                    activations=activations, grad_overlap=grad_overlap, sequence_parallel=sequence_parallel,
                    pace=1.0 - d.device_spread if cluster.world_size > 1 else 1.0, comm_sms=d.comm_sms,
                    grad_bytes=grad_bytes, grad_reduce=grad_reduce, gemm_k0=d.gemm_k0, gemm_k_ref=d.gemm_k_ref,
                    grad_accum_bytes=grad_accum_bytes, selective=selective,
                    fsdp_copies=fsdp_copies, loss=loss, p2p=p2p,
                    sharded_accumulation=sharded_accumulation, norm=norm, software=software, fp8=fp8,
                    fp8_peak_flops=d.peak_flops.get("fp8", 0.0), fp8_gemm_fraction=d.fp8_efficiency,
                    fp8_gemm_k_ref=d.fp8_gemm_k_ref, moe_dispatch=moe_dispatch,
                    fp8_params=fp8_params, opt_bytes=opt_bytes)


def preset_profile(model: ModelSpec, cluster: ClusterSpec, dtype: str = "bf16", **software) -> Profile:
    """`software`: how the training software runs on a GPU (`device_roofline`: attention, activations,
    grad_overlap); the executor's by default."""
    device = cluster.device
    rate = device.peak_flops[dtype] * device.efficiency
    roofline = device_roofline(cluster, dtype, **software)
    s = min(model.max_seq_len, 2048)
    compute = []
    for kind in ("embedding", "block", "head"):
        if roofline is not None:
            fwd, bwd = roofline.layer(model, kind, 1, s, 1)
        else:
            flops = layer_forward_flops(model, kind, 1, s, 1)
            fwd, bwd = flops / rate, 2 * flops / rate
        compute.append(ComputeSample(kind, 1, s, 1, forward_s=fwd, backward_s=bwd))
    # bus bandwidth NCCL reaches on each class of link (nccl-tests busbw); through the spine a GPU's NIC
    # gets its share of the leaf's uplinks (planner/topology.py)
    inter_leaf = cluster.inter_node.bus_Bps / cluster.topology.oversubscription
    intra = cluster.intra_node
    links = {
        name: {op: LinkFit(alpha_s=latency, beta_s_per_byte=1.0 / bandwidth, busbw_curve=[list(p) for p in curve],
                           nvls_min_ranks=intra.nvls_min_ranks if curve else 0)
               for op in LINK_OPS}
        for name, latency, bandwidth, curve in (
            ("intra_node", intra.latency_s, intra.bus_Bps, intra.busbw_curve),
            ("inter_node", cluster.inter_node.latency_s, cluster.inter_node.bus_Bps, ()),
            ("inter_leaf", cluster.inter_node.latency_s, inter_leaf, ()))
    }
    return Profile(
        model=model, dtype=dtype, source="preset", device_kind=device.kind, device_name=device.type,
        torch_version=torch.__version__, compute=compute, links=links,
        optimizer_s_per_param=(adam_bytes(roofline) + CLIP_BYTES_PER_PARAM)
        / (device.memory_bandwidth_Bps * device.memory_efficiency),
        concurrent_ranks=cluster.devices_per_node, roofline=roofline,
    )
