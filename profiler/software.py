"""How the training software runs on a GPU, for the preset model (profiler/roofline.py): named settings of
`presets.device_roofline`, so that `plan --software NAME` predicts the engine a plan will run on (the
executor by default; `plan export` hands plans to the others). Facts about each software, from its code
or papers, not fitted values:

- attention: Megatron-LM and Megatron-DeepSpeed in 2021-22 computed it unfused, with a fused
  scale-mask-softmax and dropout on the b·a·s² probabilities (Korthikanti et al. 2022 §4.1, Eq. 1 counts
  those tensors); Megatron-Core runs Transformer Engine's fused attention, torchtitan and the executor
  torch's flash SDPA.
- activations: Megatron-LM keeps sequence-parallel activations as shards and gathers them again in
  backward behind the input-gradient GEMM (Korthikanti et al. 2022 Eq. 5), and Megatron-Core's fused
  SwiGLU keeps its input only; the executor keeps the same, its gather in backward started when the
  module's output gradient arrives (executor/parallelize.keep_input_shard); torch's SequenceParallel as
  torchtitan runs it keeps the gathered input of the column-parallel Linears. Sequence parallelism came
  with Korthikanti et al. 2022.
- gradient reduction: Megatron-LM's local DDP of 2021-22 all-reduces after the whole backward (SC'21's
  artifact examples/sc21/run_table_1.sh runs DDP=local from 39B up, torch's overlapping DDP below it;
  --overlap-grad-reduce came in 2023), as does
  DeepSpeed's pipeline engine after the last micro-batch (runtime/pipe/schedule.py TrainSchedule:
  ReduceGrads at the final step); its BF16_Optimizer all-reduces the whole fp32 gradients before stepping
  its shard (runtime/pipe/engine.py _bf16_reduce_grads).
- gradient bytes: Megatron-LM in fp16 keeps and all-reduces 16-bit gradients (its default); in bf16 it
  forces fp32 accumulation and reduction (megatron/training/arguments.py), as DeepSpeed's BF16_Optimizer,
  FSDP with an fp32 reduce dtype and the executor do: 4 bytes. Megatron-Bridge's performance recipes keep and
  reduce them in bf16 (perf_recipes/_common.py and scripts/performance/configs: grad_reduce_in_fp32 = False;
  Megatron-LM's --grad-reduce-in-bf16): 2 bytes.
- gradient accumulation (grad_accum_bytes, per weight per micro-batch): Megatron-LM's local DDP of 2021
  adds each micro-batch's gradient into its buffer in a hook, main_grad.add_(grad) (megatron/model/
  distributed.py since b4bc51b1e7, 2021-03), 16-bit in fp16: read 2 + 2, write 2; in bf16 into the fp32
  buffer: read 2 + 4, write 4. DeepSpeed's fp16 engine leaves it to autograd's in-place add into the
  16-bit .grad: 6 bytes. Gradient accumulation
  fusion (the wgrad GEMM accumulating into main_grad, 83b1e42f30, 2022-02) removed the pass. DeepSpeed's
  BF16_Optimizer copies each micro-batch's bf16 gradient to fp32 and adds it (runtime/bf16_optimizer.py
  update_hp_grads, hp_grad.add_(lp.grad.to(fp32)) at 6719b46b, 2022-05): read 2, write 4, read 4 + 4,
  write 4 = 18 bytes.
- selective recompute: Megatron's attention core (Korthikanti et al. 2022 §4.2.2); torchtitan's per-op
  policy reruns every second matmul of a block (roofline.SELECTIVE).
- the loss (roofline.LOSS): Megatron-LM, its Megatron-Core and Megatron-DeepSpeed upcast the logits and run
  their vocab-parallel cross-entropy in fp32, pass by pass (megatron/core/tensor_parallel/cross_entropy.py;
  Megatron-Core's fused one is opt-in, --cross-entropy-loss-fusion); torchtitan and the executor run
  F.cross_entropy on the upcast logits. Megatron-Bridge's pretraining models fuse it
  (src/megatron/bridge/models/gpt_provider.py at 5776a6d90, 25.11: cross_entropy_loss_fusion = True) with
  Transformer Engine's kernel (scripts/performance/utils/overrides.py: cross_entropy_fusion_impl = "te"), as
  NeMo 2.3's performance scripts do (scripts/performance/utils.py set_primary_perf_configs at v2.3.1): "fused".
- pipeline transfers (roofline.P2P): DeepSpeed's pipeline engine sends each stage output and input
  gradient whole, in blocking calls (runtime/pipe/p2p.py); Megatron-LM pairs a send with a receive and
  scatters the stage output over tensor parallelism (SC'21 §4.1), torch's pipelining sends asynchronously.
- mixture-of-experts under expert tensor parallelism (roofline.MOE_DISPATCH): Megatron-Core's alltoall
  dispatcher, and the executor's, send each TP rank's sequence shard and gather the received rows over the
  expert-TP group.
- FP8 parameters (roofline fp8_params): NVIDIA's FP8 runs of Megatron-Core keep the blocks' weights in FP8
  and gather them so (Megatron-Bridge's FP8 mixed-precision configs set fp8_param_gather = True,
  src/megatron/bridge/training/mixed_precision.py; NeMo's DGX Cloud recipes +model.fp8_params); `plan
  export --format megatron` passes --fp8-param-gather.
- the data-parallel engine's copies (fsdp_copies): FSDP2 (torchtitan, the executor) copies parameters out
  of its all-gather buffer and gradients into its reduce buffer; Megatron-LM's DDP and distributed
  optimizer reduce and gather in the parameters' and gradients' own contiguous buffers; DeepSpeed's are
  not modelled.
"""

