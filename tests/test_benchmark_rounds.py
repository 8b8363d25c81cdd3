"""predict_vs_measure's interleaved rounds: order and pooling, with the executor runs stubbed out (the
benchmark itself is the end-to-end run; this checks only how it combines runs)."""

import importlib.util
import os
import sys

from rich.console import Console

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _benchmark():
    spec = importlib.util.spec_from_file_location("predict_vs_measure",
                                                  os.path.join(ROOT, "benchmarks", "predict_vs_measure.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def test_rounds_alternate_order_and_pool_the_steps(tmp_path, monkeypatch):
    bench = _benchmark()
    paths = [str(tmp_path / f"plan{i}.json") for i in range(3)]
    calls = []

    def fake_measure(path, nproc, steps, workdir, tag):
        i = paths.index(path)
        calls.append((i, tag))
        first = tag == f"plan{i}"
        return ([1.0, 2.0, 3.0] if first else [10.0, 20.0]), (100.0 if first else 50.0) * (i + 1)

    monkeypatch.setattr(bench, "measure", fake_measure)
    probes = iter(range(1, 7))

    def probe():
        calls.append("probe")
        return float(next(probes))

    out = bench.measure_rounds(paths, [1, 1, 1], ["a", "b", "c"], 4, 2, str(tmp_path), Console(quiet=True), probe)
    runs = [c for c in calls if c != "probe"]
    assert runs == [(0, "plan0"), (1, "plan1"), (2, "plan2"), (2, "plan2.r2"), (1, "plan1.r2"), (0, "plan0.r2")]
    assert calls[::2] == ["probe"] * 6  # a probe just before every run
    # median of the pooled steps [1, 2, 3, 10, 20]; the larger of the two rounds' peaks; each run's probe
    assert [(r.median_s, r.peak) for r in out] == [(3.0, 100.0), (3.0, 200.0), (3.0, 300.0)]
    assert [r.probes for r in out] == [[1.0, 6.0], [2.0, 5.0], [3.0, 4.0]]
    assert out[0].run_medians() == [2.0, 15.0]


def test_noise_summary_separates_run_to_run_drift_from_the_plans_errors():
    """Two plans, each run twice: plan 0 is off by 2x in both runs (the model's error), and the runs'
    deviations follow the probe exactly; the summary reports the spread of identical runs and Pearson +1."""
    bench = _benchmark()
    runs = [bench.Runs(steps=[[1.0, 1.0], [1.5, 1.5]], probes=[2.0, 3.0]),
            bench.Runs(steps=[[4.0], [2.0]], probes=[0.02, 0.01])]
    text = bench.drift_summary(runs, predicted=[0.5, 3.0])
    assert "differed x1.75 (median over plans; largest x2.00)" in text
    assert "machine probe ranged x300.00 over the runs" in text
    with_profile = bench.drift_summary(runs, predicted=[0.5, 3.0], at_profile=0.5)
    assert "and was x0.50 of their median right after profiling" in with_profile  # median probe 1.0
    assert "Pearson +1.00 (4 runs)" in text
    assert bench.drift_summary([bench.Runs(steps=[[1.0]])], [1.0]) is None  # one run each: nothing to compare


def test_machine_probe_times_a_block_of_the_model():
    from meshplan.planner.model_sources import builtin_model

    bench = _benchmark()
    model = builtin_model("tiny").to_dict()
    probe = bench.machine_probe(model, 16, "fp32", seconds=0.05)
    t = probe()
    assert 0 < t < 1.0
    factory = dict(model, arch="custom")
    assert bench.machine_probe(factory, 16, "fp32") is None  # the profiler cannot build it: no probe


def test_rounds_must_be_positive(capsys):
    bench = _benchmark()
    assert bench.main(["--rounds", "0"]) == 2
    err = capsys.readouterr().err
    assert "--rounds: expected a positive number" in err and len(err.strip().splitlines()) == 1


def test_a_run_counts_the_steps_the_executor_times(tmp_path, monkeypatch):
    """The benchmark pools the steps of a run that the executor's own median uses: not the step its CPU
    memory probe instrumented (every op seen from Python slows it), not the warm-up step."""
    import json

    from meshplan.executor.metrics import Metrics

    bench = _benchmark()
    metrics = Metrics(str(tmp_path / "plan0.jsonl"), True)
    for step, (t, timed) in enumerate([(3.0, True), (9.0, False), (1.0, True), (1.2, True), (1.1, True)], 1):
        metrics.step(step, 0.0, t, 10, 0, timed=timed)
    summary = metrics.summary(1.0, peak_tensor_bytes=7)
    monkeypatch.setattr(bench, "run", lambda cmd: "")
    times, peak = bench.measure(str(tmp_path / "plan0.json"), 2, 5, str(tmp_path), "plan0")
    assert times == [1.0, 1.2, 1.1] and peak == 7
    assert summary["measured_iteration_time_s"] == 1.1
    assert json.loads((tmp_path / "plan0.jsonl").read_text().splitlines()[1])["timed"] is False


def _trace_tool():
    spec = importlib.util.spec_from_file_location("pipeline_trace",
                                                  os.path.join(ROOT, "benchmarks", "pipeline_trace.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pipeline_trace_splits_a_step_into_actions_waits_and_the_rest():
    """Two steps of one rank: F0, F1, B0, B1 with a wait before each backward; the report covers the
    second half (step 1): actions 4 ms, waits 2 ms, span 10 ms, so 4 ms between them."""
    tool = _trace_tool()
    events = []
    for step in range(2):
        t = step * 100.0
        for kind, mb, start in (("F", 0, 0.0), ("F", 1, 0.002), ("B", 0, 0.005), ("B", 1, 0.009)):
            if kind == "B":
                events.append(("wait", -1, t + start - 0.001, t + start, 0.0))
            events.append((kind, mb, t + start, t + start + 0.001, 0.0005))
    lines = tool.summarise({0: events}, steps=2)
    assert lines == ["rank 0: F 1.00 ms (CPU 0.50), B 1.00 ms (CPU 0.50); step span 10.0 ms = actions 4.0 "
                     "+ waits 2.0 + rest 4.0"]
    # the executor's whole steps of two ranks (12 ms wall; 9 and 6 CPU-ms): 15 CPU-ms in 12 ms
    steps = {r: events + [("step", -1, s * 100.0, s * 100.0 + 0.012, cpu) for s in range(2)]
             for r, cpu in ((0, 0.009), (1, 0.006))}
    assert tool.summarise(steps, steps=2)[-1] == \
        "training step: rank 0 12.0 ms (CPU 9.0), rank 1 12.0 ms (CPU 6.0); 1.25 cores busy"


def test_pipeline_trace_report_without_files_is_a_one_line_error(tmp_path, capsys):
    assert _trace_tool().report(str(tmp_path / "none")) == 2
    assert "no " in capsys.readouterr().err


def test_pipeline_trace_bad_arguments_are_one_line_errors(capsys):
    tool = _trace_tool()
    for argv, field in ((["plan.json", "--steps", "2"], "--trace"), (["plan.json", "--trace"], "--trace"),
                        (["--report"], "--report"), (["--report", "a", "b"], "--report")):
        assert tool.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"pipeline_trace: {field}:") and len(err.strip().splitlines()) == 1


def test_resimulate_repredicts_a_finished_run(tmp_path, capsys):
    """resimulate reads a benchmark's workdir: the plans' recorded predictions, the cost model's
    prediction now (unchanged model: the same), and each plan's runs pooled as the benchmark pools them."""
    import json

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import resimulate
    from meshplan.planner.cluster_spec import parse_cluster
    from meshplan.planner.constraints import Constraints
    from meshplan.planner.model_sources import builtin_model
    from meshplan.planner.plan import save_plan
    from meshplan.planner.search import find_plan
    from meshplan.profiler.presets import preset_profile
    from meshplan.profiler.profile import save_profile

    model, cluster = builtin_model("tiny"), parse_cluster("2xcpu")
    profile = preset_profile(model, cluster, "fp32")
    save_profile(profile, str(tmp_path / "profile.json"))
    base = dict(global_batch_size=8, seq_len=64, dtype="fp32", top_k=0)
    plans = [find_plan(model, cluster, Constraints(**base, dp=2, tp=1, pp=1), profile),
             find_plan(model, cluster, Constraints(**base, dp=1, tp=1, pp=2, schedule="gpipe"), profile)]
    steps = [[0.9, 1.0, 1.0, 1.2], [0.5, 3.0, 3.0, 3.0]]  # two runs of two timed steps per plan
    for i, (plan, times) in enumerate(zip(plans, steps)):
        save_plan(plan, str(tmp_path / f"plan{i}.json"))
        for tag, run in ((f"plan{i}", times[:2]), (f"plan{i}.r2", times[2:])):
            records = [{"step": k + 1, "step_time_s": t} for k, t in enumerate([9.0] + run)]  # 9.0: warm-up
            (tmp_path / f"{tag}.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    lines = resimulate.resimulate(str(tmp_path), None)
    assert len(lines) == 1 + 2 + 2
    recorded = [p.predicted.iteration_time_s for p in plans]
    measured = [resimulate.measured_s(str(tmp_path / f"plan{i}.json")) for i in range(2)]
    assert measured[1] == 3.0  # both runs of plan 1 pooled, each run's warm-up step left out
    err, rho, regret = resimulate.summary(recorded, measured)
    assert f"median |error| {err:.1%}" in lines[-2] and f"median |error| {err:.1%}" in lines[-1]
    assert regret == (1.0 if recorded[0] < recorded[1] else measured[1] / min(measured))
    capsys.readouterr()
    assert resimulate.main([str(tmp_path / "missing")]) == 2
    assert resimulate.main([str(tmp_path), "--profile", str(tmp_path / "none.json")]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 2 and errors[0].startswith("resimulate: WORKDIR:") and "--profile" in errors[1]
