import json

import pytest
from meshplan.planner.cluster_spec import ClusterSpec, GiB, parse_cluster
from meshplan.planner.errors import InputError


@pytest.mark.parametrize("text,nodes,per_node,dtype", [
    ("8xa100-80gb", 1, 8, "a100-80gb"),
    ("4xa100-40gb", 1, 4, "a100-40gb"),
    ("16x8xh100-80gb", 16, 8, "h100-80gb"),
    ("2x8xh200-141gb", 2, 8, "h200-141gb"),
    ("4xcpu", 1, 4, "cpu"),
])
def test_preset_strings(text, nodes, per_node, dtype):
    c = parse_cluster(text)
    assert (c.num_nodes, c.devices_per_node, c.device.type) == (nodes, per_node, dtype)
    assert c.world_size == nodes * per_node


def test_preset_values():
    c = parse_cluster("8xa100-80gb")
    assert c.device.memory_bytes == 80 * GiB
    assert c.device.peak_flops["bf16"] == 312e12
    assert c.intra_node.bandwidth_Bps > c.inter_node.bandwidth_Bps


def test_cpu_ranks_share_host_memory():
    one, four = parse_cluster("1xcpu"), parse_cluster("4xcpu")
    assert abs(four.device.memory_bytes * 4 - one.device.memory_bytes) <= 4


def test_local_without_gpu_is_one_cpu():
    c = parse_cluster("local")
    assert c.world_size >= 1 and c.name == "local"


def test_link_classes_and_graph():
    c = parse_cluster("2x4xh100-80gb")
    assert c.link(0, 3) == c.intra_node and c.link(3, 4) == c.inter_node
    g = c.graph()
    devices = [n for n, d in g.nodes(data=True) if d["kind"] == "device"]
    assert len(devices) == 8
    import networkx as nx

    def bottleneck(a, b):
        path = nx.shortest_path(g, a, b, weight="latency_s")
        return min(g.edges[u, v]["bandwidth_Bps"] for u, v in zip(path, path[1:]))

    assert bottleneck(0, 5) == c.inter_node.bandwidth_Bps
    assert bottleneck(0, 3) == c.intra_node.bandwidth_Bps


def test_json_round_trip():
    c = parse_cluster("16x8xh100-80gb")
    assert ClusterSpec.from_dict(json.loads(json.dumps(c.to_dict()))) == c


@pytest.mark.parametrize("text,message", [
    ("8xb200", "unknown device type 'b200'"),
    ("0xa100-80gb", "positive integer, got '0'"),
    ("-2xa100-80gb", "positive integer"),
    ("1.5xa100-80gb", "positive integer"),
    ("a100", "cannot parse"),
    ("2x4xcpu", "one node"),
])
def test_bad_cluster_strings(text, message):
    with pytest.raises(InputError, match=message):
        parse_cluster(text)


