"""The mixture-of-experts lines of `plan show`: experts per rank, where the EP groups land, and the
exposed all-to-all time."""

from __future__ import annotations

from meshplan.planner.model_spec import sparse_blocks
from meshplan.planner.plan import Plan
from meshplan.planner.report import human_count
from rich.text import Text


def mesh_rank(plan: Plan, pp: int, dp: int, cp: int, tp: int) -> int:
    """Global rank at a [pp, dp, cp, tp] mesh position: the plan's placement, else row-major."""
    if plan.placement is not None:
        return int(plan.placement.ranks[pp][dp][cp][tp])
    p = plan.parallel
    return ((pp * p.dp + dp) * p.cp + cp) * p.tp + tp


def ep_groups(plan: Plan) -> list[list[int]]:
    """Every EP group's ranks: the dp·cp ranks of each (pp, tp) position, dp-major and cp-minor (folded
    over TP, `experts_span_tp`: the dp·cp·tp ranks of each pp position), cut into consecutive runs of ep
    (executor.expert_parallel.expert_meshes)."""
    p = plan.parallel
    groups = []
    for pp in range(p.pp):
        if p.experts_span_tp:
            lines = [[mesh_rank(plan, pp, d, c, t) for d in range(p.dp) for c in range(p.cp) for t in range(p.tp)]]
        else:
            lines = [[mesh_rank(plan, pp, d, c, t) for d in range(p.dp) for c in range(p.cp)] for t in range(p.tp)]
        for line in lines:
            groups += [line[i:i + p.ep] for i in range(0, len(line), p.ep)]
    return groups


def ep_tag(p) -> str:
    """' ep=8' (and ' expert_tp=2') for a mesh line, '' without EP."""
    if p.ep <= 1:
        return ""
    return f" ep={p.ep}" + (f" expert_tp={p.expert_tp}" if p.expert_tp > 1 else "")


def moe_lines(plan: Plan) -> list[Text]:
    m, p = plan.model, plan.parallel
    if m.moe is None:
        return []
    moe = m.moe
    sparse = len(sparse_blocks(m))
    out = [Text(f"experts: {moe.num_experts} per MoE block ({sparse} of {m.num_layers} blocks), top {moe.top_k}, "
                f"{moe.router} router; ep {p.ep}: {moe.num_experts // p.ep} experts per rank, expert_tp "
                f"{p.expert_tp}, expert data parallel {p.expert_dp}; {human_count(m.active_parameters)} of "
                f"{human_count(m.num_parameters)} parameters active per token")]
    if p.ep > 1:
        c = plan.cluster
        groups = ep_groups(plan)
        nodes = [len({c.node_of(r) for r in g}) for g in groups]
        where = "inside one node" if max(nodes) == 1 else f"across up to {max(nodes)} nodes"
        shown = ", ".join(str(r) for r in groups[0][:8]) + (", ..." if len(groups[0]) > 8 else "")
        exposed = plan.predicted.exposed_communication_s.get("ep")
        text = f"EP groups: {len(groups)} of {p.ep} ranks, {where} (first: ranks {shown})"
        if exposed is not None:
            text += f"; exposed all-to-all {exposed * 1e3:.1f} ms per iteration"
        out.append(Text(text))
    return out
