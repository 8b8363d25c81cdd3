"""`plan profile` end to end on 2 CPU ranks, the cache, presets, and refusals of bad input."""

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from meshplan.planner.cli import main as plan_main
from meshplan.planner.cluster_spec import parse_cluster
from meshplan.planner.model_sources import builtin_model
from meshplan.profiler.cache import cache_key, cache_path, load_cached, store
from meshplan.profiler.measure import default_config, device_name, measure_profile
from meshplan.profiler.profile import SCHEMA_VERSION, Profile, load_profile, save_profile
from meshplan.profiler.source import AUTO_PROFILE_ENV, profile_for, small_enough

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHPLAN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(AUTO_PROFILE_ENV, "0")  # tests that measure through `plan` turn it on


@pytest.fixture(scope="module")
def measured_1cpu() -> Profile:
    """A real (small) measurement on one CPU process: tiny, s in {8, 16}, b in {1, 2}, fp32."""
    cfg = default_config(builtin_model("tiny"), parse_cluster("1xcpu"), "fp32", seq_len=16, quick=True,
                         show_progress=False)
    return measure_profile(cfg)


def run_plan(*argv: str, cache: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT, MESHPLAN_CACHE=cache)
    return subprocess.run([sys.executable, "-m", "meshplan.planner", *argv], capture_output=True, text=True, env=env,
                          timeout=300)


