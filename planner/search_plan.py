"""From the search's ranked results to the plan JSON's objects (planner/plan.py), and the one-line message
when nothing fits."""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshplan.planner.candidate import Candidate
from meshplan.planner.cost_collectives import grad_sync
from meshplan.planner.cost_compute import model_flops_per_iteration
from meshplan.planner.cost_ep import spans_tp
from meshplan.planner.cost_memory import state_bytes
from meshplan.planner.cost_model import Evaluation, evaluate
from meshplan.planner.exposed import exposed_communication
from meshplan.planner.plan import Alternative, ParallelConfig, Placement, Plan, Predicted, SearchStats, StagePlan
from meshplan.planner.report import human_bytes

if TYPE_CHECKING:
    from meshplan.planner.search import Scored, Search


def describe(cand: Candidate) -> str:
    v = f" v={cand.v}" if cand.v > 1 else ""
    cp = f" cp={cand.cp} ({cand.cp_mode})" if cand.cp > 1 else ""
    cp += f" ep={cand.ep}" + (f" expert_tp={cand.expert_tp}" if cand.expert_tp > 1 else "") if cand.ep > 1 else ""
    return (f"pp={cand.pp} dp={cand.dp}{cp} tp={cand.tp} zero={cand.zero} {cand.schedule}{v} "
            f"b={cand.b} m={cand.m} recompute={cand.recompute}")


