import json

import pytest
from meshplan.planner.errors import InputError
from meshplan.planner.plan import Plan, load_plan, save_plan

from tests.helpers import make_plan


@pytest.mark.parametrize("kwargs", [
    dict(dp=4),
    dict(pp=2, dp=2, schedule="1f1b"),
    dict(pp=2, virtual_stages=2, schedule="interleaved-1f1b", num_micro_batches=4),
    dict(pp=2, virtual_stages=2, schedule="zero-bubble", dp=2),
    dict(tp=2, dp=2, zero=3, recompute="full"),
])
def test_round_trip(tmp_path, kwargs):
    plan = make_plan(**kwargs)
    path = tmp_path / "plan.json"
    save_plan(plan, str(path))
    again = load_plan(str(path))
    assert again == plan
    assert again.to_dict() == json.loads(path.read_text())


def test_zero_bubble_v_places_stages_in_a_v():
    plan = make_plan(pp=2, virtual_stages=2, schedule="zero-bubble")
    assert [s.pp_rank for s in plan.stages] == [0, 1, 1, 0]
    plan = make_plan(pp=2, virtual_stages=2, schedule="interleaved-1f1b", num_micro_batches=4)
    assert [s.pp_rank for s in plan.stages] == [0, 1, 0, 1]


def _mutated(mutate):
    data = make_plan(pp=2, dp=2).to_dict()
    mutate(data)
    return data


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d.update(schema_version=3), r"plan\.schema_version: expected one of \[1, 2\]"),
    (lambda d: d["parallel"].update(tp=-1), r"plan\.parallel\.tp: expected a positive integer, got -1"),
    (lambda d: d["parallel"].update(schedule="bogus"), r"plan\.parallel\.schedule: expected one of"),
    (lambda d: d["parallel"].update(global_batch_size=7), r"plan\.parallel\.global_batch_size"),
    (lambda d: d.update(world_size=3), r"plan\.world_size"),
    (lambda d: d["mesh"].update(shape=[1, 2, 1, 2]), r"plan\.mesh\.shape"),
    (lambda d: d["parallel"].update(ep=3), r"plan\.parallel\.ep: expected a divisor of dp x cp = 2"),
    (lambda d: d["parallel"].update(cp_mode="zigzag"), r"plan\.parallel\.cp_mode: expected one of"),
    (lambda d: d["stages"][1].update(layers=[2, 6]), r"plan\.stages\[1\]\.layers: expected to start at layer 3"),
    (lambda d: d["stages"].pop(), r"plan\.stages: expected pp x virtual_stages = 2"),
    (lambda d: d["model"].pop("hidden_size"), r"plan\.model\.hidden_size: missing"),
    (lambda d: d["cluster"]["device"].update(memory_bytes="lots"), r"plan\.cluster\.device\.memory_bytes"),
    (lambda d: d["predicted"].update(mfu=None), r"plan\.predicted\.mfu: expected a number"),
    (lambda d: d["stages"][0].update(recompute_layers=9), r"plan\.stages\[0\]\.recompute_layers"),
    (lambda d: d["parallel"].update(virtual_stages=2), r"plan\.parallel\.virtual_stages"),
    (lambda d: d["parallel"].update(fp8="mxfp8"), r"plan\.parallel\.fp8: expected one of"),
    (lambda d: d["parallel"].update(fp8="delayed", dtype="fp32"), r"plan\.parallel\.fp8: expected 'none' with dtype"),
    (lambda d: d["model"].update(rotary_dim=5), r"model\.rotary_dim: expected an even number"),
])
def test_bad_plan_names_field(mutate, message):
    with pytest.raises(InputError, match=message):
        Plan.from_dict(_mutated(mutate))


def test_load_plan_bad_files(tmp_path):
    with pytest.raises(InputError, match="cannot read"):
        load_plan(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(InputError, match="not valid JSON"):
        load_plan(str(bad))
    bad.write_text("[]")
    with pytest.raises(InputError, match="plan: expected an object"):
        load_plan(str(bad))


def test_placement_round_trip_and_validation(tmp_path):
    from meshplan.planner.plan import Placement

    plan = make_plan(pp=2, dp=2)
    plan.placement = Placement(["dp", "pp", "cp", "tp"], [[[[0]], [[2]]], [[[1]], [[3]]]])
    path = tmp_path / "plan.json"
    save_plan(plan, str(path))
    assert load_plan(str(path)) == plan
    data = plan.to_dict()
    data["placement"]["ranks"] = [[[[0]], [[0]]], [[[1]], [[3]]]]
    with pytest.raises(InputError, match=r"plan\.placement\.ranks"):
        Plan.from_dict(data)
    data["placement"] = {"order": ["pp", "pp", "cp", "tp"], "ranks": [[[[0]], [[2]]], [[[1]], [[3]]]]}
    with pytest.raises(InputError, match=r"plan\.placement\.order"):
        Plan.from_dict(data)
    assert "placement" not in make_plan().to_dict()  # optional: absent means row-major [pp, dp, tp]


def test_schema_1_plan_loads_as_cp_1(tmp_path):
    """A version-1 file (mesh [pp, dp, tp], 3-level placement) loads with cp = ep = 1."""
    from meshplan.planner.plan import Placement

    plan = make_plan(pp=2, dp=2)
    plan.placement = Placement(["dp", "pp", "cp", "tp"], [[[[0]], [[2]]], [[[1]], [[3]]]])
    data = plan.to_dict()
    data["schema_version"] = 1
    data["mesh"] = {"dim_names": ["pp", "dp", "tp"], "shape": [2, 2, 1]}
    data["placement"] = {"order": ["dp", "pp", "tp"], "ranks": [[[0], [2]], [[1], [3]]]}
    for key in ("cp", "cp_mode", "ep", "expert_tp"):
        data["parallel"].pop(key)
    data["predicted"].pop("exposed_communication_s")
    again = Plan.from_dict(data)
    assert again.parallel.cp == again.parallel.ep == 1 and again.mesh.shape == [2, 2, 1, 1]
    assert again.placement == plan.placement and again.schema_version == 2
