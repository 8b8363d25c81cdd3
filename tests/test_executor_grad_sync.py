"""Data-parallel gradient reduction with gradient accumulation, as the executor runs it on 2 gloo processes
and as the cost model's `grad_sync` describes it."""

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from executor.train import TrainConfig, Trainer
from planner.cost_model import Candidate, grad_sync
from planner.plan import load_plan, save_plan
from tests.executor_worker import free_port
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
    mp.spawn(_grad_sync_worker, args=(2, free_port(), plans, str(tmp_path)), nprocs=2, join=True)
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["z1"] == [False, False, False]
    assert seen["z2"] == seen["z3"] == [False, True, True]
    for zero in (1, 2, 3):
        cand = Candidate(dp=2, tp=1, pp=1, v=1, schedule="1f1b", b=1, m=3, zero=zero, recompute="none")
        sync = grad_sync(cand)
        assert (sync.full_grads, sync.reductions) == ((True, 1) if zero == 1 else (False, 3))
