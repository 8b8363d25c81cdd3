"""`plan export PLAN.json --format megatron|torchtitan|deepspeed`: the plan as another engine's settings.

Each `to_*` function is pure: it returns the text and appends a one-line warning to `warnings` for every
plan feature the target cannot express (the CLI prints those on stderr). Field names were checked
against each project's own source and documentation (search, December 2026):

- Megatron-LM: megatron/training/arguments.py `_add_distributed_args` / `_add_training_args` (Megatron Core
  0.12+), `--pipeline-model-parallel-layout` from the Megatron Core developer guide "Custom Pipeline Model
  Parallel Layout" (0.15+ docs), Megatron-FSDP flags (`--use-megatron-fsdp`,
  `--data-parallel-sharding-strategy optim|optim_grads|optim_grads_params`) from its README.
- torchtitan 0.2.x: torchtitan/config/job_config.py JobConfig dataclasses (Training.local_batch_size /
  global_batch_size / seq_len / mixed_precision_param, Parallelism.* including module_fqns_per_model_part,
  ActivationCheckpoint.mode / selective_ac_option); schedule names are torch's get_schedule_class keys.
- DeepSpeed: docs/_pages/config-json.md (batch size, zero_optimization.stage, bf16/fp16.enabled),
  deepspeed/runtime/config.py get_pipeline_config ("pipeline" keys) and the AutoTP training docs
  ("tensor_parallel": {"autotp_size": N}).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence

from meshplan.planner.cli import _Parser
from meshplan.planner.errors import InputError
from meshplan.planner.export_cp import deepspeed_cp_config, megatron_cp_args, torchtitan_cp_degrees
from meshplan.planner.export_moe import deepspeed_moe_note, megatron_moe_args, torchtitan_moe_degrees
from meshplan.planner.plan import Plan, load_plan
from meshplan.planner.stage_split import split_bounds

FORMATS = ("megatron", "torchtitan", "deepspeed")


def _blocks(plan: Plan, start: int, end: int) -> list[int]:
    return [int(layer.name.split(".")[-1]) for layer in plan.model.layers[start:end] if layer.kind == "block"]


def _has(plan: Plan, start: int, end: int, kind: str) -> bool:
    return any(layer.kind == kind for layer in plan.model.layers[start:end])


def _partial_recompute(plan: Plan) -> list[str]:
    """Stages that recompute some but not all of their blocks under recompute=full."""
    out = []
    for s in plan.stages:
        n = len(_blocks(plan, *s.layers))
        if plan.parallel.recompute == "full" and min(s.recompute_layers, n) < n:
            out.append(f"stage {s.stage}: {min(s.recompute_layers, n)} of {n}")
    return out


# ------------------------------------------------------------------------------------------- Megatron


def to_megatron(plan: Plan, warnings: list[str] | None = None) -> str:
    """Megatron-LM `pretrain_gpt.py` arguments, one per line, ready to paste into a launch script."""
    warn = warnings.append if warnings is not None else (lambda _: None)
    p, m = plan.parallel, plan.model
    args: list[tuple[str, object | None]] = [
        ("--tensor-model-parallel-size", p.tp), ("--pipeline-model-parallel-size", p.pp),
        ("--micro-batch-size", p.micro_batch_size), ("--global-batch-size", p.global_batch_size),
        ("--seq-length", p.seq_len), ("--max-position-embeddings", m.max_seq_len),
        ("--num-layers", m.num_layers), ("--hidden-size", m.hidden_size), ("--ffn-hidden-size", m.ffn_hidden_size),
        ("--num-attention-heads", m.num_heads),
    ]
    if m.num_kv_heads != m.num_heads:
        args += [("--group-query-attention", None), ("--num-query-groups", m.num_kv_heads)]
    if m.arch != "custom":
        args += _megatron_block(m, warn)
    if not m.tied_embeddings:
        args.append(("--untie-embeddings-and-output-weights", None))
    args += _megatron_pipeline(plan, warn)
    if p.sequence_parallel:
        args.append(("--sequence-parallel", None))
    args += _megatron_recompute(plan, warn)
    if p.zero == 1:
        args.append(("--use-distributed-optimizer", None))
    elif p.zero in (2, 3):
        strategy = "optim_grads" if p.zero == 2 else "optim_grads_params"
        args += [("--use-megatron-fsdp", None), ("--data-parallel-sharding-strategy", strategy),
                 ("--use-distributed-optimizer", None), ("--no-gradient-accumulation-fusion", None),
                 ("--ckpt-format", "fsdp_dtensor")]
        if p.pp > 1:
            warn(f"ZeRO-{p.zero} with pipeline parallelism: Megatron-FSDP may not support pp > 1 in your Megatron "
                 "version; fall back to --use-distributed-optimizer (ZeRO-1) if it refuses")
    if p.dtype in ("bf16", "fp16"):
        args.append((f"--{p.dtype}", None))
    if plan.search.software == "megatron-bridge":  # costed with bf16 gradients and a fused cross-entropy
        if p.dtype == "bf16":
            args.append(("--grad-reduce-in-bf16", None))
        args.append(("--cross-entropy-loss-fusion", None))  # Megatron-LM's own kernel (it refuses TE's)
    if p.fp8 != "none":  # Transformer Engine: E4M3 forward, E5M2 gradients; current scaling is "tensorwise"
        args += [("--fp8-format", "hybrid"), ("--fp8-recipe", "delayed" if p.fp8 == "delayed" else "tensorwise")]
        if p.zero >= 1:  # FP8 parameters, as `--software megatron` costs them (profiler/software.py)
            args.append(("--fp8-param-gather", None))
    args += megatron_moe_args(plan, warn)
    args += megatron_cp_args(plan, warn)
    lines = [f"# Megatron-LM arguments for {m.name} on {plan.cluster.name}, from a meshplan plan",
             f"# launch {plan.world_size} processes; Megatron derives data-parallel size "
             f"{p.dp} = world size / (tp {p.tp} x pp {p.pp}"
             + (f" x cp {p.cp})" if p.cp > 1 else ")")]
    body = [f"{flag} {value}" if value is not None else flag for flag, value in args]
    lines += [line + " \\" for line in body[:-1]] + body[-1:]
    return "\n".join(lines) + "\n"


def _megatron_block(m, warn: Callable[[str], None]) -> list[tuple[str, object | None]]:
    """The block's parts as Megatron-LM flags (its defaults: GELU, LayerNorm, learned positions, biases)."""
    args: list[tuple[str, object | None]] = []
    if m.mlp == "swiglu":
        args.append(("--swiglu", None))
    elif m.mlp == "geglu":
        warn("GeGLU MLP: Megatron-LM's GPT has no GeGLU flag; exported with --swiglu (the same matmuls)")
        args.append(("--swiglu", None))
    elif m.mlp == "relu":
        warn("ReLU MLP: Megatron-LM's GPT offers GELU, SwiGLU and squared ReLU; exported with its default GELU")
    if m.norm == "rmsnorm":
        args.append(("--normalization", "RMSNorm"))
    if m.position == "alibi":
        warn("ALiBi positions: Megatron-LM has none (Megatron-DeepSpeed, which trained BLOOM, has "
             "--position-embedding-type alibi); exported without position embeddings")
        args.append(("--position-embedding-type", "none"))
    if m.embedding_norm:
        warn("the embedding's LayerNorm (BLOOM): Megatron-LM's GPT has none; not exported")
    if m.position == "rope":
        args.append(("--position-embedding-type", "rope"))
        if m.rotated_dims < m.head_dim:
            args.append(("--rotary-percent", m.rotated_dims / m.head_dim))
    if not m.linear_bias:
        args.append(("--disable-bias-linear", None))
        if m.qkv_bias:
            args.append(("--add-qkv-bias", None))
    if m.parallel_residual:
        warn("parallel residual (attention and MLP side by side): Megatron-LM's GPT block is sequential; "
             "exported as sequential")
    if m.sliding_window:
        warn(f"sliding window of {m.sliding_window} tokens: set Megatron-Core's TransformerConfig.window_size to "
             f"({m.sliding_window - 1}, 0) (keys i - {m.sliding_window - 1} .. i), not exported as a flag")
    return args