from __future__ import annotations

from meshplan.planner.errors import InputError

_MEGATRON_CORE = dict(activations="sharded", fsdp_copies=False, loss="megatron", fp8_params=True)
_MEGATRON_2022 = dict(attention="unfused", activations="sharded", grad_overlap=False, fsdp_copies=False,
                      loss="megatron")

SOFTWARE: dict[str, dict] = {
    # meshplan's executor (executor/): the preset model's defaults
    "meshplan": {},
    # torchtitan: the executor's stack (FSDP2, DTensor TP, flash SDPA) without its sharded Linear inputs; its
    # selective AC is the per-op policy
    "torchtitan": dict(selective="every-second-mm", activations="gathered"),
    # Megatron-Core (2023-): fused attention, shards kept, reduction overlapped, accumulation fused
    "megatron": _MEGATRON_CORE,
    # Megatron-Bridge's (NeMo 2's) performance recipes: Megatron-Core with gradients held and reduced in bf16
    # and Transformer Engine's fused cross-entropy
    "megatron-bridge": dict(_MEGATRON_CORE, grad_bytes=2, loss="fused"),
    # Megatron-LM as Korthikanti et al. 2022 ran it: unfused attention, reduction after the backward
    "megatron-2022": _MEGATRON_2022,
    # Megatron-LM as Narayanan et al. SC'21 ran it: no sequence parallelism, an accumulation pass of its own
    # (gradients: FP16 below)
    "megatron-2021": dict(_MEGATRON_2022, sequence_parallel=False, grad_accum_bytes=10),
    # Megatron-DeepSpeed on DeepSpeed's pipeline engine (BLOOM, MT-NLG; 2022): in bf16 its BF16_Optimizer
    "megatron-deepspeed-2022": dict(_MEGATRON_2022, grad_reduce="all_reduce", grad_accum_bytes=18, p2p="blocking"),
}
# In fp16 these keep 16-bit gradients and add them up in 16 bits
FP16 = {"megatron-2021": dict(grad_bytes=2, grad_accum_bytes=6),
        "megatron-deepspeed-2022": dict(grad_bytes=2, grad_accum_bytes=6)}


# What each engine can run, for the search (Constraints.engine_*; None: all the executor runs). Megatron-LM
# has no GPipe or zero-bubble schedule; its --cp-comm-type is p2p (ring), allgather or a2a, from Megatron-Core
# (2023; none before); ZeRO-2/3 as Megatron-FSDP, ZeRO-1 as --use-distributed-optimizer (2022; SC'21's
# artifact runs neither); selective recompute came with Korthikanti et al. 2022. DeepSpeed's pipeline engine
# runs 1F1B (runtime/pipe/schedule.py TrainSchedule) with ZeRO stage 0 or 1, and checkpoints whole blocks
# (deepspeed.checkpointing, no selective policy); Ulysses (2023) came after. Both checkpoint every block when
# they recompute (`engine_recompute_all`): Megatron-LM 2021's --checkpoint-activations runs all of a stage's
# layers in chunks of --checkpoint-num-layers (megatron/model/transformer.py _checkpointed_forward), DeepSpeed's
# PipelineModule every activation_checkpoint_interval layers; a count of blocks per stage came with Megatron-LM's
# --activations-checkpoint-method block (c1e0689d92, 2021-08, after SC'21's runs). torchtitan's context
# parallelism is torch's ring attention (rotate methods allgather or alltoall), not Ulysses.
# planner/export.py and export_cp.py name the same limits when a plan is exported.
_MEGATRON_SCHEDULES = ("1f1b", "interleaved-1f1b")
# Stage splits (planner/stage_split.py has the sources): Megatron-LM of 2021-22 gives every stage the same
# number of blocks; DeepSpeed's pipeline engine balances them by its partition_method
_MEGATRON_EVEN = dict(engine_stage_splits=("even",), engine_even_divides=True)
ENGINES: dict[str, dict] = {
    "meshplan": {},
    "torchtitan": dict(engine_cp_modes=("ring", "all-gather")),
    "megatron": dict(engine_schedules=_MEGATRON_SCHEDULES),
    "megatron-bridge": dict(engine_schedules=_MEGATRON_SCHEDULES),  # Megatron-Core's
    "megatron-2022": dict(engine_schedules=_MEGATRON_SCHEDULES, engine_zero=(0, 1), engine_cp_modes=(),
                          **_MEGATRON_EVEN),
    "megatron-2021": dict(engine_schedules=_MEGATRON_SCHEDULES, engine_zero=(0,), engine_cp_modes=(),
                          engine_recompute=("none", "full"), engine_recompute_all=True, **_MEGATRON_EVEN),
    "megatron-deepspeed-2022": dict(engine_schedules=("1f1b",), engine_zero=(0, 1), engine_cp_modes=(),
                                    engine_recompute=("none", "full"), engine_recompute_all=True,
                                    engine_stage_splits=("even", "even-ends")),
}


def engine_limits(name: str) -> dict:
    """Constraints fields (engine, engine_schedules, engine_zero, engine_cp_modes, engine_recompute,
    engine_recompute_all, engine_stage_splits, engine_even_divides) of the named software."""
    software_settings(name)  # the same one-line error for an unknown name
    return {"engine": name, **ENGINES[name]}


def software_settings(name: str, dtype: str = "bf16") -> dict:
    """`device_roofline` settings of the named training software in this training precision."""
    if name not in SOFTWARE:
        raise InputError(f"--software: unknown software {name!r}; expected one of {', '.join(SOFTWARE)}")
    return SOFTWARE[name] | (FP16.get(name, {}) if dtype == "fp16" else {}) | {"software": name}
