"""What this executor cannot run exactly as planned, refused before any process group exists."""

from __future__ import annotations

from meshplan.executor.context_parallel import check_cp
from meshplan.planner.errors import InputError
from meshplan.planner.plan import Plan


def check_supported(plan: Plan) -> None:
    """Refuse, before starting, what this executor cannot run exactly as planned."""
    spec, p = plan.model, plan.parallel
    if spec.arch not in ("gpt2", "llama"):
        raise InputError(f"plan.model.arch: the executor builds gpt2/llama models, not '{spec.arch}' "
                         f"({spec.factory or spec.name})")
    for what, n in (("num_heads", spec.num_heads), ("num_kv_heads", spec.num_kv_heads),
                    ("ffn_hidden_size", spec.ffn_hidden_size)):
        if n % p.tp:
            raise InputError(f"plan.parallel.tp: {p.tp} does not divide the model's {what} = {n}")
    if p.sequence_parallel and p.seq_len % p.tp:
        raise InputError(f"plan.parallel.seq_len: {p.seq_len} must be a multiple of tp={p.tp} with sequence parallel")
    if spec.position == "learned" and p.seq_len > spec.max_seq_len:
        raise InputError(f"plan.parallel.seq_len: {p.seq_len} exceeds the model's max_seq_len {spec.max_seq_len}")
    if p.fp8 != "none":
        raise InputError(f"plan.parallel.fp8: the executor trains without FP8 ({p.fp8} scaling planned); "
                         "export the plan (plan export --format megatron) or plan without --fp8")
    check_cp(plan)
    if p.schedule == "zero-bubble" and p.zero >= 3 and p.dp > 1:
        raise InputError("plan.parallel.zero: zero-bubble schedules split backward into input and weight passes, "
                         "which FSDP2 with ZeRO-3 resharding gets wrong in this PyTorch; use zero <= 2 or 1f1b")
    _check_moe(plan)
    if p.schedule == "zero-bubble" and p.virtual_stages not in (1, 2) and p.num_micro_batches % p.pp:
        raise InputError(f"plan.parallel.num_micro_batches: zero-bubble with {p.virtual_stages} virtual stages "
                         f"needs a multiple of pp={p.pp}")


def _check_moe(plan: Plan) -> None:
    """Mixture of experts: what executor/moe.py and executor/expert_parallel.py run."""
    spec, p = plan.model, plan.parallel
    if spec.moe is None:
        if p.ep > 1:
            raise InputError(f"plan.parallel.ep: {p.ep} needs a mixture-of-experts model; '{spec.name}' is dense")
        return
    if spec.moe.num_experts % p.ep:
        raise InputError(f"plan.parallel.ep: {p.ep} does not divide the model's {spec.moe.num_experts} experts")
    if p.expert_tp > 1:  # expert_tp = tp (ParallelConfig): each expert's width is split over TP
        for what, n in (("expert_ffn_hidden_size", spec.moe.expert_ffn_hidden_size),
                        ("shared_expert_ffn_hidden_size", spec.moe.shared_expert_ffn_hidden_size)):
            if n % p.expert_tp:
                raise InputError(f"plan.parallel.expert_tp: {p.expert_tp} does not divide the model's {what} = {n}")
    if spec.moe.capacity_factor is not None:
        raise InputError("plan.model.moe.capacity_factor: the executor is dropless only; set it to null")
