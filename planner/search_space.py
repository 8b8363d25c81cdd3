"""The search's outer space: every (tp, cp, pp, dp, micro-batch, schedule, virtual stages, ZeRO level,
recompute mode, mesh order, CP mode, EP) that satisfies the user's pins and the --software engine, simplest
first within each mesh shape (planner/search.py bounds and solves them)."""

from __future__ import annotations

from collections.abc import Iterator

from meshplan.planner.candidate import Candidate
from meshplan.planner.cluster_spec import ClusterSpec
from meshplan.planner.constraints import Constraints
from meshplan.planner.cost_cp import cp_modes, cp_pp_pairs
from meshplan.planner.cost_ep import ep_options
from meshplan.planner.model_spec import ModelSpec
from meshplan.planner.placement import Placer

MAX_VIRTUAL_STAGES = 8


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def schedules(pp: int, m: int, num_layers: int, constraints: Constraints, blocks: int = 0
              ) -> Iterator[tuple[str, int]]:
    """(schedule, virtual stages) that torch.distributed.pipelining can run for this pp and m.
    zero-bubble is emitted only as ZB-V (v = 2, V-shaped placement, ScheduleZBVZeroBubble) to keep the
    executor's mapping simple; Schedule1F1B and ZBV need m ≥ pp; interleaved needs m % pp == 0. Unpinned,
    interleaving takes v = 2 and the v whose pp·v chunks split the `blocks` evenly (Megatron-LM's rule), or
    split them evenly with the embedding and the head counted as a layer each (Megatron-Core's
    account_for_embedding_in_pipeline_split / account_for_loss_in_pipeline_split; Llama 3 §3.3.2 takes one
    layer off the first and the last stage): an uneven chunk delays every micro-batch that passes it, and
    each v costs an ILP."""
    engine = constraints.engine_schedules
    for name, v in _schedules(pp, m, num_layers, constraints, blocks):
        if engine is None or name in engine:
            yield name, v


def _schedules(pp: int, m: int, num_layers: int, constraints: Constraints, blocks: int) -> Iterator[tuple[str, int]]:
    pin_s, pin_v = constraints.schedule, constraints.virtual_stages
    if pp == 1:
        options = [("1f1b", 1), ("gpipe", 1)] if pin_s in (None, "1f1b", "gpipe") else []
        for name, v in options:
            if (pin_s is None and name == "1f1b" or pin_s == name) and pin_v in (None, 1):
                yield name, v
        return
    if pin_v in (None, 1):
        if pin_s in (None, "gpipe"):
            yield "gpipe", 1
        if pin_s in (None, "1f1b") and m >= pp:
            yield "1f1b", 1
    if pin_s in (None, "interleaved-1f1b") and m % pp == 0:
        vs = [pin_v] if pin_v is not None else [v for v in range(2, MAX_VIRTUAL_STAGES + 1)
                                                if v == 2 or not blocks or blocks % (pp * v) == 0
                                                or (blocks + 2) % (pp * v) == 0]
        for v in vs:
            if v >= 2 and pp * v <= num_layers:
                yield "interleaved-1f1b", v
    if pin_s in (None, "zero-bubble") and pin_v in (None, 2) and m >= pp and 2 * pp <= num_layers:
        yield "zero-bubble", 2


def candidates(model: ModelSpec, cluster: ClusterSpec, constraints: Constraints,
               placer: Placer) -> Iterator[Candidate]:
    """Every outer candidate that satisfies the pins, simplest first within each mesh shape."""
    world, gbs, c = cluster.world_size, constraints.global_batch_size, constraints
    n_layers = len(model.layers)
    for tp in divisors(world):
        if (c.tp is not None and tp != c.tp) or cluster.devices_per_node % tp or model.num_heads % tp \
                or model.num_kv_heads % tp or model.ffn_hidden_size % tp or c.effective_seq_len(model) % tp:
            continue  # the executor shards heads and the MLP by tp and the sequence (sequence parallel) too
        for cp, pp in cp_pp_pairs(model, cluster, c, tp):  # cp = 1 first (planner/cost_cp.py)
            if (c.pp is not None and pp != c.pp) or pp > n_layers:
                continue
            dp = world // (tp * cp * pp)
            if (c.dp is not None and dp != c.dp) or gbs % dp:
                continue
            for b in divisors(gbs // dp):
                if c.micro_batch_size is not None and b != c.micro_batch_size:
                    continue
                m = gbs // (dp * b)
                for schedule, v in schedules(pp, m, n_layers, c, model.num_layers):
                    if not c.split_runs(model, pp * v):
                        continue  # the engine's stage split cannot cut this pipeline
                    for zero in ([c.zero] if c.zero is not None else range(4 if dp * cp > 1 else 1)):
                        if c.engine_zero is not None and zero not in c.engine_zero and dp * cp > 1:
                            continue  # a ZeRO level the --software engine does not run
                        if schedule == "zero-bubble" and zero == 3:
                            continue  # the executor refuses it: FSDP2 resharding breaks the split backward
                        if c.recompute is not None:
                            modes = [(c.recompute, c.recompute != "none")]
                        else:  # the ILP counts full recompute per stage; the executor's selective is all blocks
                            modes = [(mode, pinned) for mode, pinned in (("none", False), ("selective", True),
                                                                         ("full", c.engine_recompute_all))
                                     if c.engine_recompute is None or mode in c.engine_recompute]
                        for mode, pinned in modes:
                            for order in placer.orders(pp, dp, tp, cp):
                                for cp_mode in cp_modes(model, cluster, c, tp, cp):
                                    for ep, etp in ep_options(model, dp, cp, tp, c.ep, c.expert_tp):
                                        yield Candidate(dp=dp, tp=tp, pp=pp, v=v, schedule=schedule, b=b, m=m,
                                                        zero=zero, recompute=mode, recompute_pinned=pinned,
                                                        order=order, cp=cp, cp_mode=cp_mode, ep=ep, expert_tp=etp)


def memory_key(cand: Candidate) -> tuple:
    """What a candidate's memory bound (`Search._bounds`' ratio) depends on: not where its groups are
    placed (`order`) nor anything else that only moves time (tests/test_search.py checks it)."""
    return (cand.tp, cand.cp, cand.cp_mode, cand.pp, cand.dp, cand.b, cand.schedule, cand.v, cand.zero,
            cand.recompute, cand.recompute_pinned, cand.ep, cand.expert_tp)
