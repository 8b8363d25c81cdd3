"""The mixture-of-experts part of `plan export` (planner/export.py calls these).

Names checked against each project (search, December 2026):
- Megatron-LM (megatron/training/arguments.py `_add_moe_args`, and launch scripts that use them, e.g.
  THUDM/slime scripts/models/qwen3-30B-A3B.sh): `--num-experts`, `--moe-router-topk`, `--moe-ffn-hidden-size`,
  `--expert-model-parallel-size`, `--expert-tensor-parallel-size`, `--moe-token-dispatcher-type alltoall`,
  `--moe-grouped-gemm`, `--moe-router-score-function softmax|sigmoid`, `--moe-router-pre-softmax`,
  `--moe-router-load-balancing-type aux_loss`, `--moe-aux-loss-coeff`, `--moe-layer-freq`,
  `--moe-shared-expert-intermediate-size`, `--moe-expert-capacity-factor`, `--qk-layernorm`, `--kv-channels`.
  Megatron's router without --moe-router-pre-softmax takes the top-k of the logits and softmaxes over them,
  which equals softmax over all experts renormalised over the top k (norm_topk_prob); with it, no
  renormalisation.
- torchtitan (torchtitan/config/job_config.py `Parallelism`): `expert_parallel_degree`,
  `expert_tensor_parallel_degree`; with etp = 1 its EP group spans cp·tp ranks (ep % (cp·tp) == 0), with
  etp = tp it needs ep % cp == 0. Experts, top-k and the router come from the model flavour, not the job.
- DeepSpeed (deepspeed/moe/layer.py at v0.19.6, edaa722): `MoE(hidden_size, expert, num_experts=1, ep_size=1,
  k=1, capacity_factor=1.0, eval_capacity_factor=1.0, min_capacity=4, use_residual=False,
  noisy_gate_policy=None, drop_tokens=True, use_rts=True, use_tutel=False,
  enable_expert_tensor_parallelism=False, top2_2nd_expert_sampling=True)` in model code; its config JSON has
  no MoE section. k > 2 goes to `topkgating` (sharded_moe.py, PR #5881, August 2024), which takes none of
  noisy_gate_policy, use_rts or top2_2nd_expert_sampling.
"""

from __future__ import annotations

from collections.abc import Callable

from meshplan.planner.model_spec import sparse_blocks
from meshplan.planner.plan import Plan


def _dense_ep(plan: Plan, warn: Callable[[str], None]) -> bool:
    """True for a dense model (nothing MoE to export); warns if the plan still sets ep > 1."""
    if plan.model.moe is not None:
        return False
    if plan.parallel.ep > 1:
        warn(f"ep={plan.parallel.ep} on a dense model: no experts to shard; not exported")
    return True


def megatron_moe_args(plan: Plan, warn: Callable[[str], None]) -> list[tuple[str, object | None]]:
    m, p = plan.model, plan.parallel
    args: list[tuple[str, object | None]] = []
    if m.head_dim != m.hidden_size // m.num_heads:
        args.append(("--kv-channels", m.head_dim))
    if m.qk_norm:
        args.append(("--qk-layernorm", None))
    if _dense_ep(plan, warn):
        return args
    moe = m.moe
    assert moe is not None
    args += [("--num-experts", moe.num_experts), ("--moe-router-topk", moe.top_k),
             ("--moe-ffn-hidden-size", moe.expert_ffn_hidden_size),
             ("--expert-model-parallel-size", p.ep), ("--expert-tensor-parallel-size", p.expert_tp),
             ("--moe-token-dispatcher-type", "alltoall"), ("--moe-grouped-gemm", None),
             ("--moe-router-score-function", moe.router)]
    if moe.router == "softmax" and not moe.norm_topk_prob:
        args.append(("--moe-router-pre-softmax", None))
    if moe.router == "sigmoid" and not moe.norm_topk_prob and moe.top_k > 1:
        warn("sigmoid router without top-k renormalisation: Megatron renormalises sigmoid top-k scores")
    args += [("--moe-router-load-balancing-type", "aux_loss"), ("--moe-aux-loss-coeff", moe.aux_loss_coef)]
    sparse = set(sparse_blocks(m))
    if len(sparse) != m.num_layers:
        pattern = ",".join("1" if i in sparse else "0" for i in range(m.num_layers))
        args.append(("--moe-layer-freq", f'"[{pattern}]"'))
    if moe.num_shared_experts:
        args.append(("--moe-shared-expert-intermediate-size", moe.shared_expert_ffn_hidden_size))
        if moe.shared_expert_gate:
            warn("shared-expert sigmoid gate (Qwen2-MoE): not among these arguments; set your Megatron version's "
                 "shared-expert gate option by hand")
    if moe.capacity_factor is not None:
        args += [("--moe-expert-capacity-factor", moe.capacity_factor), ("--moe-token-drop-policy", "probs")]
    if p.tp > 1 and p.expert_tp == 1 and p.ep > 1 and not p.experts_span_tp:
        warn(f"expert_tp=1 with tp={p.tp}: Megatron folds the tensor-parallel ranks into the experts' data-parallel "
             f"group (expert data parallel = world / (pp x ep x etp) = {plan.world_size // (p.pp * p.ep)}), each "
             f"routing its own sequence shard; meshplan's plan runs the MoE replicated over tp")
    return args


