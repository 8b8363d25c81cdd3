"""Every plan shape reproduces a 1-process PyTorch loop: the losses of the first 5 steps within 1e-4
relative (fp32, gloo, 4 processes, one torchrun launch for all plans)."""

from dataclasses import replace

import pytest
from meshplan.planner.model_sources import builtin_model
from meshplan.planner.plan import Placement

from tests.executor_worker import assert_matches_reference, run_plans
from tests.helpers import make_plan

STEPS, SEED = 5, 3

PLANS = {  # the eight shapes first, then other schedule x zero x recompute combinations
    "dp4": dict(dp=4, micro_batch_size=2, num_micro_batches=2),
    "tp2xdp2": dict(tp=2, dp=2, micro_batch_size=2, num_micro_batches=2),
    "pp2xdp2": dict(pp=2, dp=2, micro_batch_size=2, num_micro_batches=2),
    "pp2xtp2": dict(pp=2, tp=2, micro_batch_size=2, num_micro_batches=4),
    "pp4-1f1b": dict(pp=4, schedule="1f1b", micro_batch_size=2, num_micro_batches=4),
    "pp2-interleaved-v2xdp2": dict(pp=2, dp=2, virtual_stages=2, schedule="interleaved-1f1b",
                                   micro_batch_size=1, num_micro_batches=4),
    "fsdp-zero3-dp2xtp2": dict(dp=2, tp=2, zero=3, micro_batch_size=2, num_micro_batches=2),
    "pp2-full-recomputexdp2": dict(pp=2, dp=2, recompute="full", micro_batch_size=2, num_micro_batches=2),
    "pp2-zbv-v2xtp2-sp": dict(pp=2, tp=2, virtual_stages=2, schedule="zero-bubble", sequence_parallel=True,
                              micro_batch_size=2, num_micro_batches=4),
    "pp2-gpipe-zero1xdp2": dict(pp=2, dp=2, schedule="gpipe", zero=1, micro_batch_size=2, num_micro_batches=2),
    "dp2xtp2-sp-selective-zero2": dict(dp=2, tp=2, zero=2, sequence_parallel=True, recompute="selective",
                                       micro_batch_size=2, num_micro_batches=2),
    # mixed precision (FSDP casts parameters to bf16, reduces in fp32): close, not equal, to fp32
    "bf16-pp2xtp2-sp": dict(pp=2, tp=2, dtype="bf16", sequence_parallel=True, micro_batch_size=2,
                            num_micro_batches=2),
    # tied embedding / LM head on different stages (gradients summed between first and last stage)
    "tied-pp2xdp2-zero3": dict(tied=True, pp=2, dp=2, zero=3, micro_batch_size=2, num_micro_batches=2),
    "tied-pp2-zbv-v2xtp2": dict(tied=True, pp=2, tp=2, virtual_stages=2, schedule="zero-bubble",
                                micro_batch_size=2, num_micro_batches=2),
    # the planner's placement with data parallelism outermost: rank = 2·dp_index + pp_index
    "pp2xdp2-dp-outer-placement": dict(pp=2, dp=2, micro_batch_size=2, num_micro_batches=2,
                                       placement=Placement(["dp", "pp", "cp", "tp"], [[[[0]], [[2]]], [[[1]], [[3]]]])),
    # other block parts: GPT-NeoX's (parallel residual, a quarter of each head rotated, LayerNorm, biases)
    # and OPT's (ReLU MLP, learned positions, tied head)
    "neox-pp2xtp2-sp": dict(model="neox", pp=2, tp=2, sequence_parallel=True, micro_batch_size=2,
                            num_micro_batches=2),
    "opt-dp2xtp2-zero3": dict(model="opt", dp=2, tp=2, zero=3, micro_batch_size=2, num_micro_batches=2),
    # and Gemma's (GeGLU, scaled embedding, heads wider than hidden / heads)
    "gemma-pp2xtp2-sp": dict(model="gemma", pp=2, tp=2, sequence_parallel=True, micro_batch_size=2,
                             num_micro_batches=2),
    # a sliding window narrower than the sequence (Mistral v0.1's), under selective recompute
    "window-dp2xtp2-sp-selective": dict(model="window", dp=2, tp=2, sequence_parallel=True, recompute="selective",
                                        micro_batch_size=2, num_micro_batches=2),
    # BLOOM's: ALiBi (each TP rank's heads keep their own slopes), the embedding's LayerNorm
    "bloom-pp2xtp2-sp": dict(model="bloom", pp=2, tp=2, sequence_parallel=True, micro_batch_size=2,
                             num_micro_batches=2),
    # Qwen3's norms over each head of q and k: one weight for all heads, each TP rank norming its own
    "qwen3-dp2xtp2-sp-zero3": dict(model="qwen3", dp=2, tp=2, zero=3, sequence_parallel=True, micro_batch_size=2,
                                   num_micro_batches=2),
    "qwen3-pp2xtp2": dict(model="qwen3", pp=2, tp=2, micro_batch_size=2, num_micro_batches=2),
    "qwen3-pp2-zbv-v2xtp2-sp": dict(model="qwen3", pp=2, tp=2, virtual_stages=2, schedule="zero-bubble",
                                    sequence_parallel=True, micro_batch_size=2, num_micro_batches=4),
}

_TINY_GPT = dict(norm="layernorm", mlp="gelu", linear_bias=True, num_kv_heads=4, layers=())
MODELS = {  # variants of the tiny model
    "tied": dict(name="tiny-tied", tied_embeddings=True, layers=()),
    "neox": dict(_TINY_GPT, name="tiny-neox", parallel_residual=True, rotary_dim=4),
    "opt": dict(_TINY_GPT, name="tiny-opt", mlp="relu", position="learned", tied_embeddings=True),
    "gemma": dict(name="tiny-gemma", mlp="geglu", embedding_scale=True, head_dim=32, tied_embeddings=True, layers=()),
    "window": dict(name="tiny-window", sliding_window=8, layers=()),
    "bloom": dict(_TINY_GPT, name="tiny-bloom", position="alibi", embedding_norm=True, tied_embeddings=True),
    "qwen3": dict(name="tiny-qwen3", qk_norm=True, layers=()),
}


def build(tied: bool = False, placement: Placement | None = None, model: str | None = None, **kwargs):
    plan = make_plan(cluster="4xcpu", **kwargs)
    plan.placement = placement
    model = "tied" if tied else model  # the tiny model with its LM head tied to the embedding
    if model is not None:
        plan.model = replace(builtin_model("tiny"), **MODELS[model])
    return plan


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    plans = {name: build(**kwargs) for name, kwargs in PLANS.items()}
    return run_plans(tmp_path_factory.mktemp("equiv"), plans, "executor_worker.py", STEPS, SEED, timeout=420)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS))
def test_plan_matches_single_process(results, name):
    rel = 1e-4 if PLANS[name].get("dtype", "fp32") == "fp32" else 2e-2
    assert_matches_reference(results, name, STEPS, SEED, rel=rel)