@pytest.mark.slow
def test_profile_two_cpu_ranks_then_cached(tmp_path, capsys):
    out = tmp_path / "profile.json"
    cache = str(tmp_path / "cache")
    args = ["profile", "tiny", "--cluster", "2xcpu", "--seq-len", "16", "--micro-batch-sizes", "1", "2",
            "--repeats", "2", "--warmup", "1", "--max-message-size", "64KiB", "--dtype", "fp32"]
    r = run_plan(*args, "-o", str(out), cache=cache)
    assert r.returncode == 0, r.stderr
    assert "compute per layer" in r.stdout and "all_reduce" in r.stdout
    assert "profile [1/" in r.stderr  # progress: which layer, which size
    p = load_profile(str(out), model=builtin_model("tiny"))
    assert p.source == "measured" and p.device_kind == "cpu" and p.concurrent_ranks == 2
    assert p.schema_version == SCHEMA_VERSION and p.torch_version and p.device_name
    assert {(c.kind, c.tp) for c in p.compute} == {("embedding", 1), ("embedding", 2), ("block", 1), ("block", 2),
                                                   ("head", 1), ("head", 2)}
    # t=2 ran tensor-parallel across the two ranks: the collectives are in the times, not added again
    assert all(c.with_collectives == (c.tp == 2) for c in p.compute)
    assert p.tp_collectives_measured("block", 2) and not p.tp_collectives_measured("block", 1)
    # the executor's data-parallel engines, measured in situ on both ranks
    assert {w.engine for w in p.wrappers} == {"replicate", "fully_shard", "fully_shard_reshard"}
    assert all(w.ranks == 2 and w.unit_params and w.optimizer_ratio > 0 for w in p.wrappers)
    assert set(p.pipeline_overheads) == {"gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"}
    assert [s.micro_batch_size for s in p.pipeline_samples] == [1, 2]  # the smallest and largest b
    assert p.pipeline_samples[0].overheads == p.pipeline_overheads and "in situ at b=2" in r.stdout
    assert all(v >= 0 for v in p.pipeline_overheads.values()) and "pipeline schedules in situ" in r.stderr
    # the cut model as one module, bare and tensor-parallel across both ranks
    assert sorted((c.tp, c.micro_batch_size) for c in p.chains) == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert p.chain_factor(1) > 0 and p.chain_factor(1, 2) > 0 and "applied to the t=2 fit" in r.stdout
    assert p.tp_optimizer_ratio(2) > 0 and p.tp_optimizer_ratio(1) is None  # AdamW over the TP DTensors
    assert all((c.split_extra_s > 0) == (c.tp == 1) for c in p.chains) and p.split_backward_factor(1) > 1
    assert all(c.forward_s > 0 and c.backward_s > 0 and c.spread >= 0 for c in p.compute)
    assert {f.measured_group_size for f in p.links["intra_node"].values()} == {2}
    assert {f.measured_group_size for f in p.links["inter_node"].values()} == {0}  # one host: presets
    assert {m.recompute for m in p.memory if m.kind == "block"} == {"none", "selective", "full"}
    assert p.state and p.optimizer_s_per_param > 0 and p.threads_per_rank >= 1
    assert 0 < p.step_sync_s < 1.0 and "scalar over all ranks" in r.stdout  # the executor's step runs two
    # the planner's queries answer sizes that were not measured
    fwd, bwd = p.layer_time("block", 8, 16, 2)
    assert fwd > 0 and bwd > 0
    assert plan_main(args) == 0  # same cache (the private_cache fixture): no second measurement
    assert "using the cached profile" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["lama3", "--cluster", "2xcpu"], "did you mean"),
    (["tiny", "--cluster", "2xb300"], "unknown device type 'b300'"),
    pytest.param(["tiny", "--cluster", "8xh100-80gb"], "CUDA is not available here",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present here")),
    (["gpt2", "--cluster", "2xcpu", "--seq-len", "4096"], "--seq-len: 4096 exceeds the model's 1024 learned"),
    (["tiny", "--cluster", "2xcpu", "--tp-degrees", "3"], "--tp: 3 does not divide"),
    (["tiny", "--cluster", "2xcpu", "--max-message-size", "12XB"], "--max-message-size"),
    (["tiny", "--cluster", "2xcpu", "--dtype", "int8"], "--dtype"),
    (["tests.fixtures.factory_models:tiny_lm", "--cluster", "2xcpu"], "gpt2/llama"),
    (["tiny"], "--cluster"),
])
def test_bad_input_exit_2(capsys, argv, message):
    assert plan_main(["profile", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_preset_profile_for_a_large_cluster_from_a_laptop(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert plan_main(["profile", "llama3-70b", "--cluster", "128x8xh100-80gb", "--preset", "-o", str(out)]) == 0
    p = load_profile(str(out), model=builtin_model("llama3-70b"))
    assert p.source == "preset" and p.links["inter_node"]["all_reduce"].beta_s_per_byte == pytest.approx(1 / 47e9)
    assert "links" in capsys.readouterr().out
    # the optimizer step as the executor runs it: the global-norm clip's 12 B and AdamW's 36 B per parameter, at
    # the streaming kernels' share of HBM's bandwidth (H100: BabelStream Triad 2.97 of 3.35 TB/s)
    h100 = parse_cluster("128x8xh100-80gb").device
    assert p.optimizer_s_per_param == pytest.approx(48.0 / (h100.memory_bandwidth_Bps * h100.memory_efficiency))
    assert h100.memory_efficiency < 1


def test_plan_refuses_profile_of_another_model_or_schema(tmp_path, capsys, measured_1cpu):
    path = tmp_path / "tiny.json"
    save_profile(measured_1cpu, str(path))
    assert plan_main(["gpt2", "--cluster", "2xcpu", "--profile", str(path)]) == 2
    assert "measured for model 'tiny'" in capsys.readouterr().err
    data = json.loads(path.read_text())
    data["schema_version"] = SCHEMA_VERSION + 1
    path.write_text(json.dumps(data))
    assert plan_main(["tiny", "--cluster", "2xcpu", "--profile", str(path)]) == 2
    assert "schema_version" in capsys.readouterr().err


def test_round_trip_keeps_measurements(tmp_path, measured_1cpu):
    path = tmp_path / "p.json"
    save_profile(measured_1cpu, str(path))
    back = load_profile(str(path), model=builtin_model("tiny"))
    assert back.to_dict() == measured_1cpu.to_dict()
    assert back.settings["repeats"] == 3 and back.created


def test_measured_queries(measured_1cpu):
    p = measured_1cpu
    assert p.recompute_time("block", 2, 16, 1, "none") == 0
    assert p.recompute_time("block", 2, 16, 1, "full") >= 0
    # activations: the measured / analytic ratio answers unmeasured sizes
    measured = next(m for m in p.memory if (m.kind, m.micro_batch_size, m.seq_len, m.recompute) ==
                    ("block", 2, 16, "none"))
    assert p.activation_bytes("block", 2, 16, 1) == pytest.approx(measured.activation_bytes, rel=0.05)
    assert p.activation_bytes("block", 2, 16, 1, "full") < p.activation_bytes("block", 2, 16, 1)


def test_source_uses_cache_for_local_hardware_and_presets_otherwise(measured_1cpu):
    tiny = builtin_model("tiny")
    one_cpu = parse_cluster("1xcpu")
    assert profile_for(tiny, one_cpu, "fp32").source == "preset"  # nothing cached, auto-profile off
    store(measured_1cpu)
    assert load_cached(tiny, measured_1cpu.device_name, "fp32", 1) is not None
    got = profile_for(tiny, one_cpu, "fp32")
    assert got.source == "measured" and got.compute == measured_1cpu.compute
    assert profile_for(tiny, one_cpu, "bf16").source == "preset"  # another dtype
    assert profile_for(tiny, parse_cluster("2xcpu"), "fp32").source == "preset"  # 2 ranks share the cores
    assert profile_for(tiny, parse_cluster("8xa100-80gb"), "fp32").source == "preset"  # not this machine
    assert cache_key(tiny, "x", "fp32", 1) != cache_key(tiny, "x", "fp32", 2)


def test_corrupt_cache_is_ignored_not_used(measured_1cpu, capsys):
    path = store(measured_1cpu)
    with open(path, "w") as fh:
        fh.write("{not json")
    assert profile_for(builtin_model("tiny"), parse_cluster("1xcpu"), "fp32").source == "preset"
    assert "ignoring cached profile" in capsys.readouterr().err
    assert path == cache_path(measured_1cpu.model, measured_1cpu.device_name, "fp32", 1)


@pytest.mark.slow
def test_auto_profile_only_for_plan_and_small_models(monkeypatch):
    monkeypatch.setenv(AUTO_PROFILE_ENV, "1")
    tiny = builtin_model("tiny")
    assert profile_for(tiny, parse_cluster("1xcpu"), "fp32").source == "preset"  # a library call never measures
    p = profile_for(tiny, parse_cluster("1xcpu"), "fp32", auto_measure=True, seq_len=16)
    assert p.source == "measured" and p.settings["seconds"] < 60
    assert profile_for(tiny, parse_cluster("1xcpu"), "fp32", auto_measure=True).created == p.created  # cached now
    big = builtin_model("gpt2")
    assert profile_for(big, parse_cluster("1xcpu"), "fp32", auto_measure=True).source == "preset"  # too big
    monkeypatch.setenv(AUTO_PROFILE_ENV, "0")
    assert profile_for(tiny, parse_cluster("2xcpu"), "fp32", auto_measure=True).source == "preset"  # turned off


def test_auto_profile_size_rule():
    """gpt-20m (2.3e10 forward FLOPs at b=2, s=256) measured in 15-90 s here; gpt2 (5.8e11) is not measured."""
    cores = os.cpu_count() or 1
    assert small_enough(builtin_model("tiny"), None, 8) and small_enough(builtin_model("gpt-20m"), None, cores)
    assert not small_enough(builtin_model("gpt2"), None, 1) and not small_enough(builtin_model("llama3-8b"))
    assert not small_enough(builtin_model("tiny"), 1 << 20)  # the planned sequence counts
    assert not small_enough(builtin_model("gpt-20m"), None, 2 * cores)  # more ranks than cores: slower


def test_plan_measures_this_hosts_cpus_once_then_uses_the_cache(tmp_path, monkeypatch, capsys):
    """`plan` on this host's CPUs with nothing cached: a small model is measured (once) and the plan uses the
    measurement; switched off or too big, the prediction comes from presets and stderr says how to measure."""
    args = ["tiny", "--cluster", "1xcpu", "--seq-len", "16", "--dtype", "fp32", "--json"]
    assert plan_main(args) == 0  # MESHPLAN_AUTO_PROFILE=0 (the private_cache fixture): presets
    out, err = capsys.readouterr()
    preset = json.loads(out)["predicted"]["iteration_time_s"]
    assert err.strip() == ("plan: prediction from presets; measure with "
                           "`plan profile tiny --cluster 1xcpu --dtype fp32 --seq-len 16`")
    monkeypatch.setenv(AUTO_PROFILE_ENV, "1")
    assert plan_main(args) == 0
    out, err = capsys.readouterr()
    assert "plan: measuring tiny on this host (1 CPU rank)" in err and "prediction from presets" not in err
    measured = json.loads(out)["predicted"]["iteration_time_s"]
    assert measured != preset
    cached = load_cached(builtin_model("tiny"), device_name("cpu"), "fp32", 1)
    assert cached is not None and cached.source == "measured" and max(c.seq_len for c in cached.compute) == 16
    assert plan_main(args) == 0  # the cache now: no second measurement, no note
    out, err = capsys.readouterr()
    assert err == "" and json.loads(out)["predicted"]["iteration_time_s"] == measured
    assert plan_main(["gpt2", "--cluster", "1xcpu", "--json"]) == 0  # too big to measure by itself
    assert "measure with `plan profile gpt2 --cluster 1xcpu`" in capsys.readouterr().err
    assert plan_main(["gpt2", "--cluster", "8xa100-80gb", "--json"]) == 0  # not this host: presets, silently
    assert capsys.readouterr().err == ""


def test_plan_and_profile_accept_the_same_sequence_length(tmp_path, capsys):
    """tiny has rotary positions: both commands take --seq-len 128 beyond its max_seq_len of 64 (the
    profiler measures 64 and 128); a learned-position model refuses it in both, with the same message."""
    out = tmp_path / "p.json"
    assert plan_main(["tiny", "--cluster", "1xcpu", "--seq-len", "128", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["parallel"]["seq_len"] == 128
    assert plan_main(["profile", "tiny", "--cluster", "1xcpu", "--seq-len", "128", "--micro-batch-size", "1",
                      "--tp", "1", "--warmup", "1", "--repeats", "2", "--dtype", "fp32", "--quiet",
                      "-o", str(out)]) == 0
    p = load_profile(str(out), model=builtin_model("tiny"))  # plan's option names: --micro-batch-size, --tp
    assert {c.seq_len for c in p.compute} == {64, 128} and {c.micro_batch_size for c in p.compute} == {1}
    capsys.readouterr()
    errors = []
    for argv in (["gpt2", "--cluster", "1xcpu", "--seq-len", "2048"],
                 ["profile", "gpt2", "--cluster", "1xcpu", "--seq-len", "2048"]):
        assert plan_main(argv) == 2
        errors.append(capsys.readouterr().err.strip())
    assert errors[0] == errors[1] == "plan: error: --seq-len: 2048 exceeds the model's 1024 learned positions"


def test_preset_efficiency_is_user_overridable(tmp_path):
    """Presets: GEMMs at documented peak x efficiency (the measured MAMF share by default); a cluster file
    overrides the efficiency: a compute-bound GEMM slows by the ratio, the block by less (its attention
    core and memory-bound ops do not change)."""
    model = builtin_model("llama3-8b")
    base = profile_for(model, parse_cluster("8xh100-80gb"), "bf16")
    cluster_file = tmp_path / "slow.yaml"
    cluster_file.write_text("base: 8xh100-80gb\ndevice:\n  efficiency: 0.25\n")
    slow = profile_for(model, parse_cluster(str(cluster_file)), "bf16")
    assert slow.source == base.source == "preset"
    ratio = (794.5 / 989) / 0.25
    assert slow.roofline.gemm(4096, 4096, 4096) == pytest.approx(ratio * base.roofline.gemm(4096, 4096, 4096))
    fwd_base, _ = base.layer_time("block", 1, 4096, 8)
    fwd_slow, _ = slow.layer_time("block", 1, 4096, 8)
    assert 1.5 * fwd_base < fwd_slow < ratio * fwd_base


def test_cached_profile_used_only_when_it_covers_the_request():
    from types import SimpleNamespace

    from meshplan.planner.model_spec import wrapped_unit_params as unit_params
    from meshplan.profiler.cli import covers
    from meshplan.profiler.profile import ChainSample, ComputeSample, PipelineSample, WrapperSample

    model = replace(builtin_model("tiny"), tied_embeddings=True, layers=())
    engine = WrapperSample("replicate", 2, 1, 64, unit_params(model, 2), 0.001, 0.01, 1.0)
    sample = [ComputeSample("block", b, 64, t, 1.0, 2.0) for b in (1, 2) for t in (1, 2)]
    chain = [ChainSample(1, 64, 2, 0.1, split_extra_s=0.01)]
    pipes = {k: 0.001 for k in ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")}
    profile = SimpleNamespace(compute=sample, wrappers=[engine], chains=chain, pipeline_overheads=pipes,
                              pipeline_samples=[PipelineSample(1, pipes), PipelineSample(2, pipes)])
    cfg = SimpleNamespace(model=model, micro_batch_sizes=[1, 2], seq_lens=[64], tps=[1, 2], nprocs=2)
    assert covers(profile, cfg)
    wrong_root = replace(engine, unit_params=engine.unit_params[:-1] + [engine.unit_params[-1] - 16384])
    assert not covers(SimpleNamespace(**{**vars(profile), "wrappers": [wrong_root]}), cfg)  # tied head subtracted
    assert not covers(profile, SimpleNamespace(**{**vars(cfg), "micro_batch_sizes": [1, 2, 4]}))
    before_in_situ = SimpleNamespace(compute=sample, wrappers=[], chains=chain, pipeline_overheads={})
    assert not covers(before_in_situ, cfg)
    one_schedule = SimpleNamespace(**{**vars(profile), "pipeline_overheads": {"1f1b": 0.001}})
    assert not covers(one_schedule, cfg)  # measured before the per-schedule pipeline phase
    small_only = SimpleNamespace(**{**vars(profile), "pipeline_samples": [PipelineSample(1, pipes)]})
    assert not covers(small_only, cfg)  # the pipeline was measured at b=1 only: b=2's messages are larger
    no_split = SimpleNamespace(**{**vars(profile), "chains": [ChainSample(1, 64, 2, 0.1)]})
    assert not covers(no_split, cfg)
    timed = [replace(c, backward_full_s=3.0, forward_full_s=1.2) for c in sample]
    assert covers(SimpleNamespace(**{**vars(profile), "compute": timed}), cfg)
    untimed = [replace(c, forward_full_s=0.0) for c in timed]  # the checkpointed forward was not timed
    assert not covers(SimpleNamespace(**{**vars(profile), "compute": untimed}), cfg)
    one = SimpleNamespace(**{**vars(cfg), "nprocs": 1})
    assert covers(before_in_situ, one)
    assert not covers(SimpleNamespace(**{**vars(before_in_situ), "chains": []}), one)


@pytest.mark.parametrize("field,value,message", [
    ("wrappers", [{"engine": "ddp", "ranks": 2, "micro_batch_size": 1, "seq_len": 8, "unit_params": [1],
                   "hook_s": 0.0, "sync_s": 0.0, "optimizer_ratio": 1.0}], "profile.wrappers[0].engine"),
    ("wrappers", [{"engine": "replicate", "ranks": 2, "micro_batch_size": 1, "seq_len": 8, "unit_params": [],
                   "hook_s": 0.0, "sync_s": 0.0, "optimizer_ratio": 1.0}], "profile.wrappers[0].unit_params"),
    ("chains", [{"micro_batch_size": 0, "seq_len": 8, "blocks": 2, "seconds": 0.1}],
     "profile.chains[0].micro_batch_size"),
    ("pipeline_overheads", {"1f1b": -1.0}, "profile.pipeline_overheads.1f1b"),
    ("pipeline_overheads", {"zb": 0.001}, "profile.pipeline_overheads.zb"),
    ("chains", [{"micro_batch_size": 1, "seq_len": 8, "blocks": 2, "seconds": 0.1, "split_extra_s": -1}],
     "profile.chains[0].split_extra_s"),
    ("chains", [{"micro_batch_size": 1, "seq_len": 8, "blocks": 2, "seconds": 0.1, "tp": 0}],
     "profile.chains[0].tp"),
    ("chains", [{"micro_batch_size": 1, "seq_len": 8, "blocks": 2, "seconds": 0.1, "tp": 2,
                 "optimizer_ratio": -1.0}], "profile.chains[0].optimizer_ratio"),
    ("pipeline_samples", [{"micro_batch_size": 0, "overheads": {"1f1b": 0.001}}],
     "profile.pipeline_samples[0].micro_batch_size"),
    ("pipeline_samples", [{"micro_batch_size": 4, "overheads": {"zb": 0.001}}],
     "profile.pipeline_samples[0].overheads.zb"),
    ("compute", [{"kind": "block", "micro_batch_size": 1, "seq_len": 8, "tp": 1, "forward_s": 0.001,
                  "backward_s": 0.002, "backward_full_s": 0.003, "forward_full_s": -0.001}],
     "profile.compute[0].forward_full_s"),
    ("step_sync_s", -0.001, "profile.step_sync_s"),
])
def test_bad_in_situ_fields_are_one_line_errors(tmp_path, capsys, measured_1cpu, field, value, message):
    path = tmp_path / "p.json"
    save_profile(measured_1cpu, str(path))
    data = json.loads(path.read_text())
    data[field] = value
    path.write_text(json.dumps(data))
    assert plan_main(["tiny", "--cluster", "2xcpu", "--profile", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
