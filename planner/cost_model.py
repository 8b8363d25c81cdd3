"""Cost model (DESIGN.md §5): one function per term, each citing its source, fed only by Profile queries.

The search turns a candidate (mesh shape, micro-batching, schedule, ZeRO level, recompute mode,
placement) into a `StageProblem`: per-layer and per-stage coefficients that are linear in the layer →
stage assignment and the per-stage recompute counts. `evaluate` computes the predicted iteration time
and memory of one partition from those coefficients; the ILP (planner/ilp.py) optimises exactly the same
expressions, and the brute-force tests compare the two.

Units: per-stage times here are seconds per micro-batch (the plan JSON multiplies them by m: seconds per
iteration, as `plan show` reads them); the tail terms (gradient sync, optimizer step) are seconds per
iteration; memory is bytes per device.

Assumptions (documented once here):
- Model state (ZeRO, Rajbhandari et al. SC'20, §3): mixed precision (bf16/fp16) Adam keeps a 16-bit
  parameter (2 B), an fp32 gradient (4 B, `grad_bytes`) and fp32 master copy + 2 moments (12 B) = 18 B/param;
  fp32 Adam keeps parameter 4 + gradient 4 + 2 moments 8 = 16 B/param with no master copy. ZeRO-1 shards
  the optimizer over dp, ZeRO-2 also the gradients, ZeRO-3 also the parameters. Gradients are fp32 because
  the executor accumulates and reduces them in fp32 (executor/parallelize.apply_dp: MixedPrecisionPolicy
  reduce_dtype=float32; FSDP2 upcasts gradients it accumulates without reducing, torch _fsdp_param.py
  to_accumulated_grad_if_needed), as Megatron-LM forces for bf16 ("bfloat16 requires gradient accumulation
  and all-reduce to be done in fp32", megatron/training/arguments.py), DeepSpeed's BF16_Optimizer reduces
  its fp32 gradients (runtime/pipe/engine.py _bf16_reduce_grads) and Llama 3 reduce-scatters in FP32
  (arXiv:2407.21783 §3.3.4). The data-parallel gradient reduction moves `grad_bytes` per element.
- All layers' parameters (vocab-parallel embedding and head included) are split over tp; the few norm
  weights that TP replicates are neglected.
- ZeRO-3 gathers two layers' parameters at a time (current + prefetch), the workspace term below.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from meshplan.planner.model_spec import ModelSpec, vocab_shard, wrapped_unit_params
from meshplan.profiler.analytic import DTYPE_BYTES, layer_forward_flops

# (parameter, gradient, optimizer) bytes per parameter; see the module docstring.
STATE_BYTES = {"bf16": (2.0, 4.0, 12.0), "fp16": (2.0, 4.0, 12.0), "fp32": (4.0, 4.0, 8.0)}


@dataclass(frozen=True)
class Candidate:
    """One point of the outer search space. `order` is the mesh placement, outermost dim first."""

    dp: int
    tp: int
    pp: int
    v: int
    schedule: str
    b: int
    m: int
    zero: int
    recompute: str  # none | selective | full (the mode; the ILP picks how many blocks per stage)
    recompute_pinned: bool = False  # True: every block uses `recompute` (the user pinned --recompute)
    order: tuple[str, ...] = ("pp", "dp", "tp")
    cp: int = 1  # context parallelism (planner/cost_cp.py): each rank holds s/cp tokens of every sequence
    cp_mode: str = "ring"  # ring | all-gather | all-to-all
    ep: int = 1  # expert parallelism (planner/cost_ep.py), carved out of dp x cp
    expert_tp: int = 1  # 1 or tp: the experts' tensor-parallel degree

    @property
    def num_stages(self) -> int:
        return self.pp * self.v


# ---------------------------------------------------------------------------------------------------
# Terms. Each takes Profile queries (or closed forms) and returns seconds or bytes.
# ---------------------------------------------------------------------------------------------------

def compute_time(profile, kind: str, b: int, s: int, tp: int) -> tuple[float, float]:
    """(forward, backward) s of one layer per micro-batch — measured by the profiler, or FLOPs /
    (peak × efficiency) for presets (Narayanan et al. SC'21: backward ≈ 2× forward)."""
    fwd, bwd = profile.layer_time(kind, b, s, tp)
    k = profile.correction("compute")
    return fwd * k, bwd * k


def recompute_time(profile, kind: str, b: int, s: int, tp: int, mode: str) -> float:
    """Extra forward work in backward: full = one forward (Chen et al. 2016; Narayanan et al. SC'21),
    selective = the attention core only (Korthikanti et al. 2022, §5)."""
    return profile.recompute_time(kind, b, s, tp, mode) * profile.correction("compute")


def tp_comm_time(profile, kind: str, b: int, s: int, h: int, tp: int, dtype: str, mode: str) -> float:
    """TP collectives per micro-batch (Shoeybi et al. 2019, §3): a block does 2 all-reduces of b·s·h in
    forward and 2 in backward (with sequence parallelism the same volume as all-gather + reduce-scatter
    pairs, Korthikanti et al. 2022 §4.2.2); full recompute repeats the 2 forward ones, torchtitan's selective
    policies (profiler/roofline.SELECTIVE) one on average: every second block repeats both, or every block
    its two all-gathers (half an all-reduce each; reduce-scatter outputs are kept). The vocab-parallel
    embedding reduces once in forward, the head's input gradient once in backward. Zero when the profiler
    timed the layer tensor-parallel across ranks: its time includes them."""
    if tp <= 1 or profile.tp_collectives_measured(kind, tp):  # then already in the layer's time
        return 0.0
    r = getattr(profile, "roofline", None)
    again = 2 if mode == "full" else 1 if mode == "selective" and r is not None and r.selective != "attention" else 0
    count = {"block": 4 + again, "embedding": 1, "head": 1}[kind]
    nbytes = b * s * h * DTYPE_BYTES[dtype]
    return count * profile.collective_time("all_reduce", nbytes, tp, "intra_node") * profile.correction("tp_comm")


def pp_comm_time(profile, b: int, s: int, h: int, tp: int, dtype: str, sequence_parallel: bool,
                 link_class: str) -> float:
    """One boundary per micro-batch: a stage sends its output forward and its input gradient backward,
    b·s·h values each (÷tp when sequence-parallel activations stay sharded), Narayanan et al. SC'21 §3.2.
    Returned per side of a boundary: each stage pays it once per neighbour; with a blocking pipeline engine
    (profiler/roofline.P2P) both transfers, whole."""
    r = getattr(profile, "roofline", None)
    blocking = r is not None and r.p2p == "blocking"
    nbytes = b * s * h * DTYPE_BYTES[dtype] / (tp if sequence_parallel and not blocking else 1)
    one = profile.collective_time("send_recv", nbytes, 2, link_class) * profile.correction("pp_comm")
    return 2 * one if blocking else one


def pipeline_stage_time(profile, hop: float, crossings: int, schedule: str, unfused: float = 0.0,
                        b: int | None = None) -> float:
    """Per stage and micro-batch: the pipeline's cost for a stage with `crossings` neighbours on other
    ranks. Measured in situ per schedule and crossing (torch.distributed.pipelining's bookkeeping, P2P
    and waits; zero-bubble's extra actions), else the link fit's `hop` per neighbour. 1F1B's figure is
    its steady state; the `unfused` share of its micro-batches pays GPipe's (see `unfused_share`). `b`:
    the micro-batch size, whose message the P2P carries."""
    overhead = profile.pipeline_overhead(schedule, b)
    if schedule == "1f1b" and unfused > 0:
        overhead = (1 - unfused) * overhead + unfused * profile.pipeline_overhead("gpipe", b)
    if overhead > 0:
        return overhead * profile.correction("pp_comm") * crossings
    return hop * crossings


def pipeline_busy_wait(profile, schedule: str, unfused: float = 0.0, b: int | None = None) -> tuple[float, float]:
    """Per crossing and micro-batch, (the rank's own work, the wait on the hop) within 1F1B's in-situ
    figure, for the shared-core simulation; (0, 0) for other schedules or unmeasured profiles (their
    figure is all the rank's work). In the in-situ pairs GPipe streams its micro-batches, so its figure
    is one side's bookkeeping per micro-batch; 1F1B's steady state alternates forward and backward, so
    each micro-batch waits a round trip with both sides' bookkeeping in series. A 1F1B crossing is then
    GPipe's work on each side and, on the hops, its figure beyond twice GPipe's: that part is waiting, not
    work, and the simulation waits there only where the real order makes it wait."""
    if schedule != "1f1b":
        return 0.0, 0.0
    gpipe, steady = profile.pipeline_overhead("gpipe", b), profile.pipeline_overhead("1f1b", b)
    if gpipe <= 0 or steady <= 0:
        return 0.0, 0.0
    corr = profile.correction("pp_comm")
    return gpipe * corr, (1 - unfused) * max(0.0, steady - 2 * gpipe) * corr


def pipeline_stage_split(profile, hop: float, crossings: int, schedule: str, unfused: float = 0.0,
                         b: int | None = None) -> tuple[float, float, float]:
    """(`pipeline_stage_time`, the part of it that is not the stage's own work in the shared-core
    simulation, the wait per crossing it puts on the hops instead): the one rule for build_problem's
    boundaries and Search.bounds' sums."""
    t = pipeline_stage_time(profile, hop, crossings, schedule, unfused, b)
    busy, wait = pipeline_busy_wait(profile, schedule, unfused, b)
    return t, (max(0.0, t - busy * crossings) if busy > 0 else 0.0), wait


def unfused_share(schedule: str, pp: int, m: int, rank: int) -> float:
    """Share of a 1F1B rank's micro-batches outside the steady state. Schedule1F1B fuses each backward's
    send with the next forward's receive (and the reverse) only in its 1B1F phase; the min(m, pp − rank)
    warm-up forwards and their cool-down backwards send and receive one by one, as GPipe does
    (torch/distributed/pipelining/schedules.py). With m ≤ pp − rank the whole step is GPipe's."""
    if schedule != "1f1b" or m < 1:
        return 0.0
    return min(m, pp - rank) / m


def split_backward_factor(profile, schedule: str, b: int) -> float:
    """Zero-bubble schedules split every backward into input- and weight-grad passes; what that costs
    over the whole backward, measured on the cut model (1 for other schedules or when not measured)."""
    return profile.split_backward_factor(b) if schedule == "zero-bubble" else 1.0


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


def grad_bytes(profile, dtype: str) -> float:
    """Bytes per gradient element held and reduced over data parallelism: fp32 training's 4 whatever
    the software; in mixed precision the software's (a preset's roofline), else the executor's fp32
    (module docstring)."""
    r = getattr(profile, "roofline", None)
    return float(r.grad_bytes) if r is not None and dtype != "fp32" else STATE_BYTES["fp32"][1]


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


def grad_sync(cand: Candidate) -> GradSync:
    """ZeRO-2/3 without pipelining reduce-scatter every micro-batch, so gradients stay sharded (as DeepSpeed
    and torchtitan run them). ZeRO-0/1 reduce once after the last micro-batch (DDP's no_sync), and so
    does every pipelined plan: torch.distributed.pipelining skips the reduction until a stage's last
    backward."""
    every = cand.zero >= 2 and cand.pp == 1 and cand.dp * cand.cp > 1 and cand.m > 1
    return GradSync(full_grads=cand.m > 1 and not every, reductions=cand.m if every else 1,
                    gathers=2 * cand.m if cand.zero >= 3 else 1)


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


def _link_time(profile, ops: tuple[str, ...], params: float, dtype: str, dp: int, link_class: str) -> float:
    """`ops` over `params` elements: gradient reductions at `grad_bytes`, parameter gathers at `dtype`."""
    per = {"all_gather": DTYPE_BYTES[dtype]}
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
                 reductions: int = 1) -> float:
    """Data-parallel traffic per iteration for one unit of `params` (already ÷tp): `dp_ops` once, and its
    gradient reduction (the first op) `reductions` times in all (`GradSync`); scaled by the engine's
    in-situ factor when the profiler measured it (then it is the exposed time: see `unhidden_share`)."""
    if dp <= 1:
        return 0.0
    ops, _ = dp_ops(zero, grad_reduce_op(profile))
    t = _link_time(profile, ops, params, dtype, dp, link_class) + \
        (reductions - 1) * _link_time(profile, ops[:1], params, dtype, dp, link_class)
    k = in_situ_factor(profile, zero)
    return t * (k if k is not None else 1.0) * profile.correction("dp_comm")