def _megatron_pipeline(plan: Plan, warn: Callable[[str], None]) -> list[tuple[str, object | None]]:
    p = plan.parallel
    if p.schedule == "gpipe" and p.pp > 1:
        warn("pipeline schedule gpipe: Megatron-LM has no GPipe schedule; it will run 1F1B (less activation memory)")
    if p.schedule == "zero-bubble":
        warn(f"pipeline schedule zero-bubble: Megatron-LM has no zero-bubble schedule; exported as "
             f"{'interleaved 1F1B' if p.virtual_stages > 1 else '1F1B'} with looped stage placement")
    if p.pp == 1:
        if p.virtual_stages > 1:
            warn(f"{p.virtual_stages} virtual stages with pp=1: Megatron-LM interleaves only across pipeline "
                 "ranks; exported without virtual stages")
        return []
    counts = [len(_blocks(plan, *s.layers)) for s in plan.stages]
    even = plan.model.num_layers // len(plan.stages)
    if all(c == even for c in counts) and even * len(plan.stages) == plan.model.num_layers:
        return [("--num-layers-per-virtual-pipeline-stage", even)] if p.virtual_stages > 1 else []
    return [("--pipeline-model-parallel-layout", f'"{megatron_layout(plan)}"')]


def megatron_layout(plan: Plan) -> str:
    """Megatron's --pipeline-model-parallel-layout: stages in order split by '|', E embedding, t a block,
    L the loss/output head; e.g. 'Et*3|t*4|t*4|t*3L'."""
    parts = []
    for s in plan.stages:
        n = len(_blocks(plan, *s.layers))
        text = "E" if _has(plan, *s.layers, "embedding") else ""
        text += "" if n == 0 else "t" if n == 1 else f"t*{n}"
        text += "L" if _has(plan, *s.layers, "head") else ""
        parts.append(text)
    return "|".join(parts)


