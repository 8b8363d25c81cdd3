"""Distributed checkpoints (torch.distributed.checkpoint): model + optimizer of every local stage under
their unsharded FQNs (so a checkpoint does not depend on how it was sharded), plus the step and data
position in meta.json. A checkpoint is written to `step-N.tmp` and renamed to `step-N` only after every
rank finished writing: a directory without `.tmp` is complete."""

from __future__ import annotations

import json
import os
import re
import shutil

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
STEP_DIR = re.compile(r"^step-(\d+)$")
KEEP = 2


def _parts(modules: list[nn.Module], optims: list[Optimizer]) -> tuple[list[dict], list[dict]]:
    return ([get_model_state_dict(m) for m in modules],
            [get_optimizer_state_dict(m, o, options=OPTIONS) for m, o in zip(modules, optims)])


def latest(directory: str) -> tuple[str, dict] | None:
    """The newest complete checkpoint in `directory` and its meta.json, or None."""
    if not os.path.isdir(directory):
        return None
    best = None
    for name in os.listdir(directory):
        m = STEP_DIR.match(name)
        path = os.path.join(directory, name)
        if m and os.path.isfile(os.path.join(path, "meta.json")) and (best is None or int(m.group(1)) > best[0]):
            best = (int(m.group(1)), path)
    if best is None:
        return None
    with open(os.path.join(best[1], "meta.json"), encoding="utf-8") as fh:
        return best[1], json.load(fh)


def save(directory: str, step: int, modules: list[nn.Module], optims: list[Optimizer], meta: dict) -> str:
    final = os.path.join(directory, f"step-{step:08d}")
    tmp = final + ".tmp"
    rank0 = dist.get_rank() == 0
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    models, optim_parts = _parts(modules, optims)
    state = {"model": {k: v for part in models for k, v in part.items()},
             "optim": {k: v for part in optim_parts for k, v in part.items()}}
    dcp.save(state, checkpoint_id=tmp)
    dist.barrier()
    if rank0:
        with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as fh:
            json.dump({**meta, "step": step}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _prune(directory)
    dist.barrier()
    return final


def _prune(directory: str) -> None:
    steps = sorted(int(m.group(1)) for n in os.listdir(directory) if (m := STEP_DIR.match(n)))
    for s in steps[:-KEEP]:
        shutil.rmtree(os.path.join(directory, f"step-{s:08d}"), ignore_errors=True)


def load(path: str, modules: list[nn.Module], optims: list[Optimizer]) -> None:
    """Load in place; works whatever plan wrote the checkpoint, as long as the model is the same."""
    models, optim_parts = _parts(modules, optims)
    state = {"model": {k: v for part in models for k, v in part.items()},
             "optim": {k: v for part in optim_parts for k, v in part.items()}}
    dcp.load(state, checkpoint_id=path)
    for m, o, msd, osd in zip(modules, optims, models, optim_parts):
        set_model_state_dict(m, {k: state["model"][k] for k in msd})
        set_optimizer_state_dict(m, o, {k: state["optim"][k] for k in osd}, options=OPTIONS)
