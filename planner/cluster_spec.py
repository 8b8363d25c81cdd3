"""ClusterSpec: nodes x devices per node x device type, with link classes, as a networkx graph.

Preset values are the vendors' published figures (dense, no sparsity); memory is what `nvidia-smi`
reports as total. Link bandwidths are per device, one direction, as NCCL's "bus bandwidth" sees them.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import networkx as nx
from meshplan.planner.errors import InputError
from meshplan.planner.fields import Fields
from meshplan.planner.topology import Topology, build_graph, domain_size

GiB = 1024**3
MiB = 1024**2


@dataclass(frozen=True)
class DeviceSpec:
    type: str
    kind: str  # "cuda" or "cpu"
    memory_bytes: int
    peak_flops: dict[str, float]  # dense peak by dtype: fp32, bf16, fp16
    efficiency: float = 0.5  # achieved / peak matmul throughput for large GEMMs (GPUs: measured MAMF)
    memory_bandwidth_Bps: float = 1e12  # for memory-bound work (optimizer step, embedding)
    # Per-operation preset model (profiler/roofline.py); sm_count 0: not a GPU, FLOPs x efficiency instead.
    sm_count: int = 0
    memory_efficiency: float = 0.8  # achievable share of memory_bandwidth_Bps for streaming kernels
    kernel_launch_s: float = 0.0  # floor per kernel
    # flash-attention-2 causal fwd+bwd FLOP/s by head size ("hd64", "hd128"): [[seq_len, FLOP/s], ...]
    attention_flops: dict[str, list[list[float]]] = field(default_factory=dict)
    # how far below one device's rates the slowest of a synchronous group runs (0: identical devices)
    device_spread: float = 0.0
    comm_sms: int = 0  # SMs an overlapped NCCL collective holds (GPUs)
    # device memory outside PyTorch's allocator (planner/memory_reserve.py): the CUDA context, and NCCL's
    # buffers per communicator
    context_bytes: float = 0.0
    communicator_bytes: float = 0.0
    # per-tile fixed cost of a GEMM in units of its reduction length K (throughput ∝ K/(K + gemm_k0)), and
    # the K of the shape `efficiency` was measured at; 0: not modelled
    gemm_k0: float = 0.0
    gemm_k_ref: float = 0.0
    # FP8 tensor cores (peak_flops["fp8"]): measured MAMF / peak and the K of its shape; 0: none
    fp8_efficiency: float = 0.0
    fp8_gemm_k_ref: float = 0.0

    @classmethod
    def from_dict(cls, data: dict, path: str) -> DeviceSpec:
        f = Fields(data, path)
        peak = f.number_map("peak_flops")
        for dtype in ("fp32", "bf16", "fp16"):
            if peak.get(dtype, 0) <= 0:
                raise InputError(f"{path}.peak_flops.{dtype}: expected a positive number, got {peak.get(dtype)!r}")
        eff = f.float("efficiency", min=0.0, default=0.5)
        if not 0 < eff <= 1:
            raise f.fail("efficiency", "a number in (0, 1]", eff)
        mem_eff = f.float("memory_efficiency", min=0.0, default=0.8)
        if not 0 < mem_eff <= 1:
            raise f.fail("memory_efficiency", "a number in (0, 1]", mem_eff)
        table = f.obj("attention_flops", default={}).data
        for key, points in table.items():
            if not isinstance(points, list) or not points or not all(
                    isinstance(p, list) and len(p) == 2 and all(isinstance(x, (int, float)) and x > 0 for x in p)
                    for p in points):
                raise InputError(f"{path}.attention_flops.{key}: expected a list of [seq_len, FLOP/s] pairs")
        kind = f.str("kind", choices=("cuda", "cpu"))
        gpu = kind == "cuda"
        return cls(type=f.str("type"), kind=kind,
                   memory_bytes=f.int("memory_bytes", min=1), peak_flops=peak, efficiency=eff,
                   memory_bandwidth_Bps=f.float("memory_bandwidth_Bps", min=1.0, default=1e12),
                   sm_count=f.int("sm_count", min=0, default=0), memory_efficiency=mem_eff,
                   kernel_launch_s=f.float("kernel_launch_s", min=0.0, default=0.0),
                   device_spread=f.float("device_spread", min=0.0, default=0.0),
                   comm_sms=f.int("comm_sms", min=0, default=0),
                   context_bytes=f.float("context_bytes", min=0.0, default=CUDA_CONTEXT_BYTES * gpu),
                   communicator_bytes=f.float("communicator_bytes", min=0.0, default=NCCL_COMMUNICATOR_BYTES * gpu),
                   gemm_k0=f.float("gemm_k0", min=0.0, default=0.0),
                   gemm_k_ref=f.float("gemm_k_ref", min=0.0, default=0.0),
                   fp8_efficiency=f.float("fp8_efficiency", min=0.0, default=0.0),
                   fp8_gemm_k_ref=f.float("fp8_gemm_k_ref", min=0.0, default=0.0),
                   attention_flops={k: [[float(a), float(b)] for a, b in v] for k, v in table.items()})


@dataclass(frozen=True)
class LinkSpec:
    bandwidth_Bps: float  # bytes/s per device, one direction (datasheet)
    latency_s: float  # per collective step
    efficiency: float = 1.0  # the bus bandwidth NCCL reaches over it (nccl-tests busbw) / bandwidth_Bps
    # all-reduce bus bandwidth by payload as measured, ((bytes, B/s), ...); empty: efficiency at every size
    busbw_curve: tuple[tuple[float, float], ...] = ()
    # the least ranks for which NCCL runs an all-reduce as NVLS (NVLink SHARP, reduced in the switch), when
    # the curve was measured so; every other collective on the link runs NCCL's ring, at most `bus_Bps`.
    # 0: the curve is the ring's
    nvls_min_ranks: int = 0

    @property
    def bus_Bps(self) -> float:
        return self.bandwidth_Bps * self.efficiency

    @classmethod
    def from_dict(cls, data: dict, path: str) -> LinkSpec:
        f = Fields(data, path)
        bw = f.float("bandwidth_Bps", min=0.0)
        if bw <= 0:
            raise f.fail("bandwidth_Bps", "a positive number", bw)
        eff = f.float("efficiency", min=0.0, default=1.0)
        if not 0 < eff <= 1:
            raise f.fail("efficiency", "a number in (0, 1]", eff)
        curve = f.list("busbw_curve", default=[])
        if not all(isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(x, (int, float)) and x > 0
                                                                        for x in p) for p in curve):
            raise InputError(f"{path}.busbw_curve: expected a list of [bytes, B/s] pairs")
        return cls(bandwidth_Bps=bw, latency_s=f.float("latency_s", min=0.0), efficiency=eff,
                   busbw_curve=tuple((float(a), float(b)) for a, b in curve),
                   nvls_min_ranks=f.int("nvls_min_ranks", min=0, default=0))


def _host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GiB


# Sources: NVIDIA A100 datasheet (2021): 19.5 TFLOP/s FP32, 312 TFLOP/s BF16/FP16 dense, NVLink3 600 GB/s
# total (300 GB/s per direction), HDR InfiniBand 200 Gb/s per GPU in DGX A100. NVIDIA H100 SXM datasheet
# (2023): 67 TFLOP/s FP32, 989 TFLOP/s BF16/FP16 dense, NVLink4 900 GB/s (450 per direction), NDR 400 Gb/s
# per GPU in DGX H100. H200 SXM datasheet (2024): H100 compute, 141 GB HBM3e, same NVLink/NDR.
# HBM bandwidth: A100 40GB 1.555 TB/s, A100 80GB 2.039 TB/s, H100 SXM 3.35 TB/s, H200 4.8 TB/s.
# B200 (HGX/DGX B200, docs/sources/hardware_constants.md): 2,250 TFLOP/s BF16/FP16 dense, 80 TFLOP/s FP32,
# 180 GB HBM3e (DGX B200: 1,440 GB for 8 GPUs) at 8 TB/s, NVLink5 1.8 TB/s total (900 GB/s per direction),
# 8x ConnectX-7 400 Gb/s per node (50 GB/s per GPU).
# Latencies: NCCL all-reduce small-message latency, ~5 us over NVLink, ~10 us over InfiniBand.
# Per-operation preset model (profiler/roofline.py; figures and quotes in docs/sources/hardware_constants.md):
# - efficiency: the largest-GEMM throughput measured on the device over its dense peak (MAMF, stas00/
#   ml-engineering compute/accelerator/README.md): A100 271.2/312, H100 794.5/989 (H200: same die), B200
#   1745.0/2250.
# - sm_count: A100 whitepaper 108; H100 whitepaper 132 (H200 same die); B200 148 (public kernels; not in an
#   NVIDIA document).
# - attention_flops: flash-attention-2's causal fwd+bwd TFLOP/s, bf16, by sequence length (512-16k) and head
#   size, read from Dao-AILab/flash-attention assets/flash2_a100_fwd_bwd_benchmark.png and
#   flash2_h100_fwd_bwd_benchmark.png. No B200 figure is published: H100's x (B200 MAMF / H100 MAMF), a
#   derived value, marked as such.
_SEQS = (512, 1024, 2048, 4096, 8192, 16384)


def _fa(hd64: tuple[float, ...], hd128: tuple[float, ...], scale: float = 1.0) -> dict[str, list[list[float]]]:
    return {"hd64": [[s, r * 1e12 * scale] for s, r in zip(_SEQS, hd64)],
            "hd128": [[s, r * 1e12 * scale] for s, r in zip(_SEQS, hd128)]}


# - FlashAttention-1 (flash-attn 1.x, the kernel before FlashAttention-2, for software that ran it): the
#   "FlashAttention" bars of the same two figures, causal. Its Triton port (LLM Foundry's attn_impl
#   'triton') is within 2-10 % of it on A100 (the figure's "FlashAttention Triton" bars: 50-80 at hd128);
#   no H100 figure has the port, so H100's FlashAttention-1 bars stand for both.
FA1_A100 = _fa((58, 70, 77, 87, 92, 97), (55, 62, 69, 76, 80, 83))
FA1_H100 = _fa((104, 123, 136, 138, 149, 156), (98, 109, 108, 126, 135, 137))
FA2_A100 = _fa((88, 119, 140, 156, 165, 171), (99, 133, 155, 173, 182, 189))
_FA2_H100_BARS = ((141, 192, 232, 257, 273, 284), (163, 221, 265, 294, 308, 328))  # hd64, hd128
FA2_H100 = _fa(*_FA2_H100_BARS)
FA2_B200_DERIVED = _fa(*_FA2_H100_BARS, scale=1745.0 / 794.5)
FA2_GB200_DERIVED = _fa(*_FA2_H100_BARS, scale=1822.0 / 794.5)
# B300 (Blackwell Ultra) doubles the SFU's exponentials ("Inside NVIDIA Blackwell Ultra", NVIDIA technical blog,
# 2025-08), which softmax spends; no attention kernel rate is published for it: scaled by MAMF as B200's.
FA2_B300_DERIVED = _fa(*_FA2_H100_BARS, scale=1769.0 / 794.5)
# FlashAttention-1 rates by device preset (H200: H100's die, as for FlashAttention-2); none for B200/GB200
FLASH1_PRESETS = {"a100-40gb": FA1_A100, "a100-80gb": FA1_A100, "h100-80gb": FA1_H100, "h200-141gb": FA1_H100}
# - memory_efficiency: BabelStream Triad over the datasheet bandwidth (docs/sources/hardware_constants_2.md):
#   A100 40GB 1.377/1.555 TB/s (ALCF polaris/02_profiling.md), A100 80GB 1.725/2.039 (ukri-bench
#   benchmark-BabelStream, Tursa), H100 SXM 2.97/3.35 and H200 4.18/4.8 (Azure/AI-benchmarking-guide ND v5
#   results). B200: no measurement published; H200's share assumed.
# - kernel_launch_s: cudaLaunchKernel's mean host time on A100, 3.50 us over 501 calls (ALCF nsys profile);
#   3.0-3.3 us on GB200 (meta-pytorch/tritonbench PR #1017).
# - device_spread: GPUs of one model differ, "I have seen 5% and higher differences on an 8-gpu node"
#   (stas00/ml-engineering compute/accelerator/README.md, "Not all accelerators are created equal"), and a
#   synchronous group runs at its slowest.
# - comm_sms: an NCCL all-gather overlapping a GEMM on H100 launched 24 blocks (NVIDIA developer forum,
#   "Compute-Communication Overlap Causes Severe GEMM Performance Degradation because of Tail Effect",
#   nsys); taken for every GPU preset.
# - context_bytes: the CUDA context, "about 400 MB" with CUDA >= 11.7's lazy module loading (ptrblck,
#   pytorch/pytorch#109888; PR #86509 measured 287,047,680 B lazy, 666,632,192 B eager).
# - communicator_bytes: NCCL's buffers for one communicator: each channel keeps 4 MiB (Simple), 4.69 MiB
#   (LL128) and 512 KiB (LL) per connection (NVIDIA/nccl src/init.cc, NCCL_BUFFSIZE defaults); measured on
#   A100 with NVLink, 544 MB for a 2-GPU group and 688 MB for a 4-GPU group (NVIDIA/nccl#964): the larger.
# - gemm_k0, gemm_k_ref: a GEMM tile's prologue and epilogue cost a fixed time, so throughput rises with the
#   reduction length K as K/(K + K0). H100 (sm_90; H200 the same die): OpenXLA's measured GEMM table
#   (xla/service/gpu/model/matmul_interpolator_data.h @71feeddf, bf16, M = N = 4096, median kernel time):
#   685.2 TFLOP/s at K = 1024 and 780.2 at K = 4096, so K0 = 1024·4096·(1 − r)/(4096·r − 1024) with
#   r = 685.2/780.2: 198 (an H800 SXM sweep at M = N = 8192, tile-ai/tilelang benchmark/matmul, gives 249).
#   MAMF was measured at 2048x2048x13312 (ml-engineering), K_ref 13312. A100: no K sweep is published;
#   K0 derived from H100's, a derived value: clock for clock an H100 SM runs twice the A100 SM's matrix
#   rate (H100 whitepaper; 1,024 dense FP16 FMA per SM per clock on A100), so a K step of a tile takes
#   twice the cycles, while the fixed part (writing the 256x128 output tile) moves the same bytes at
#   about the same HBM bytes per SM clock (A100 80GB 2.039 TB/s / 108 / 1.41 GHz = 13.4, H100 3.35 /
#   132 / 1.83 = 13.9): K0 = 198 / 2. Its MAMF shape is not published: H100's K is taken (the
#   normalisation is 1.007 there). Cross-check in docs/sources/hardware_constants_2.md §6.5.
#   B200 has one (XLA sm_100) but its MAMF shape is not published with it: not modelled.
H100_GEMM_K0, H100_MAMF_K = 198.0, 13312.0
A100_GEMM_K0_DERIVED = H100_GEMM_K0 / 2
LAUNCH_S = 3.5e-6
CUDA_CONTEXT_BYTES = 400e6
NCCL_COMMUNICATOR_BYTES = 688e6
DEVICE_SPREAD = 0.05
COMM_SMS = 24


def _gpu(name: str, mem: int, peak: dict[str, float], hbm: float, mamf: float, sms: int,
         fa: dict[str, list[list[float]]], hbm_share: float, k0: float = 0.0, k_ref: float = 0.0,
         fp8: tuple[float, float] = (0.0, 0.0)) -> DeviceSpec:
    return DeviceSpec(name, "cuda", mem, peak, efficiency=mamf, memory_bandwidth_Bps=hbm, sm_count=sms,
                      memory_efficiency=hbm_share, kernel_launch_s=LAUNCH_S, attention_flops=fa,
                      device_spread=DEVICE_SPREAD, comm_sms=COMM_SMS, context_bytes=CUDA_CONTEXT_BYTES,
                      communicator_bytes=NCCL_COMMUNICATOR_BYTES, gemm_k0=k0, gemm_k_ref=k_ref,
                      fp8_efficiency=fp8[0], fp8_gemm_k_ref=fp8[1])


# - FP8 (float8_e4m3fn) tensor cores: dense peak (H100/H200 SXM datasheets 1,979 TFLOP/s, B200 4,500, GB200
#   5,000, B300 4,500; the "Theory" column of the table below) and MAMF with its shape (stas00/ml-engineering
#   compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS", FP8 table): H100 SXM 1402.6 at
#   1024x9216x14336, H200 SXM 1453.4 at 1280x4096x12032, B200 3432.5 at 15360x4096x3072, GB200 3615.6 at
#   19456x5120x1536, B300 3353.3 at 3072x6144x7168. A100 has no FP8 tensor cores.
_A100 = {"fp32": 19.5e12, "bf16": 312e12, "fp16": 312e12}
_H100 = {"fp32": 67e12, "bf16": 989e12, "fp16": 989e12, "fp8": 1979e12}
DEVICE_PRESETS: dict[str, DeviceSpec] = {
    "a100-40gb": _gpu("a100-40gb", 40960 * MiB, _A100, 1.555e12, 271.2 / 312, 108, FA2_A100, 1.377 / 1.555,
                      A100_GEMM_K0_DERIVED, H100_MAMF_K),
    "a100-80gb": _gpu("a100-80gb", 81920 * MiB, _A100, 2.039e12, 271.2 / 312, 108, FA2_A100, 1.725 / 2.039,
                      A100_GEMM_K0_DERIVED, H100_MAMF_K),
    "h100-80gb": _gpu("h100-80gb", 81559 * MiB, _H100, 3.35e12, 794.5 / 989, 132, FA2_H100, 2.97 / 3.35,
                      H100_GEMM_K0, H100_MAMF_K, fp8=(1402.6 / 1979, 14336)),
    "h200-141gb": _gpu("h200-141gb", 143771 * MiB, _H100, 4.8e12, 794.5 / 989, 132, FA2_H100, 4.18 / 4.8,
                       H100_GEMM_K0, H100_MAMF_K, fp8=(1453.4 / 1979, 12032)),
    "b200-180gb": _gpu("b200-180gb", 180 * 1000**3,
                       {"fp32": 80e12, "bf16": 2250e12, "fp16": 2250e12, "fp8": 4500e12}, 8e12,
                       1745.0 / 2250, 148, FA2_B200_DERIVED, 4.18 / 4.8, fp8=(3432.5 / 4500, 3072)),
    # GB200 NVL72 (nvidia.com gb200-nvl72: 360 PFLOP/s sparse BF16 per 72 GPUs -> 2,500 dense each; 186 GB
    # HBM3e at 8 TB/s; FP32 80, ml-engineering); MAMF 1822.0 (ml-engineering L358); SMs and HBM share as B200.
    "gb200-186gb": _gpu("gb200-186gb", 186 * 1000**3,
                        {"fp32": 80e12, "bf16": 2500e12, "fp16": 2500e12, "fp8": 5000e12}, 8e12,
                        1822.0 / 2500, 148, FA2_GB200_DERIVED, 4.18 / 4.8, fp8=(3615.6 / 5000, 1536)),
    # HGX/DGX B300 (Blackwell Ultra): dense BF16 2,250 and FP8 4,500 TFLOP/s, FP32 80, 288 GB HBM3e at 8 TB/s
    # (ml-engineering compute/accelerator/README.md tables, from the DGX B300 datasheet); MAMF 1769.0 at
    # 12288x18432x1024 (ml-engineering, BF16 table); 160 SMs ("Inside NVIDIA Blackwell Ultra"); HBM share as B200.
    "b300-288gb": _gpu("b300-288gb", 288 * 1000**3,
                       {"fp32": 80e12, "bf16": 2250e12, "fp16": 2250e12, "fp8": 4500e12}, 8e12,
                       1769.0 / 2250, 160, FA2_B300_DERIVED, 4.18 / 4.8, fp8=(3353.3 / 4500, 7168)),
    # GB300 NVL72 (Blackwell Ultra in the NVL72 rack): dense BF16 2,500 and FP8 5,000 TFLOP/s, FP32 80
    # (ml-engineering compute/accelerator/README.md TFLOPS table, note 24: "GB200 NVL72 and GB300 NVL72 seem to be
    # the same but faster fp4 and more memory for the latter", from nvidia.com gb300-nvl72); the B300 die's 288 GB
    # HBM3e at 8 TB/s and 160 SMs. No GB300 MAMF is published: GB200's share of the same peak (BF16 and FP8),
    # and GB200's attention rates; HBM share as B200.
    "gb300-288gb": _gpu("gb300-288gb", 288 * 1000**3,
                        {"fp32": 80e12, "bf16": 2500e12, "fp16": 2500e12, "fp8": 5000e12}, 8e12,
                        1822.0 / 2500, 160, FA2_GB200_DERIVED, 4.18 / 4.8, fp8=(3615.6 / 5000, 1536)),
    # A CPU "device" is one process; its memory is this host's RAM shared by the processes of a node
    # (set in parse_cluster). FLOP/s: a nominal few-core AVX2 figure; the profiler measures the real one.
    "cpu": DeviceSpec("cpu", "cpu", 16 * GiB, {"fp32": 1e11, "bf16": 2e10, "fp16": 1e10}, efficiency=0.3,
                      memory_bandwidth_Bps=2e10),
}

# Links, per GPU and direction: datasheet bandwidth, latency per ring step, and the bus bandwidth NCCL reaches
# over it as a share of the datasheet figure (nccl-tests' busbw, "the speed of the hardware bottleneck";
# docs/sources/hardware_constants.md §4, hardware_constants_2.md §3-4):
# - NVLink: A100 300 GB/s, H100/H200 450, B200 900. Ring all-reduce busbw over 8 GPUs at 8-16 GiB (NVLS
#   off): A100 234.89 GB/s, H200 367.2 (H100: the same NVLink4 / NVSwitch), B200 682.2
#   (stas00/ml-engineering network/README.md).
# - InfiniBand per GPU NIC: HDR 200 Gb/s = 25 GB/s, ~24 "on perfect setups" (nccl-tests #160; NVIDIA/nccl
#   #812: 192 GB/s all-reduce busbw with 8x HDR); NDR 400 Gb/s = 50 GB/s, 46-48 per NIC (nccl-tests #290).
# - Latency per ring step, NCCL's tuning model (NVIDIA/nccl src/graph/tuning.cc, LL128): NVLink 1.9 us,
#   network 4.0 us.
_NVLINK_LAT, _NET_LAT = 1.9e-6, 4.0e-6
# All-reduce busbw by payload inside one 8-GPU node (stas00/ml-engineering network/README.md @744d01e1,
# "Real network throughput"): A100, nccl-tests all_reduce_perf 32 KiB-16 GiB; H200, all_reduce_bench.py with
# NCCL's defaults (NVLS on: 482 GB/s at 16 GiB; H100 has the same NVLink4 / NVSwitch); B200, all_reduce_bench.py
# on one P6-B200 node (nccl 2.27.7). Payloads are 32 KiB x 2^i.
# NVLS, NVLink SHARP, is behind the H200 and B200 curves' top: NCCL runs it for an all-reduce over more than 4
# H200s (5 GPUs: 414.2 GB/s against 364.4 with NVLS off; 8: 473.1 against 365.6) and more than 5 B200s, and
# for no other collective: on the same H200 node all-gather 361.4 and reduce-scatter 362.9 GB/s at 16 GiB,
# the ring's, as the all-reduce's 367.2 with NVLS off (ml-engineering network/README.md @744d01e1, "NVLink
# SHARP"). So those run at most the ring's bus bandwidth (`LinkSpec.nvls_min_ranks`).
_SIZES = [32768 * 2**i for i in range(20)]


def _curve(gbps: tuple[float, ...]) -> tuple[tuple[float, float], ...]:
    return tuple((float(s), g * 1e9) for s, g in zip(_SIZES, gbps))


A100_BUSBW = _curve((1.31, 2.45, 4.43, 7.47, 11.41, 18.00, 36.18, 72.33, 109.93, 106.16, 138.49, 171.54, 176.92,
                     194.07, 222.72, 229.04, 231.41, 233.88, 234.61, 234.89))
H200_BUSBW = _curve((1.44, 2.93, 5.73, 11.74, 23.94, 39.93, 64.53, 107.16, 155.53, 219.89, 275.84, 346.51, 401.93,
                     436.15, 450.29, 463.58, 469.17, 473.10, 477.45, 482.26))
B200_BUSBW = _curve((1.20, 2.17, 4.86, 9.54, 18.71, 36.06, 63.09, 76.48, 126.49, 254.96, 325.97, 400.60, 568.38,
                     646.11, 688.99, 723.34, 734.97, 740.64, 839.07, 845.67))
_HDR = LinkSpec(25e9, _NET_LAT, 24 / 25)
_NDR = LinkSpec(50e9, _NET_LAT, 47 / 50)
# XDR 800 Gb/s = 100 GB/s per GPU (DGX B300: eight ConnectX-8, "up to 800Gb/s", DGX B300 datasheet; the DGX
# SuperPOD B300 reference architecture's XDR InfiniBand). No nccl-tests figure at 800 Gb/s is published: NDR's
# share of the line rate is taken.
_XDR = LinkSpec(100e9, _NET_LAT, 47 / 50)
LINK_PRESETS: dict[str, tuple[LinkSpec, LinkSpec]] = {  # (intra-node, inter-node)
    "a100-40gb": (LinkSpec(300e9, _NVLINK_LAT, 234.89 / 300, A100_BUSBW), _HDR),
    "a100-80gb": (LinkSpec(300e9, _NVLINK_LAT, 234.89 / 300, A100_BUSBW), _HDR),
    "h100-80gb": (LinkSpec(450e9, _NVLINK_LAT, 367.2 / 450, H200_BUSBW, nvls_min_ranks=5), _NDR),
    "h200-141gb": (LinkSpec(450e9, _NVLINK_LAT, 367.2 / 450, H200_BUSBW, nvls_min_ranks=5), _NDR),
    "b200-180gb": (LinkSpec(900e9, _NVLINK_LAT, 682.2 / 900, B200_BUSBW, nvls_min_ranks=6), _NDR),
    # B300: the same NVLink5 / NVSwitch generation as B200 (1.8 TB/s per GPU, both directions); no B300 busbw
    # curve is published: B200's.
    "b300-288gb": (LinkSpec(900e9, _NVLINK_LAT, 682.2 / 900, B200_BUSBW, nvls_min_ranks=6), _XDR),
    # NVL72: NVLink5 across the rack; ring all-reduce busbw 680 GB/s (NVIDIA GTC slide cited in
    # ml-engineering network/README.md L957); one ConnectX-7 400 Gb/s per GPU (DGX GB200 user guide).
    "gb200-186gb": (LinkSpec(900e9, _NVLINK_LAT, 680 / 900), _NDR),
    # GB300 NVL72: the same NVLink5 rack (130 TB/s over 72 GPUs, nvidia.com gb300-nvl72) with a ConnectX-8
    # SuperNIC, 800 Gb/s, per GPU (Quantum-X800: ml-engineering network/README.md).
    "gb300-288gb": (LinkSpec(900e9, _NVLINK_LAT, 680 / 900), _XDR),
    # gloo over loopback TCP: a few GB/s, tens of microseconds (measured by the profiler when present).
    "cpu": (LinkSpec(2e9, 50e-6), LinkSpec(1e9, 100e-6)),
}
# Scalable units of NVIDIA's DGX SuperPOD reference architectures (a non-blocking, rail-optimised fat tree):
# 20 DGX A100 per SU, 32 DGX H100/H200/B200 per SU, 64 DGX B300 per SU (its busbar RA; 72 in the PSU one).
TOPOLOGY_PRESETS: dict[str, Topology] = {
    "a100-40gb": Topology(nodes_per_leaf=20), "a100-80gb": Topology(nodes_per_leaf=20),
    "h100-80gb": Topology(nodes_per_leaf=32), "h200-141gb": Topology(nodes_per_leaf=32),
    "b200-180gb": Topology(nodes_per_leaf=32), "b300-288gb": Topology(nodes_per_leaf=64), "cpu": Topology(),
    # 18 compute trays of 4 GPUs in one NVLink domain; the DGX GB200 SuperPOD SU is 8 racks (576 GPUs).
    "gb200-186gb": Topology(nvlink_domain=72, nodes_per_leaf=144),
    "gb300-288gb": Topology(nvlink_domain=72, nodes_per_leaf=144),  # GB200's SuperPOD unit (none published)
}


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    num_nodes: int
    devices_per_node: int
    device: DeviceSpec
    intra_node: LinkSpec
    inter_node: LinkSpec
    topology: Topology = Topology()

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.devices_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.devices_per_node

    def domain_of(self, rank: int) -> int:
        """NVLink domain of a rank (one node unless the topology says more, e.g. NVL72)."""
        return rank // domain_size(self.topology, self.devices_per_node)

    def link(self, a: int, b: int) -> LinkSpec:
        """The link class between two global ranks: NVLink inside a domain, else the NIC."""
        return self.intra_node if self.domain_of(a) == self.domain_of(b) else self.inter_node

    def graph(self) -> nx.Graph:
        """GPUs, NVLink domains, per-GPU NICs on rail leaves, spine (planner/topology.py). Linear in the
        number of devices (3072 GPUs: ~6k edges)."""
        return build_graph(self.name, self.num_nodes, self.devices_per_node, self.topology,
                           self.intra_node.bandwidth_Bps, self.intra_node.latency_s, self.inter_node.bandwidth_Bps,
                           self.inter_node.latency_s, self.device.memory_bytes)

    def to_dict(self) -> dict:
        data = asdict(self) | {"world_size": self.world_size}
        for link in ("intra_node", "inter_node"):  # tuples of the frozen spec as JSON reads them back
            data[link]["busbw_curve"] = [list(p) for p in data[link]["busbw_curve"]]
        return data

    @classmethod
    def from_dict(cls, data: dict, path: str = "cluster") -> ClusterSpec:
        f = Fields(data, path)
        spec = cls(
            name=f.str("name"), num_nodes=f.int("num_nodes", min=1), devices_per_node=f.int("devices_per_node", min=1),
            device=DeviceSpec.from_dict(f.obj("device").data, f"{path}.device"),
            intra_node=LinkSpec.from_dict(f.obj("intra_node").data, f"{path}.intra_node"),
            inter_node=LinkSpec.from_dict(f.obj("inter_node").data, f"{path}.inter_node"),
            topology=Topology.from_dict(f.obj("topology", default={}).data, f"{path}.topology"),
        )
        dom = domain_size(spec.topology, spec.devices_per_node)
        if dom % spec.devices_per_node or spec.world_size % dom:
            raise InputError(f"{path}.topology.nvlink_domain: expected a multiple of devices_per_node "
                             f"({spec.devices_per_node}) that divides the world size {spec.world_size}, got {dom}")
        if "world_size" in data and f.int("world_size", min=1) != spec.world_size:
            raise f.fail("world_size", f"{spec.world_size} (num_nodes x devices_per_node)", data["world_size"])
        return spec


def preset_cluster(num_nodes: int, devices_per_node: int, device_type: str, name: str | None = None) -> ClusterSpec:
    if device_type not in DEVICE_PRESETS:
        raise InputError(
            f"CLUSTER: unknown device type '{device_type}'; expected one of {', '.join(DEVICE_PRESETS)}"
        )
    device = DEVICE_PRESETS[device_type]
    if device.kind == "cpu":
        if num_nodes != 1:
            raise InputError("CLUSTER: cpu clusters run on this host: expected 'Nxcpu' (one node)")
        device = replace(device, memory_bytes=_host_memory_bytes() // devices_per_node)
    intra, inter = LINK_PRESETS[device_type]
    label = f"{devices_per_node}x{device_type}"
    label = name or (f"{num_nodes}x{label}" if num_nodes > 1 else label)
    topo = TOPOLOGY_PRESETS.get(device_type, Topology())
    world = num_nodes * devices_per_node
    if topo.nvlink_domain and world % topo.nvlink_domain:
        topo = replace(topo, nvlink_domain=spread_domain(world, topo.nvlink_domain, devices_per_node))
    if topo.nvlink_domain and (topo.nvlink_domain % devices_per_node or world % topo.nvlink_domain):
        full = TOPOLOGY_PRESETS[device_type].nvlink_domain
        fits = next(n for n in range(num_nodes, 0, -1)
                    if (n * devices_per_node) % spread_domain(n * devices_per_node, full, devices_per_node) == 0)
        raise InputError(f"CLUSTER: {device_type} comes in NVLink domains of {full} GPUs; expected a count the "
                         f"fewest domains share in whole nodes of {devices_per_node} (e.g. {fits}x{devices_per_node}), "
                         f"got {num_nodes}x{devices_per_node}; a cluster file sets other layouts "
                         f"(topology.nvlink_domain)")
    return ClusterSpec(label, num_nodes, devices_per_node, device, intra, inter, topo)


def spread_domain(world: int, domain: int, devices_per_node: int) -> int:
    """GPUs per NVLink domain for a job of `world` GPUs that whole domains (an NVL72 rack: 72) do not divide:
    the fewest domains that hold it, each filled alike (128 GB200s: 2 racks of 64, as a Slurm allocation of
    equal segments per rack gives them), when that comes out in whole nodes; a part of one rack is one
    domain. Otherwise the domain unchanged, which `preset_cluster` then refuses."""
    racks = -(-world // domain)
    share = world // racks
    return share if world % racks == 0 and share % devices_per_node == 0 else domain


def gpu_preset_type(name: str, total_memory: int) -> str | None:
    """The device preset of a GPU by its CUDA name (GB200 before B200, GB300 before B300: their names contain
    both); None for another GPU."""
    title = name.upper()
    for tag, preset in (("GB200", "gb200-186gb"), ("GB300", "gb300-288gb"), ("B300", "b300-288gb"),
                        ("B200", "b200-180gb"), ("H200", "h200-141gb"), ("H100", "h100-80gb")):
        if tag in title:
            return preset
    if "A100" in title:
        return "a100-80gb" if total_memory / GiB > 50 else "a100-40gb"
    return None


def local_cluster() -> ClusterSpec:
    """This machine as it is: its CUDA devices if any, else one CPU process."""
    import torch

    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        props = torch.cuda.get_device_properties(0)
        dtype = gpu_preset_type(props.name, props.total_memory) or "a100-80gb"
        base = preset_cluster(1, count, dtype, name="local")
        device = replace(base.device, type=props.name, memory_bytes=props.total_memory)
        return replace(base, device=device)
    return preset_cluster(1, 1, "cpu", name="local")


_CLUSTER_RE = re.compile(r"^(?:(?P<nodes>[^x]+)x)?(?P<gpus>[^x]+)x(?P<type>[a-z][a-z0-9-]*)$")


def _size(text: str, what: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise InputError(f"CLUSTER: {what} must be a positive integer, got '{text}'")
    return int(text)


def _deep_merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _yaml_load(text: str) -> Any:
    """YAML with YAML 1.2 floats: PyYAML alone reads `5e10` (no dot, no sign) as a string."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:\d[\d_]*\.?[\d_]*(?:[eE][-+]?\d+)?|\.\d[\d_]*(?:[eE][-+]?\d+)?)$"),
        list("-+0123456789."),
    )
    return yaml.load(text, Loader=Loader)