def _megatron_recompute(plan: Plan, warn: Callable[[str], None]) -> list[tuple[str, object | None]]:
    p = plan.parallel
    if p.recompute == "none":
        return []
    if p.recompute == "selective":
        return [("--recompute-granularity", "selective")]
    partial = _partial_recompute(plan)
    if not partial:
        return [("--recompute-granularity", "full"), ("--recompute-method", "uniform"), ("--recompute-num-layers", 1)]
    counts = {min(s.recompute_layers, len(_blocks(plan, *s.layers))) for s in plan.stages}
    if len(counts) > 1:
        warn(f"per-stage recompute counts ({', '.join(partial)}): Megatron's --recompute-num-layers is one number "
             f"for every stage; exported the largest, {max(counts)}")
    return [("--recompute-granularity", "full"), ("--recompute-method", "block"),
            ("--recompute-num-layers", max(counts))]


# ----------------------------------------------------------------------------------------- torchtitan

TITAN_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B"}
TITAN_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def to_torchtitan(plan: Plan, warnings: list[str] | None = None) -> str:
    """A torchtitan JobConfig TOML with the [training], [parallelism] and [activation_checkpoint] sections."""
    warn = warnings.append if warnings is not None else (lambda _: None)
    p, m = plan.parallel, plan.model
    local = p.micro_batch_size * p.num_micro_batches if p.pp > 1 else p.micro_batch_size
    training: dict[str, object] = {"local_batch_size": local, "global_batch_size": p.global_batch_size,
                                   "seq_len": p.seq_len}
    if p.dtype == "fp16":
        warn("dtype fp16: torchtitan's mixed_precision_param is bfloat16 or float32; exported bfloat16")
    training["mixed_precision_param"] = TITAN_DTYPES.get(p.dtype, "bfloat16")
    if p.fp8 != "none":
        warn(f"fp8 {p.fp8}: torchtitan's FP8 is torchao's Float8LinearConverter, set in the model registry "
             "(filter_fqns=['output']), not in this file; its recipes (rowwise by default) differ from Transformer "
             "Engine's, which the plan's predictions charge")
    parallelism: dict[str, object] = {}
    if p.zero == 0:
        parallelism.update(data_parallel_replicate_degree=p.dp, data_parallel_shard_degree=1)
    else:
        parallelism.update(data_parallel_replicate_degree=1, data_parallel_shard_degree=p.dp,
                           fsdp_reshard_after_forward="default" if p.zero == 3 else "never")
        if p.zero == 1 and p.dp > 1:
            warn("ZeRO-1 (optimizer-state sharding only): torchtitan shards with FSDP2; exported as "
                 "data_parallel_shard_degree with fsdp_reshard_after_forward='never', which also shards gradients")
    parallelism["tensor_parallel_degree"] = p.tp
    parallelism.update(torchtitan_moe_degrees(plan, warn))
    parallelism.update(torchtitan_cp_degrees(plan, warn))
    if p.tp > 1 and not p.sequence_parallel:
        warn("tensor parallel without sequence parallel: torchtitan always shards norms and dropout along the "
             "sequence with TP (sequence parallel on)")
    parallelism["pipeline_parallel_degree"] = p.pp
    if p.pp > 1:
        if p.schedule == "zero-bubble":
            schedule = "ZBVZeroBubble" if p.virtual_stages == 2 else "InterleavedZeroBubble"
        else:
            schedule = TITAN_SCHEDULES[p.schedule]
        parallelism.update(pipeline_parallel_schedule=schedule, pipeline_parallel_microbatch_size=p.micro_batch_size,
                           module_fqns_per_model_part=torchtitan_fqns(plan))
    if m.arch != "llama":
        warn(f"model architecture {m.arch}: module names follow torchtitan's llama3 model (tok_embeddings, "
             "layers.N, norm, output)")
    parts = [what for what, has in (("a parallel residual", m.parallel_residual), (f"a {m.mlp} MLP", m.mlp != "swiglu"),
                                    ("partial rotary", m.rotated_dims < m.head_dim), ("LayerNorm", m.norm != "rmsnorm"),
                                    ("biases", m.linear_bias), ("a sliding window", m.sliding_window > 0),
                                    ("ALiBi", m.position == "alibi"), ("an embedding norm", m.embedding_norm)) if has]
    if parts and m.arch != "custom":
        warn(f"{m.name} has {', '.join(parts)}: torchtitan's llama3 model has none of these; the model must be "
             "registered with torchtitan as it is")
    ac: dict[str, object] = {"mode": p.recompute}
    if p.recompute == "selective":
        ac["selective_ac_option"] = "op"
        warn("recompute selective: torchtitan's closest option, 'op', saves matmul outputs and recomputes the "
             "rest; meshplan's recomputes only the attention core, so time and memory differ from the plan's")
    partial = _partial_recompute(plan)
    if partial:
        warn(f"partial recompute ({', '.join(partial)}): torchtitan checkpoints every block (mode 'full') or "
             "every N-th block ('selective' with an integer option); exported full")
    sections = [("training", training), ("parallelism", parallelism), ("activation_checkpoint", ac)]
    lines = [f"# torchtitan job config (JobConfig TOML, torchtitan 0.2) for {m.name} on {plan.cluster.name}",
             f"# from a meshplan plan; run on {plan.world_size} GPUs. Merge with your [model], [optimizer], ..."]
    for name, values in sections:
        lines.append(f"\n[{name}]")
        lines += [f"{key} = {_toml(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


def torchtitan_fqns(plan: Plan) -> list[list[str]]:
    """Module names per pipeline stage in torchtitan's llama3 naming."""
    out = []
    for s in plan.stages:
        names = ["tok_embeddings"] if _has(plan, *s.layers, "embedding") else []
        names += [f"layers.{b}" for b in _blocks(plan, *s.layers)]
        names += ["norm", "output"] if _has(plan, *s.layers, "head") else []
        out.append(names)
    return out


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        return "[\n" + "".join(f"  {_toml(v)},\n" for v in value) + "]"  # one stage per line
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


# ------------------------------------------------------------------------------------------ DeepSpeed


def to_deepspeed(plan: Plan, warnings: list[str] | None = None) -> str:
    """A DeepSpeed config JSON: batch arithmetic (train_batch_size = micro x accumulation x dp), ZeRO stage,
    precision, AutoTP degree and the pipeline engine's section."""
    warn = warnings.append if warnings is not None else (lambda _: None)
    p = plan.parallel
    if p.fp8 != "none":
        warn(f"fp8 {p.fp8}: DeepSpeed's config has no FP8 switch; the model must use Transformer Engine's "
             "Linears under te.fp8_autocast")
    config: dict[str, object] = {
        "train_batch_size": p.global_batch_size,
        "train_micro_batch_size_per_gpu": p.micro_batch_size,
        "gradient_accumulation_steps": p.num_micro_batches,
        "zero_optimization": {"stage": p.zero},
        "bf16": {"enabled": p.dtype == "bf16"},
        "fp16": {"enabled": p.dtype == "fp16"},
    }
    if p.tp > 1:
        config["tensor_parallel"] = {"autotp_size": p.tp}
        if p.sequence_parallel:
            warn("sequence parallel: DeepSpeed AutoTP has no Megatron-style sequence parallelism; not exported")
    if p.pp > 1:
        config["pipeline"] = {"stages": p.pp, "activation_checkpoint_interval": 1 if p.recompute == "full" else 0}
        warn(f"pipeline stage boundaries: DeepSpeed sets them in code, PipelineModule(num_stages={p.pp}, "
             f"partition_method={_deepspeed_partition(plan)}); the plan's are layers {[s.layers for s in plan.stages]}")
        if p.schedule != "1f1b" or p.virtual_stages > 1:
            warn(f"pipeline schedule {p.schedule}" + (f" with {p.virtual_stages} virtual stages" if p.virtual_stages > 1
                 else "") + ": DeepSpeed's pipeline engine runs 1F1B with one stage per rank")
        if p.zero >= 2:
            warn(f"ZeRO-{p.zero} with pipeline parallelism: DeepSpeed's pipeline engine supports ZeRO stage 0 or 1 "
                 "only")
    deepspeed_moe_note(plan, warn)
    config.update(deepspeed_cp_config(plan, warn))
    if p.recompute == "selective":
        warn("recompute selective: DeepSpeed has no selective (attention-only) activation checkpointing setting")
    elif p.recompute == "full" and p.pp == 1:
        warn("recompute full: DeepSpeed checkpoints activations from model code (deepspeed.checkpointing.checkpoint "
             "around each block); the config cannot switch it on")
    if _partial_recompute(plan):
        warn(f"partial recompute ({', '.join(_partial_recompute(plan))}): not expressible in DeepSpeed's config")
    return json.dumps(config, indent=2) + "\n"


def _deepspeed_partition(plan: Plan) -> str:
    """The partition_method that gives the plan's stages (DeepSpeed balances the count of the matching layers:
    planner/stage_split.py), else '...' (a custom partition in code)."""
    bounds = [s.layers[0] for s in plan.stages] + [plan.stages[-1].layers[1]]
    kinds = [layer.kind for layer in plan.model.layers]
    for method, split in (("'type:transformer'", "even"), ("'type:transformer|embedding'", "even-ends")):
        if split_bounds(kinds, len(plan.stages), split) == bounds:
            return method
    return "..."


# ------------------------------------------------------------------------------------------------ CLI

EXPORTERS: dict[str, Callable[..., str]] = {"megatron": to_megatron, "torchtitan": to_torchtitan,
                                            "deepspeed": to_deepspeed}


# The `plan --software` names whose costs an export target runs (profiler/software.py); the first to suggest
SOFTWARE_OF = {"megatron": ("megatron", "megatron-bridge", "megatron-2022", "megatron-2021"),
               "torchtitan": ("torchtitan",), "deepspeed": ("megatron-deepspeed-2022",)}


def main(argv: Sequence[str]) -> int:
    p = _Parser(prog="plan export", description="Print a plan as the arguments or config file of another "
                "training engine. Plan features the engine cannot express are named on stderr, one line each.")
    p.add_argument("plan", metavar="PLAN.json")
    p.add_argument("--format", required=True, choices=FORMATS, help="target engine")
    p.add_argument("-o", "--output", metavar="PATH", help="write to PATH instead of stdout")
    args = p.parse_args(list(argv))
    plan = load_plan(args.plan)
    warnings: list[str] = []
    text = EXPORTERS[args.format](plan, warnings)
    software = plan.search.software
    if software and software not in SOFTWARE_OF[args.format]:
        warnings.append(f"the plan's times were costed as {software} runs it (GPU presets); for {args.format}'s, "
                        f"plan again with --software {SOFTWARE_OF[args.format][0]}")
    for w in warnings:
        print(f"plan export: warning: {w}", file=sys.stderr)
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as fh:
                fh.write(text)
        except OSError as exc:
            raise InputError(f"--output: cannot write '{args.output}': {exc.strerror}") from None
        print(f"{args.format} config written to {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