def test_cluster_file_yaml_overrides(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("base: 2x8xa100-80gb\ninter_node:\n  bandwidth_Bps: 5.0e10\ndevice:\n  memory_bytes: 1000000\n")
    c = parse_cluster(str(path))
    assert c.num_nodes == 2 and c.inter_node.bandwidth_Bps == 5e10 and c.device.memory_bytes == 1000000
    assert c.device.peak_flops["bf16"] == 312e12 and c.name == "mine"


def test_cluster_file_json_full(tmp_path):
    spec = parse_cluster("4xh100-80gb").to_dict()
    spec["name"] = "custom"
    path = tmp_path / "c.json"
    path.write_text(json.dumps(spec))
    assert parse_cluster(str(path)).name == "custom"


@pytest.mark.parametrize("body,message", [
    ("base: 2x8xa100-80gb\ndevice:\n  memory_bytes: -5\n", r"device\.memory_bytes: expected a positive integer"),
    ("base: 2x8xa100-80gb\nnum_nodes: two\n", r"num_nodes: expected an integer"),
    ("base: 8xfoo\n", "unknown device type"),
    ("base: 8xa100-80gb\nintra_node: {bandwidth_Bps: 0, latency_s: 1e-6}\n", r"intra_node\.bandwidth_Bps"),
    ("num_nodes: 1\n", r"missing"),
    ("[1, 2]\n", "expected a mapping"),
    ("a: [\n", "not valid YAML"),
])
def test_bad_cluster_files(tmp_path, body, message):
    path = tmp_path / "bad.yaml"
    path.write_text(body)
    with pytest.raises(InputError, match=message):
        parse_cluster(str(path))


def test_b200_preset():
    """HGX/DGX B200 datasheet figures: 2.25 PFLOP/s dense BF16, 180 GB at 8 TB/s, NVLink5 900 GB/s a direction."""
    c = parse_cluster("2x8xb200-180gb")
    assert c.world_size == 16 and c.device.peak_flops["bf16"] == 2250e12
    assert c.device.memory_bytes == 180 * 1000**3 and c.device.memory_bandwidth_Bps == 8e12
    assert c.intra_node.bandwidth_Bps == 900e9 and c.inter_node.bandwidth_Bps == 50e9
    assert c.intra_node.bus_Bps == pytest.approx(682.2e9) and c.inter_node.bus_Bps == pytest.approx(47e9)


def test_b300_preset():
    """DGX B300 figures: B200's dense BF16/FP8 peaks with 288 GB, 160 SMs, XDR 800 Gb/s NICs, SUs of 64 nodes;
    B300's measured MAMF (1769.0) and FP8 MAMF (3353.3)."""
    c = parse_cluster("2x8xb300-288gb")
    d = c.device
    assert d.peak_flops["bf16"] == 2250e12 and d.peak_flops["fp8"] == 4500e12 and d.memory_bytes == 288 * 1000**3
    assert d.peak_flops["bf16"] * d.efficiency == pytest.approx(1769.0e12) and d.sm_count == 160
    assert d.peak_flops["fp8"] * d.fp8_efficiency == pytest.approx(3353.3e12)
    assert c.intra_node.bus_Bps == pytest.approx(682.2e9) and c.inter_node.bandwidth_Bps == 100e9
    assert c.topology.nodes_per_leaf == 64


def test_gb300_preset():
    """GB300 NVL72: GB200's dense BF16/FP8 peaks (2.5/5 PFLOP/s) with the B300 die's 288 GB and 160 SMs, GB200's
    MAMF share (no GB300 measurement), NVLink5 across 72 GPUs at GB200's 680 GB/s ring busbw, 800 Gb/s NICs."""
    c = parse_cluster("36x4xgb300-288gb")
    d = c.device
    assert d.peak_flops["bf16"] == 2500e12 and d.peak_flops["fp8"] == 5000e12 and d.memory_bytes == 288 * 1000**3
    assert d.peak_flops["bf16"] * d.efficiency == pytest.approx(1822.0e12) and d.sm_count == 160
    assert c.topology.nvlink_domain == 72 and c.intra_node.bus_Bps == pytest.approx(680e9)
    assert c.inter_node.bandwidth_Bps == 100e9


def test_gpu_names_map_to_presets():
    """A local GPU's CUDA name picks its preset, one rule for the planner's `local` and the profiler (GB200's
    name contains B200's)."""
    from meshplan.planner.cluster_spec import gpu_preset_type

    for name, memory, preset in (("NVIDIA GB200", 186e9, "gb200-186gb"), ("NVIDIA B200", 180e9, "b200-180gb"),
                                 ("NVIDIA B300 SXM6 AC", 288e9, "b300-288gb"),
                                 ("NVIDIA GB300", 288e9, "gb300-288gb"), ("NVIDIA H200", 141e9, "h200-141gb"),
                                 ("NVIDIA H100 80GB HBM3", 80e9, "h100-80gb"),
                                 ("NVIDIA A100-SXM4-40GB", 40 * 2**30, "a100-40gb"),
                                 ("NVIDIA A100-SXM4-80GB", 80 * 2**30, "a100-80gb"), ("NVIDIA L4", 24e9, None)):
        assert gpu_preset_type(name, int(memory)) == preset, name


def test_gb200_jobs_spread_over_the_fewest_racks():
    """GB200 comes in NVL72 racks: a job of 128 GPUs takes 64 in each of 2 racks (NVIDIA's DGX Cloud recipes run
    128, 256 and 512), 72 one whole rack, 8 a part of one; a count no rack split gives in whole trays is refused
    with a count that works."""
    from meshplan.planner.placement import Placer

    for text, domain in (("32x4xgb200-186gb", 64), ("128x4xgb200-186gb", 64), ("18x4xgb200-186gb", 72),
                         ("36x4xgb200-186gb", 72), ("2x4xgb200-186gb", 8), ("24x4xgb200-186gb", 48)):
        assert parse_cluster(text).topology.nvlink_domain == domain, text
    placer = Placer(parse_cluster("32x4xgb200-186gb"))
    assert sorted(set(placer.domains.tolist())) == [0, 1] and (placer.domains == 0).sum() == 64
    with pytest.raises(InputError, match=r"e\.g\. 24x4\), got 25x4"):
        parse_cluster("25x4xgb200-186gb")
