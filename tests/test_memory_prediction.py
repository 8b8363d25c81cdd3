"""Predicted peak memory against the executor's measured peak (tracked tensor bytes, one CPU process),
for a tied, vocabulary-heavy model where the step's transients (the tied embedding's gradient sum, the
loss backward, AdamW's temporaries) are a third of the peak: the cost model's `peak_memory`."""

import json
import math

import pytest
from meshplan.executor.cli import main as executor_main
from meshplan.planner.candidate import Candidate, Links
from meshplan.planner.cli import main as plan_main
from meshplan.planner.cost_model import build_problem, evaluate
from meshplan.planner.model_sources import from_hf_config
from meshplan.planner.plan import load_plan, save_plan
from meshplan.profiler.profile import load_profile

from tests.executor_worker import free_port
from tests.helpers import make_plan


def predicted_peak(plan, profile) -> float:
    p = plan.parallel
    cand = Candidate(p.dp, p.tp, p.pp, p.virtual_stages, p.schedule, p.micro_batch_size, p.num_micro_batches,
                     p.zero, p.recompute)
    links = Links("intra_node", "intra_node", "intra_node")
    problem = build_problem(plan.model, profile, cand, p.seq_len, p.dtype, links, math.inf,
                            [True] * len(plan.model.layers))
    bounds = [s.layers[0] for s in plan.stages] + [plan.stages[-1].layers[1]]
    return max(evaluate(problem, bounds, [s.recompute_layers for s in plan.stages]).rank_memory)


@pytest.mark.parametrize("b,m", [(1, 4), (4, 1)])
def test_predicted_peak_matches_the_executor(tmp_path, monkeypatch, capsys, b, m):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 8192, "n_embd": 64, "n_layer": 2,
                                  "n_head": 4, "n_positions": 64, "tie_word_embeddings": True}))
    monkeypatch.setenv("MESHPLAN_CACHE", str(tmp_path / "cache"))
    profile_path = tmp_path / "profile.json"
    assert plan_main(["profile", str(config), "--cluster", "1xcpu", "--seq-len", "32", "--micro-batch-sizes",
                      str(b), "--warmup", "1", "--repeats", "2", "--quiet", "-o", str(profile_path)]) == 0
    plan = make_plan(cluster="1xcpu", micro_batch_size=b, num_micro_batches=m, seq_len=32)
    plan.model = from_hf_config(str(config))
    plan.stages[0].layers = [0, len(plan.model.layers)]
    plan_path, metrics = tmp_path / "plan.json", tmp_path / "m.jsonl"
    save_plan(plan, str(plan_path))
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    assert executor_main([str(plan_path), "--steps", "3", "--metrics", str(metrics)]) == 0
    summary = json.loads(metrics.read_text().splitlines()[-1])
    measured = summary["peak_tensor_bytes"]
    predicted = predicted_peak(load_plan(str(plan_path)), load_profile(str(profile_path)))
    assert predicted == pytest.approx(measured, rel=0.05)
    state = 16 * plan.model.num_parameters  # parameters, gradients and AdamW state: 16 B each
    assert measured - state > 0.3 * measured  # the transients matter here