def infeasible_message(search: Search) -> str:
    """Exit 3: the nearest candidate, by how much it exceeds memory where, and what would make it fit."""
    near = search.nearest()
    c, dev = search.c, search.cluster.device
    per_param = sum(state_bytes(search.profile, c.dtype, 0, 1))
    state = sum(layer.params for layer in search.model.layers) * per_param
    need_devices = int(-(-state // (dev.memory_bytes * (1 - c.memory_margin))))
    hints = []
    if c.zero is not None and c.zero < 3:
        hints.append("--zero 3 (shard parameters, gradients and optimizer over dp)")
    if c.recompute in ("none", "selective"):
        hints.append("--recompute full")
    if c.micro_batch_size is not None and c.micro_batch_size > 1:
        hints.append("a smaller --micro-batch-size")
    for flag, value in (("--tp", c.tp), ("--pp", c.pp), ("--dp", c.dp)):
        if value is not None:
            hints.append(f"dropping {flag} {value}")
    if c.memory_margin > 0.01:
        hints.append(f"a smaller --memory-margin than {c.memory_margin}")
    if need_devices <= search.cluster.world_size:  # the state fits sharded: the activations do not
        default = " (the default, the model's maximum)" if c.seq_len is None else ""
        hints.insert(0, f"a shorter --seq-len than {search.seq}{default}")
        hints.append(f"more devices (the model state, {human_bytes(state)}, fits on this cluster; the "
                     f"activations of {search.seq}-token sequences do not: more devices split them with "
                     "context parallelism)")
    else:
        hints.append(f"more devices (model state alone is {human_bytes(state)} at {per_param:g} B/param: at "
                     f"least {need_devices} devices of {human_bytes(dev.memory_bytes)} with ZeRO-3)")
    tried = [name for name, pin in (("ZeRO level", c.zero), ("recompute mode", c.recompute),
                                    ("micro-batch size", c.micro_batch_size)) if pin is None]
    fit = "; to fit try " + ", ".join(hints) + (f" (every {', '.join(tried)} was tried)" if tried else "")
    if near is None:
        return (f"no feasible plan: no parallel configuration of {search.model.name} on {search.cluster.name} "
                f"satisfies the constraints (searched {search.considered} candidates){fit}")
    cand, problem, sol = near
    ev = evaluate(problem, sol.bounds, sol.recompute)
    worst = max(range(len(ev.rank_memory)), key=lambda r: ev.rank_memory[r])
    stages = [s for s, r in enumerate(problem.rank) if r == worst]
    usable, res = problem.mem_limit, search.reserve(cand)
    over = ev.rank_memory[worst] - usable
    need, limit = human_bytes(ev.rank_memory[worst]), human_bytes(dev.memory_bytes)
    held = f" less {human_bytes(res.total)} for the {res.describe()}," if res.total else ","
    return (f"no plan fits in memory: the nearest ({describe(cand)}) needs {need} on "
            f"pipeline rank {worst} (stage {', '.join(map(str, stages))}), {human_bytes(over)} ({int(over)} bytes) "
            f"over the {human_bytes(usable)} usable per device ({limit}{held} less the {c.memory_margin:.0%} "
            f"margin){fit}")


def predicted_of(search: Search, scored: Scored, ev: Evaluation) -> Predicted:
    cand = scored.cand
    seconds = scored.time
    tokens = search.c.global_batch_size * search.seq
    flops = model_flops_per_iteration(search.model, search.c.global_batch_size, search.seq)
    peak = search.cluster.device.peak_flops[search.c.dtype] * cand.dp * cand.cp * cand.tp * cand.pp
    bubble = scored.problem.bubble
    exposed = exposed_communication(cand, scored.problem, ev, scored.solution.bounds, scored.solution.recompute,
                                    search.terms_for(cand))
    return Predicted(
        iteration_time_s=seconds, tokens_per_s=tokens / seconds,
        bubble_fraction=bubble / (scored.problem.m + bubble), peak_memory_bytes=max(ev.rank_memory),
        mfu=flops / (seconds * peak), exposed_communication_s=exposed, usable_memory_bytes=search.limit(cand))


def parallel_config(search: Search, scored: Scored) -> ParallelConfig:
    cand = scored.cand
    mode = cand.recompute if any(scored.solution.recompute) or cand.recompute_pinned else "none"
    # sequence parallelism wherever tp > 1, unless the software costed runs without it (a preset's roofline:
    # Megatron-LM of 2021, rows that ran without); EP folded over TP routes sequence shards, so it keeps it
    roofline = getattr(search.profile, "roofline", None)
    sp = cand.tp > 1 and (roofline is None or roofline.sequence_parallel or spans_tp(cand.ep, cand.tp, cand.expert_tp))
    return ParallelConfig(
        dp=cand.dp, tp=cand.tp, pp=cand.pp, virtual_stages=cand.v, zero=cand.zero, schedule=cand.schedule,
        micro_batch_size=cand.b, num_micro_batches=cand.m, global_batch_size=search.c.global_batch_size,
        seq_len=search.seq, recompute=mode, dtype=search.c.dtype, sequence_parallel=sp, cp=cand.cp,
        cp_mode=cand.cp_mode if cand.cp > 1 else "ring", ep=cand.ep, expert_tp=cand.expert_tp,
        fp8=roofline.fp8 if roofline is not None else "none")


def to_plan(search: Search, results: list[Scored], stats: SearchStats) -> Plan:
    best = results[0]
    cand, sol = best.cand, best.solution
    pb, gb, ob = state_bytes(search.profile, search.c.dtype, cand.zero, cand.dp,
                             grad_sync(cand, search.sharded).full_grads)
    total = pb + gb + ob
    ev = evaluate(best.problem, sol.bounds, sol.recompute, (pb / total, gb / total, ob / total))
    stages, m = [], cand.m
    for s, res in enumerate(ev.stages):
        stages.append(StagePlan(
            stage=s, pp_rank=best.problem.rank[s], layers=[sol.bounds[s], sol.bounds[s + 1]],
            recompute_layers=sol.recompute[s],
            # Seconds per iteration on the stage (its m micro-batches; plan show divides by m): busy time
            # without the bubble; dp_sync (exposed) and optimizer are the rank's once-per-iteration tail.
            predicted_time_s={"forward": m * res.forward, "backward": m * res.backward,
                              "recompute": m * res.recompute, "communication": m * res.communication,
                              "total": m * res.total, "dp_sync": res.dp_sync, "optimizer": res.optimizer},
            predicted_memory_bytes={"parameters": res.parameters, "gradients": res.gradients,
                                    "optimizer": res.optimizer_state, "activations": res.activations,
                                    "workspace": res.workspace, "total": res.memory_total}))
    alternatives, seen = [], {plan_key(parallel_config(search, best), best.cand.order)}
    for other in results[1:]:
        par = parallel_config(search, other)
        if plan_key(par, other.cand.order) in seen:
            continue
        seen.add(plan_key(par, other.cand.order))
        oev = evaluate(other.problem, other.solution.bounds, other.solution.recompute)
        note = f"{(other.time / best.time - 1):+.1%} time"
        if other.cand.order != cand.order:
            note += f", mesh order {'/'.join(other.cand.order)}"
        alternatives.append(Alternative(par, predicted_of(search, other, oev), note))
    placement = search.placer.place(cand.pp, cand.dp, cand.tp, cand.order, cand.cp)
    return Plan(model=search.model, cluster=search.cluster, parallel=parallel_config(search, best), stages=stages,
                predicted=predicted_of(search, best, ev), alternatives=alternatives[:search.c.top_k], search=stats,
                placement=Placement(list(placement.order), placement.ranks.tolist()))


def plan_key(par: ParallelConfig, order: tuple[str, ...]) -> tuple:
    return tuple(sorted(vars(par).items())) + (order,)
