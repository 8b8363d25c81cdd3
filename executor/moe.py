"""The mixture-of-experts feed-forward of a sparse block (ModelSpec.moe): router, routed experts,
optional shared experts, and the load-balancing loss.

Routing (Mixtral, Qwen-MoE): router logits = Linear(h, E, no bias)(x); scores = softmax over the E
experts (or a sigmoid per expert); the top_k experts of each token are kept, their scores renormalised
to sum to 1 when `norm_topk_prob`. Dropless: every routed (token, expert) pair is computed (tokens are
sorted by expert, each expert runs one GEMM over its rows, torchtitan's GroupedExperts loop path).
The experts' weights are stacked [E, out, in] (`w1`, `w3` gate/up, `w2` down), so expert parallelism
shards them on dim 0 (executor/expert_parallel.py); the module only ever sees its local experts.

Load-balancing loss: Switch Transformer's (Fedus et al. 2022, eq. 4) with Megatron-Core's top-k
normalisation (switch_load_balancing_loss_func: E/(k·T²) · sum_i count_i · sum_t p_t,i, 1 when perfectly
balanced), computed per sequence and averaged over the sequences (T = the sequence's tokens; DeepSeek-V3
uses the same per-sequence form). Per sequence, it is a sum over the batch's rows, so any split of the
global batch into data-parallel shards and micro-batches gives the same gradient as the whole batch at
once: every plan trains the same model. Context parallelism splits each sequence over the CP ranks: the
per-expert counts and score sums are all-reduced over the CP group (`cp_group`, an autograd-aware
all-reduce whose backward sums the CP ranks' gradients, which the dp·cp gradient average then divides
back), so every chunk's router gets the whole sequence's loss and gradient. Sequence parallelism (executor/
expert_parallel.py, either expert_tp) splits each sequence over the TP ranks: the statistics are all-reduced over the
TP group too (`tp_group`), with an identity backward, since the TP ranks' gradients are summed, not averaged,
so every shard's router gets the whole sequence's loss and its own tokens' share of the gradient. Otherwise
every TP rank routes, and balances, the whole sequence. The loss is not added to the reported loss; its gradient is
injected into backward at the block's output (Megatron-Core's MoEAuxLossAutoScaler), scaled by
`aux_loss_scale` = the scale the training loop applies to the main loss (1/num_micro_batches in a plain
loop, the fp16 loss scale), set by `set_aux_loss_scale`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from meshplan.executor.activation import activation
from meshplan.executor.collectives import wait
from meshplan.planner.model_spec import ModelSpec
from torch.distributed.tensor import DTensor, Partial


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on `out`; in backward, d(aux)/d(aux) = 1 flows into the auxiliary loss's graph
    (Megatron-Core moe_utils.MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad, torch.ones_like(aux)


class _SumGrad(torch.autograd.Function):
    """Identity on `x`; in backward, the gradient summed over `group` (Megatron's
    copy_to_tensor_model_parallel_region): for a tensor every TP rank holds whole that feeds expert-TP
    partial sums, so each rank's gradient is only its width shard's share."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _sum_over(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-reduce (sum) with autograd: its backward sums the gradients over `group` too."""
    return wait(funcol.all_reduce(t, "sum", group))


class _SumForward(torch.autograd.Function):
    """All-reduce (sum) over `group` in forward, identity in backward (Megatron's
    reduce_from_tensor_model_parallel_region): for statistics of a loss that every rank of `group` holds
    once, whose parameters' gradients are then summed over `group`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _local(t: torch.Tensor, tokens_split: bool = False) -> torch.Tensor:
    """A parameter's local tensor. `tokens_split` (sequence parallelism, expert_tp = 1): the parameter is
    replicated over TP ranks that see different tokens (a DTensor Replicate() there); its gradient is
    declared Partial() over those mesh dims, so that FSDP2's post-backward (or train.reduce_partial_grads)
    sums it over TP, as for the sequence-parallel norms' weights."""
    if not isinstance(t, DTensor):
        return t
    if not tokens_split:
        return t.to_local()
    return t.to_local(grad_placements=[Partial() if x.is_replicate() else x for x in t.placements])


