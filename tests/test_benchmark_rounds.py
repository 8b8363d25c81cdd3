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
    out = bench.measure_rounds(paths, [1, 1, 1], ["a", "b", "c"], 4, 2, str(tmp_path), Console(quiet=True))
    assert calls == [(0, "plan0"), (1, "plan1"), (2, "plan2"), (2, "plan2.r2"), (1, "plan1.r2"), (0, "plan0.r2")]
    # median of the pooled steps [1, 2, 3, 10, 20]; the larger of the two rounds' peaks
    assert out == [(3.0, 100.0), (3.0, 200.0), (3.0, 300.0)]


def test_rounds_must_be_positive(capsys):
    bench = _benchmark()
    assert bench.main(["--rounds", "0"]) == 2
    err = capsys.readouterr().err
    assert "--rounds: expected a positive number" in err and len(err.strip().splitlines()) == 1


def test_a_run_counts_the_steps_the_executor_times(tmp_path, monkeypatch):
    """The benchmark pools the steps of a run that the executor's own median uses: not the step its CPU
    memory probe instrumented (the torch profiler slows it many times), not the warm-up step."""
    import json

    from executor.metrics import Metrics

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
