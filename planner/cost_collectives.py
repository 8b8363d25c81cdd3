"""Communication terms outside the pipeline: tensor-parallel collectives per micro-batch, the data-parallel
engine's reductions, gathers, hooks and copies per iteration, and the optimizer step with its scalar
all-reduces."""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.planner.candidate import Candidate, Links
from meshplan.planner.cost_memory import fp8_params, grad_bytes
from meshplan.planner.model_spec import wrapped_unit_params
from meshplan.profiler.analytic import DTYPE_BYTES


def tp_comm_time(profile, kind: str, b: int, s: int, h: int, tp: int, dtype: str, mode: str) -> float:
    """TP collectives per micro-batch (Shoeybi et al. 2019, §3): a block does 2 all-reduces of b·s·h in
    forward and 2 in backward (with sequence parallelism all-gather + reduce-scatter pairs of the same
    volume, Korthikanti et al. 2022 §4.2.2); full recompute repeats the 2 forward ones, torchtitan's selective
    policies (profiler/roofline.SELECTIVE) one on average: every second block repeats both, or every block
    its two all-gathers (half an all-reduce each; reduce-scatter outputs are kept). The vocab-parallel
    embedding reduces once in forward, the head's input gradient once in backward. Zero when the profiler
    timed the layer tensor-parallel across ranks: its time includes them."""
    if tp <= 1 or profile.tp_collectives_measured(kind, tp):  # then already in the layer's time
        return 0.0
    r = getattr(profile, "roofline", None)
    again = 2 if mode == "full" else 1 if mode == "selective" and r is not None and r.selective != "attention" else 0
    count = {"block": 4 + again, "embedding": 1, "head": 1}[kind]
    return count * tp_exchange_time(profile, b * s * h * DTYPE_BYTES[dtype], tp)


def tp_exchange_time(profile, nbytes: float, tp: int) -> float:
    """One tensor-parallel exchange of `nbytes`: an all-reduce, or with sequence parallelism (the preset's
    software) the all-gather + reduce-scatter pair it is, which NVLS speeds neither of (profile.LinkFit)."""
    r = getattr(profile, "roofline", None)
    if r is not None and r.sequence_parallel:
        one = (profile.collective_time("all_gather", nbytes, tp, "intra_node")
               + profile.collective_time("reduce_scatter", nbytes, tp, "intra_node"))
    else:
        one = profile.collective_time("all_reduce", nbytes, tp, "intra_node")
    return one * profile.correction("tp_comm")


