"""Memory terms: model state per parameter, activations kept for backward, the transients of a step and a
rank's peak.

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
- Under an FP8 recipe (profiler/roofline.FP8) Transformer Engine caches each Linear's FP8 weight and its
  transpose for the step: 2 B per parameter of the blocks below ZeRO-3 (the embedding and the head stay
  16-bit: Megatron-Core builds them as plain embedding / ColumnParallelLinear, not TE modules); with ZeRO-3
  they live with the gathered unit and are not counted. Software that keeps FP8 parameters (roofline
  `fp8_params`: Megatron-Core's --fp8-param-gather with its distributed optimizer or FSDP, ZeRO >= 1) holds
  no 16-bit copy of a block's Linear weights: the FP8 weight and its transpose are the parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.planner.candidate import Candidate
from meshplan.planner.model_spec import ModelSpec, vocab_shard
from meshplan.profiler.analytic import DTYPE_BYTES

# (parameter, gradient, optimizer) bytes per parameter; see the module docstring.
STATE_BYTES = {"bf16": (2.0, 4.0, 12.0), "fp16": (2.0, 4.0, 12.0), "fp32": (4.0, 4.0, 8.0)}


def grad_bytes(profile, dtype: str) -> float:
    """Bytes per gradient element held and reduced over data parallelism: fp32 training's 4 whatever
    the software; in mixed precision the software's (a preset's roofline), else the executor's fp32
    (this module's docstring)."""
    r = getattr(profile, "roofline", None)
    return float(r.grad_bytes) if r is not None and dtype != "fp32" else STATE_BYTES["fp32"][1]


def fp8_weight_bytes(profile) -> float:
    """Bytes per parameter of the FP8 weight cache (module docstring): 2 under an FP8 recipe, else 0."""
    r = getattr(profile, "roofline", None)
    return 2.0 if r is not None and r.fp8 != "none" else 0.0


def fp8_params(profile, zero: int) -> bool:
    """A block's Linear weights kept in FP8 (module docstring): the software's setting under an FP8 recipe,
    with a sharded optimizer (Megatron-Core supports it with its distributed optimizer or FSDP only)."""
    r = getattr(profile, "roofline", None)
    return r is not None and r.fp8 != "none" and r.fp8_params and zero >= 1


def state_bytes_per_param(dtype: str, zero: int, dp: int, accumulating: bool = False,
                          grad: float | None = None, fp8_weights: float = 0.0, param: float | None = None,
                          opt: float | None = None) -> tuple[float, float, float]:
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
    from the executor's (`grad_bytes`); `param`: bytes of the working parameter where not the dtype's
    (0 with FP8 parameters, whose FP8 copies are `fp8_weights`); `opt`: optimizer bytes where the software's
    differ from the executor's 12 in mixed precision (profiler/roofline.py `opt_bytes`)."""
    p, g, o = STATE_BYTES[dtype]
    g = g if grad is None else grad
    p = p if param is None else param
    o = o if opt is None else opt
    if dp <= 1:
        return p + fp8_weights, g, o
    shards = dp if zero >= 1 else 1  # replicate: FSDP2's engine over one shard, the whole parameter
    shard = p / shards if dtype == "fp32" else 0.0
    params = shard if zero >= 3 else p + shard + fp8_weights  # ZeRO-3 gathers per unit (gather_workspace)
    return params, (g / shards if zero >= 2 and not accumulating else g), o / shards


def state_bytes(profile, dtype: str, zero: int, dp: int, accumulating: bool = False, block: bool = True
                ) -> tuple[float, float, float]:
    """`state_bytes_per_param` as the profile's software holds it: its gradient and optimizer bytes and, for a
    block's parameters (`block`), the FP8 weight cache, or FP8 parameters in place of the 16-bit ones."""
    fp8 = fp8_weight_bytes(profile) if block else 0.0
    param = 0.0 if block and fp8_params(profile, zero) else None
    r = getattr(profile, "roofline", None)
    opt = float(r.opt_bytes) if r is not None and dtype != "fp32" else None
    return state_bytes_per_param(dtype, zero, dp, accumulating, grad_bytes(profile, dtype), fp8, param, opt)


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


def regathered_input(profile, model: ModelSpec, cand: Candidate, s: int, dtype: str) -> float:
    """Bytes of one Linear input gathered again in backward under sequence parallelism (the executor,
    executor/parallelize.keep_input_shard, and Megatron-LM's gather buffer: profiler/roofline activations
    "sharded"): a rank's b·(s/cp)·h, alive beside the first backward's other transients."""
    r = getattr(profile, "roofline", None)
    if cand.tp <= 1 or (r is not None and not (r.sequence_parallel and r.activations == "sharded")):
        return 0.0
    return cand.b * (s // cand.cp) * model.hidden_size * DTYPE_BYTES[dtype]


def step_transients(model: ModelSpec, cand: Candidate, s: int, dtype: str,
                    rank: list[int], loss_grad_16bit: bool = False, regathered: float = 0.0) -> Workspace:
    """The Workspace of `cand` with stage k on pipeline rank rank[k] (executor/train.py's step); with
    `loss_grad_16bit` the loss backward allocates only the logits' 16-bit gradient; `regathered`: the
    bytes of an input gathered again at each rank's first backward (`regathered_input`)."""
    tp, pp, S = cand.tp, cand.pp, cand.num_stages
    dp = cand.dp * cand.cp  # FSDP shards over dp x cp
    shards = dp if cand.zero >= 1 and dp > 1 else 1  # AdamW steps FSDP's shards
    local = tp * shards
    table = vocab_shard(model, tp) * model.hidden_size  # embedding / LM-head weight elements
    # a new gradient is in the compute dtype under FSDP2 (param_dtype), fp32 under autocast (one replica)
    grad = DTYPE_BYTES[dtype] if dp > 1 else 4.0
    tied_one = model.tied_embeddings and S == 1
    accumulating = cand.m > 1
    act, emb, opt = [regathered] * pp, [0.0] * pp, [0.0] * pp
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
