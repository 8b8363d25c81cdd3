import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from meshplan.planner.cli import main
from meshplan.planner.plan import Alternative, Plan, Predicted, load_plan, save_plan
from meshplan.planner.show import layer_span, render

from tests.helpers import make_plan

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).parent / "golden"
GIB = 1024**3
UPDATE = os.environ.get("MESHPLAN_UPDATE_GOLDEN") == "1"  # regenerate goldens after an intended change


def check_golden(name: str, text: str) -> None:
    """Compare with tests/golden/NAME line by line, ignoring trailing spaces (rich pads table lines)."""
    path = GOLDEN / name
    text = "".join(line.rstrip() + "\n" for line in text.splitlines())
    if UPDATE:
        path.write_text(text, encoding="utf-8")
    assert path.exists(), f"missing golden {path}; run with MESHPLAN_UPDATE_GOLDEN=1"
    assert text.splitlines() == path.read_text(encoding="utf-8").splitlines()


def with_predictions(plan: Plan, iteration_s: float, peak_gib: float, mfu: float, alternatives=()) -> Plan:
    """Give a hand-made plan stage times and memory like the planner's: seconds per iteration per stage."""
    m = plan.parallel.num_micro_batches
    for s in plan.stages:
        blocks = sum(1 for layer in plan.model.layers[s.layers[0]:s.layers[1]] if layer.kind == "block")
        heavy = blocks + (2 if any(layer.kind == "head" for layer in plan.model.layers[s.layers[0]:s.layers[1]]) else 0)
        fwd, bwd = m * 0.004 * heavy, m * 0.008 * heavy
        rec = fwd if plan.parallel.recompute == "full" else 0.2 * fwd if plan.parallel.recompute == "selective" else 0.0
        comm = m * 0.002
        s.predicted_time_s = {"forward": fwd, "backward": bwd, "recompute": rec, "communication": comm,
                              "total": fwd + bwd + rec + comm}
        params = peak_gib * GIB * 0.4 * (blocks + 1) / (plan.model.num_layers / len(plan.stages) + 1)
        s.predicted_memory_bytes = {"parameters": params / 4, "gradients": params / 4, "optimizer": params / 2,
                                    "activations": 0.5 * peak_gib * GIB, "total": params + 0.5 * peak_gib * GIB}
    p = plan.parallel
    tokens = p.global_batch_size * p.seq_len
    plan.predicted = Predicted(iteration_time_s=iteration_s, tokens_per_s=tokens / iteration_s, bubble_fraction=0.12,
                               peak_memory_bytes=max(s.predicted_memory_bytes["total"] for s in plan.stages), mfu=mfu)
    plan.alternatives = list(alternatives)
    return plan


def alt(plan: Plan, iteration_s: float, peak_gib: float, note: str = "", **parallel) -> Alternative:
    p = replace(plan.parallel, **parallel)
    p.global_batch_size = p.dp * p.micro_batch_size * p.num_micro_batches
    return Alternative(p, Predicted(iteration_s, p.global_batch_size * p.seq_len / iteration_s, 0.0,
                                    peak_gib * GIB, 0.3), note)


def llama_plan() -> Plan:
    plan = make_plan(model="llama3-8b", cluster="8xa100-80gb", dp=2, tp=2, pp=2, schedule="1f1b", zero=1,
                     micro_batch_size=1, num_micro_batches=8, seq_len=2048, recompute="selective", dtype="bf16",
                     sequence_parallel=True)
    with_predictions(plan, 1.9, 61.0, 0.41)
    plan.alternatives = [
        alt(plan, 2.09, 55.0, "fewer pipeline stages, larger TP all-reduces", dp=4, pp=1, num_micro_batches=4),
        alt(plan, 1.7, 85.5, "fastest, but ZeRO-0 keeps full optimizer state", zero=0),
    ]
    return plan


def zero_bubble_plan() -> Plan:
    plan = make_plan(model="gpt2-xl", cluster="2x8xh100-80gb", dp=4, tp=1, pp=4, virtual_stages=2,
                     schedule="zero-bubble", zero=0, micro_batch_size=2, num_micro_batches=8, seq_len=1024,
                     recompute="full", dtype="fp16")
    return with_predictions(plan, 0.85, 40.0, 0.38)


def tiny_plan() -> Plan:
    plan = make_plan(model="tiny", cluster="4xa100-80gb", dp=4, zero=3, micro_batch_size=2, num_micro_batches=2)
    return with_predictions(plan, 0.01, 2.0, 0.01)


PLANS = {"llama": llama_plan, "zero_bubble": zero_bubble_plan, "tiny": tiny_plan}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_show_golden(name, tmp_path):
    path = tmp_path / "plan.json"
    save_plan(PLANS[name](), str(path))
    check_golden(f"show_{name}.txt", render(load_plan(str(path)), width=100))


def test_why_the_runner_ups_lost():
    text = " ".join(render(llama_plan(), width=100).split())
    assert "1. pp=1 dp=4 tp=2 zero=1 1f1b b=1 m=4 recompute=selective: 10.0% slower (2.09 s vs 1.9 s)" in text
    assert "does not fit: peak 85.5 GiB > 80.0 GiB device memory (over by 5.5 GiB)" in text
    assert "fastest, but ZeRO-0 keeps full optimizer state" in text


