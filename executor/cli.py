"""`torchrun ... -m meshplan.executor PLAN.json` (DESIGN §2).

Everything that can be checked without the process group (arguments, the plan file, the world size,
the backend, combinations the engines cannot run) is checked first, on every rank, and reported as one
line with a non-zero exit and no traceback.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import socket
import sys

import torch
import torch.distributed as dist
from meshplan.executor.checks import check_supported
from meshplan.executor.context_parallel import check_cp_backend
from meshplan.executor.data import DATA_DTYPES
from meshplan.executor.pipeline import local_stages
from meshplan.executor.train import TrainConfig, Trainer
from meshplan.planner.cli import _Parser
from meshplan.planner.errors import InputError, MeshplanError
from meshplan.planner.plan import Plan, load_plan


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = _Parser(prog="python -m meshplan.executor", description="Train a plan's model exactly as planned "
                 "(launch with torchrun --nproc-per-node N [--nnodes M ...]).")
    ap.add_argument("plan", metavar="PLAN.json")
    ap.add_argument("--steps", type=int, default=10, help="train until this many steps are done (default 10)")
    ap.add_argument("--seed", type=int, default=0, help="model init and synthetic data seed (default 0)")
    ap.add_argument("--metrics", metavar="FILE.jsonl", help="write per-step metrics and a summary (rank 0)")
    ap.add_argument("--data", metavar="TOKENS", help="flat binary file of token ids (nanoGPT train.bin); "
                    "default: a deterministic synthetic stream")
    ap.add_argument("--data-dtype", choices=sorted(DATA_DTYPES), default="uint16")
    ap.add_argument("--checkpoint-dir", metavar="DIR")
    ap.add_argument("--checkpoint-interval", type=int, default=0, metavar="K",
                    help="also checkpoint every K steps (default: only at the end)")
    ap.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup-steps", type=int, default=None, help="default: a tenth of --steps")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--log-interval", type=int, default=1)
    ap.add_argument("--gc-interval", type=int, default=50, metavar="K",
                    help="run Python's garbage collector every K steps, with automatic collection off in between "
                         "as torchtitan does (default 50; 0: leave automatic collection on)")
    args = ap.parse_args(argv)
    for name in ("steps", "log_interval"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')}: expected a positive integer, got {getattr(args, name)}")
    for name in ("checkpoint_interval", "gc_interval"):
        if getattr(args, name) < 0:
            raise InputError(f"--{name.replace('_', '-')}: expected >= 0, got {getattr(args, name)}")
    if args.resume and not args.checkpoint_dir:
        raise InputError("--resume: needs --checkpoint-dir")
    return args


def pick_device(plan: Plan, local_rank: int) -> tuple[torch.device, str]:
    """NCCL on CUDA for GPU plans, gloo on CPU for CPU plans; refuse when that backend is missing."""
    if not dist.is_available():
        raise InputError("torch.distributed is not available in this PyTorch build")
    if plan.cluster.device.kind == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"plan.cluster: the plan is for {plan.cluster.device.type} GPUs but CUDA is not "
                             "available here (NCCL backend unavailable); plan for Nxcpu to run on CPU")
        if not dist.is_nccl_available():
            raise InputError("plan.cluster: the plan is for GPUs but this PyTorch has no NCCL backend")
        if local_rank >= torch.cuda.device_count():
            raise InputError(f"--nproc-per-node: local rank {local_rank} but only {torch.cuda.device_count()} GPUs")
        return torch.device("cuda", local_rank), "nccl"
    if not dist.is_gloo_available():
        raise InputError("plan.cluster: the plan is for CPU but this PyTorch has no gloo backend")
    return torch.device("cpu"), "gloo"


def _single_process_env() -> None:
    """`python -m meshplan.executor PLAN.json` without torchrun: a world of one."""
    if "WORLD_SIZE" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def init_distributed(backend: str) -> None:
    """init_process_group on a store prefixed by torchrun's restart count: after a restart
    (--max-restarts) the agent's store still holds the dead workers' addresses, which a plain env://
    init reads back (gloo then fails to connect)."""
    timeout = datetime.timedelta(minutes=10)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        dist.init_process_group(backend, timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent_store and rank == 0, timeout=timeout,
                          multi_tenant=not agent_store)
    dist.init_process_group(backend, store=dist.PrefixStore(f"meshplan/attempt_{attempt}", store),
                            rank=rank, world_size=world, timeout=timeout)


PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")  # gloo's tcp transport


def lost_peer(exc: BaseException) -> str | None:
    """gloo's words when this rank failed because another rank's process is gone (the error can come
    wrapped, e.g. by torch.distributed.pipelining's "[Stage 0] failed to run forward"), else None."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            break
        for marker in PEER_LOST:
            if marker in str(seen):
                return marker
        seen = seen.__cause__ or seen.__context__
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rank = os.environ.get("RANK", "0")
    # Expandable segments keep the caching allocator's fragmentation small, as torchtitan's launcher does;
    # the planner's --memory-margin assumes them (planner/memory_reserve.py). Read at CUDA's first use.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    try:
        args = parse_args(argv)
        plan = load_plan(args.plan)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        check_supported(plan)  # what no launch can run, before the launch's size
        if world != plan.world_size:
            raise InputError(f"plan.world_size: the plan needs {plan.world_size} processes (pp={plan.parallel.pp} "
                             f"x dp={plan.parallel.dp} x cp={plan.parallel.cp} x tp={plan.parallel.tp}) but {world} "
                             f"were launched; "
                             f"use torchrun with nnodes x nproc-per-node = {plan.world_size}")
        device, backend = pick_device(plan, int(os.environ.get("LOCAL_RANK", "0")))
        check_cp_backend(plan, backend)
        assert local_stages(plan, 0)  # validated by load_plan: every pp rank has a stage
    except MeshplanError as exc:
        print(f"executor: error: [rank {rank}] {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    _single_process_env()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_distributed(backend)
    try:
        cfg = TrainConfig(steps=args.steps, seed=args.seed, lr=args.lr, warmup_steps=args.warmup_steps,
                          weight_decay=args.weight_decay, grad_clip=args.grad_clip, metrics=args.metrics,
                          data=args.data, data_dtype=args.data_dtype, checkpoint_dir=args.checkpoint_dir,
                          checkpoint_interval=args.checkpoint_interval, resume=args.resume,
                          log_interval=args.log_interval, plan_path=args.plan, gc_interval=args.gc_interval)
        Trainer(plan, cfg, device).run()
        dist.barrier()  # no rank tears gloo down while another still has work in flight
    except MeshplanError as exc:
        print(f"executor: error: [rank {rank}] {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except RuntimeError as exc:
        lost = lost_peer(exc)
        if lost is None:
            raise
        # another rank's process went away (its own output says why): one line here, not a traceback
        print(f"executor: error: [rank {rank}] a peer process stopped ({lost})", file=sys.stderr, flush=True)
        return 1
    finally:
        if dist.is_initialized():
            # the model's hooks hold the process groups in reference cycles; a gloo group destroyed in the
            # interpreter's teardown can abort a finished run (profiler.measure.exit_spawned_rank): freed now
            gc.collect()
            dist.destroy_process_group()
    return 0