def torchtitan_moe_degrees(plan: Plan, warn: Callable[[str], None]) -> dict[str, object]:
    p = plan.parallel
    if _dense_ep(plan, warn):
        return {}
    out: dict[str, object] = {"expert_parallel_degree": p.ep, "expert_tensor_parallel_degree": p.expert_tp}
    if p.expert_tp == 1 and p.ep > 1 and p.ep % (p.cp * p.tp):
        warn(f"expert_parallel_degree {p.ep} with expert_tensor_parallel_degree 1: torchtitan's EP group then spans "
             f"the cp x tp = {p.cp * p.tp} ranks too and needs a multiple of it (e.g. {p.ep * p.cp * p.tp}); "
             + ("this plan's EP groups are whole TP groups of the dp x cp x tp ranks" if p.experts_span_tp
                else "this plan's EP is carved from dp x cp only"))
    if p.expert_tp > 1 and p.ep % p.cp:
        warn(f"expert_parallel_degree {p.ep}: torchtitan with expert_tensor_parallel_degree = tp needs a multiple "
             f"of cp = {p.cp}")
    m = plan.model
    moe = m.moe
    assert moe is not None
    warn(f"experts ({moe.num_experts}, top {moe.top_k}, {moe.router} router, expert FFN "
         f"{moe.expert_ffn_hidden_size}) come from torchtitan's model flavour, not the job config: choose the "
         f"flavour that matches {m.name}")
    return out


def deepspeed_moe_note(plan: Plan, warn: Callable[[str], None]) -> None:
    """DeepSpeed MoE lives in model code: name the call that carries the plan's expert layout."""
    p = plan.parallel
    if _dense_ep(plan, warn):
        return
    moe = plan.model.moe
    assert moe is not None
    capacity = "capacity_factor=1.0, drop_tokens=False" if moe.capacity_factor is None \
        else f"capacity_factor={moe.capacity_factor}, drop_tokens=True"
    tp = ", enable_expert_tensor_parallelism=True" if p.expert_tp > 1 else ""
    warn(f"MoE layers: DeepSpeed sets expert parallelism in model code, not in the config: "
         f"deepspeed.moe.layer.MoE(hidden_size={plan.model.hidden_size}, expert=<the expert MLP>, "
         f"num_experts={moe.num_experts}, ep_size={p.ep}, k={moe.top_k}, {capacity}{tp})")
    if p.experts_span_tp:
        warn(f"ep_size={p.ep} spans the tp={p.tp} ranks (expert_tp 1): DeepSpeed forms expert-parallel groups from "
             f"the data-parallel ranks only (ep_size must divide dp = {p.dp * p.cp})")
    if moe.top_k > 2:
        warn(f"top-{moe.top_k} routing: DeepSpeed's gate routes k > 2 through topkgating only since PR #5881 "
             "(August 2024), without noisy_gate_policy or use_rts")
    if moe.num_shared_experts:
        warn("shared experts: DeepSpeed's use_residual (PR-MoE) mixes a dense MLP with a learned coefficient, not "
             "Qwen-style shared experts")
    if moe.router != "softmax" or not moe.norm_topk_prob:
        warn(f"router {moe.router}{'' if moe.norm_topk_prob else ' without top-k renormalisation'}: DeepSpeed's "
             "gates are softmax, renormalised over the top k")
