"""Expert parallelism reproduces a 1-process loop: tiny-moe (8 experts of 32, top 2, block 0 dense) on 4
gloo processes, fp32, same seed and global batch; losses and gradient norms (before clipping) of the first
steps within 1e-4 relative. The load-balancing loss's gradient is part of every step (aux_loss_coef > 0; tiny-moe's
0.01, raised to 1 where a plan checks that loss itself): a plan that got it wrong would differ in the gradient norms
and, after the first update, in the losses."""

from dataclasses import replace

import pytest

from tests.executor_worker import reference_steps, run_plans
from tests.helpers import make_plan

STEPS, SEED = 4, 5

PLANS = {  # the four shapes, then ZeRO-3 with full recompute, sequence, context and expert tensor parallelism
    "ep2xdp2": dict(dp=4, ep=2, zero=1, micro_batch_size=1, num_micro_batches=2),
    "ep4": dict(dp=4, ep=4, micro_batch_size=1, num_micro_batches=2),
    "ep2-tp2": dict(dp=2, tp=2, ep=2, micro_batch_size=2, num_micro_batches=2),
    "ep2-pp2": dict(dp=2, pp=2, ep=2, micro_batch_size=1, num_micro_batches=4),
    "ep2xdp2-zero3-full-recompute": dict(dp=4, ep=2, zero=3, recompute="full", micro_batch_size=1,
                                         num_micro_batches=2),
    "ep2-tp2-sp-selective": dict(dp=2, tp=2, ep=2, sequence_parallel=True, recompute="selective",
                                 micro_batch_size=2, num_micro_batches=2),
    # expert_tp = 1 under sequence parallelism: each TP rank routes its own sequence shard, the MoE's parameters'
    # gradients are summed over TP and the load-balancing loss's statistics too (weight 1: a wrong sum shows)
    "ep2-tp2-sp-shared-zero1-aux1": dict(dp=2, tp=2, ep=2, sequence_parallel=True, shared=True, zero=1,
                                         micro_batch_size=2, num_micro_batches=2, aux_loss_coef=1.0),
    # both fold EP over TP (ParallelConfig.experts_span_tp): the EP group of 2 is the TP group, edp = 2; here EP
    # spans all 4 ranks (tp 2 x dp 2), one expert pair per rank, not replicated over TP (edp = 1)
    "ep4-tp2-sp-zero1": dict(dp=2, tp=2, ep=4, sequence_parallel=True, zero=1, micro_batch_size=2,
                             num_micro_batches=2, aux_loss_coef=1.0),
    "ep4-tp2-sp-zero3-full-recompute": dict(dp=2, tp=2, ep=4, sequence_parallel=True, zero=3, recompute="full",
                                            micro_batch_size=2, num_micro_batches=2),
    "ep2-tp2-pp2-sp": dict(pp=2, tp=2, ep=2, sequence_parallel=True, micro_batch_size=1, num_micro_batches=4),
    # folded over cp x tp: all-gather context parallelism, EP over all 4 ranks
    "ep4-cp2-tp2-sp": dict(cp=2, cp_mode="all-gather", tp=2, ep=4, sequence_parallel=True, zero=1,
                           micro_batch_size=2, num_micro_batches=2, aux_loss_coef=1.0),
    # ZeRO-0 (replicate: experts all-reduced over edp = 2), with all-to-all context parallelism. CP splits
    # sequences: the load-balancing loss sums its statistics over the CP group, so it is the whole sequence's.
    "ep2-cp2-zero0": dict(dp=2, cp=2, cp_mode="all-to-all", ep=2, micro_batch_size=1, num_micro_batches=2),
    "ep4-cp2-zero1": dict(dp=2, cp=2, cp_mode="all-to-all", ep=4, zero=1, micro_batch_size=1, num_micro_batches=2),
    # the load-balancing loss weighted as much as the language-model loss: per CP chunk it would differ at once
    "cp2xdp2-aux1": dict(dp=2, cp=2, cp_mode="all-to-all", zero=1, micro_batch_size=1, num_micro_batches=2,
                         aux_loss_coef=1.0),
    "ep2-cp2-aux1": dict(dp=2, cp=2, cp_mode="all-to-all", ep=2, micro_batch_size=1, num_micro_batches=2,
                         aux_loss_coef=1.0),
    # expert_tp = tp: every expert's width split over TP, its output a partial sum reduced over TP
    "ep2-tp2-etp2": dict(dp=2, tp=2, ep=2, expert_tp=2, micro_batch_size=2, num_micro_batches=2),
    "ep2-tp2-etp2-sp-zero1": dict(dp=2, tp=2, ep=2, expert_tp=2, sequence_parallel=True, zero=1,
                                  micro_batch_size=2, num_micro_batches=2, aux_loss_coef=1.0),
    "tp2-etp2xdp2-shared": dict(dp=2, tp=2, expert_tp=2, shared=True, micro_batch_size=2, num_micro_batches=2),
    # under sequence parallelism each TP rank dispatches its own shard's rows and gathers the received rows over TP
    # (Megatron-Core's dispatcher): with EP, without it (the TP exchange alone), with shared experts and the
    # load-balancing loss's statistics summed over TP, with ZeRO-3 and full recompute
    "ep2-tp2-etp2-sp-shared-aux1": dict(dp=2, tp=2, ep=2, expert_tp=2, sequence_parallel=True, shared=True, zero=1,
                                        micro_batch_size=2, num_micro_batches=2, aux_loss_coef=1.0),
    "tp2-etp2xdp2-sp-shared": dict(dp=2, tp=2, expert_tp=2, sequence_parallel=True, shared=True,
                                   micro_batch_size=2, num_micro_batches=2),
    "ep2-tp2-etp2-sp-zero3-full-recompute": dict(dp=2, tp=2, ep=2, expert_tp=2, sequence_parallel=True, zero=3,
                                                 recompute="full", micro_batch_size=2, num_micro_batches=2),
    "tp2-etp2-pp2-sp": dict(pp=2, tp=2, expert_tp=2, sequence_parallel=True, micro_batch_size=1, num_micro_batches=4),
    # zero-bubble (ZB-V): backward split into input and weight passes, the all-to-alls in the input pass
    "ep2-pp2-zbv": dict(dp=2, pp=2, ep=2, virtual_stages=2, schedule="zero-bubble", zero=1, micro_batch_size=1,
                        num_micro_batches=4),
}


