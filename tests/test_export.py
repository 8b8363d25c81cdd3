import json
import os
import subprocess
import sys

import pytest
from meshplan.planner.cli import main
from meshplan.planner.export import megatron_layout, to_deepspeed, to_megatron, to_torchtitan, torchtitan_fqns
from meshplan.planner.plan import save_plan

from tests.helpers import make_plan
from tests.test_show import PLANS, ROOT, check_golden

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

EXPORTS = {"megatron": (to_megatron, "txt"), "torchtitan": (to_torchtitan, "toml"), "deepspeed": (to_deepspeed, "json")}


@pytest.mark.parametrize("fmt", sorted(EXPORTS))
@pytest.mark.parametrize("name", sorted(PLANS))
def test_export_golden(name, fmt):
    fn, ext = EXPORTS[fmt]
    warnings: list[str] = []
    text = fn(PLANS[name](), warnings)
    check_golden(f"{fmt}_{name}.{ext}", text + "".join(f"# warning: {w}\n" for w in warnings) if ext == "txt"
                 else text)


@pytest.mark.parametrize("name", sorted(PLANS))
def test_torchtitan_toml_parses_and_batches_add_up(name):
    plan = PLANS[name]()
    cfg = tomllib.loads(to_torchtitan(plan))
    p, tr, par = plan.parallel, cfg["training"], cfg["parallelism"]
    assert tr["global_batch_size"] == p.global_batch_size and tr["seq_len"] == p.seq_len
    dp = par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"]
    assert dp * par["tensor_parallel_degree"] * par["pipeline_parallel_degree"] == plan.world_size
    accumulation = tr["global_batch_size"] // (tr["local_batch_size"] * dp)
    assert tr["local_batch_size"] * dp * accumulation == p.global_batch_size
    if p.pp > 1:
        assert tr["local_batch_size"] // par["pipeline_parallel_microbatch_size"] == p.num_micro_batches
        assert len(par["module_fqns_per_model_part"]) == p.pp * p.virtual_stages
    assert cfg["activation_checkpoint"]["mode"] == p.recompute


@pytest.mark.parametrize("name", sorted(PLANS))
def test_deepspeed_batch_arithmetic(name):
    plan = PLANS[name]()
    cfg = json.loads(to_deepspeed(plan))
    dp = plan.world_size // (plan.parallel.tp * plan.parallel.pp)
    assert cfg["train_batch_size"] == cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * dp
    assert cfg["zero_optimization"]["stage"] == plan.parallel.zero
    assert cfg["bf16"]["enabled"] == (plan.parallel.dtype == "bf16")
    assert cfg["fp16"]["enabled"] == (plan.parallel.dtype == "fp16")


def test_megatron_layout_and_even_split():
    uneven = make_plan(model="llama3-8b", cluster="8xa100-80gb", pp=4, num_micro_batches=4)
    assert megatron_layout(uneven) == "Et*7|t*9|t*9|t*7L"  # layers [0,8) [8,17) [17,26) [26,34)
    assert "--pipeline-model-parallel-layout" in to_megatron(uneven)
    even = make_plan(model="tiny", cluster="8xa100-80gb", pp=2, virtual_stages=3, schedule="interleaved-1f1b",
                     num_micro_batches=4)  # 6 layers over 6 stages: embedding and head alone, one block each
    assert megatron_layout(even) == "E|t|t|t|t|L"
    flat = make_plan(model="gpt2", cluster="8xa100-80gb", pp=2, num_micro_batches=4)
    flat.stages[0].layers, flat.stages[1].layers = [0, 7], [7, 14]  # 6 blocks each: Megatron's default
    args = to_megatron(flat)
    assert "--pipeline-model-parallel-layout" not in args and "--num-layers-per-virtual-pipeline-stage" not in args
    assert "--untie-embeddings-and-output-weights" not in args  # gpt2 ties its head to the embedding


def test_deepspeed_names_the_partition_method_of_an_even_split():
    """DeepSpeed's 'type:transformer' balances the blocks (planner/stage_split.py "even"); another split is
    left to code."""
    plan = make_plan(model="gpt2", cluster="8xa100-80gb", pp=2, num_micro_batches=4)
    plan.stages[0].layers, plan.stages[1].layers = [0, 7], [7, 14]  # 6 blocks each
    warnings: list[str] = []
    to_deepspeed(plan, warnings)
    assert any("partition_method='type:transformer')" in w for w in warnings), warnings
    plan.stages[0].layers, plan.stages[1].layers = [0, 6], [6, 14]
    warnings = []
    to_deepspeed(plan, warnings)
    assert any("partition_method=...)" in w for w in warnings), warnings


