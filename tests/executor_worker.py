"""Runs several plans one after another on one torchrun process group (saves process start-up in the
multi-process tests): `torchrun --nproc-per-node N tests/executor_worker.py SPEC.json OUT.json`.

SPEC: {"steps": K, "seed": S, "plans": {"name": "plan.json", ...}}; OUT (rank 0): {"name": [losses]}
or {"name": "error: ..."} when a plan failed.
"""

import json
import sys
import traceback

import torch
import torch.distributed as dist

from executor.train import TrainConfig, Trainer
from planner.plan import load_plan


def main() -> None:
    spec_path, out_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as fh:
        spec = json.load(fh)
    dist.init_process_group("gloo")
    out = {}
    for name, path in spec["plans"].items():
        cfg = TrainConfig(steps=spec["steps"], seed=spec["seed"], quiet=True)
        try:
            out[name] = Trainer(load_plan(path), cfg, torch.device("cpu")).run()
        except Exception as exc:  # report and go on with the next plan (all ranks fail alike)
            traceback.print_exc()
            out[name] = f"error: {type(exc).__name__}: {exc}"
        dist.barrier()
    if dist.get_rank() == 0:
        with open(out_path, "w") as fh:
            json.dump(out, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
