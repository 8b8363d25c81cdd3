import json
from dataclasses import replace

import pytest
from meshplan.planner.calibrate import predict
from meshplan.planner.cli import main
from meshplan.planner.cluster_spec import parse_cluster
from meshplan.planner.constraints import Constraints
from meshplan.planner.model_sources import builtin_model
from meshplan.planner.plan import save_plan
from meshplan.planner.search import find_plan
from meshplan.profiler.presets import preset_profile
from meshplan.profiler.profile import load_profile, save_profile

TRAIN = [dict(dp=4), dict(dp=4, micro_batch_size=1), dict(dp=2, tp=2), dict(pp=4), dict(pp=2, dp=2),
         dict(tp=2, pp=2), dict(dp=2, tp=2, zero=3, micro_batch_size=1)]
HELD_OUT = [dict(dp=2, pp=2, micro_batch_size=1), dict(dp=2, tp=2, micro_batch_size=2),
            dict(dp=4, zero=1, micro_batch_size=2)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Plans made under the preset profile; 'measurements' from a profile whose true costs differ by
    known factors (compute 2x, data-parallel traffic 3x, pipeline traffic 0.5x)."""
    tmp = tmp_path_factory.mktemp("calibrate")
    model, cluster = builtin_model("tiny"), parse_cluster("4xcpu")
    profile = preset_profile(model, cluster, "fp32")
    truth = replace(profile, corrections={"compute": 2.0, "dp_comm": 3.0, "pp_comm": 0.5})
    plans = [find_plan(model, cluster, Constraints(global_batch_size=16, seq_len=32, dtype="fp32", top_k=0,
                                                   **pins), profile) for pins in TRAIN + HELD_OUT]
    save_profile(profile, str(tmp / "profile.json"))
    return tmp, profile, truth, plans


def test_predict_reproduces_the_planner(setup):
    _, profile, _, plans = setup
    for plan in plans:
        assert predict(plan, profile) == pytest.approx(plan.predicted.iteration_time_s, rel=1e-9)


def test_calibration_moves_held_out_predictions_towards_measurements(setup, capsys):
    tmp, profile, truth, plans = setup
    train, held_out = plans[:len(TRAIN)], plans[len(TRAIN):]
    assert len({json.dumps(p.to_dict()["parallel"], sort_keys=True) for p in plans}) == len(plans)
    files = []
    for i, plan in enumerate(train):
        save_plan(plan, str(tmp / f"plan{i}.json"))
        metrics = tmp / f"run{i}.jsonl"
        metrics.write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n" + json.dumps(
            {"summary": True, "predicted_iteration_time_s": plan.predicted.iteration_time_s,
             "measured_iteration_time_s": predict(plan, truth), "plan": f"plan{i}.json"}) + "\n")
        files.append(str(metrics))
    out = tmp / "calibrated.json"
    assert main(["calibrate", *files, "--profile", str(tmp / "profile.json"), "-o", str(out)]) == 0
    assert "factors:" in capsys.readouterr().out
    calibrated = load_profile(str(out), model=plans[0].model)
    for plan in held_out:
        measured = predict(plan, truth)
        before = abs(predict(plan, profile) / measured - 1)
        after = abs(predict(plan, calibrated) / measured - 1)
        assert after < before / 3
    assert calibrated.correction("compute") == pytest.approx(2.0, rel=0.1)


@pytest.mark.parametrize("body,message", [
    ("", "no summary line"),
    ("{not json\n", "not JSON lines"),
    ('{"summary": true, "measured_iteration_time_s": -1}\n', "measured_iteration_time_s"),
    ('{"summary": true, "measured_iteration_time_s": 0.5}\n', "summary.plan: missing"),
])
def test_bad_metrics_one_line_exit_2(setup, capsys, body, message):
    tmp = setup[0]
    path = tmp / "bad.jsonl"
    path.write_text(body)
    assert main(["calibrate", str(path), "--profile", str(tmp / "profile.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