def test_megatron_recompute_and_zero():
    full = to_megatron(make_plan(model="tiny", cluster="8xa100-80gb", recompute="full", zero=1, dtype="bf16"))
    assert "--recompute-granularity full \\\n--recompute-method uniform \\\n--recompute-num-layers 1" in full
    assert "--use-distributed-optimizer" in full and full.rstrip().endswith("--bf16")
    partial = make_plan(model="tiny", cluster="8xa100-80gb", pp=2, recompute="full", zero=3, num_micro_batches=4)
    partial.stages[0].recompute_layers, partial.stages[1].recompute_layers = 1, 2
    warnings: list[str] = []
    args = to_megatron(partial, warnings)
    assert "--recompute-method block \\\n--recompute-num-layers 2" in args
    assert "--data-parallel-sharding-strategy optim_grads_params" in args
    assert any(w.startswith("per-stage recompute counts") for w in warnings)
    assert any(w.startswith("ZeRO-3 with pipeline parallelism") for w in warnings)


@pytest.mark.parametrize("fmt,kwargs,feature", [
    ("megatron", {"pp": 2, "schedule": "gpipe"}, "pipeline schedule gpipe"),
    ("megatron", {"pp": 2, "virtual_stages": 2, "schedule": "zero-bubble"}, "pipeline schedule zero-bubble"),
    ("torchtitan", {"dtype": "fp16"}, "dtype fp16"),
    ("torchtitan", {"zero": 1, "dp": 2}, "ZeRO-1"),
    ("torchtitan", {"tp": 2}, "tensor parallel without sequence parallel"),
    ("torchtitan", {"recompute": "selective"}, "recompute selective"),
    ("deepspeed", {"pp": 2, "zero": 2}, "ZeRO-2 with pipeline parallelism"),
    ("deepspeed", {"pp": 2, "virtual_stages": 2, "schedule": "interleaved-1f1b"}, "pipeline schedule interleaved-1f1b"),
    ("deepspeed", {"recompute": "selective"}, "recompute selective"),
])
def test_unexpressible_features_are_named(fmt, kwargs, feature):
    kwargs = {"num_micro_batches": 4, **kwargs}
    warnings: list[str] = []
    EXPORTS[fmt][0](make_plan(model="tiny", cluster="8xa100-80gb", **kwargs), warnings)
    assert any(w.startswith(feature) for w in warnings), warnings
    assert all("\n" not in w for w in warnings)


@pytest.mark.parametrize("mode, megatron, rotate, deepspeed", [
    ("ring", "p2p", "alltoall", None), ("all-gather", "allgather", "allgather", None),
    ("all-to-all", "a2a", "alltoall", 2)])
def test_context_parallel_in_every_export(mode, megatron, rotate, deepspeed):
    """Megatron-LM --context-parallel-size / --cp-comm-type, torchtitan context_parallel_degree / its rotate
    method, DeepSpeed-Ulysses sequence_parallel_size (all-to-all only; the others named on stderr)."""
    plan = make_plan(model="tiny", cluster="8xa100-80gb", dp=2, cp=2, cp_mode=mode, seq_len=32)
    warnings: list[str] = []
    text = to_megatron(plan, warnings)
    assert "--context-parallel-size 2" in text and f"--cp-comm-type {megatron}" in text
    titan = to_torchtitan(plan, warnings)
    assert "context_parallel_degree = 2" in titan and f'context_parallel_rotate_method = "{rotate}"' in titan
    ds = json.loads(to_deepspeed(plan, warnings))
    assert ds.get("sequence_parallel_size") == deepspeed
    if deepspeed is None:
        assert any(w.startswith(f"context parallelism cp=2 ({mode})") for w in warnings), warnings


def test_torchtitan_fqns_cover_every_module_once():
    plan = PLANS["zero_bubble"]()
    names = [n for part in torchtitan_fqns(plan) for n in part]
    assert names == ["tok_embeddings", *[f"layers.{i}" for i in range(48)], "norm", "output"]


def test_export_cli(tmp_path):
    path = tmp_path / "plan.json"
    save_plan(PLANS["zero_bubble"](), str(path))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "meshplan.planner", "export", str(path), "--format", "torchtitan"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert tomllib.loads(proc.stdout)["parallelism"]["pipeline_parallel_schedule"] == "ZBVZeroBubble"
    warnings = proc.stderr.strip().splitlines()
    assert warnings and all(line.startswith("plan export: warning: ") for line in warnings)
    assert any("dtype fp16" in line for line in warnings)