def load_cluster_file(path: str) -> ClusterSpec:
    """A YAML or JSON file: `base:` a cluster string (optional), then any ClusterSpec field to override."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise InputError(f"CLUSTER: cannot read '{path}': {exc.strerror}") from None
    try:
        if path.endswith(".json"):
            data: Any = json.loads(text)
        else:
            data = _yaml_load(text)
    except Exception as exc:
        raise InputError(f"CLUSTER: '{path}' is not valid {'JSON' if path.endswith('.json') else 'YAML'}: "
                         f"{str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a mapping of cluster fields")
    data = dict(data)
    data.setdefault("name", os.path.splitext(os.path.basename(path))[0])
    base_text = data.pop("base", None)
    if base_text is not None:
        if not isinstance(base_text, str):
            raise InputError(f"{path}.base: expected a cluster string such as '2x8xh100-80gb'")
        base = parse_cluster(base_text).to_dict()
        base.pop("world_size")
        data = _deep_merge(base, data)
    else:
        device = data.get("device")
        if isinstance(device, dict) and device.get("type") in DEVICE_PRESETS:
            data["device"] = _deep_merge(asdict(DEVICE_PRESETS[device["type"]]), device)
    return ClusterSpec.from_dict(data, path)


def parse_cluster(text: str) -> ClusterSpec:
    """CLUSTER as given on the command line (DESIGN.md §2)."""
    if text == "local":
        return local_cluster()
    if text.endswith((".json", ".yaml", ".yml")) or os.path.isfile(text):
        return load_cluster_file(text)
    m = _CLUSTER_RE.match(text.lower())
    if not m:
        raise InputError(
            f"CLUSTER: cannot parse '{text}': expected GxTYPE, NxGxTYPE, Nxcpu, local or a cluster file"
        )
    nodes = _size(m["nodes"], "the node count") if m["nodes"] is not None else 1
    gpus = _size(m["gpus"], "the device count")
    return preset_cluster(nodes, gpus, m["type"])
