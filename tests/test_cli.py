import os
import subprocess
import sys

import pytest
from meshplan.planner.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv,field", [
    (["lama3-8b", "--cluster", "8xa100-80gb"], "did you mean llama3-8b"),
    (["llama3-8b", "--cluster", "8xb300"], "unknown device type 'b300'"),
    (["llama3-8b", "--cluster", "0x8xa100-80gb"], "CLUSTER: the node count must be a positive integer"),
    (["llama3-8b", "--cluster", "eightxa100"], "CLUSTER"),
    (["llama3-8b", "--cluster", "8xa100-80gb", "--tp", "3"], "--tp: 3 must divide"),
    (["llama3-8b", "--cluster", "8xa100-80gb", "--tp", "-2"], "argument --tp: expected a positive integer"),
    (["llama3-8b", "--cluster", "8xa100-80gb", "--tp", "1.5"], "argument --tp: expected a positive integer"),
    (["llama2-7b", "--cluster", "2x8xa100-80gb", "--tp", "16"], "--tp: 16 exceeds the 8 devices of a node"),
    (["llama3-8b", "--cluster", "8xa100-80gb", "--global-batch-size", "0"], "--global-batch-size"),
    (["llama3-8b", "--cluster", "8xa100-80gb", "--global-batch-size", "-8"], "--global-batch-size"),
    (["llama3-8b", "--cluster", "8xa100-80gb", "--dp", "2", "--tp", "2", "--pp", "1", "--cp", "1"],
     "dp x tp x pp x cp = 4"),
    (["llama3-8b", "--cluster", "8xa100-80gb", "--dp", "3"], "--dp: 3 does not divide"),
    (["llama3-8b", "--cluster", "8xa100-80gb", "--cp", "3"], "--cp: 3 does not divide"),
    (["llama3-8b", "--cluster", "8xa100-80gb", "--ep", "2"], "--ep/--expert-tp: llama3-8b is dense"),
    (["llama3-8b", "--cluster", "8xa100-80gb", "--global-batch-size", "12", "--dp", "8"], "not divisible by --dp"),
    (["llama3-8b", "--cluster", "8xa100-80gb", "--global-batch-size", "16", "--micro-batch-size", "3"],
     "--micro-batch-size"),
    (["gpt2", "--cluster", "8xa100-80gb", "--seq-len", "2048"], "--seq-len: 2048 exceeds"),
    (["llama3-8b", "--cluster", "8xa100-80gb", "--schedule", "fast"], "argument --schedule: invalid choice"),
    (["llama3-8b", "--cluster", "8xa100-80gb", "--schedule", "1f1b", "--virtual-stages", "2"],
     "--virtual-stages"),
    (["tiny", "--cluster", "4xcpu", "--pp", "4", "--virtual-stages", "2"], "8 pipeline stages"),
    (["llama3-8b", "--cluster", "8xa100-80gb", "--memory-margin", "1.5"], "--memory-margin"),
    (["llama3-8b"], "--cluster"),
    (["llama3-8b", "--cluster", "8xa100-80gb", "--software", "megatron-lm"], "argument --software: invalid choice"),
    (["llama3-8b", "--cluster", "8xa100-80gb", "--software", "megatron", "--schedule", "zero-bubble"],
     "--schedule: megatron does not run zero-bubble (it runs: 1f1b, interleaved-1f1b)"),
    (["llama3-8b", "--cluster", "8xa100-80gb", "--software", "megatron-deepspeed-2022", "--zero", "3"],
     "--zero: megatron-deepspeed-2022 does not run 3"),
    (["llama3-8b", "--cluster", "8xa100-80gb", "--software", "megatron-2021", "--recompute", "selective"],
     "--recompute: megatron-2021 does not run selective (it runs: none, full)"),
    (["llama3-8b", "--cluster", "8xa100-80gb", "--seq-len", "8192", "--software", "megatron-2021", "--cp", "2"],
     "--cp: megatron-2021 does not run context parallelism"),
    (["llama3-8b", "--cluster", "8xa100-80gb", "--seq-len", "8192", "--software", "torchtitan", "--cp", "2",
      "--cp-mode", "all-to-all"], "--cp-mode: torchtitan does not run all-to-all"),
    (["llama3-8b", "--cluster", "8xa100-80gb", "--stage-split", "uneven"], "argument --stage-split: invalid choice"),
    (["llama3-8b", "--cluster", "8xa100-80gb", "--bogus"], "unrecognized arguments: --bogus"),
    (["llama3-8b", "--cluster", "8xa100-80gb", "--fp8", "delayed"], "--fp8: a100-80gb has no FP8 tensor cores"),
    (["tiny", "--cluster", "2xcpu", "--fp8", "delayed"], "--fp8: cpu has no FP8 tensor cores"),
    (["llama3-8b", "--cluster", "8xh100-80gb", "--fp8", "current", "--dtype", "fp16"], "expected --dtype bf16"),
    (["llama3-8b", "--cluster", "8xh100-80gb", "--fp8", "e4m3"], "argument --fp8: invalid choice"),
    (["llama3-8b", "--cluster", "8xa100-80gb", "--profile", "/nonexistent/profile.json"], "profile"),
])
def test_bad_input_is_one_line_exit_2(capsys, argv, field):
    code, out, err = run(capsys, *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("plan: error: "), err
    assert field in lines[0]
    assert "Traceback" not in err and out == ""


def test_malformed_hf_config(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama", "hidden_size": ')
    code, _, err = run(capsys, str(path), "--cluster", "8xa100-80gb")
    assert code == 2 and "not valid JSON" in err and len(err.strip().splitlines()) == 1


def test_bad_cluster_file(capsys, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("base: 8xa100-80gb\ndevice:\n  memory_bytes: -1\n")
    code, _, err = run(capsys, "gpt2", "--cluster", str(path))
    assert code == 2 and "device.memory_bytes" in err


def test_help_documents_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for word in ("plan profile", "plan show", "plan export", "plan calibrate", "--global-batch-size",
                 "--virtual-stages", "--recompute", "--zero", "--top-k", "--json", "exit codes"):
        assert word in out


def test_console_script_installed():
    proc = subprocess.run([sys.executable, "-m", "meshplan.planner", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "usage: plan" in proc.stdout


def test_pareto_of_every_candidate(capsys, tmp_path):
    out = tmp_path / "pareto.png"
    code, stdout, _ = run(capsys, "gpt2", "--cluster", "4xa100-80gb", "--pareto", str(out))
    assert code == 0 and out.stat().st_size > 10_000
    assert "candidates written to" in stdout


def test_installed_under_meshplan_only(tmp_path):
    """The parts install as meshplan.planner/profiler/executor; bare top-level names (PyPI has other
    distributions called planner, profiler and executor) must not import outside the repository."""
    code = ("import importlib.util as u, meshplan.planner.cli, meshplan.profiler.cli, meshplan.executor.cli\n"
            "print([u.find_spec(n) is None for n in ('planner', 'profiler', 'executor')])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[True, True, True]"


def test_software_sets_what_presets_charge(capsys, tmp_path):
    """--software names the engine a GPU preset predicts (profiler/software.py): Megatron-LM of 2022
    computes attention unfused, so the same pinned plan takes longer; the plan JSON carries the time. For
    this host's CPUs (a measured profile or CPU presets) a one-line note says --software does not apply."""
    import json

    pinned = ["gpt3-175b", "--cluster", "8x8xa100-80gb", "--global-batch-size", "64", "--tp", "8", "--pp", "8",
              "--recompute", "full", "--json"]
    times = {}
    for software in ("meshplan", "megatron-2022"):
        code, out, _ = run(capsys, *pinned, "--software", software)
        assert code == 0
        times[software] = json.loads(out)["predicted"]["iteration_time_s"]
    assert times["megatron-2022"] > times["meshplan"]
    # the report names the software it costed; the default says how to cost another engine's run
    code, out, _ = run(capsys, *pinned[:-1])
    assert code == 0 and "costed as meshplan's executor runs it" in out and "--software megatron" in out
    code, out, _ = run(capsys, *pinned[:-1], "--software", "megatron-2022")
    assert code == 0 and "costed as megatron-2022 runs it" in out and "another engine" not in out
    code, _, err = run(capsys, "tiny", "--cluster", "2xcpu", "--software", "megatron")
    assert code == 0 and "--software megatron applies to GPU presets" in err


def test_software_limits_the_search(capsys):
    """The --software engine's schedules, ZeRO levels, stage splits and CP modes bound the search: DeepSpeed's
    pipeline engine runs 1F1B with ZeRO 0 or 1 on evenly split stages, Megatron-LM of 2021 no context
    parallelism."""
    import json

    code, out, _ = run(capsys, "gpt3-175b", "--cluster", "16x8xa100-80gb", "--global-batch-size", "256",
                       "--software", "megatron-deepspeed-2022", "--json")
    assert code == 0
    plans = [json.loads(out)] + json.loads(out)["alternatives"]
    assert all(p["parallel"]["schedule"] == "1f1b" and p["parallel"]["zero"] <= 1 for p in plans)
    # its 'type:transformer' partition: the 96 blocks spread evenly (planner/stage_split.py)
    counts = [sum(1 for layer in range(*s["layers"]) if 0 < layer < 97) for s in plans[0]["stages"]]
    assert len(counts) > 1 and max(counts) - min(counts) <= 1 and counts == sorted(counts, reverse=True), counts
    code, out, _ = run(capsys, "llama3-8b", "--cluster", "8xh100-80gb", "--seq-len", "131072",
                       "--global-batch-size", "8", "--software", "megatron-2021", "--json")
    assert code == 0 and json.loads(out)["parallel"]["cp"] == 1


def test_preset_profile_file_carries_its_software(capsys, tmp_path):
    """A preset profile written for an engine (plan profile --preset --software) makes plans for that
    engine when read back with --profile: its costs, its limits (Megatron-LM of 2021: no ZeRO) and the
    name in the plan JSON."""
    import json

    path = tmp_path / "megatron.json"
    assert main(["profile", "gpt3-175b", "--cluster", "8x8xa100-80gb", "--preset", "--software", "megatron-2021",
                 "-o", str(path), "--quiet"]) == 0
    code, out, err = run(capsys, "gpt3-175b", "--cluster", "8x8xa100-80gb", "--global-batch-size", "64",
                         "--profile", str(path), "--json")
    plan = json.loads(out)
    assert code == 0 and plan["search"]["software"] == "megatron-2021" and "--software" not in err
    assert all(p["parallel"]["zero"] == 0 and p["parallel"]["schedule"] in ("1f1b", "interleaved-1f1b")
               for p in [plan] + plan["alternatives"])


def test_fp8_plans_are_faster_exported_and_refused_by_the_executor(capsys, tmp_path):
    """--fp8 (Transformer Engine's recipes, costed as Megatron-Core runs them): the same pinned H100 plan
    predicts a shorter step than bf16, the plan JSON carries the recipe, Megatron's export names it
    (--fp8-format hybrid, --fp8-recipe tensorwise for current scaling, --fp8-param-gather), and the executor
    refuses it in one line
    before any launch."""
    import json

    from meshplan.executor.cli import main as executor_main

    pinned = ["llama3-8b", "--cluster", "8xh100-80gb", "--global-batch-size", "64", "--seq-len", "4096", "--tp", "1",
              "--pp", "1", "--zero", "2", "--micro-batch-size", "1", "--recompute", "none", "--software", "megatron"]
    code, out, _ = run(capsys, *pinned, "--json")
    bf16 = json.loads(out)
    path = tmp_path / "fp8.json"
    code, _, _ = run(capsys, *pinned, "--fp8", "current", "-o", str(path))
    fp8 = json.loads(path.read_text())
    assert code == 0 and fp8["parallel"]["fp8"] == "current" and bf16["parallel"]["fp8"] == "none"
    assert fp8["predicted"]["iteration_time_s"] < 0.8 * bf16["predicted"]["iteration_time_s"]
    code, out, _ = run(capsys, "export", str(path), "--format", "megatron")
    assert code == 0 and "--fp8-format hybrid" in out and "--fp8-recipe tensorwise" in out
    assert "--fp8-param-gather" in out  # FP8 parameters with the sharded optimizer, as costed
    assert executor_main([str(path)]) == 2
    assert "plan.parallel.fp8: the executor trains without FP8" in capsys.readouterr().err


def test_megatron_bridge_software_reduces_bf16_gradients(capsys, tmp_path):
    """--software megatron-bridge (NVIDIA's performance recipes): Megatron-Core with gradients held and reduced
    in bf16 and a fused cross-entropy, so the same pinned plan needs less memory than --software megatron; its
    Megatron export passes --grad-reduce-in-bf16 and --cross-entropy-loss-fusion and has no costing warning."""
    import json

    pinned = ["llama3-8b", "--cluster", "2x8xh100-80gb", "--global-batch-size", "64", "--seq-len", "4096", "--tp", "1",
              "--pp", "1", "--zero", "1", "--micro-batch-size", "1", "--recompute", "none", "--json"]
    code, out, _ = run(capsys, *pinned, "--software", "megatron")
    mcore = json.loads(out)
    path = tmp_path / "bridge.json"
    code, _, _ = run(capsys, *pinned[:-1], "--software", "megatron-bridge", "-o", str(path))
    bridge = json.loads(path.read_text())
    assert code == 0 and bridge["search"]["software"] == "megatron-bridge"
    # 8.03B parameters: 2 bytes less per gradient element on every rank; per token of the micro-batch the head
    # keeps the 16-bit logits and a log-sum-exp instead of the fp32 softmax (128,256 logits)
    v = 128256
    assert mcore["predicted"]["peak_memory_bytes"] - bridge["predicted"]["peak_memory_bytes"] == \
        pytest.approx(2 * 8.03e9 + 4096 * (4 * v - (2 * v + 4)), rel=0.002)
    code, out, err = run(capsys, "export", str(path), "--format", "megatron")
    assert code == 0 and "--grad-reduce-in-bf16" in out and "--cross-entropy-loss-fusion" in out
    assert "costed as" not in err


def test_fp8_preset_profile_file(capsys, tmp_path):
    """`plan profile --preset --fp8` writes the recipe into the profile; plans from it carry it, and --fp8
    against a profile made without it is one line, exit 2."""
    import json

    path, plain = tmp_path / "fp8.json", tmp_path / "bf16.json"
    assert main(["profile", "llama3-8b", "--cluster", "8xh100-80gb", "--preset", "--software", "megatron", "--fp8",
                 "delayed", "-o", str(path), "--quiet"]) == 0
    code, out, _ = run(capsys, "llama3-8b", "--cluster", "8xh100-80gb", "--global-batch-size", "64", "--profile",
                       str(path), "--json")
    assert code == 0 and json.loads(out)["parallel"]["fp8"] == "delayed"
    assert main(["profile", "llama3-8b", "--cluster", "8xh100-80gb", "--preset", "-o", str(plain), "--quiet"]) == 0
    code, _, err = run(capsys, "llama3-8b", "--cluster", "8xh100-80gb", "--profile", str(plain), "--fp8", "delayed")
    assert code == 2 and "--fp8:" in err and len(err.strip().splitlines()) == 1


def test_sliding_window_keeps_context_parallelism_out(capsys, tmp_path):
    """A sliding window narrower than the sequence: the search weighs no CP degree (the executor's CP attends
    over whole chunks), and a pinned --cp is one line, exit 2. Mistral-7B-v0.1's config (window 4096)."""
    import json

    cfg = {"model_type": "mistral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000,
           "max_position_embeddings": 32768, "sliding_window": 4096}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    code, out, _ = run(capsys, str(path), "--cluster", "8xh100-80gb", "--seq-len", "32768", "--global-batch-size",
                       "8", "--json")
    plan = json.loads(out)
    assert code == 0 and all(p["parallel"]["cp"] == 1 for p in [plan] + plan["alternatives"])
    assert plan["model"]["sliding_window"] == 4096
    code, _, err = run(capsys, str(path), "--cluster", "8xh100-80gb", "--seq-len", "32768", "--cp", "2")
    assert code == 2 and "sliding window of 4096 tokens" in err


def test_a_long_default_sequence_is_pointed_out(capsys):
    """The default sequence is the model's maximum; past 8K (a long-context config's 128K) stderr says so and
    how to plan another length; stdout (the report, --json) is unchanged."""
    code, out, err = run(capsys, "llama3.2-1b", "--cluster", "8xh100-80gb", "--global-batch-size", "8")
    assert code == 0 and "seq 131072" in out and "plan: seq 131072 is llama3.2-1b's maximum" in err
    code, out, err = run(capsys, "llama3.2-1b", "--cluster", "8xh100-80gb", "--global-batch-size", "8",
                         "--seq-len", "131072")
    assert code == 0 and "seq 131072" in out and "maximum" not in err
    code, _, err = run(capsys, "llama3-8b", "--cluster", "8xh100-80gb")
    assert code == 0 and "maximum" not in err


def test_old_engines_recompute_every_block(capsys):
    """Megatron-LM of 2021 checkpoints every layer of a stage when it recomputes (no per-stage count before
    --activations-checkpoint-method block): a full-recompute plan for it recomputes each stage's blocks."""
    import json

    code, out, _ = run(capsys, "llama3-70b", "--cluster", "4x8xa100-80gb", "--global-batch-size", "128",
                       "--seq-len", "4096", "--software", "megatron-2021", "--json")
    plan = json.loads(out)
    assert code == 0 and plan["parallel"]["recompute"] == "full"
    for s in plan["stages"]:
        blocks = sum(1 for layer in range(*s["layers"]) if 0 < layer < 81)
        assert s["recompute_layers"] == blocks, s


def test_plans_for_software_without_sequence_parallelism_say_so(capsys, tmp_path):
    """Megatron-LM of 2021 had no sequence parallelism: its plans say so (the executor then replicates the
    norms' activations over TP, as costed) and the Megatron export passes no --sequence-parallel."""
    import json

    from meshplan.planner.export import to_megatron
    from meshplan.planner.plan import load_plan

    path = tmp_path / "plan.json"
    code, _, _ = run(capsys, "gpt3-175b", "--cluster", "16x8xa100-80gb", "--global-batch-size", "256",
                     "--software", "megatron-2021", "-o", str(path))
    plan = json.loads(path.read_text())
    assert code == 0 and plan["parallel"]["tp"] > 1 and plan["parallel"]["sequence_parallel"] is False
    assert "--sequence-parallel" not in to_megatron(load_plan(str(path)))
    code, _, _ = run(capsys, "gpt3-175b", "--cluster", "16x8xa100-80gb", "--global-batch-size", "256",
                     "--software", "megatron", "-o", str(path))
    assert code == 0 and json.loads(path.read_text())["parallel"]["sequence_parallel"] is True
