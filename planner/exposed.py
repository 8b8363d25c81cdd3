"""Communication left on the critical path of an iteration, per term, for the plan JSON's
`predicted.exposed_communication_s` (DESIGN.md §3) and `plan show`.

Read on the bottleneck rank (the one whose micro-batch time sets the pipeline's pace):
- ``tp``: tensor-parallel collectives run between the layer's GEMMs, nothing to hide them behind: all of
  them, every micro-batch (and again for recomputed blocks);
- ``pp``: the stage boundaries' send/recv per micro-batch as the schedule's cost model charges them;
- ``fsdp_gather``: ZeRO-3 all-gathers the prefetch cannot hide behind the previous unit's compute (the
  first unit's at least);
- ``dp``: the gradient reduction left after the backward it overlaps with (the last bucket at least;
  all of it when the software reduces after the backward), and where a step reduces after every
  micro-batch, the share of the per-micro-batch traffic it pools with the gathers that compute cannot hide;
- ``cp`` / ``ep`` (context / expert parallel), added by their cost terms.
"""

from __future__ import annotations

from meshplan.planner.candidate import Candidate
from meshplan.planner.cost_model import Evaluation, StageProblem, Terms, rank_of_stages


def bottleneck_rank(problem: StageProblem, ev: Evaluation) -> int:
    ranks = rank_of_stages(problem)
    return max(range(len(ranks)), key=lambda r: sum(ev.stages[s].total for s in ranks[r]))


def exposed_communication(cand: Candidate, problem: StageProblem, ev: Evaluation, bounds: list[int],
                          recompute: list[int], terms: Terms) -> dict[str, float]:
    """Seconds per iteration of each communication term on the critical path. The CP and EP seconds
    that `terms` count in a block's communication value (`Terms.side_comm`) are their own terms."""
    r = bottleneck_rank(problem, ev)
    side = terms.side_comm(cand.b, cand.tp, cand.recompute)
    rec_tp = terms.recompute(cand.b, cand.tp, cand.recompute)[2] if cand.recompute != "none" else 0.0
    tp = pp = comm = dp = gathers = reduces = 0.0
    other = dict.fromkeys(side, 0.0)
    for s in rank_of_stages(problem)[r]:
        layers = range(bounds[s], bounds[s + 1])
        blocks = sum(1 for i in layers if problem.kinds[i] == "block")
        tp += sum(terms.kind(problem.kinds[i], cand.b, cand.tp, cand.schedule)[2] for i in layers)
        tp += recompute[s] * rec_tp
        for name, (run, again) in side.items():
            other[name] += blocks * run + recompute[s] * again
            tp -= blocks * run
        pp += problem.boundary[s] - (problem.boundary_relief[s] if problem.boundary_relief else 0.0)
        comm += ev.stages[s].communication
        dp += ev.stages[s].dp_sync
        gathers += sum(problem.gather[i] for i in layers)
        reduces += sum(problem.reduce[i] for i in layers)
    pooled = comm - tp - pp - sum(other.values())
    pooled = pooled if pooled > 1e-9 * comm else 0.0  # not the sums' rounding
    reduce_share = reduces / (gathers + reduces) if reduces > 0 else 0.0
    out = {"tp": cand.m * max(tp, 0.0), "pp": cand.m * pp, "dp": dp + cand.m * pooled * reduce_share,
           "fsdp_gather": cand.m * pooled * (1.0 - reduce_share)}
    return out | {name: cand.m * v for name, v in other.items()}