class GroupedExperts(nn.Module):
    """E experts (SwiGLU or GELU MLPs without bias) as stacked weights. `forward(x, counts)`: x holds the
    routed rows sorted by expert, counts[e] rows for expert e. Under expert parallelism `dispatcher` (set
    by apply_ep) exchanges the rows with the ranks that hold their experts and calls `compute`."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        assert spec.moe is not None
        e, h, f = spec.moe.num_experts, spec.hidden_size, spec.moe.expert_ffn_hidden_size
        self.num_experts = e
        self.act = activation(spec)
        self.w1 = nn.Parameter(torch.empty(e, f, h))
        self.w2 = nn.Parameter(torch.empty(e, h, f))
        self.w3 = nn.Parameter(torch.empty(e, f, h)) if spec.gated_mlp else None
        self.dispatcher = None
        self.tokens_split = False  # replicated over TP ranks that route different tokens (_local)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.dispatcher is not None:
            return self.dispatcher(self, x, counts)
        return self.compute(x, counts.tolist())

    def compute(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The local experts over their rows (len(counts) = local experts), one GEMM chain per expert."""
        w1, w2 = _local(self.w1, self.tokens_split), _local(self.w2, self.tokens_split)
        w3 = _local(self.w3, self.tokens_split) if self.w3 is not None else None
        outs = []
        for e, rows in enumerate(torch.split(x, counts)):
            hidden = self.act(rows @ w1[e].t())
            if w3 is not None:
                hidden = hidden * (rows @ w3[e].t())
            outs.append(hidden @ w2[e].t())
        return torch.cat(outs) if outs else x.new_zeros(0, x.shape[-1])