def build(ep: int = 1, expert_tp: int = 1, aux_loss_coef: float | None = None, shared: bool = False, **kwargs):
    """tiny-moe with the plan's degrees; `aux_loss_coef` replaces the model's (0.01); `shared` adds a
    Qwen2-MoE shared expert (width 64) behind a sigmoid gate."""
    plan = make_plan(model="tiny-moe", cluster="4xcpu", **kwargs)
    plan.parallel.ep, plan.parallel.expert_tp = ep, expert_tp
    moe = plan.model.moe
    if aux_loss_coef is not None:
        moe = replace(moe, aux_loss_coef=aux_loss_coef)
    if shared:
        moe = replace(moe, num_shared_experts=1, shared_expert_ffn_hidden_size=64, shared_expert_gate=True)
    plan.model = replace(plan.model, moe=moe)
    return plan


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    plans = {name: build(**kwargs) for name, kwargs in PLANS.items()}
    return run_plans(tmp_path_factory.mktemp("moe"), plans, "moe_worker.py", STEPS, SEED, timeout=420)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS))
def test_expert_parallel_matches_single_process(results, name):
    losses, paths = results
    got = losses[name]
    assert isinstance(got, list), got
    want = reference_steps(paths[name], STEPS, SEED)
    assert len(got) == STEPS
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, want), 1):
        assert loss == pytest.approx(ref_loss, rel=1e-4), f"{name} step {step}: loss {loss} vs 1-process {ref_loss}"
        assert norm == pytest.approx(ref_norm, rel=1e-4), f"{name} step {step}: norm {norm} vs 1-process {ref_norm}"