def sharded_dp_time(profile, params: float, dtype: str, dp: int, zero: int, link_class: str) -> float:
    """Data-parallel cost of one unit every micro-batch: the engine's hooks and, under ZeRO-3, the two
    parameter gathers (`dp_ops`). Measured in situ when the profiler could (exposed, per unit), else the
    link fit's gathers, overlapped with compute in `evaluate`."""
    if dp <= 1:
        return 0.0
    w = profile.wrapper(zero)
    if w is not None:
        return w.hook_s * profile.correction("dp_comm")
    _, ops = dp_ops(zero)
    return _link_time(profile, ops, params, dtype, dp, link_class) * profile.correction("dp_comm")


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


def bubble_micro_batches(schedule: str, pp: int, v: int, zb_ratio: float) -> float:
    """Idle time of the bottleneck rank, in micro-batch times: (p−1) for GPipe and 1F1B (Huang et al.
    2019; Narayanan et al. SC'21), (p−1)/v interleaved (Narayanan et al. SC'21 §2.2), and for zero-bubble
    the ZB-H1 bubble (p−1)·(T_F + T_B − T_W)/(T_F + T_B + T_W) (Qi et al. 2023, §3), ≈ (p−1)/3 when the
    backward splits evenly into input gradient B and weight gradient W."""
    if pp <= 1:
        return 0.0
    if schedule in ("gpipe", "1f1b"):
        return float(pp - 1)
    if schedule == "interleaved-1f1b":
        return (pp - 1) / v
    if schedule == "zero-bubble":
        return (pp - 1) * zb_ratio
    raise ValueError(f"unknown schedule {schedule!r}")