def test_over_capacity_stage_is_flagged():
    plan = llama_plan()
    plan.stages[1].predicted_memory_bytes["total"] = 96 * GIB
    lines = render(plan, width=100).splitlines()
    line = next(line for line in lines if line.lstrip().startswith("1 ") and "GiB" in line)
    assert "96.0 GiB ████████!120%" in line


def test_layer_span_names_embedding_blocks_and_head():
    model = make_plan(model="tiny").model  # embedding, block.0-3, head
    assert layer_span(model, 0, 3) == "embedding + blocks 0-1"
    assert layer_span(model, 3, 4) == "block 2"
    assert layer_span(model, 4, 6) == "block 3 + head"


def test_show_cli_writes_timeline_and_pareto_pngs(tmp_path, capsys):
    plan_path, timeline, pareto = tmp_path / "plan.json", tmp_path / "t.png", tmp_path / "p.png"
    save_plan(llama_plan(), str(plan_path))
    code = main(["show", str(plan_path), "--timeline", str(timeline), "--pareto", str(pareto), "--width", "100"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "pipeline timeline of one iteration" in out and f"timeline written to {timeline}" in out
    for png in (timeline, pareto):
        data = png.read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000


def test_show_as_a_subprocess(tmp_path):
    plan_path = tmp_path / "plan.json"
    save_plan(zero_bubble_plan(), str(plan_path))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120"}
    proc = subprocess.run([sys.executable, "-m", "meshplan.planner", "show", str(plan_path)], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "rank 3 (stage 3,4)" in proc.stdout  # ZBV: rank 3 holds the two middle stages of the V
    assert "mesh [pp, dp, tp] = [4, 4, 1]" in proc.stdout  # printed as text, not rich markup


@pytest.mark.parametrize("argv,message", [
    (["show", "/nonexistent/plan.json"], "PLAN: cannot read"),
    (["show"], "the following arguments are required: PLAN.json"),
    (["show", "PLAN", "--width", "10"], "--width"),
    (["show", "PLAN", "--timeline", "/nonexistent/dir/t.png"], "--timeline: cannot write"),
])
def test_show_bad_input_is_one_line(argv, message, tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    save_plan(tiny_plan(), str(plan_path))
    code = main([str(plan_path) if a == "PLAN" else a for a in argv])
    out, err = capsys.readouterr()
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("plan: error: ") and message in lines[0], err


def test_pareto_front_and_png(tmp_path):
    from meshplan.planner.pareto import pareto_front, write_pareto

    cands = [(1.0, 50 * GIB, "a"), (1.2, 40 * GIB, "b"), (1.1, 60 * GIB, "c"), (2.0, 30 * GIB, "d"),
             (2.5, 35 * GIB, "e")]
    assert [c[2] for c in pareto_front(cands)] == ["a", "b", "d"]
    out = tmp_path / "pareto.png"
    write_pareto(cands, cands[0], str(out), capacity_bytes=80 * GIB)
    assert out.read_bytes().startswith(b"\x89PNG") and out.stat().st_size > 10_000


def test_show_without_stage_times_says_so(tmp_path, capsys):
    plan = tiny_plan()
    for s in plan.stages:
        s.predicted_time_s = {}
    assert "no pipeline timeline: the stages carry no forward/backward times" in render(plan, width=100)
    path = tmp_path / "plan.json"
    save_plan(plan, str(path))
    assert main(["show", str(path), "--timeline", str(tmp_path / "t.png")]) == 2
    assert "--timeline: the plan's stages carry no forward/backward times" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["llama3-8b", "--cluster", "8xa100-80gb", "--pp", "2", "--tp", "2", "--schedule", "1f1b",
     "--global-batch-size", "16", "--seq-len", "2048"],
    ["llama3-70b", "--cluster", "4x8xh100-80gb", "--pp", "4", "--schedule", "interleaved-1f1b",
     "--global-batch-size", "64", "--seq-len", "4096"],
    ["gpt2", "--cluster", "4xa100-40gb", "--pp", "2", "--schedule", "zero-bubble", "--global-batch-size", "16"],
])
def test_show_and_export_plans_from_the_planner(argv, tmp_path, capsys):
    """The three commands on plans the search produced (not hand-built ones)."""
    import json
    import tomllib

    path = tmp_path / "plan.json"
    assert main([*argv, "-o", str(path), "--json"]) == 0
    capsys.readouterr()
    png = tmp_path / "timeline.png"
    assert main(["show", str(path), "--timeline", str(png)]) == 0
    out = capsys.readouterr().out
    assert "pipeline timeline" in out and "why not the runner-ups" in out and png.stat().st_size > 10_000
    assert main(["export", str(path), "--format", "torchtitan"]) == 0
    tomllib.loads(capsys.readouterr().out)
    assert main(["export", str(path), "--format", "deepspeed"]) == 0
    ds = json.loads(capsys.readouterr().out)
    plan = load_plan(str(path))
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] \
        * plan.parallel.dp
    assert main(["export", str(path), "--format", "megatron"]) == 0
    assert f"--pipeline-model-parallel-size {plan.parallel.pp}" in capsys.readouterr().out
