"""Context parallelism in the exports (planner/export.py), and which engine runs which CP mode.

Names checked against the engines' sources:
- Megatron-LM (megatron/training/arguments.py): `--context-parallel-size N` and `--cp-comm-type` with
  p2p (ring attention with point-to-point KV exchanges), a2a (DeepSpeed-Ulysses style all-to-all),
  allgather or a2a+p2p.
- torchtitan (JobConfig [parallelism]): `context_parallel_degree` and `context_parallel_rotate_method`,
  "allgather" or "alltoall" (how torch's ring attention passes KV shards); its CP is torch's ring attention.
- DeepSpeed-Ulysses: `sequence_parallel_size` (all-to-all head scatter only).
"""

from __future__ import annotations

from collections.abc import Callable

from meshplan.planner.plan import Plan

MEGATRON_CP_COMM = {"ring": "p2p", "all-gather": "allgather", "all-to-all": "a2a"}
# torch's rotate method for each mode: ring passes each KV shard to the next rank (the executor's
# RING_ROTATE_METHOD, executor/context_parallel.py); all-gather gathers every KV shard up front
TITAN_ROTATE_METHOD = {"ring": "alltoall", "all-gather": "allgather", "all-to-all": "alltoall"}

ENGINES = {  # which engines run each CP mode, for the planner's output
    "ring": "Megatron-LM (--cp-comm-type p2p), torchtitan (torch context_parallel), meshplan's executor on CUDA "
            "(torch context_parallel; refused on CPU/gloo); not DeepSpeed-Ulysses",
    "all-gather": "Megatron-LM (--cp-comm-type allgather), torchtitan (rotate method allgather), meshplan's "
                  "executor on CPU and GPU; not DeepSpeed-Ulysses",
    "all-to-all": "Megatron-LM (--cp-comm-type a2a), DeepSpeed-Ulysses (sequence_parallel_size), meshplan's executor "
                  "on CPU and GPU; not torchtitan (its CP is ring attention)",
}


def megatron_cp_args(plan: Plan, warn: Callable[[str], None]) -> list[tuple[str, object | None]]:
    p = plan.parallel
    if p.cp == 1:
        return []
    return [("--context-parallel-size", p.cp), ("--cp-comm-type", MEGATRON_CP_COMM[p.cp_mode])]


def torchtitan_cp_degrees(plan: Plan, warn: Callable[[str], None]) -> dict[str, object]:
    p = plan.parallel
    if p.cp == 1:
        return {}
    if p.cp_mode == "all-to-all":
        warn(f"cp_mode all-to-all: torchtitan's context parallelism is torch's ring attention; exported as "
             f"context_parallel_degree {p.cp} with rotate method '{TITAN_ROTATE_METHOD[p.cp_mode]}' (KV shards "
             "passed all-to-all), not a head scatter")
    return {"context_parallel_degree": p.cp, "context_parallel_rotate_method": TITAN_ROTATE_METHOD[p.cp_mode]}


def deepspeed_cp_config(plan: Plan, warn: Callable[[str], None]) -> dict[str, object]:
    p = plan.parallel
    if p.cp == 1:
        return {}
    if p.cp_mode != "all-to-all":
        warn(f"context parallelism cp={p.cp} ({p.cp_mode}): DeepSpeed has no {p.cp_mode} attention (DeepSpeed-Ulysses "
             "is an all-to-all head scatter); not exported; re-plan with --cp-mode all-to-all for "
             "sequence_parallel_size")
        return {}
    return {"sequence_parallel_size": p.cp}


def engines_line(plan: Plan) -> str:
    """One line: the plan's CP mode and the engines that run it ('' without CP)."""
    p = plan.parallel
    if p.cp == 1:
        return ""
    return f"cp mode {p.cp_mode} runs on: {ENGINES[p.cp_mode]}"
