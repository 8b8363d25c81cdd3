"""Gradient reduction as the executor runs it on 2 gloo processes: data-parallel with gradient accumulation
(as the cost model's `grad_sync` describes it), and the gradients tensor parallelism leaves Partial."""

import json
import os

import pytest
import torch
import torch.distributed as dist
from meshplan.executor.train import TrainConfig, Trainer
from meshplan.planner.candidate import Candidate
from meshplan.planner.cost_collectives import grad_sync
from meshplan.planner.plan import load_plan, save_plan

from tests.executor_worker import free_port, spawn_ranks
from tests.helpers import make_plan


def _grad_sync_worker(rank: int, world: int, port: int, plans: dict, out_dir: str) -> None:
    """Runs one forward_backward of each plan and records, at every micro-batch's forward, whether the
    sharded parameters already hold a gradient: they do after a micro-batch that reduce-scattered."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    seen = {}
    try:
        for name, path in plans.items():
            trainer = Trainer(load_plan(path), TrainConfig(steps=1, quiet=True), torch.device("cpu"))
            model = trainer.modules[0]
            sharded = list(model.parameters())  # FSDP2's sharded parameters (it registers them between steps)
            seen[name] = []
            model.register_forward_pre_hook(
                lambda *_, n=name, ps=sharded: seen[n].append(any(p.grad is not None for p in ps)))
            trainer.forward_backward(0)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(os.path.join(out_dir, "seen.json"), "w") as fh:
            json.dump(seen, fh)


@pytest.mark.slow
def test_zero2_and_zero3_reduce_scatter_every_micro_batch_without_pipelining(tmp_path):
    """ZeRO-2/3 keep gradients sharded between micro-batches (a reduce-scatter each), as the cost model's
    grad_sync assumes; ZeRO-1 accumulates full gradients and reduces once."""
    plans = {}
    for zero in (1, 2, 3):
        path = str(tmp_path / f"z{zero}.json")
        save_plan(make_plan(cluster="2xcpu", dp=2, zero=zero, micro_batch_size=1, num_micro_batches=3), path)
        plans[f"z{zero}"] = path
    spawn_ranks(_grad_sync_worker, 2, free_port(), plans, str(tmp_path))
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["z1"] == [False, False, False]
    assert seen["z2"] == seen["z3"] == [False, True, True]
    for zero in (1, 2, 3):
        cand = Candidate(dp=2, tp=1, pp=1, v=1, schedule="1f1b", b=1, m=3, zero=zero, recompute="none")
        sync = grad_sync(cand)
        assert (sync.full_grads, sync.reductions) == ((True, 1) if zero == 1 else (False, 3))


def _norm_worker(rank: int, world: int, port: int, path: str, out_dir: str) -> None:
    """One forward_backward of a TP + sequence-parallel plan, then the executor's clip_and_step: records
    the gradient norm it clipped by, and whether any gradient was still Partial when AdamW stepped."""
    from torch.distributed.tensor import DTensor, Partial

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        trainer = Trainer(load_plan(path), TrainConfig(steps=1, quiet=True), torch.device("cpu"))
        partial = []
        for opt in trainer.optims:
            opt.register_step_pre_hook(lambda o, *_: partial.extend(
                isinstance(p.grad, DTensor) and any(isinstance(x, Partial) for x in p.grad.placements)
                for g in o.param_groups for p in g["params"]))
        trainer.forward_backward(0)
        norm = trainer.clip_and_step(0)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(os.path.join(out_dir, "norm.json"), "w") as fh:
            json.dump({"norm": norm, "stepped": len(partial), "partial": sum(partial)}, fh)


@pytest.mark.slow
@pytest.mark.parametrize("qk_norm,sp", [(False, True), (True, True), (True, False)])
def test_sequence_parallel_gradients_are_reduced_once_before_the_norm_and_the_step(tmp_path, qk_norm, sp):
    """Sequence parallelism leaves the norms' weight gradients Partial (a sum per sequence shard). The
    executor reduces them before clipping, so its global norm is the single process's, and AdamW never
    sees a Partial gradient (which it would all-reduce once per op that reads it). The same for Qwen3's
    q/k norms, whose one weight each TP rank applies to its own heads (with or without sequence
    parallelism): left local, each rank's gradient would hold only its heads' share, and the norm differ."""
    from dataclasses import replace

    from meshplan.executor.data import SyntheticData
    from meshplan.executor.model import Transformer, init_weights, loss_fn
    from meshplan.planner.model_sources import builtin_model

    plan = make_plan(cluster="2xcpu", tp=2, sequence_parallel=sp, micro_batch_size=2, num_micro_batches=2)
    if qk_norm:
        plan.model = replace(builtin_model("tiny"), name="tiny-qwen3", qk_norm=True, layers=())
    path = str(tmp_path / "tp2.json")
    save_plan(plan, path)
    spawn_ranks(_norm_worker, 2, free_port(), path, str(tmp_path))
    got = json.loads((tmp_path / "norm.json").read_text())

    p, cfg = plan.parallel, TrainConfig(steps=1)
    model = Transformer(plan.model)
    init_weights(model, cfg.seed)
    batch = SyntheticData(plan.model.vocab_size, p.seq_len, p.global_batch_size, cfg.seed).batch(0)
    loss_fn(model(batch[:, :-1]), batch[:, 1:]).backward()
    want = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
    assert got["stepped"] > 0 and got["partial"] == 0
    assert got["norm"] == pytest.approx(want, rel=1e-5)