def dp_ops(zero: int, grad_reduce: str = "reduce_scatter") -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(once per iteration, every micro-batch) data-parallel collectives of one wrapped unit, as the
    executor's engines run them with gradient accumulation (executor/train.py; torch.distributed.pipelining
    does the same): ZeRO-0 (replicate) all-reduces the accumulated gradients after the last micro-batch
    (Li et al. VLDB'20, DDP no_sync); ZeRO-1/2 (FSDP2 keeping parameters gathered between micro-batches)
    reduce-scatter them and all-gather the updated parameter shards at the next forward (Rajbhandari et
    al. SC'20 §5.2); ZeRO-3 reduce-scatters once and all-gathers the parameters before every forward and
    again before every backward (SC'20 §5.3; FSDP2 reshards after forward). ZeRO-2/3 without pipelining
    repeat the reduce-scatter every micro-batch instead (`grad_sync`). `grad_reduce` "all_reduce": a ZeRO-1/2
    that all-reduces whole gradients (DeepSpeed's BF16_Optimizer)."""
    if zero == 0:
        return ("all_reduce",), ()
    if zero <= 2:
        return (grad_reduce, "all_gather"), ()
    return ("reduce_scatter",), ("all_gather", "all_gather")


def grad_reduce_op(profile) -> str:
    r = getattr(profile, "roofline", None)
    return r.grad_reduce if r is not None else "reduce_scatter"


@dataclass(frozen=True)
class GradSync:
    """How the executor reduces a step's data-parallel gradients over its m micro-batches
    (executor/train.py). `full_grads`: unsharded gradients are held between micro-batches because
    the reduction waits for the last one. `reductions`: gradient reductions per iteration. `gathers`:
    parameter unshards per iteration (ZeRO-3 regathers for every micro-batch's forward and backward;
    below it the parameters stay unsharded through the step)."""

    full_grads: bool
    reductions: int
    gathers: int = 1


def grad_sync(cand: Candidate, sharded_accumulation: bool = False) -> GradSync:
    """ZeRO-2/3 without pipelining reduce-scatter every micro-batch, so gradients stay sharded (as DeepSpeed
    and torchtitan run them). ZeRO-0/1 reduce once after the last micro-batch (DDP's no_sync), and so
    does every pipelined plan: torch.distributed.pipelining skips the reduction until a stage's last
    backward; unless the software keeps gradients sharded under pipelining too (`sharded_accumulation`,
    Roofline.sharded_accumulation)."""
    every = cand.zero >= 2 and (cand.pp == 1 or sharded_accumulation) and cand.dp * cand.cp > 1 and cand.m > 1
    return GradSync(full_grads=cand.m > 1 and not every, reductions=cand.m if every else 1,
                    gathers=2 * cand.m if cand.zero >= 3 else 1)


def sharded_accumulation(profile) -> bool:
    """Whether the profile's software keeps gradients sharded through a pipelined step (a preset's)."""
    r = getattr(profile, "roofline", None)
    return bool(r is not None and r.sharded_accumulation)


def engine_copy_time(profile, params: float, dtype: str, dp: int, zero: int, sync: GradSync) -> float:
    """The data-parallel engine's own copies in a step, on the compute stream, for `params` elements of
    one device (presets whose software runs FSDP2, `Roofline.fsdp_copies`; a measured profile times
    them in situ). torch.distributed.fsdp._fully_shard (_fsdp_collectives.py, _fsdp_param_group.py):
    each unshard copies the all-gather output into the parameters (split_with_sizes_copy: read and
    write the compute dtype; a replicated mesh, zero 0, instead casts its fp32 copy and copies it: read
    4, write B, when B < 4; then read B, write B), and each reduction first copies the gradients into the reduce-dtype
    buffer (chunk_cat: read B, or the reduce dtype's bytes where the micro-batches' gradients were added
    up in it first, `sync.full_grads`; write the reduce dtype's bytes). `sync.gathers` unshards and
    `sync.reductions` reductions per step; none without data parallelism (the executor runs no FSDP)."""
    r = getattr(profile, "roofline", None)
    if r is None or not r.fsdp_copies or dp <= 1 or profile.wrapper(zero) is not None:
        return 0.0
    B = DTYPE_BYTES[dtype]
    unshard = 2 * B + (4 + B if zero == 0 and B < 4 else 0)
    g = grad_bytes(profile, dtype)
    return r.bytes_time(params * (sync.gathers * unshard + sync.reductions * ((g if sync.full_grads else B) + g)))


def gather_bytes(profile, dtype: str, zero: int, block: bool) -> float:
    """Bytes per parameter the data-parallel all-gathers move: the compute dtype's, or 1 for a block's
    weights kept in FP8 (cost_memory.fp8_params; Megatron-Core's --fp8-param-gather: "Keep the compute
    param in fp8 ... and perform the param all-gather in fp8", megatron/training/arguments.py)."""
    return 1.0 if block and fp8_params(profile, zero) else float(DTYPE_BYTES[dtype])


def _link_time(profile, ops: tuple[str, ...], params: float, dtype: str, dp: int, link_class: str,
               gather: float | None = None) -> float:
    """`ops` over `params` elements: gradient reductions at `grad_bytes`, parameter gathers at `gather`
    bytes (`dtype`'s when None)."""
    per = {"all_gather": DTYPE_BYTES[dtype] if gather is None else gather}
    g = grad_bytes(profile, dtype)
    return sum(profile.collective_time(op, params * per.get(op, g), dp, link_class) for op in ops)


def in_situ_factor(profile, zero: int) -> float | None:
    """Measured cost of the engine's per-iteration reduction (profiler/wrappers.py) over what the link
    fit predicts for the same units and ranks: on CPU collectives inside FSDP2 cost several times the
    bare link fit (copy-in/out, waiting for the slower rank). None without an in-situ sample."""
    w = profile.wrapper(zero)
    if w is None:
        return None
    ops, _ = dp_ops(zero, grad_reduce_op(profile))
    # the units' sizes from the model, not the sample: older profiles counted a tied root's weight wrong
    units = wrapped_unit_params(profile.model, len(w.unit_params) - 1)
    ref = sum(_link_time(profile, ops, n, profile.dtype, w.ranks, "intra_node") for n in units)
    return w.sync_s / ref if ref > 0 else None


def dp_sync_time(profile, params: float, dtype: str, dp: int, zero: int, link_class: str,
                 reductions: int = 1, gather: float | None = None) -> float:
    """Data-parallel traffic per iteration for one unit of `params` (already ÷tp): `dp_ops` once, and its
    gradient reduction (the first op) `reductions` times in all (`GradSync`); scaled by the engine's
    in-situ factor when the profiler measured it (then it is the exposed time: see `unhidden_share`)."""
    if dp <= 1:
        return 0.0
    ops, _ = dp_ops(zero, grad_reduce_op(profile))
    t = _link_time(profile, ops, params, dtype, dp, link_class, gather) + \
        (reductions - 1) * _link_time(profile, ops[:1], params, dtype, dp, link_class)
    k = in_situ_factor(profile, zero)
    return t * (k if k is not None else 1.0) * profile.correction("dp_comm")


def dp_reduction_times(profile, params: float, dtype: str, dp: int, zero: int, link_class: str,
                       sync: GradSync, gather: float | None = None) -> tuple[float, float]:
    """(per-iteration DP traffic of the step's tail, per-micro-batch reduction traffic) of one unit. Where a
    step reduces gradients after every micro-batch (`GradSync.reductions` > 1), the reductions before the
    last run beside later micro-batches' compute, on the communicator the parameter gathers use (NCCL runs
    one communicator's collectives in order), so they join the gathers' per-micro-batch pool
    (cost_model.evaluate), spread evenly over the micro-batches; the last one stays in the tail. Measured
    in situ, all of it stays in the tail (the measurement is the exposed time)."""
    if sync.reductions <= 1 or dp <= 1 or profile.wrapper(zero) is not None:
        return dp_sync_time(profile, params, dtype, dp, zero, link_class, sync.reductions, gather), 0.0
    ops, _ = dp_ops(zero, grad_reduce_op(profile))
    one = _link_time(profile, ops[:1], params, dtype, dp, link_class) * profile.correction("dp_comm")
    return (dp_sync_time(profile, params, dtype, dp, zero, link_class, gather=gather),
            one * (sync.reductions - 1) / sync.reductions)


def sharded_dp_time(profile, params: float, dtype: str, dp: int, zero: int, link_class: str,
                    gather: float | None = None) -> float:
    """Data-parallel cost of one unit every micro-batch: the engine's hooks and, under ZeRO-3, the two
    parameter gathers (`dp_ops`). Measured in situ when the profiler could (exposed, per unit), else the
    link fit's gathers, overlapped with compute in `evaluate`."""
    if dp <= 1:
        return 0.0
    w = profile.wrapper(zero)
    if w is not None:
        return w.hook_s * profile.correction("dp_comm")
    _, ops = dp_ops(zero)
    return _link_time(profile, ops, params, dtype, dp, link_class, gather) * profile.correction("dp_comm")


def root_hook_time(profile, dp: int, zero: int) -> float:
    """Per stage and micro-batch: the hooks of the stage's root unit (executor wraps the stage module
    itself too), measured in situ; 0 without a sample (presets)."""
    w = profile.wrapper(zero) if dp > 1 else None
    return w.hook_s * profile.correction("dp_comm") if w is not None else 0.0


def unhidden_share(profile, dp: int, zero: int, num_layers: int, num_stages: int) -> float:
    """Share of data-parallel traffic that never overlaps compute: the last bucket (one of a stage's
    layers), or all of it when it was measured in situ (the measurement is the exposed time)."""
    if dp > 1 and profile.wrapper(zero) is not None:
        return 1.0
    if getattr(profile, "roofline", None) is not None and not profile.roofline.grad_overlap:
        return 1.0  # the software reduces after the whole backward
    return 1.0 / max(1.0, num_layers / num_stages)


def overlap_tax(profile) -> float:
    """Share of compute lost while an overlapped collective runs: NCCL's kernels hold SMs the GEMMs would
    use (an H100 under FSDP prefetch: ncclAllGather launched 24 blocks of the 132 SMs, NVIDIA developer
    forum "Compute-communication overlap causes severe GEMM performance degradation because of tail
    effect"). Compute of work W overlapping a collective of duration C then takes W/r + C·share.
    GPU presets only; a measured profile times the engines in situ."""
    r = getattr(profile, "roofline", None)
    return r.comm_sms / r.sm_count if r is not None and r.sm_count > 0 else 0.0


def optimizer_time(profile, params: float, dp: int, zero: int, tp: int = 1) -> float:
    """Optimizer step over the parameters this device updates (÷dp with ZeRO ≥ 1): memory bound, measured
    seconds per parameter of the executor's global-norm clip and AdamW, or preset ones (AdamW's 36 B and
    the clip's 12 B touched per parameter, profiler/presets.py), times the
    measured cost of stepping DTensor parameters: the data-parallel engine's, or the tensor-parallel
    model's (the larger of the two when both)."""
    w = profile.wrapper(zero) if dp > 1 else None
    ratio = w.optimizer_ratio if w is not None else 1.0
    tp_ratio = profile.tp_optimizer_ratio(tp) if tp > 1 else None
    if tp_ratio is not None:
        ratio = max(ratio, tp_ratio)
    return profile.optimizer_s_per_param * params / (dp if zero >= 1 else 1) * ratio * profile.correction("optimizer")


def step_sync_time(profile, world: int, links: "Links") -> float:
    """The executor's two all-reduces of a scalar over every rank each step (the global gradient norm for
    the clip, the logged loss); 0 on one rank. A profile measured on this many ranks gives its own timing
    of one (0 when measured before it was timed); presets and other rank counts the link fit at 8 bytes.
    The fit's intercept is not used for measured ranks: fitted from 4 KiB up, it does not extrapolate
    down to 8 bytes, and on CPU it is far above what one scalar all-reduce takes."""
    if world <= 1:
        return 0.0
    if profile.source == "measured" and world == int(profile.settings.get("ranks", 0)):
        one = profile.step_sync_s
    else:
        used = (links.tp, links.pp, links.dp, links.cp)
        link = next((c for c in ("inter_leaf", "inter_node") if c in used), "intra_node")
        one = profile.collective_time("all_reduce", 8.0, world, link)
    return 2.0 * one * profile.correction("optimizer")
