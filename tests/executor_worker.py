"""Runs several plans one after another on one torchrun process group (saves process start-up in the
multi-process tests): `torchrun --nproc-per-node N tests/executor_worker.py SPEC.json OUT.json`.

SPEC: {"steps": K, "seed": S, "plans": {"name": "plan.json", ...}}; OUT (rank 0): {"name": [losses]}
or {"name": "error: ..."} when a plan failed.
"""

import gc
import json
import sys
import traceback

import torch
import torch.distributed as dist
from meshplan.executor.train import TrainConfig, Trainer
from meshplan.planner.plan import load_plan


def main(train=lambda trainer, cfg: trainer.run(), named: bool = False) -> None:
    """Train every plan of SPEC with `train(trainer, cfg)` (`train(trainer, cfg, name)` when `named`); rank 0
    writes what it returns per plan."""
    spec_path, out_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as fh:
        spec = json.load(fh)
    dist.init_process_group("gloo")
    out = {}
    for name, path in spec["plans"].items():
        cfg = TrainConfig(steps=spec["steps"], seed=spec["seed"], quiet=True)
        try:
            trainer = Trainer(load_plan(path), cfg, torch.device("cpu"))
            out[name] = train(trainer, cfg, name) if named else train(trainer, cfg)
        except Exception as exc:  # report and go on with the next plan (all ranks fail alike)
            traceback.print_exc()
            out[name] = f"error: {type(exc).__name__}: {exc}"
        dist.barrier()
    if dist.get_rank() == 0:
        with open(out_path, "w") as fh:
            json.dump(out, fh)
    trainer = None
    gc.collect()  # torchrun's ranks finalize: the groups are freed before, as in executor/cli.py
    dist.destroy_process_group()



def reference_steps(plan_path: str, steps: int, seed: int, tokens=None) -> list[tuple[float, float]]:
    """A plain single-process PyTorch loop over the full model and the same global batches: what every
    plan must reproduce, as (loss, gradient norm before clipping) per step. `tokens`: a TokenFile-like
    source instead of the synthetic stream."""
    from meshplan.executor.data import SyntheticData
    from meshplan.executor.model import Transformer, init_weights, loss_fn
    from meshplan.executor.train import lr_multiplier, make_optimizer

    plan = load_plan(plan_path)
    p, cfg = plan.parallel, TrainConfig(steps=steps, seed=seed)
    torch.manual_seed(0)
    model = Transformer(plan.model)
    init_weights(model, seed)
    opt = make_optimizer(model, cfg)
    data = tokens or SyntheticData(plan.model.vocab_size, p.seq_len, p.global_batch_size, seed)
    out = []
    for step in range(steps):
        batch = data.batch(step)
        loss = loss_fn(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        for group in opt.param_groups:
            group["lr"] = cfg.lr * lr_multiplier(step, cfg)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append((loss.item(), float(norm)))
    return out


def reference_losses(plan_path: str, steps: int, seed: int, tokens=None) -> list[float]:
    return [loss for loss, _ in reference_steps(plan_path, steps, seed, tokens)]


def repo_root() -> str:
    import os
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_then_exit(rank: int, fn, args: tuple) -> None:
    from meshplan.profiler.measure import exit_spawned_rank

    fn(rank, *args)
    exit_spawned_rank()


def spawn_ranks(fn, *args, nprocs: int = 2) -> None:
    """torch.multiprocessing.spawn of fn(rank, *args) on `nprocs` processes; a worker that returns exits
    at once (profiler.measure.exit_spawned_rank); one that raises fails the spawn as usual."""
    import torch.multiprocessing as mp

    mp.spawn(_run_then_exit, args=(fn, args), nprocs=nprocs, join=True)


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(args: list[str], nproc: int, timeout: float = 240, extra_env: dict | None = None,
             torchrun_args: list[str] | None = None):
    """Run `torchrun --nproc-per-node nproc ... ARGS` (ARGS start with `-m meshplan.executor` or a script) on a free
    port, with the worktree on PYTHONPATH; returns the CompletedProcess."""
    import os
    import subprocess
    # faulthandler: a rank that crashes (SIGSEGV, SIGABRT) prints its Python stack to the captured stderr
    env = {**os.environ, "PYTHONPATH": repo_root(), "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1",
           **(extra_env or {})}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    launcher += torchrun_args if torchrun_args is not None else ["--master-addr", "127.0.0.1",
                                                                 "--master-port", str(free_port())]
    return subprocess.run(launcher + args, env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=repo_root())


def run_plans(tmp, plans: dict, worker: str, steps: int, seed: int, timeout: float = 420) -> tuple[dict, dict]:
    """Save every plan under `tmp`, train them all in one 4-process torchrun of `worker` (a script under
    tests/), and return (the worker's results by plan name, the plan paths)."""
    import json
    import os

    from meshplan.planner.plan import save_plan

    paths = {}
    for name, plan in plans.items():
        paths[name] = str(tmp / f"{name}.json")
        save_plan(plan, paths[name])
    spec = tmp / "spec.json"
    spec.write_text(json.dumps({"steps": steps, "seed": seed, "plans": paths}))
    out = tmp / "out.json"
    proc = torchrun([os.path.join("tests", worker), str(spec), str(out)], nproc=4, timeout=timeout)
    crash = proc.stderr.find("Fatal Python error")  # a crashed rank's stack, ahead of torchrun's summary
    assert proc.returncode == 0, (proc.stderr[crash:crash + 3000] + "\n...\n" if crash >= 0 else "") \
        + proc.stderr[-4000:]
    return json.loads(out.read_text()), paths


def assert_matches_reference(results: tuple[dict, dict], name: str, steps: int, seed: int, rel: float) -> None:
    """The plan's per-step losses from `run_plans` equal a 1-process loop's within `rel`."""
    import pytest

    losses, paths = results
    got = losses[name]
    assert isinstance(got, list), got
    want = reference_losses(paths[name], steps, seed)
    assert len(got) == steps
    for step, (a, b) in enumerate(zip(got, want), 1):
        assert a == pytest.approx(b, rel=rel), f"{name} step {step}: {a} vs 1-process fp32 {b}"


if __name__ == "__main__":
    main()
