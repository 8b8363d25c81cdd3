"""The device memory outside the allocator (planner/memory_reserve.py) and how the search applies it."""

import json

import pytest
from meshplan.planner.cluster_spec import parse_cluster
from meshplan.planner.constraints import Constraints
from meshplan.planner.errors import InfeasibleError
from meshplan.planner.memory_reserve import communicators, reserve, usable_bytes
from meshplan.planner.model_sources import builtin_model
from meshplan.planner.plan import Plan
from meshplan.planner.search import find_plan
from meshplan.profiler.presets import preset_profile


def test_communicators_one_per_parallel_dimension_plus_world():
    assert communicators(1, 1, 1) == 0  # one process: no collective, no communicator
    assert communicators(8, 16, 64) == 4  # world, tp, pp, dp
    assert communicators(2, 1, 4, cp=2) == 4  # world, tp, dp, cp
    assert communicators(1, 1, 8, ep=4) == 4  # world, dp, ep, expert dp (8 / 4 = 2)
    assert communicators(1, 1, 4, ep=4) == 3  # expert dp of one rank: no group


def test_reserve_by_hand():
    """A tp8 pp16 dp64 rank on an 80 GB GPU: 400 MB context (pytorch#109888) + 4 x 688 MB (NVIDIA/nccl#964),
    and 5 % of the rest kept for fragmentation."""
    r = reserve(parse_cluster("8xh100-80gb").device, 8, 16, 64)
    assert r.total == pytest.approx(400e6 + 4 * 688e6)
    capacity = 79.6 * 2**30
    assert usable_bytes(capacity, 0.05, r) == pytest.approx((capacity - 3.152e9) * 0.95)
    cpu = parse_cluster("4xcpu").device
    assert reserve(cpu, 8, 16, 64).total == 0.0
    assert usable_bytes(1e9, 0.0, reserve(cpu, 1, 1, 1)) == 1e9


def test_plans_fit_under_the_reserve_and_the_message_names_it():
    """A plan's predicted peak stays under the capacity less the reserve and the margin; when nothing fits,
    the one error line names what is held back."""
    model, cluster = builtin_model("llama3-8b"), parse_cluster("8xa100-40gb")
    profile = preset_profile(model, cluster, "bf16")
    c = Constraints(global_batch_size=64, seq_len=4096)
    plan = find_plan(model, cluster, c, profile)
    p = plan.parallel
    limit = usable_bytes(cluster.device.memory_bytes, c.memory_margin, reserve(cluster.device, p.tp, p.pp, p.dp))
    assert plan.predicted.peak_memory_bytes <= limit * (1 + 1e-9)
    assert plan.predicted.usable_memory_bytes == pytest.approx(limit)  # recorded in the plan JSON
    data = json.loads(plan.to_json())
    assert Plan.from_dict(data).predicted.usable_memory_bytes == pytest.approx(limit)
    del data["predicted"]["usable_memory_bytes"]  # plans written before the field still load
    assert Plan.from_dict(data).predicted.usable_memory_bytes == 0.0
    with pytest.raises(InfeasibleError, match=r"less [0-9.]+ MiB for the CUDA context, "
                                              r"less the 5% margin"):
        one = parse_cluster("1xa100-40gb")
        find_plan(model, one, Constraints(global_batch_size=8, seq_len=4096), preset_profile(model, one, "bf16"))


def test_cluster_file_sets_the_reserve():
    """A cluster file's GPU gets the sourced defaults unless it says otherwise; a CPU holds none."""
    from dataclasses import asdict

    from meshplan.planner.cluster_spec import CUDA_CONTEXT_BYTES, NCCL_COMMUNICATOR_BYTES, DeviceSpec

    gpu = {k: v for k, v in asdict(parse_cluster("8xh100-80gb").device).items()
           if k not in ("context_bytes", "communicator_bytes")}
    assert (DeviceSpec.from_dict(gpu, "d").context_bytes, DeviceSpec.from_dict(gpu, "d").communicator_bytes) == \
        (CUDA_CONTEXT_BYTES, NCCL_COMMUNICATOR_BYTES)
    own = DeviceSpec.from_dict({**gpu, "context_bytes": 0, "communicator_bytes": 2e9}, "d")
    assert reserve(own, 2, 1, 4).total == 3 * 2e9
    assert DeviceSpec.from_dict({**gpu, "kind": "cpu"}, "d").context_bytes == 0.0


def test_bad_reserve_fields_are_one_line_errors():
    from dataclasses import asdict

    from meshplan.planner.cluster_spec import DeviceSpec
    from meshplan.planner.errors import InputError

    gpu = asdict(parse_cluster("8xh100-80gb").device)
    for key in ("context_bytes", "communicator_bytes"):
        with pytest.raises(InputError, match=rf"^d\.{key}: expected a number >= 0\.0"):
            DeviceSpec.from_dict({**gpu, key: -1}, "d")