def test_export_cli_output_file(tmp_path, capsys):
    path, out = tmp_path / "plan.json", tmp_path / "ds.json"
    save_plan(PLANS["llama"](), str(path))
    assert main(["export", str(path), "--format", "deepspeed", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["train_micro_batch_size_per_gpu"] == 1
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("argv,message", [
    (["export", "PLAN", "--format", "jax"], "argument --format: invalid choice: 'jax'"),
    (["export", "PLAN"], "the following arguments are required: --format"),
    (["export", "/nonexistent.json", "--format", "megatron"], "PLAN: cannot read"),
])
def test_export_bad_input_is_one_line(argv, message, tmp_path, capsys):
    path = tmp_path / "plan.json"
    save_plan(PLANS["tiny"](), str(path))
    code = main([str(path) if a == "PLAN" else a for a in argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("plan: error: ") and message in lines[0], err


@pytest.mark.parametrize("mode, comm, engines", [
    ("ring", "1 KV exchanges per layer", "--cp-comm-type p2p"),
    ("all-gather", "K and V gathered before each layer's attention", "--cp-comm-type allgather"),
    ("all-to-all", "4 all-to-alls per layer", "DeepSpeed-Ulysses (sequence_parallel_size)")])
def test_cp_lines_name_mode_group_exposure_and_engines(mode, comm, engines):
    """What `plan` and `plan show` print for a CP plan: the mode's communication, the tokens per rank,
    the group and its exposed seconds, and the engines that run the mode."""
    from meshplan.planner.cp_report import cp_lines

    plan = make_plan(model="tiny", cluster="8xa100-80gb", dp=2, cp=2, cp_mode=mode, seq_len=32)
    plan.predicted.exposed_communication_s["cp"] = 0.0123
    text = "\n".join(cp_lines(plan))
    assert f"cp=2 ({mode}: {comm}" in text and "16 of 32 tokens per rank" in text
    assert "CP groups of 2 ranks each inside one node" in text and "exposed CP communication 12.3 ms" in text
    assert f"cp mode {mode} runs on:" in text and engines in text
    assert cp_lines(make_plan(model="tiny", cluster="8xa100-80gb")) == []


def test_plan_records_the_software_it_was_costed_for(tmp_path, capsys):
    """A plan from GPU presets records the --software its times were costed for (search.software, read back
    from the JSON); exporting it to another engine warns, one line, how to cost it for that engine."""
    from meshplan.planner.plan import load_plan

    out = tmp_path / "plan.json"
    assert main(["llama3-8b", "--cluster", "2x8xa100-80gb", "--global-batch-size", "32", "--software",
                 "megatron-2022", "-o", str(out)]) == 0
    capsys.readouterr()
    assert load_plan(str(out)).search.software == "megatron-2022"
    assert main(["export", str(out), "--format", "megatron"]) == 0
    assert "costed as" not in capsys.readouterr().err
    assert main(["export", str(out), "--format", "torchtitan"]) == 0
    assert "costed as megatron-2022 runs it (GPU presets); for torchtitan's, plan again with --software " \
           "torchtitan" in capsys.readouterr().err


def test_megatron_block_flags_follow_the_model_parts():
    """Megatron-LM's defaults are GELU, LayerNorm, learned positions and biases: a GPT-NeoX block exports
    only its rotary share (--rotary-percent) and names its parallel residual as not exportable; Qwen2's q/k/v
    bias without other biases is --add-qkv-bias; an OPT ReLU MLP is named; a llama block keeps its four flags."""
    from dataclasses import replace

    from meshplan.planner.model_sources import builtin_model

    plan = make_plan()
    gpt = builtin_model("gpt2")
    neox = replace(gpt, name="neox", position="rope", rotary_dim=16, parallel_residual=True, layers=())
    for model, present, absent, warned in (
            (neox, ["--position-embedding-type rope", "--rotary-percent 0.25"],
             ["--swiglu", "--normalization", "--disable-bias-linear"], "parallel residual"),
            (replace(builtin_model("llama3-8b"), name="qwen", qkv_bias=True, layers=()),
             ["--swiglu", "--normalization RMSNorm", "--disable-bias-linear", "--add-qkv-bias"], ["--rotary-percent"],
             None),
            (replace(gpt, name="opt", mlp="relu", layers=()), [], ["--swiglu", "--position-embedding-type"], "ReLU")):
        plan.model = model
        warnings: list[str] = []
        text = to_megatron(plan, warnings)
        assert all(flag in text for flag in present) and not any(flag in text for flag in absent), text
        assert warned is None or any(warned in w for w in warnings), warnings