def zb_ratio(forward: float, backward: float) -> float:
    """(T_F + T_B − T_W)/(T_F + T_B + T_W) with B = W = backward/2 (Qi et al. 2023, Table 1)."""
    total = forward + backward
    return forward / total if total > 0 else 1.0 / 3.0


def in_flight(schedule: str, pp: int, v: int, m: int, rank: int) -> float:
    """Micro-batches of a rank's layers whose activations are alive at the peak, as a multiple of one
    micro-batch of all the rank's layers.
    GPipe: all m (Huang et al. 2019). 1F1B: pp − rank (Narayanan et al. SC'21 §2.2). Interleaved:
    Megatron-LM's warm-up 2·(pp − rank − 1) + (v − 1)·pp + 1 chunk micro-batches spread over v chunks
    (= pp·(1 + (pp−1)/(pp·v)) on rank 0, Korthikanti et al. 2022 §4.2.3). Zero-bubble V (ZB-V): pp
    micro-batches on every rank, the 1F1B peak (Qi et al. 2023, §4)."""
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(pp - rank, m))
    if schedule == "interleaved-1f1b":
        return min(2 * (pp - rank - 1) + (v - 1) * pp + 1, m * v) / v
    if schedule == "zero-bubble":
        return float(min(pp, m))
    raise ValueError(f"unknown schedule {schedule!r}")


def state_bytes_per_param(dtype: str, zero: int, dp: int, accumulating: bool = False,
                          grad: float | None = None) -> tuple[float, float, float]:
    """(parameter, gradient, optimizer) bytes per parameter on one device under ZeRO level `zero`, at the
    activation peak of a step as the executor runs it. FSDP2 (ZeRO ≥ 1, dp > 1) keeps each parameter's
    fp32 shard, and below ZeRO-3 also the gathered parameter for the whole step (ZeRO-3 gathers it per
    unit and frees it: `gather_workspace`); with mixed precision the shard is the master copy already in
    the 12 optimizer bytes, in fp32 it adds p/dp. Micro-batches
    that skip the reduction keep unsharded gradients (torch FSDPParamGroup.post_backward), so where the
    reduction waits for the last micro-batch (`accumulating`: `GradSync.full_grads`) ZeRO-2/3 hold full
    gradients too. ZeRO-0 (`replicate`, FSDP2's engine on a replicated mesh) keeps a whole fp32 copy as
    its shard and the gathered parameter, so ZeRO-0 holds about as much parameter memory as ZeRO-1 (one
    fp32 copy more than plain DDP would). `grad`: bytes per gradient element where the software's differ
    from the executor's (`grad_bytes`)."""
    p, g, o = STATE_BYTES[dtype]
    g = g if grad is None else grad
    if dp <= 1:
        return p, g, o
    shards = dp if zero >= 1 else 1  # replicate: FSDP2's engine over one shard, the whole parameter
    shard = p / shards if dtype == "fp32" else 0.0
    params = shard if zero >= 3 else p + shard  # ZeRO-3 gathers 16-bit parameters per unit (gather_workspace)
    return params, (g / shards if zero >= 2 and not accumulating else g), o / shards


@dataclass
class Workspace:
    """Transient bytes on top of the state and the activations, in the three moments of a step that
    can set a rank's peak (found with the executor's CPU memory tracking; which one wins depends on the
    plan):
    `act[r]`: at the last stage's first backward, with every in-flight micro-batch's activations alive:
    the loss backward (gradient of the log-softmax output and of the logits, b·s·V/t fp32 each: loss_fn
    upcasts; the loss is vocabulary-parallel, V/t per TP rank), or the logits' gradient plus a new LM-head
    weight gradient waiting to be accumulated.
    `emb[r]`: at the first stage's embedding backward, one micro-batch's activations already freed: the
    dense embedding gradient, which a tied head in the same module sums out of place with the head's
    (3 V·h tensors), or adds into the accumulated gradient (1; m = 1 untied: it is the gradient).
    `opt[r]` + Σ `per_layer` of the rank: AdamW's step, activations freed. The executor's AdamW is
    foreach on every device (executor.train.make_optimizer), which materialises sqrt(v) for a whole
    parameter group (4 B per local parameter)."""

    act: list[float]
    emb: list[float]
    opt: list[float]
    per_layer: list[float]


def loss_grad_16bit(profile) -> bool:
    """A preset whose loss backward allocates only the logits' 16-bit gradient (profiler/roofline.LOSS): a
    fused cross-entropy, or Megatron-LM's, which computes it in place in its kept fp32 softmax."""
    r = getattr(profile, "roofline", None)
    return r is not None and r.loss in ("fused", "megatron")