class SharedExperts(nn.Module):
    """Always-on experts (Qwen2-MoE's shared expert: one MLP of the shared size), no bias."""

    def __init__(self, spec: ModelSpec, ffn: int):
        super().__init__()
        h = spec.hidden_size
        self.w1 = nn.Linear(h, ffn, bias=False)
        self.w2 = nn.Linear(ffn, h, bias=False)
        self.w3 = nn.Linear(h, ffn, bias=False) if spec.gated_mlp else None
        self.act = activation(spec)
        self.tokens_split = False  # replicated over TP ranks that see different tokens (_local)

    def _linear(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, _local(layer.weight, True)) if self.tokens_split else layer(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lin = self._linear
        hidden = self.act(lin(self.w1, x))
        return lin(self.w2, hidden * lin(self.w3, x) if self.w3 is not None else hidden)


class MoE(nn.Module):
    """Router + routed experts (+ shared experts); input and output [b, s, h]."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        moe = spec.moe
        assert moe is not None
        if moe.capacity_factor is not None:
            raise ValueError("executor: MoE capacity factors (token dropping) are not implemented; "
                             "set model.moe.capacity_factor to null (dropless)")
        self.cfg = moe
        self.gate = nn.Linear(spec.hidden_size, moe.num_experts, bias=False)
        self.experts = GroupedExperts(spec)
        self.shared_experts = SharedExperts(spec, moe.shared_expert_ffn_hidden_size) \
            if moe.num_shared_experts else None
        self.shared_gate = nn.Linear(spec.hidden_size, 1, bias=False) if moe.shared_expert_gate else None
        self.aux_loss_scale = 1.0
        self.cp_group: dist.ProcessGroup | None = None  # context parallelism: the aux loss's statistics summed
        # expert_tp = tp without sequence parallelism: experts return partial sums
        self.expert_tp_group: dist.ProcessGroup | None = None
        # sequence parallelism: this rank routes its sequence shard; the router's parameters are
        # Replicate() DTensors over TP with gradients summed over it, the aux loss's statistics summed over it
        self.tp_group: dist.ProcessGroup | None = None

    def _whole_over_tp(self, t: torch.Tensor) -> torch.Tensor:
        """`t`, held whole by every TP rank, feeds the experts' partial sums (expert_tp = tp): sum its
        gradient over TP. Identity otherwise."""
        return t if self.expert_tp_group is None else _SumGrad.apply(t, self.expert_tp_group)

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scores over all experts [T, E] in fp32, the top-k weights [T, k], their expert ids [T, k])."""
        logits = F.linear(flat, _local(self.gate.weight, self.tp_group is not None)).float()
        scores = torch.softmax(logits, dim=-1) if self.cfg.router == "softmax" else torch.sigmoid(logits)
        weights, ids = torch.topk(scores, self.cfg.top_k, dim=-1)
        if self.cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return scores, weights, ids

    def aux_loss(self, scores: torch.Tensor, ids: torch.Tensor, b: int, s: int) -> torch.Tensor:
        """Load-balancing loss, per sequence, averaged over the b sequences (module docstring)."""
        e, k = self.cfg.num_experts, self.cfg.top_k
        if self.cfg.router == "sigmoid":  # per-expert sigmoid scores: compare their shares, as for softmax
            scores = scores / scores.sum(dim=-1, keepdim=True)
        counts = F.one_hot(ids.view(b, s * k), e).sum(dim=1).to(scores.dtype)  # [b, E]
        stats = torch.cat([scores.view(b, s, e).sum(dim=1), counts], dim=-1)  # [b, 2E]: score sums, counts
        if self.cp_group is not None:  # this rank holds a chunk of each sequence: sum over the whole sequence
            stats = _sum_over(stats, self.cp_group)
            s *= dist.get_world_size(self.cp_group)
        if self.tp_group is not None:  # and a TP shard of it (sequence parallelism)
            stats = _SumForward.apply(stats, self.tp_group)
            s *= dist.get_world_size(self.tp_group)
        probs, counts = stats[:, :e] / s, stats[:, e:]
        return (probs * counts).sum(dim=-1).mean() * (e / (k * s))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        flat = x.reshape(-1, h)
        scores, weights, ids = self.route(flat)
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.cfg.num_experts)
        token = order // self.cfg.top_k
        # under expert_tp = tp without sequence parallelism, `routed` and `out` are partial sums over TP (reduced
        # at the block's output)
        routed = self.experts(self._whole_over_tp(flat)[token], counts)
        routed = routed * self._whole_over_tp(weights).reshape(-1)[order].unsqueeze(-1).to(routed.dtype)
        out = torch.zeros_like(flat).index_add(0, token, routed)
        if self.shared_experts is not None:
            shared = self.shared_experts(flat)
            if self.shared_gate is not None:
                gate = F.linear(flat, _local(self.shared_gate.weight, self.tp_group is not None))
                shared = self._whole_over_tp(torch.sigmoid(gate)) * shared
            out = out + shared
        out = out.view(b, s, h)
        coef = self.cfg.aux_loss_coef
        if coef > 0 and torch.is_grad_enabled() and self.training:
            aux = self.aux_loss(scores, ids, b, s) * (coef * self.aux_loss_scale)
            out = _AttachAuxLoss.apply(out, aux)
        return out


def moe_modules(module: nn.Module) -> list[MoE]:
    return [m for m in module.modules() if isinstance(m, MoE)]


def set_aux_loss_scale(modules: list[nn.Module], scale: float) -> None:
    """The factor the training loop applies to the main loss's gradient (1/num_micro_batches for a plain
    loop that divides each micro-batch's loss, the fp16 loss scale): the load-balancing loss's gradient
    gets the same, so that its weight relative to the main loss is `aux_loss_coef` in every plan."""
    for module in modules:
        for moe in moe_modules(module):
            moe.aux_loss_scale = scale
