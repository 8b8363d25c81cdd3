"""Executor overhead on CPU: the executor's single-process step vs a plain PyTorch loop over the same
model, batch, AdamW, clipping and LR schedule, measured side by side (alternating blocks of steps) in
one run. One command:

    PYTHONPATH=. python benchmarks/executor_overhead.py [--models tiny,gpt-20m] [--rounds 5] [--steps 4]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
from meshplan.executor.data import SyntheticData
from meshplan.executor.model import Transformer, init_weights, loss_fn
from meshplan.executor.train import TrainConfig, Trainer, lr_multiplier, make_optimizer
from meshplan.planner.cluster_spec import parse_cluster
from meshplan.planner.model_sources import builtin_model
from meshplan.planner.plan import ParallelConfig, Plan, Predicted, StagePlan
from rich.console import Console
from rich.table import Table

SHAPES = {"tiny": (8, 64), "gpt-20m": (4, 128)}  # (global batch, seq_len)


def single_process_plan(model: str, batch: int, seq: int) -> Plan:
    spec = builtin_model(model)
    parallel = ParallelConfig(dp=1, tp=1, pp=1, virtual_stages=1, zero=0, schedule="1f1b", micro_batch_size=batch,
                              num_micro_batches=1, global_batch_size=batch, seq_len=seq, recompute="none",
                              dtype="fp32")
    return Plan(model=spec, cluster=parse_cluster("1xcpu"), parallel=parallel,
                stages=[StagePlan(stage=0, pp_rank=0, layers=[0, len(spec.layers)])],
                predicted=Predicted(0.0, 0.0, 0.0, 0.0, 0.0))


class PlainLoop:
    """What a user would write by hand: same model, init, data, optimizer, clipping, schedule."""

    def __init__(self, plan: Plan, cfg: TrainConfig):
        self.model = Transformer(plan.model)
        init_weights(self.model, cfg.seed)
        self.opt = make_optimizer(self.model, cfg)
        p = plan.parallel
        self.data = SyntheticData(plan.model.vocab_size, p.seq_len, p.global_batch_size, cfg.seed)
        self.cfg = cfg

    def train_step(self, step: int) -> float:
        batch = self.data.batch(step)
        loss = loss_fn(self.model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        for group in self.opt.param_groups:
            group["lr"] = self.cfg.lr * lr_multiplier(step, self.cfg)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()


def timed(fn, step: int) -> float:
    t0 = time.perf_counter()
    fn(step)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,gpt-20m")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4, help="steps per block (per round and side)")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    table = Table(title=f"executor overhead, 1 process, CPU, {torch.get_num_threads()} threads "
                        f"(median step of {args.rounds} x {args.steps} steps after 1 warm-up step each)")
    for col in ("model", "batch x seq", "plain loop ms", "executor ms", "overhead", "same losses"):
        table.add_column(col, justify="right")
    for model in args.models.split(","):
        batch, seq = SHAPES.get(model, (4, 64))
        plan = single_process_plan(model, batch, seq)
        total = 1 + args.rounds * args.steps
        cfg = TrainConfig(steps=total, quiet=True)
        trainer, plain = Trainer(plan, cfg, torch.device("cpu")), PlainLoop(plan, cfg)
        same = abs(trainer.train_step(0)[0] - plain.train_step(0)) <= 1e-4 * 10  # warm-up, and a sanity check
        ex_times, plain_times = [], []
        step = 1
        for _ in range(args.rounds):  # alternate blocks so that load from other processes hits both sides
            for _ in range(args.steps):
                ex_times.append(timed(trainer.train_step, step))
                plain_times.append(timed(plain.train_step, step))
                step += 1
        ex, pl = statistics.median(ex_times), statistics.median(plain_times)
        table.add_row(model, f"{batch} x {seq}", f"{pl * 1e3:.1f}", f"{ex * 1e3:.1f}", f"{(ex / pl - 1) * 100:+.1f}%",
                      "yes" if same else "NO")
    dist.destroy_process_group()
    Console().print(table)


if __name__ == "__main__":
    main()