def step_transients(model: ModelSpec, cand: Candidate, s: int, dtype: str,
                    rank: list[int], loss_grad_16bit: bool = False) -> Workspace:
    """The Workspace of `cand` with stage k on pipeline rank rank[k] (executor/train.py's step); with
    `loss_grad_16bit` the loss backward allocates only the logits' 16-bit gradient."""
    tp, pp, S = cand.tp, cand.pp, cand.num_stages
    dp = cand.dp * cand.cp  # FSDP shards over dp x cp
    shards = dp if cand.zero >= 1 and dp > 1 else 1  # AdamW steps FSDP's shards
    local = tp * shards
    table = vocab_shard(model, tp) * model.hidden_size  # embedding / LM-head weight elements
    # a new gradient is in the compute dtype under FSDP2 (param_dtype), fp32 under autocast (one replica)
    grad = DTYPE_BYTES[dtype] if dp > 1 else 4.0
    tied_one = model.tied_embeddings and S == 1
    accumulating = cand.m > 1
    act, emb, opt = [0.0] * pp, [0.0] * pp, [0.0] * pp
    logits = cand.b * (s // cand.cp) * vocab_shard(model, tp) * 4.0  # a CP rank's logits: its s/cp tokens
    if loss_grad_16bit:  # its backward writes only the logits' gradient, in the compute dtype
        grad_logits = logits * DTYPE_BYTES[dtype] / 4.0
        act[rank[-1]] += grad_logits + (table * grad if accumulating or tied_one else 0.0)
    else:
        act[rank[-1]] += max(2.0 * logits, logits + (table * grad if accumulating or tied_one else 0.0))
    emb[rank[0]] += table * grad * (3 if tied_one else 1 if accumulating else 0)
    per_layer = [4.0 * layer.params / local for layer in model.layers]
    tied = sum(layer.tied_params for layer in model.layers if layer.kind == "head")
    if tied and S > 1:
        opt[rank[-1]] += 4.0 * tied / local
    return Workspace(act, emb, opt, per_layer)


def peak_memory(state: float, fixed: float, inflight: float, act: float, opt_layers: float, ws: Workspace,
                r: int, grads_idle: float = 0.0, later: tuple[tuple[float, float], ...] = (),
                emb_inflight: float | None = None) -> float:
    """A rank's peak: state and fixed bytes plus the largest of the three transient moments (Workspace);
    at the activation moment without the gradients not allocated yet (`grads_idle` share of the state;
    counting gradients that do not exist there would over-predict such plans by their size), and at
    each `later` moment (in-flight, share of the state not allocated) of `grad_moments`; the embedding's
    moment with `emb_inflight` micro-batches alive (`emb_in_flight`; one below the peak by default)."""
    acts = [state * (1.0 - idle) + n * act + ws.act[r] for n, idle in ((inflight, grads_idle), *later)]
    emb = max(inflight - 1.0, 0.0) if emb_inflight is None else emb_inflight
    return fixed + max(*acts, state + emb * act + ws.emb[r], state + opt_layers + ws.opt[r])


def _walk(schedule: str, pp: int, v: int, m: int, rank: int) -> tuple[tuple[tuple[float, float], ...], float]:
    return _walks(schedule, pp, v, m)[rank] if schedule == "zero-bubble" else _looped_moments(schedule, pp, v, m, rank)


def _looped_moments(schedule: str, pp: int, v: int, m: int, rank: int
                    ) -> tuple[tuple[tuple[float, float], ...], float]:
    """`_walks` in closed form for GPipe, 1F1B and interleaved 1F1B (tests check it against the walk).
    Before backward k the rank holds its peak N chunk micro-batches through the steady phase (S backwards),
    then one fewer per backward; backwards run chunk v−1 for a round of g micro-batches, then chunk v−2, …
    (ScheduleInterleaved1F1B's rounds, g = m // max(1, m // pp)). Chunk j's gradients appear at
    backward j·g, so the most activations seen with j + 1 chunks' gradients are those before backward
    j·g + 1 (or after j·g when it is the last)."""
    v = v if schedule == "interleaved-1f1b" else 1
    chunks, peak = m * v, round(in_flight(schedule, pp, v, m, rank) * v)
    steady = chunks - peak + 1
    group = m // max(1, m // pp) if v > 1 else m

    def alive(k: int) -> int:
        return peak - max(0, k - steady + 1)
    front = [(float(peak), 0.0)]
    for j in range(v):
        k = j * group
        n = alive(k + 1) if k + 1 < chunks else alive(k) - 1
        if n == front[-1][0]:
            front[-1] = (float(n), (j + 1) / v)
        else:
            front.append((float(n), (j + 1) / v))
    emb = alive((v - 1) * group) - 1
    return tuple((n / v, share) for n, share in front), emb / v


@functools.lru_cache(maxsize=1024)
def _walks(schedule: str, pp: int, v: int, m: int) -> list[tuple[tuple[tuple[float, float], ...], float]]:
    """Walk the rank's actions as torch.distributed.pipelining orders them (planner/schedule.rank_actions):
    a forward adds a chunk micro-batch of activations; the pass that ends a micro-batch's backward on a
    chunk (B; W under zero-bubble, whose input-grad I leaves the saved inputs for W) frees it, and the
    first such pass of a chunk allocates that chunk's gradients. Returns the Pareto front of (chunk
    micro-batches alive, gradient share) at the start and end of every freeing pass, most activations
    first, and the activations left after the first freeing pass of the rank's first chunk (the stage
    with the embedding on rank 0)."""
    from meshplan.planner.schedule import rank_actions  # schedule imports the plan types, not this module

    v = v if schedule in ("interleaved-1f1b", "zero-bubble") else 1
    frees = "W" if schedule == "zero-bubble" else "B"
    out = []
    for rank, order in enumerate(rank_actions(schedule, pp, v, m)):
        n, done, points, emb = 0, set(), [], None
        for act in order:
            if act.kind == "F":
                n += 1
            elif act.kind == frees:
                points.append((n, len(done) / v))
                done.add(act.stage)
                n -= 1
                points.append((n, len(done) / v))
                if emb is None and act.stage == rank:
                    emb = n
        front: list[tuple[float, float]] = []
        for k, share in sorted(set(points), key=lambda p: (-p[0], -p[1])):
            if not front or share > front[-1][1]:
                front.append((k / v, share))
        out.append((tuple(front), (emb or 0) / v))
    return out


@functools.lru_cache(maxsize=65536)
def grad_moments(schedule: str, pp: int, v: int, m: int, rank: int) -> tuple[tuple[float, float], ...]:
    """The moments of a rank's step that can set its peak, as (activations alive in `in_flight` units,
    share of the rank's gradients allocated), the activation peak first, dominated moments dropped. The
    executor frees gradients at every step (zero_grad(set_to_none=True)); a chunk's gradients appear with
    its first backward, which also frees that micro-batch's activations (`_walk`). The peak is
    `in_flight`'s (the walk's can be lower: ZB-V with m < 2pp − 1)."""
    front, _ = _walk(schedule, pp, v, m, rank)
    return ((in_flight(schedule, pp, v, m, rank), front[0][1]), *front[1:])


def emb_in_flight(schedule: str, pp: int, v: int, m: int, rank: int) -> float:
    """Activations alive (`in_flight` units) when the rank's first chunk ends its first backward (on rank
    0: the embedding's), every gradient of the rank allocated by then in every schedule: one micro-batch
    below the peak for 1F1B and GPipe."""
    return _walk(schedule, pp, v, m, rank)[1]


def grads_idle(state_bytes: tuple[float, float, float], moments: list[tuple[tuple[float, float], ...]]
               ) -> list[float]:
    """Per rank: the share of the (parameter, gradient, optimizer) bytes not yet allocated at the
    activation peak (`grad_moments`' first moment): the gradients not allocated there."""
    pb, gb, ob = state_bytes
    return [gb / (pb + gb + ob) * (1.0 - mo[0][1]) for mo in moments]


def later_moments(state_bytes: tuple[float, float, float], moments: list[tuple[tuple[float, float], ...]]
                  ) -> list[tuple[tuple[float, float], ...]]:
    """Per rank: the other moments of `grad_moments` as (in-flight, share of the state not allocated)."""
    pb, gb, ob = state_bytes
    g = gb / (pb + gb + ob)
    return [tuple((n, g * (1.0 - share)) for n, share in mo[1:]) for mo in moments]


def state_kept(idle: list[float]) -> float:
    """The least share of a rank's state it holds at every moment of its peak (`grads_idle` per rank):
    memory bounds scale state by it to stay below `peak_memory`."""
    return 1.0 - max(idle)


def gather_workspace(model: ModelSpec, tp: int, dtype: str) -> float:
    """ZeRO-3's gathered parameters: two layers at a time (current + prefetch)."""
    return 2.0 * max(layer.params for layer in model.layers) / tp * DTYPE_BYTES[dtype]


def fixed_bytes(pp: int, rank: list[int], tied_copy: float, workspace: float) -> list[float]:
    """Per rank, bytes no partition changes: ZeRO-3's `workspace` on every rank, and a tied head's copy
    (`tied_copy` bytes) in the last stage's module whenever the model is pipelined, also when a V puts
    that stage on rank 0 (executor/train.py builds one module per stage and sums the two gradients)."""
    fixed = [workspace] * pp
    if tied_copy and len(rank) > 1:
        fixed[rank[-1]] += tied_copy
    return fixed


def activation_bytes(profile, kind: str, b: int, s: int, tp: int, mode: str, sequence_parallel: bool) -> float:
    """Bytes a layer keeps for backward per micro-batch (Korthikanti et al. 2022, Eq. 2-6; the profiler
    measures, the formula is the fit's shape)."""
    return profile.activation_bytes(kind, b, s, tp, mode if kind == "block" else "none", sequence_parallel)


def model_flops_per_iteration(model: ModelSpec, global_batch: int, s: int) -> float:
    """3 × forward FLOPs (forward + 2× backward), no recompute: the MFU numerator (Chowdhery et al. 2022)."""
    return 3.0 * sum(layer_forward_flops(model, layer.kind, global_batch, s, 1) for layer in model.layers)


# ---------------------------------------------------------------------------------------------------
# The per-candidate problem: coefficients linear in the assignment, shared by the ILP and `evaluate`.
# ---------------------------------------------------------------------------------------------------

@dataclass
class StageProblem:
    """Everything the stage partition + recompute choice depends on, for one candidate.

    Per layer l: `time` = forward + backward + TP comm per micro-batch; `fwd`, `bwd`; `act` bytes per
    micro-batch without recompute; `state` bytes of parameters + gradients + optimizer; `opt` and `dp`
    seconds per iteration; `gather` data-parallel seconds per micro-batch (hooks, ZeRO-3 gathers). Per
    block: `rec_time` and `rec_saving` when recomputed. Per stage: `boundary` PP comm per micro-batch
    (plus the stage root unit's data-parallel hooks when measured) and `rank`. Per rank: `inflight`
    multiplier and `fixed` bytes (tied copy, ZeRO-3 workspace).
    """

    kinds: list[str]
    time: list[float]
    fwd: list[float]
    bwd: list[float]
    act: list[float]
    state: list[float]
    opt: list[float]
    dp: list[float]
    gather: list[float]
    rec_time: float
    rec_saving: float
    rec_tp: float  # TP comm added per recomputed block (already in rec_time; kept for the report)
    boundary: list[float]
    rank: list[int]
    pp: int
    inflight: list[float]
    fixed: list[float]
    mem_limit: float
    weight: float  # m + bubble micro-batches
    bubble: float  # bubble micro-batches
    m: int
    unhidden: float  # share of DP traffic that can never overlap (the last bucket; 1: measured exposed)
    recompute: str  # "free": 0..n per stage; "none"; "all"
    ws: Workspace  # the step's transient bytes (peak_memory)
    grads_idle: list[float]  # per rank: share of `state` not yet allocated at the activation peak
    later: list[tuple[tuple[float, float], ...]]  # per rank: later_moments
    emb_inflight: list[float]  # per rank: emb_in_flight
    cuts: list[bool] = field(default_factory=list)  # cuts[l]: a stage may start at layer l (l ≥ 1)
    # per stage: the part of `boundary` that is not the stage's own work in the shared-core simulation,
    # and the wait it puts on each hop instead (cost_model.pipeline_busy_wait); empty: none
    boundary_relief: list[float] = field(default_factory=list)
    hop_wait: list[float] = field(default_factory=list)
    step_sync: float = 0.0  # seconds per iteration on every rank: the step's scalar all-reduces (step_sync_time)
    # share of the GPU that overlapped collectives take from compute while they run (`overlap_tax`)
    overlap_tax: float = 0.0

    @property
    def state_kept(self) -> float:
        return state_kept(self.grads_idle)

    @property
    def num_layers(self) -> int:
        return len(self.kinds)

    @property
    def num_stages(self) -> int:
        return len(self.rank)

    def uniform_blocks(self) -> bool:
        """Blocks identical and laid out embedding, blocks…, head with every cut allowed: then block
        counts per stage determine the plan and the count ILP is the same problem."""
        kinds = self.kinds
        if len(kinds) < 3 or kinds[0] != "embedding" or kinds[-1] != "head" or \
                any(k != "block" for k in kinds[1:-1]) or not all(self.cuts[1:]):
            return False
        blocks = range(1, len(kinds) - 1)
        return all(
            all(math.isclose(arr[i], arr[1], rel_tol=1e-12, abs_tol=0.0) for i in blocks)
            for arr in (self.time, self.fwd, self.bwd, self.act, self.state, self.opt, self.dp, self.gather,
                        self.ws.per_layer)
        )

    def key(self) -> tuple:
        """Identical sub-problems (many candidates share one) hash equal."""
        return (tuple(self.kinds), tuple(self.time), tuple(self.fwd), tuple(self.bwd), tuple(self.act),
                tuple(self.state), tuple(self.opt), tuple(self.dp), tuple(self.gather), self.rec_time,
                self.rec_saving, tuple(self.boundary), tuple(self.rank), tuple(self.inflight),
                tuple(self.fixed), self.mem_limit, self.weight, self.unhidden, self.recompute, tuple(self.cuts),
                tuple(self.ws.act), tuple(self.ws.emb), tuple(self.ws.opt), tuple(self.ws.per_layer),
                tuple(self.grads_idle), tuple(self.later), tuple(self.emb_inflight), tuple(self.boundary_relief),
                tuple(self.hop_wait),
                self.step_sync)


@dataclass
class StageResult:
    forward: float
    backward: float
    recompute: float
    communication: float
    total: float  # per micro-batch
    dp_sync: float  # exposed, per iteration (the rank's)
    optimizer: float  # per iteration (the rank's)
    parameters: float
    gradients: float
    optimizer_state: float
    activations: float
    memory_total: float  # the rank's (all its stages)
    workspace: float = 0.0  # the rank's peak above its state, fixed bytes and in-flight activations
    relief: float = 0.0  # per micro-batch: part of `communication` that is not the stage's own work
    hop_wait: float = 0.0  # per micro-batch and hop direction: the wait the simulation puts there


@dataclass
class Evaluation:
    iteration_time: float
    stage_time_max: float  # the bottleneck rank's time per micro-batch
    tail: float
    rank_memory: list[float]
    feasible: bool
    stages: list[StageResult]


def rank_of_stages(problem: StageProblem) -> list[list[int]]:
    ranks: list[list[int]] = [[] for _ in range(problem.pp)]
    for s, r in enumerate(problem.rank):
        ranks[r].append(s)
    return ranks


def evaluate(problem: StageProblem, bounds: list[int], recompute: list[int],
             state_split: tuple[float, float, float] = (1.0, 0.0, 0.0)) -> Evaluation:
    """Predicted iteration time and per-rank memory of one partition: stage s holds layers
    [bounds[s], bounds[s+1]) and recomputes `recompute[s]` of its blocks.

    iteration = (m + bubble) · max_rank τ_rank + max_rank tail_rank, with τ_rank the rank's time per
    micro-batch (all its stages, plus the sharded-DP traffic it cannot hide: max(gather − compute,
    unhidden · gather), prefetching across the rank's layers) and tail_rank = optimizer + exposed
    gradient sync, exposed = max(sync − one micro-batch of the rank's backward, unhidden · sync) (the
    last bucket cannot overlap). A rank's memory is its state, fixed bytes and the largest transient
    moment of `peak_memory`."""
    P = problem
    rows = []
    for s in range(P.num_stages):
        layers = range(bounds[s], bounds[s + 1])
        r = recompute[s]
        rows.append(dict(
            f=sum(P.fwd[i] for i in layers), g=sum(P.bwd[i] for i in layers),
            base=sum(P.time[i] for i in layers) + r * P.rec_time + P.boundary[s],
            gather=sum(P.gather[i] for i in layers), rec=r * P.rec_time,
            act=sum(P.act[i] for i in layers) - r * P.rec_saving, state=sum(P.state[i] for i in layers),
            opt=sum(P.opt[i] for i in layers), dp=sum(P.dp[i] for i in layers),
            opt_ws=sum(P.ws.per_layer[i] for i in layers)))
    ranks = rank_of_stages(P)
    tau, tails, mem, z3 = [], [], [], []
    for r, stages in enumerate(ranks):
        gather = sum(rows[s]["gather"] for s in stages)
        compute = sum(rows[s]["f"] + rows[s]["g"] for s in stages)
        z3.append(max(gather - compute, P.unhidden * gather) if gather > 0 else 0.0)
        # hidden gathers still slow the compute they overlap (overlap_tax of it while they run)
        z3[r] += P.overlap_tax * (gather - z3[r]) if gather > 0 else 0.0
        tau.append(sum(rows[s]["base"] for s in stages) + z3[r])
        sync = sum(rows[s]["dp"] for s in stages)
        exposed = max(sync - sum(rows[s]["g"] for s in stages), P.unhidden * sync)
        exposed += P.overlap_tax * (sync - exposed)
        tails.append((exposed, sum(rows[s]["opt"] for s in stages) + P.step_sync))
        mem.append(peak_memory(sum(rows[s]["state"] for s in stages), P.fixed[r], P.inflight[r],
                               sum(rows[s]["act"] for s in stages), sum(rows[s]["opt_ws"] for s in stages), P.ws, r,
                               P.grads_idle[r], P.later[r], P.emb_inflight[r]))
    tau_max, tail = max(tau), max(e + o for e, o in tails)
    results = []
    p_frac, g_frac, o_frac = state_split
    for s, row in enumerate(rows):
        r = P.rank[s]
        stages = ranks[r]
        gather_r = sum(rows[k]["gather"] for k in stages)
        share = row["gather"] / gather_r if gather_r > 0 else 0.0
        total = row["base"] + z3[r] * share
        n_r = len(stages)
        results.append(StageResult(
            forward=row["f"], backward=row["g"], recompute=row["rec"],
            communication=total - row["f"] - row["g"] - row["rec"], total=total,
            dp_sync=tails[r][0] / n_r, optimizer=tails[r][1] / n_r,
            parameters=row["state"] * p_frac + P.fixed[r] / n_r, gradients=row["state"] * g_frac,
            optimizer_state=row["state"] * o_frac, activations=P.inflight[r] * row["act"], memory_total=mem[r],
            workspace=(mem[r] - P.fixed[r] - sum(rows[k]["state"] + P.inflight[r] * rows[k]["act"] for k in stages))
            / n_r,
            relief=P.boundary_relief[s] if P.boundary_relief else 0.0,
            hop_wait=P.hop_wait[s] / 2 if P.hop_wait else 0.0))
    iteration = P.weight * tau_max + tail
    return Evaluation(iteration, tau_max, tail, mem, max(mem) <= P.mem_limit * (1 + 1e-9), results)


# ---------------------------------------------------------------------------------------------------
# Building the problem from a candidate.
# ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Links:
    """Link class of each parallel dimension's worst group under a placement (planner/placement.py)."""

    tp: str
    pp: str
    dp: str
    cp: str = "intra_node"
    ep: str = "intra_node"  # the worst EP group's class (planner/cost_ep.ep_link)
    dp_local: int = 1  # fewest members of a dp x cp group inside one NVLink domain

    @property
    def dp_cp(self) -> str:
        """The flattened dp x cp group that averages gradients: the slower of the two groups' classes (the
        union of a dp group's cp groups stays inside whatever holds both)."""
        return next((c for c in ("inter_leaf", "inter_node") if c in (self.dp, self.cp)), "intra_node")

    @property
    def dp_cp_group(self) -> str:
        """`dp_cp`, with the members per NVLink domain when a spanning group has several ("inter_node/8"):
        NCCL then runs the collective hierarchically and all their NICs carry it (Profile.collective_time)."""
        link = self.dp_cp
        return f"{link}/{self.dp_local}" if link != "intra_node" and self.dp_local > 1 else link


class Terms:
    """Memoised per-kind and per-parameter-count terms: the search builds thousands of problems that
    share them (the Profile is queried once per distinct input)."""

    def __init__(self, model: ModelSpec, profile, seq_len: int, dtype: str):
        self.model, self.profile, self.s, self.dtype = model, profile, seq_len, dtype
        self.memo: dict[tuple, object] = {}

    def _get(self, key: tuple, fn):
        if key not in self.memo:
            self.memo[key] = fn()
        return self.memo[key]

    def kind(self, kind: str, b: int, tp: int, schedule: str = "1f1b") -> tuple[float, float, float, float]:
        """(forward, backward, TP comm, activation bytes) of one layer of `kind` per micro-batch, the
        backward as `schedule` runs it (split for zero-bubble)."""
        def make():
            f, g = compute_time(self.profile, kind, b, self.s, tp)
            g *= split_backward_factor(self.profile, schedule, b)
            c = tp_comm_time(self.profile, kind, b, self.s, self.model.hidden_size, tp, self.dtype, "none")
            return f, g, c, activation_bytes(self.profile, kind, b, self.s, tp, "none", tp > 1)
        return self._get(("kind", kind, b, tp, schedule == "zero-bubble"), make)

    def recompute(self, b: int, tp: int, mode: str) -> tuple[float, float, float]:
        """(extra time, activation bytes saved, extra TP comm) per recomputed block per micro-batch."""
        def make():
            if mode == "none" or not self.model.num_layers:
                return 0.0, 0.0, 0.0
            h = self.model.hidden_size
            _, _, c, a = self.kind("block", b, tp)
            rec_tp = tp_comm_time(self.profile, "block", b, self.s, h, tp, self.dtype, mode) - c
            rec = recompute_time(self.profile, "block", b, self.s, tp, mode) + rec_tp
            return rec, a - activation_bytes(self.profile, "block", b, self.s, tp, mode, tp > 1), rec_tp
        return self._get(("rec", b, tp, mode), make)

    def side_comm(self, b: int, tp: int, mode: str) -> dict[str, tuple[float, float]]:
        """{term: (seconds per block, seconds again per recomputed block)} per micro-batch of the
        communication other than tensor parallelism that `kind` counts in a block's communication value
        (context and expert parallel: CPTerms, planner/cost_ep.py), so that reports can tell them apart."""
        return {}

    def hop(self, b: int, tp: int, link: str) -> float:
        h = self.model.hidden_size
        return self._get(("hop", b, tp, link),
                         lambda: pp_comm_time(self.profile, b, self.s, h, tp, self.dtype, tp > 1, link))

    def per_layer(self, tp: int, dp: int, zero: int, link: str, sync: GradSync = GradSync(False, 1)
                  ) -> tuple[list, list, list, list]:
        """(state bytes, optimizer s, per-iteration DP sync s, per-micro-batch sharded DP s) of every layer."""
        def make():
            g = grad_bytes(self.profile, self.dtype)
            pb, gb, ob = state_bytes_per_param(self.dtype, zero, dp, sync.full_grads, g)
            by_params: dict[tuple, tuple] = {}
            out: tuple[list, list, list, list] = ([], [], [], [])
            in_situ = dp > 1 and self.profile.wrapper(zero) is not None
            for layer in self.model.layers:
                key = (layer.params, layer.kind == "block")
                if key not in by_params:
                    w = layer.params / tp
                    # in situ, the embedding's and head's hooks are the stage root's (root_hook_time)
                    per_mb = 0.0 if in_situ and layer.kind != "block" else \
                        sharded_dp_time(self.profile, w, self.dtype, dp, zero, link)
                    by_params[key] = (
                        w * (pb + gb + ob), optimizer_time(self.profile, w, dp, zero, tp)
                        + engine_copy_time(self.profile, w, self.dtype, dp, zero, sync),
                        dp_sync_time(self.profile, w, self.dtype, dp, zero, link, sync.reductions), per_mb)
                for lst, value in zip(out, by_params[key]):
                    lst.append(value)
            return out
        return self._get(("layer", tp, dp, zero, link, sync), make)


def crossings(rank: list[int], k: int) -> int:
    """Neighbours of stage k that live on another pipeline rank."""
    return int(k > 0 and rank[k - 1] != rank[k]) + int(k < len(rank) - 1 and rank[k + 1] != rank[k])


def build_problem(model: ModelSpec, profile, cand: Candidate, seq_len: int, dtype: str, links: Links,
                  mem_limit: float, cuts: list[bool], terms: Terms | None = None) -> StageProblem:
    """Coefficients of `cand` for every layer, stage and rank."""
    from meshplan.planner.cost_cp import add_cp_buffers, cp_terms
    from meshplan.planner.cost_ep import DEFAULT_IMBALANCE, add_ep_buffers, ep_terms
    from meshplan.planner.plan import stage_rank

    base = terms or Terms(model, profile, seq_len, dtype)
    imbalance = getattr(base, "moe_imbalance", DEFAULT_IMBALANCE)  # MoE models (planner/cost_ep.py)
    terms = ep_terms(cp_terms(base, cand.cp, cand.cp_mode, links.cp), cand, links.ep, imbalance)
    b, tp, pp, v, zero = cand.b, cand.tp, cand.pp, cand.v, cand.zero
    dp = cand.dp * cand.cp  # from here on: the ranks that average gradients and shard ZeRO state (dp x cp)
    kinds = [layer.kind for layer in model.layers]
    rows = {k: terms.kind(k, b, tp, cand.schedule) for k in set(kinds)}
    fwd = [rows[k][0] for k in kinds]
    bwd = [rows[k][1] for k in kinds]
    time = [rows[k][0] + rows[k][1] + rows[k][2] for k in kinds]
    act = [rows[k][3] for k in kinds]
    sync = grad_sync(cand)
    state, opt, dps, gather = terms.per_layer(tp, dp, zero, links.dp_cp_group, sync)
    rec_time, rec_saving, rec_tp = terms.recompute(b, tp, cand.recompute)
    S = cand.num_stages
    rank = [stage_rank(k, pp, cand.schedule, v) for k in range(S)]
    hop = terms.hop(b, tp, links.pp) if pp > 1 else 0.0
    root = root_hook_time(profile, dp, zero)
    splits = [pipeline_stage_split(profile, hop, crossings(rank, k), cand.schedule,
                                   unfused_share(cand.schedule, pp, cand.m, rank[k]), b) for k in range(S)]
    boundary = [root + t for t, _, _ in splits]
    inflight = [in_flight(cand.schedule, pp, v, cand.m, r) for r in range(pp)]
    moments = [grad_moments(cand.schedule, pp, v, cand.m, r) for r in range(pp)]
    state_bytes = state_bytes_per_param(dtype, zero, dp, sync.full_grads, grad_bytes(profile, dtype))
    tied = sum(layer.tied_params for layer in model.layers if layer.kind == "head")
    fixed = fixed_bytes(pp, rank, tied / tp * sum(state_bytes),
                        gather_workspace(model, tp, dtype) if zero >= 3 and dp > 1 else 0.0)
    bubble = bubble_micro_batches(cand.schedule, pp, v, zb_ratio(sum(fwd), sum(bwd)))
    recompute = "none" if cand.recompute == "none" else ("all" if cand.recompute_pinned else "free")
    return StageProblem(
        kinds=kinds, time=time, fwd=fwd, bwd=bwd, act=act, state=state, opt=opt, dp=dps, gather=gather,
        rec_time=rec_time, rec_saving=rec_saving, rec_tp=rec_tp, boundary=boundary, rank=rank, pp=pp,
        inflight=inflight, fixed=fixed, mem_limit=mem_limit, weight=cand.m + bubble, bubble=bubble, m=cand.m,
        unhidden=unhidden_share(profile, dp, zero, len(kinds), S), recompute=recompute, cuts=cuts,
        boundary_relief=[r for _, r, _ in splits], hop_wait=[w for _, _, w in splits],
        ws=add_ep_buffers(add_cp_buffers(step_transients(model, cand, seq_len, dtype, rank,
                                                         loss_grad_16bit(profile)),
                                         model, cand, seq_len, dtype), model, cand, seq_len, dtype, imbalance),
        grads_idle=grads_idle(state_bytes, moments), later=later_moments(state_bytes, moments),
        emb_inflight=[emb_in_flight(cand.schedule, pp, v, cand.m, r) for r in range(pp)],
        step_sync=step_sync_time(profile, dp * tp * pp, links), overlap_tax=overlap_tax(profile),
    )


def least_recompute(left: list[float], inflight: list[float], state: float, act: float, saving: float,
                    blocks: int) -> float:
    """Fewest recomputed blocks (fractional: a relaxation, so a lower bound) that let `blocks` blocks of
    `state` bytes and `act` activation bytes per in-flight micro-batch fit in the bytes `left` on each
    rank. A rank holds left/c0 blocks free (c0 = state + k·act); beyond that each block costs
    c0/(k·saving) recomputes, up to left/c1 (c1 = state + k·(act − saving)); cheapest ranks fill first."""
    free, extra = 0.0, []
    for x, k in zip(left, inflight):
        x = max(0.0, x)
        c0, c1 = state + k * act, state + k * (act - saving)
        free += x / c0 if c0 > 0 else float("inf")
        if k * saving > 0 and c1 > 0:
            extra.append((c0 / (k * saving), x / c1 - x / c0))
    need = blocks - free
    rec = 0.0
    for cost, room in sorted(extra):
        if need <= 0:
            break
        take = min(room, need)
        rec += take * cost
        need -= take
    return min(float(blocks), rec)


def min_recomputed_blocks(problem: StageProblem) -> float:
    """Fewest recomputed blocks any partition within memory needs (`least_recompute` with the cheapest
    block and the memory each rank has left after the embedding and head)."""
    P = problem
    if P.recompute == "none" or P.rec_saving <= 0 or not math.isfinite(P.mem_limit):
        return 0.0
    blocks = [i for i, k in enumerate(P.kinds) if k == "block"]
    if not blocks:
        return 0.0
    first, last = P.rank[0], P.rank[-1]
    left = [P.mem_limit - f for f in P.fixed]
    kept = P.state_kept
    for i, k in enumerate(P.kinds):
        if k != "block":
            r = first if i < blocks[0] else last
            left[r] -= P.state[i] * kept + P.inflight[r] * P.act[i]
    return least_recompute(left, P.inflight, min(P.state[i] for i in blocks) * kept,
                           min(P.act[i] for i in blocks), P.rec_saving, len(blocks))


def lower_bound(problem: StageProblem) -> float:
    """A bound no partition of this candidate beats: total work (with the least recompute memory
    allows, and ZeRO-3 gathers hidden at best behind all compute) spread evenly over the ranks and no
    shorter than the longest layer, plus the average tail."""
    P = problem
    gather = sum(P.gather)
    z3 = max(gather - sum(P.fwd) - sum(P.bwd), P.unhidden * gather) if gather > 0 else 0.0
    work = sum(P.time) + sum(P.boundary) - sum(P.boundary_relief) + z3  # relief: the simulation may hide it
    if P.recompute == "all":
        work += P.rec_time * sum(1 for k in P.kinds if k == "block")
    elif P.recompute == "free":
        work += P.rec_time * math.ceil(min_recomputed_blocks(P) - 1e-9)
    tau = max(work / P.pp, max(P.time))
    sync, bwd = sum(P.dp), sum(P.bwd)
    tail = (sum(P.opt) + max(sync - bwd, P.unhidden * sync)) / P.pp + P.step_sync
    return P.weight * tau + tail


def memory_lower_bound(problem: StageProblem) -> float:
    """Necessary condition for a partition within memory, as a ratio (≤ 1: may fit; > 1: cannot):
    with maximum recompute, the blocks must fit in what each rank has left after its fixed layers
    (relaxed to fractional blocks)."""
    P = problem
    saving = P.rec_saving if P.recompute != "none" else 0.0
    left = [P.mem_limit - f for f in P.fixed]
    first, last = P.rank[0], P.rank[-1]
    blocks = [i for i, k in enumerate(P.kinds) if k == "block"]
    first_block = blocks[0] if blocks else 1
    kept = P.state_kept
    for i, k in enumerate(P.kinds):  # embedding on the first stage's rank, head on the last's
        if k != "block":
            r = first if i < first_block else last
            left[r] -= P.state[i] * kept + P.inflight[r] * P.act[i]
    if min(left) < 0:
        return 1.0 + max(-x for x in left) / P.mem_limit + 1.0
    if not blocks:
        return 0.0
    per_block = min(P.state[i] for i in blocks) * kept
    act = min(P.act[i] for i in blocks) - saving
    capacity = sum(x / (per_block + P.inflight[r] * act) for r, x in enumerate(left))
    return len(blocks) / capacity if capacity > 0 else float("inf")
