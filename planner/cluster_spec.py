"""ClusterSpec: nodes x devices per node x device type, with link classes, as a networkx graph.

Preset values are the vendors' published figures (dense, no sparsity); memory is what `nvidia-smi`
reports as total. Link bandwidths are per device, one direction, as NCCL's "bus bandwidth" sees them.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, replace
from typing import Any

import networkx as nx
from meshplan.planner.errors import InputError
from meshplan.planner.fields import Fields

GiB = 1024**3
MiB = 1024**2


@dataclass(frozen=True)
class DeviceSpec:
    type: str
    kind: str  # "cuda" or "cpu"
    memory_bytes: int
    peak_flops: dict[str, float]  # dense peak by dtype: fp32, bf16, fp16
    efficiency: float = 0.5  # achieved / peak matmul throughput assumed for presets (user-overridable)
    memory_bandwidth_Bps: float = 1e12  # for memory-bound work (optimizer step, embedding)

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
        return cls(type=f.str("type"), kind=f.str("kind", choices=("cuda", "cpu")),
                   memory_bytes=f.int("memory_bytes", min=1), peak_flops=peak, efficiency=eff,
                   memory_bandwidth_Bps=f.float("memory_bandwidth_Bps", min=1.0, default=1e12))


@dataclass(frozen=True)
class LinkSpec:
    bandwidth_Bps: float  # bytes/s per device, one direction
    latency_s: float

    @classmethod
    def from_dict(cls, data: dict, path: str) -> LinkSpec:
        f = Fields(data, path)
        bw = f.float("bandwidth_Bps", min=0.0)
        if bw <= 0:
            raise f.fail("bandwidth_Bps", "a positive number", bw)
        return cls(bandwidth_Bps=bw, latency_s=f.float("latency_s", min=0.0))


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
DEVICE_PRESETS: dict[str, DeviceSpec] = {
    "a100-40gb": DeviceSpec("a100-40gb", "cuda", 40960 * MiB, {"fp32": 19.5e12, "bf16": 312e12, "fp16": 312e12},
                            memory_bandwidth_Bps=1.555e12),
    "a100-80gb": DeviceSpec("a100-80gb", "cuda", 81920 * MiB, {"fp32": 19.5e12, "bf16": 312e12, "fp16": 312e12},
                            memory_bandwidth_Bps=2.039e12),
    "h100-80gb": DeviceSpec("h100-80gb", "cuda", 81559 * MiB, {"fp32": 67e12, "bf16": 989e12, "fp16": 989e12},
                            memory_bandwidth_Bps=3.35e12),
    "h200-141gb": DeviceSpec("h200-141gb", "cuda", 143771 * MiB, {"fp32": 67e12, "bf16": 989e12, "fp16": 989e12},
                             memory_bandwidth_Bps=4.8e12),
    "b200-180gb": DeviceSpec("b200-180gb", "cuda", 180 * 1000**3, {"fp32": 80e12, "bf16": 2250e12, "fp16": 2250e12},
                             memory_bandwidth_Bps=8e12),
    # A CPU "device" is one process; its memory is this host's RAM shared by the processes of a node
    # (set in parse_cluster). FLOP/s: a nominal few-core AVX2 figure; the profiler measures the real one.
    "cpu": DeviceSpec("cpu", "cpu", 16 * GiB, {"fp32": 1e11, "bf16": 2e10, "fp16": 1e10}, efficiency=0.3,
                      memory_bandwidth_Bps=2e10),
}

LINK_PRESETS: dict[str, tuple[LinkSpec, LinkSpec]] = {  # (intra-node, inter-node)
    "a100-40gb": (LinkSpec(300e9, 5e-6), LinkSpec(25e9, 10e-6)),
    "a100-80gb": (LinkSpec(300e9, 5e-6), LinkSpec(25e9, 10e-6)),
    "h100-80gb": (LinkSpec(450e9, 5e-6), LinkSpec(50e9, 10e-6)),
    "h200-141gb": (LinkSpec(450e9, 5e-6), LinkSpec(50e9, 10e-6)),
    "b200-180gb": (LinkSpec(900e9, 5e-6), LinkSpec(50e9, 10e-6)),
    # gloo over loopback TCP: a few GB/s, tens of microseconds (measured by the profiler when present).
    "cpu": (LinkSpec(2e9, 50e-6), LinkSpec(1e9, 100e-6)),
}


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    num_nodes: int
    devices_per_node: int
    device: DeviceSpec
    intra_node: LinkSpec
    inter_node: LinkSpec

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.devices_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.devices_per_node

    def link(self, a: int, b: int) -> LinkSpec:
        """The link class between two global ranks."""
        return self.intra_node if self.node_of(a) == self.node_of(b) else self.inter_node

    def graph(self) -> nx.Graph:
        """Devices joined by one switch per node (NVSwitch / shared memory) and one fabric (InfiniBand /
        TCP) that every device reaches through its own NIC, as in a DGX. Edges carry `bandwidth_Bps`,
        `latency_s` (half the link's latency per hop) and `link`; the lowest-latency path between two
        devices crosses exactly their link class. Linear in the number of devices (3072 GPUs: ~6k edges).
        """
        g = nx.Graph(name=self.name)
        g.add_node("fabric", kind="fabric")
        for n in range(self.num_nodes):
            switch = f"node{n}"
            g.add_node(switch, kind="switch", node=n)
            for d in range(self.devices_per_node):
                rank = n * self.devices_per_node + d
                g.add_node(rank, kind="device", node=n, local_rank=d, memory_bytes=self.device.memory_bytes)
                g.add_edge(rank, switch, bandwidth_Bps=self.intra_node.bandwidth_Bps,
                           latency_s=self.intra_node.latency_s / 2, link="intra_node")
                if self.num_nodes > 1:
                    g.add_edge(rank, "fabric", bandwidth_Bps=self.inter_node.bandwidth_Bps,
                               latency_s=self.inter_node.latency_s / 2, link="inter_node")
        return g

    def to_dict(self) -> dict:
        return asdict(self) | {"world_size": self.world_size}

    @classmethod
    def from_dict(cls, data: dict, path: str = "cluster") -> ClusterSpec:
        f = Fields(data, path)
        spec = cls(
            name=f.str("name"), num_nodes=f.int("num_nodes", min=1), devices_per_node=f.int("devices_per_node", min=1),
            device=DeviceSpec.from_dict(f.obj("device").data, f"{path}.device"),
            intra_node=LinkSpec.from_dict(f.obj("intra_node").data, f"{path}.intra_node"),
            inter_node=LinkSpec.from_dict(f.obj("inter_node").data, f"{path}.inter_node"),
        )
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
    return ClusterSpec(label, num_nodes, devices_per_node, device, intra, inter)


def local_cluster() -> ClusterSpec:
    """This machine as it is: its CUDA devices if any, else one CPU process."""
    import torch

    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        props = torch.cuda.get_device_properties(0)
        gib = props.total_memory / GiB
        title = props.name.upper()
        if "B200" in title:
            dtype = "b200-180gb"
        elif "H200" in title:
            dtype = "h200-141gb"
        elif "H100" in title:
            dtype = "h100-80gb"
        elif "A100" in title:
            dtype = "a100-80gb" if gib > 50 else "a100-40gb"
        else:
            dtype = "a100-80gb"
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
