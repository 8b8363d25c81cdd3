"""Communication left on the critical path of an iteration, per term, for the plan JSON's
`predicted.exposed_communication_s` (DESIGN.md §3) and `plan show`.

Read on the bottleneck rank (the one whose micro-batch time sets the pipeline's pace):
- ``tp``: tensor-parallel collectives run between the layer's GEMMs, nothing to hide them behind: all of
  them, every micro-batch (and again for recomputed blocks);
- ``pp``: the stage boundaries' send/recv per micro-batch as the schedule's cost model charges them;
- ``fsdp_gather``: ZeRO-3 all-gathers the prefetch cannot hide behind the previous unit's compute (the
  first unit's at least);
- ``dp``: the gradient reduction left after the backward it overlaps with (the last bucket at least;
  all of it when the software reduces after the backward);
- ``cp`` / ``ep`` (context / expert parallel), added by their cost terms.
"""

from __future__ import annotations

from meshplan.planner.cost_model import Candidate, Evaluation, StageProblem, Terms, rank_of_stages


def bottleneck_rank(problem: StageProblem, ev: Evaluation) -> int:
    ranks = rank_of_stages(problem)
    return max(range(len(ranks)), key=lambda r: sum(ev.stages[s].total for s in ranks[r]))


def exposed_communication(cand: Candidate, problem: StageProblem, ev: Evaluation, bounds: list[int],
                          recompute: list[int], terms: Terms, extra: dict[str, float] | None = None
                          ) -> dict[str, float]:
    """Seconds per iteration of each communication term on the critical path. `extra`: per-micro-batch
    seconds of other terms already inside the stages' communication on the bottleneck rank (cp, ep), kept
    apart from the ZeRO-3 remainder."""
    r = bottleneck_rank(problem, ev)
    stages = rank_of_stages(problem)[r]
    rec_tp = terms.recompute(cand.b, cand.tp, cand.recompute)[2] if cand.recompute != "none" else 0.0
    tp = pp = comm = dp = 0.0
    for s in stages:
        layers = range(bounds[s], bounds[s + 1])
        tp += sum(terms.kind(problem.kinds[i], cand.b, cand.tp, cand.schedule)[2] for i in layers)
        tp += recompute[s] * rec_tp
        pp += problem.boundary[s] - (problem.boundary_relief[s] if problem.boundary_relief else 0.0)
        comm += ev.stages[s].communication
        dp += ev.stages[s].dp_sync
    extra = extra or {}
    other = sum(extra.values())
    out = {"tp": cand.m * tp, "pp": cand.m * pp, "dp": dp,
           "fsdp_gather": cand.m * max(0.0, comm - tp - pp - other)}
    out.update({k: cand.m * v for k, v in extra.items()})
    return out
