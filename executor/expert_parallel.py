"""apply_ep: expert parallelism in the style of torchtitan's ExpertParallel.

EP is carved out of the data-parallel (dp x cp) ranks (DESIGN.md §3, as Megatron-Core and torchtitan
do; folded over TP as well with expert_tp = 1 under sequence parallelism, below): the dp·cp ranks of one
(pp, tp) position are laid out as an (expert_dp, ep) grid, ep innermost, by
unflattening the world mesh (`DeviceMesh._unflatten`, which keeps one root mesh, so FSDP2 can compose
the two). Each EP rank holds num_experts/ep experts: the stacked expert weights become DTensors sharded
on dim 0 over the "ep" mesh. In a MoE block's forward the routed rows, sorted by global expert, go to
the rank of their expert with one `all_to_all_single` (autograd-aware:
torch.distributed._functional_collectives.all_to_all_single_autograd, which runs on gloo in torch 2.13;
the row counts go first, with a plain all_to_all_single), are regrouped by local expert, computed, put
back in arrival order and returned with a second all-to-all (dispatch and combine; backward runs the
same two in reverse).

Gradients: an expert's gradient on its EP rank already sums the contributions of every token of the EP
group that was routed to it. FSDP2 over the "edp" mesh (`shard_experts`) then sums over the
expert-data-parallel replicas, with a gradient divide factor of dp·cp (torchtitan's
`set_gradient_divide_factor`) instead of edp, so that experts get the gradient of the mean loss over all
dp·cp ranks, exactly as the dense parameters that FSDP averages over dp.

Tensor parallelism: attention is tensor-parallel as usual.
- expert_tp = 1 with sequence parallelism (Megatron-Core's MoE parallel folding, what planner/cost_ep.py
  charges; ParallelConfig.experts_span_tp): each TP rank routes only its own sequence shard (T/tp tokens,
  no gather) to whole experts, dispatches it over its EP group and gets its shard back, so expert FLOPs per
  rank are ÷tp. The EP group is ep consecutive ranks of the flattened dp × cp × tp (whole TP groups: ep is
  tp times a divisor of dp·cp), so the experts are sharded over the TP ranks too, not replicated: an
  expert receives every row routed to it from its group, its gradient is whole. The MoE's other
  parameters (router, shared experts and gate) are Replicate() DTensors over TP (`replicate_moe_over_tp`)
  whose gradients are declared Partial() over TP (moe._local), so FSDP2's post-backward (or
  train.reduce_partial_grads) sums them over TP as for the sequence-parallel norms; the load-balancing
  loss's statistics are all-reduced over TP (moe.MoE.tp_group).
- expert_tp = 1 without sequence parallelism: every TP rank holds the whole sequence and runs the MoE
  replicated (same tokens, identical gradients): the tp ranks repeat the MoE's work.
- expert_tp = tp (Megatron-Core's expert tensor parallelism, torchtitan's ExpertTensorParallel): each
  expert's width is split over the TP group, w1/w3 on their output (expert-ffn) dim, w2 on its input dim,
  as DTensors on the (ep, tp) mesh (`shard_experts_over_tp`, then `apply_ep`). Under sequence parallelism
  it runs as Megatron-Core's alltoall dispatcher does: each TP rank routes its own sequence shard and
  dispatches those rows over its EP group; the rows it receives are gathered over TP, each TP rank computes
  its width shard of all of them, and the partial sums are reduce-scattered back onto the rows it received
  before the combine (`AllToAllDispatch` with a TP group), so the MoE's output is whole on the shard, the
  all-to-all carries T/tp rows per rank, and the router and the shared-expert gate are replicated over TP
  with their gradients summed over it; shared experts are column/row-parallel over the shard's rows.
  Without sequence parallelism every TP rank routes the whole sequence, the block's output is a partial
  sum over TP, all-reduced by the block's output hook, and the tensors every TP rank holds whole that feed
  those partial sums (the experts' input rows, the routing weights, the shared-expert gate) sum their
  gradients over TP in backward (moe.MoE._whole_over_tp).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from meshplan.executor.collectives import ALL_GATHER_AUTOGRAD, REDUCE_SCATTER_AUTOGRAD, wait
from meshplan.executor.moe import GroupedExperts, MoE, moe_modules
from meshplan.planner.plan import ParallelConfig
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInputOutput, RowwiseParallel


def expert_meshes(mesh: DeviceMesh, cfg: ParallelConfig) -> tuple[DeviceMesh, DeviceMesh]:
    """(ep mesh, expert-data-parallel mesh) from the plan's [pp, dp, cp, tp] world mesh: the dp·cp ranks
    of each (pp, tp) position reshaped to (edp, ep), ep innermost (consecutive in dp-major, cp-minor order);
    with `cfg.experts_span_tp` the dp·cp·tp ranks of each pp position (Megatron-Core's expert rank order)."""
    sizes, names = (cfg.expert_dp, cfg.ep), ("edp", "ep")
    if cfg.experts_span_tp:
        grid = mesh["dp", "cp", "tp"]._flatten("dp_cp_tp")._unflatten(0, sizes, names)
    elif cfg.cp == 1:
        grid = mesh._unflatten("dp", sizes, names)
    else:
        grid = mesh["dp", "cp"]._flatten("dp_cp")._unflatten(0, sizes, names)
    return grid["ep"], grid["edp"]


class AllToAllDispatch:
    """Dispatch routed rows to the EP ranks of their experts, compute the local experts, combine back.
    `tp_group` (expert_tp = tp under sequence parallelism, Megatron-Core's alltoall dispatcher): each TP rank
    dispatches the rows of its own sequence shard; the rows it receives are gathered over TP, every TP rank
    computes its width shard of all of them, and the experts' output, a partial sum over TP, is
    reduce-scattered back onto the rows each TP rank received before the combine. With ep = 1 only the TP
    exchange runs."""

    def __init__(self, group: dist.ProcessGroup | None, ep: int, tp_group: dist.ProcessGroup | None = None):
        self.group, self.ep, self.tp_group = group, ep, tp_group

    def __call__(self, experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep = self.ep
        local = experts.num_experts // ep
        if ep == 1:
            from_rank = counts.view(1, local)
            rows = x
        else:
            # counts[e] rows for global expert e; chunk j of the counts belongs to EP rank j's experts
            received = torch.empty_like(counts)
            dist.all_to_all_single(received, counts, group=self.group)
            send_splits = counts.view(ep, local).sum(1).tolist()
            from_rank = received.view(ep, local)  # [source rank, local expert]
            recv_splits = from_rank.sum(1).tolist()
            rows = all_to_all_single_autograd(x, recv_splits, send_splits, self.group)
        if self.tp_group is None:
            out = _compute_arrived(experts, rows, from_rank)
        else:
            out = _compute_over_tp(experts, rows, from_rank, self.tp_group)
        if ep == 1:
            return out
        return all_to_all_single_autograd(out, send_splits, recv_splits, self.group)


def _compute_arrived(experts: GroupedExperts, rows: torch.Tensor, from_rank: torch.Tensor) -> torch.Tensor:
    """The local experts over rows in arrival order, (source, local expert) with from_rank[source, e] rows
    each: regrouped by local expert (stable in source order), computed, put back in arrival order."""
    sources, local = from_rank.shape
    expert_of_row = torch.arange(local, device=rows.device).repeat(sources).repeat_interleave(from_rank.flatten())
    perm = torch.argsort(expert_of_row, stable=True)
    out = experts.compute(rows[perm], from_rank.sum(0).tolist())
    return out[torch.argsort(perm)]


def _compute_over_tp(experts: GroupedExperts, rows: torch.Tensor, from_rank: torch.Tensor,
                     tp_group: dist.ProcessGroup) -> torch.Tensor:
    """Expert TP over received rows: gather every TP rank's rows (padded to the largest count, as the
    all-gather takes equal chunks), compute this rank's width shard of all of them, reduce-scatter the partial
    sums back to their TP rank. Autograd: the all-gather's backward reduce-scatters the rows' gradients (the
    width shards' partial input gradients summed), the reduce-scatter's all-gathers the output's."""
    tp, me = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    every = torch.empty(tp * from_rank.numel(), dtype=from_rank.dtype, device=from_rank.device)
    dist.all_gather_into_tensor(every, from_rank.contiguous().flatten(), group=tp_group)
    every = every.view(tp, *from_rank.shape)
    sizes = every.flatten(1).sum(1).tolist()
    width = max(max(sizes), 1)
    h = rows.shape[-1]
    padded = torch.cat([rows, rows.new_zeros(width - rows.shape[0], h)])
    gathered = wait(ALL_GATHER_AUTOGRAD(padded, 0, tp_group))  # [tp · width, h]
    keep = torch.cat([torch.arange(r * width, r * width + n, device=rows.device) for r, n in enumerate(sizes)])
    out = _compute_arrived(experts, gathered[keep], every.view(-1, from_rank.shape[1]))
    full = out.new_zeros(tp * width, h).index_copy(0, keep, out)
    return wait(REDUCE_SCATTER_AUTOGRAD(full, "sum", 0, tp_group))[:sizes[me]]


def _experts(module: nn.Module) -> list[GroupedExperts]:
    return [m for m in module.modules() if isinstance(m, GroupedExperts)]


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shard every MoE block's experts over `ep_mesh` (dim 0, num_experts/ep per rank) and route their
    rows through all-to-all. Experts already width-sharded over TP (`shard_experts_over_tp`) go onto the
    (ep, tp) mesh. Runs on the meta device, before activation checkpointing and FSDP."""
    ep = ep_mesh.size()
    for experts in _experts(model):
        if experts.num_experts % ep:
            raise ValueError(f"plan.parallel.ep: {ep} does not divide the model's {experts.num_experts} experts")
        for name, p in list(experts.named_parameters(recurse=False)):
            mesh, placements = ep_mesh, [Shard(0)]
            if isinstance(p, DTensor):  # meta: only the full shape matters, materialise fills the shards
                mesh, placements = DeviceMesh._concatenate([ep_mesh, p.device_mesh]), placements + list(p.placements)
                p = torch.empty(p.shape, dtype=p.dtype, device=p.device)
            experts.register_parameter(name, nn.Parameter(distribute_tensor(p, mesh, placements)))
        tp_group = experts.dispatcher.tp_group if experts.dispatcher is not None else None
        experts.dispatcher = AllToAllDispatch(ep_mesh.get_group(), ep, tp_group)


def shard_experts_over_tp(moe: MoE, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    """expert_tp = tp: split every expert's width over `tp_mesh` (w1/w3 [E, f, h] on f, column-parallel;
    w2 [E, h, f] on f, row-parallel). Under sequence parallelism the MoE routes this rank's sequence shard
    and its dispatcher exchanges the received rows over TP (AllToAllDispatch), so its output is whole: the
    router and the shared-expert gate see different tokens on each TP rank (replicated, gradients summed
    over TP). Without it every TP rank routes the whole sequence and the MoE's outputs are partial sums."""
    experts, tp = moe.experts, tp_mesh.size()
    if experts.w1.shape[1] % tp:
        raise ValueError(f"plan.parallel.expert_tp: {tp} does not divide the experts' width {experts.w1.shape[1]}")
    for name, dim in (("w1", 1), ("w3", 1), ("w2", 2)):
        p = getattr(experts, name)
        if p is not None:
            experts.register_parameter(name, nn.Parameter(distribute_tensor(p, tp_mesh, [Shard(dim)])))
    if not sequence_parallel:
        moe.expert_tp_group = tp_mesh.get_group()
        return
    for module in (moe.gate, moe.shared_gate):
        if module is not None:
            _replicate_over_tp(module, tp_mesh)
    moe.tp_group = tp_mesh.get_group()
    experts.dispatcher = AllToAllDispatch(None, 1, tp_mesh.get_group())


def _replicate_over_tp(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """`module`'s own parameters as Replicate() DTensors over `tp_mesh` (TP ranks that see different tokens)."""
    for name, p in list(module.named_parameters(recurse=False)):
        module.register_parameter(name, nn.Parameter(distribute_tensor(p, tp_mesh, [Replicate()])))


def replicate_moe_over_tp(moe: MoE, tp_mesh: DeviceMesh, experts: bool = True) -> None:
    """Sequence parallelism with expert_tp = 1: the MoE runs on this rank's sequence shard. Its parameters
    become Replicate() DTensors over `tp_mesh` whose gradients are summed over TP (moe._local), and the
    load-balancing loss sums its statistics over the TP group. `experts` False (EP groups spanning the TP
    ranks, ParallelConfig.experts_span_tp): the routed experts stay out, for `apply_ep` to shard over the
    folded EP mesh; each then sees every token routed to it from its whole EP group, TP peers included,
    so its gradient is whole."""
    for module in moe.modules():
        if experts or not isinstance(module, GroupedExperts):
            _replicate_over_tp(module, tp_mesh)
    moe.experts.tokens_split = experts
    if moe.shared_experts is not None:
        moe.shared_experts.tokens_split = True
    moe.tp_group = tp_mesh.get_group()


def balance_over_cp(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Context parallelism: every MoE block's load-balancing loss sums its statistics over the CP group, so
    that it is the whole sequence's (executor/moe.py)."""
    for moe in moe_modules(model):
        moe.cp_group = cp_mesh.get_group()


def shard_experts(block: nn.Module, edp_mesh: DeviceMesh, cfg: ParallelConfig, wrap) -> None:
    """FSDP2 (or replicate) of a block's experts over the expert-data-parallel mesh, before the block
    itself is wrapped over dp (which then leaves the experts' parameters to this group). `wrap`:
    apply_dp's engine call with its mixed-precision policy, given the mesh."""
    for experts in _experts(block):
        wrap(experts, mesh=edp_mesh)
        experts.set_gradient_divide_factor(float(cfg.dp * cfg.cp))
        # gloo has no PREMUL_SUM: FSDP's reduce-scatter over edp > 1 ranks then sums and divides after.
        # Not where no reduce-scatter runs (one rank, or ZeRO-0's replicate, which all-reduces): there torch
        # 2.13's foreach_reduce divides by the factor while copying and, forced to sum, once more afterwards.
        if edp_mesh.device_type == "cpu" and edp_mesh.size() > 1 and cfg.zero >= 1:
            experts.set_force_sum_reduction_for_comms(True)


def moe_tp_plan(block: nn.Module, sequence_parallel: bool, expert_tp: bool = False) -> dict:
    """TP plan entries of a MoE block's feed-forward. expert_tp = 1: none (the MoE takes the block's local
    input: this rank's sequence shard under sequence parallelism, its parameters then replicated by
    `replicate_moe_over_tp`; the whole sequence otherwise, replicated over the TP ranks). expert_tp = tp under
    sequence parallelism: the MoE takes the sequence shard too (`shard_experts_over_tp`); shared experts
    column/row-parallel over its rows, gathering them and reduce-scattering their output. expert_tp = tp
    without it: the output is a partial sum over TP, all-reduced; shared experts' output partial too."""
    if not expert_tp:
        return {}
    shared = block.feed_forward.shared_experts
    plan: dict = {}
    if sequence_parallel:
        if shared is not None:  # over the MoE's flattened rows [b·s/tp, h]: the shard is dim 0
            plan.update({"feed_forward.shared_experts.w1": ColwiseParallel(input_layouts=Shard(0)),
                         "feed_forward.shared_experts.w2": RowwiseParallel(output_layouts=Shard(0))})
            if shared.w3 is not None:
                plan["feed_forward.shared_experts.w3"] = ColwiseParallel(input_layouts=Shard(0))
        return plan
    plan["feed_forward"] = PrepareModuleInputOutput(
        input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_input=True,
        output_layouts=(Partial(),), desired_output_layouts=(Replicate(),), use_local_output=True)
    if shared is not None:
        plan.update({"feed_forward.shared_experts.w1": ColwiseParallel(),
                     "feed_forward.shared_experts.w2": RowwiseParallel(output_layouts=Partial())})
        if shared.w3 is not None:
            plan["feed_forward.shared_experts.w3"] = ColwiseParallel()
    return plan


def is_moe_block(block: nn.Module) -> bool:
    return any(isinstance(m, MoE) for m in block.modules())
