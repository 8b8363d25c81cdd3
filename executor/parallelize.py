"""apply_tp / apply_ac / apply_dp and deterministic materialisation of one pipeline stage's module.

Order (torchtitan, DESIGN §7): the stage is cut first (pipeline.py), then TP -> AC -> FSDP/replicate,
all on the meta device; `materialise` then allocates only this rank's shards and fills them from the
FULL initial value of each parameter, so every plan starts from the same model.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import partial

import torch
import torch.nn as nn
from meshplan.executor.collectives import ALL_GATHER
from meshplan.executor.expert_parallel import (
    is_moe_block,
    moe_tp_plan,
    replicate_moe_over_tp,
    shard_experts,
    shard_experts_over_tp,
)
from meshplan.executor.model import Transformer, init_value, loss_fn
from meshplan.executor.regather import Gathered, is_paused, paused, regathering, storage_of, whole
from meshplan.planner.model_spec import splits_vocab
from meshplan.planner.plan import ParallelConfig
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
WRAPPED = "_checkpoint_wrapped_module."


def vocab_parallel(model: Transformer, tp: int) -> bool:
    """Embedding and LM head are sharded over the vocabulary when it divides evenly, else replicated."""
    return splits_vocab(model.spec, tp)


def tp_loss(model: Transformer, tp_mesh: DeviceMesh | None
            ) -> tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], Callable[[], AbstractContextManager]]:
    """The loss of a model tensor-parallel over `tp_mesh` (None: not), and the context its forward and
    backward must run in: `vocab_parallel_loss` under `loss_parallel` when the head is vocabulary-parallel,
    else the plain loss."""
    if tp_mesh is None or tp_mesh.size() == 1 or not vocab_parallel(model, tp_mesh.size()):
        return loss_fn, nullcontext
    return vocab_parallel_loss(tp_mesh), loss_parallel


def vocab_parallel_loss(tp_mesh: DeviceMesh) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Cross-entropy on this rank's vocabulary shard of the logits (torchtitan's loss parallelism): the
    log-softmax all-reduces its max and sum over the TP group instead of gathering b·s·V logits on every
    rank. Forward and backward must both run under `torch.distributed.tensor.parallel.loss_parallel()`."""
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        sharded = DTensor.from_local(logits, tp_mesh, [Shard(logits.ndim - 1)], run_check=False)
        return loss_fn(sharded, targets).to_local()
    return loss


def _gather_sequence() -> PrepareModuleInput:
    return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True)


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, sequence_parallel: bool, expert_tp: bool = False,
             experts_span_tp: bool = False) -> None:
    """Megatron-style TP with DTensor: q/k/v and w1/w3 column-wise, wo and w2 row-wise; vocab-parallel
    embedding and head (the head's logits stay sharded for `vocab_parallel_loss`); with sequence
    parallel the norms run on sequence shards and every block's input and output is a local tensor
    sharded on the sequence dim (use_local_output=True). Qwen3's q/k norms run on the rank's heads with
    their weights replicated (gradients summed over TP). MoE feed-forwards (executor/expert_parallel.py):
    with `expert_tp` (plan expert_tp = tp) their experts' width sharded over TP; else, under sequence
    parallelism, run on the rank's sequence shard with parameters replicated over TP (the routed experts
    left to `apply_ep` when `experts_span_tp`), without it replicated."""
    tp = tp_mesh.size()
    spec = model.spec
    for what, n in (("num_heads", spec.num_heads), ("num_kv_heads", spec.num_kv_heads),
                    ("ffn_hidden_size", spec.ffn_hidden_size)):
        if n % tp:
            raise ValueError(f"plan.parallel.tp: {tp} does not divide the model's {what} = {n}")
    seq = Shard(1) if sequence_parallel else Replicate()
    tied = spec.tied_embeddings and model.embedding is not None and model.head is not None
    vocab = vocab_parallel(model, tp)
    if model.embedding is not None:
        if vocab:
            parallelize_module(model.embedding, tp_mesh, {"tok": RowwiseParallel(input_layouts=Replicate())})
        if sequence_parallel:  # after positions are added: shard the sequence for the first block
            parallelize_module(model.embedding, tp_mesh, PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True))
    for block in model.blocks.values():
        block.attention.head_offset = tp_mesh.get_local_rank() * (spec.num_heads // tp)  # ALiBi's slopes
        moe = is_moe_block(block)  # a MoE feed-forward: expert_parallel.moe_tp_plan
        layer_plan: dict = {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=seq),
        }
        if spec.qk_norm:  # Qwen3: one q and one k norm weight for every head; each rank norms its own heads
            layer_plan.update({"attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
                               "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True)})
        if not moe:
            layer_plan.update({"feed_forward.w1": ColwiseParallel(),
                               "feed_forward.w2": RowwiseParallel(output_layouts=seq)})
        if spec.gated_mlp and not moe:
            layer_plan["feed_forward.w3"] = ColwiseParallel()
        if sequence_parallel:
            layer_plan.update({
                "attention_norm": SequenceParallel(use_local_output=True),
                "ffn_norm": SequenceParallel(use_local_output=True),
                "attention": _gather_sequence(), "feed_forward": _gather_sequence(),
            })
        if moe:
            layer_plan.pop("feed_forward", None)
            layer_plan.update(moe_tp_plan(block, sequence_parallel, expert_tp))
        parallelize_module(block, tp_mesh, layer_plan)
        if sequence_parallel:
            keep_input_shard(block.attention, tp_mesh)
            if not moe:
                keep_input_shard(block.feed_forward, tp_mesh)
        if moe and expert_tp:
            shard_experts_over_tp(block.feed_forward, tp_mesh, sequence_parallel)
        elif moe and sequence_parallel:
            replicate_moe_over_tp(block.feed_forward, tp_mesh, experts=not experts_span_tp)
    if model.head is not None:
        head_plan: dict = {}
        if sequence_parallel:
            head_plan["norm"] = SequenceParallel(use_local_output=True)
            if not vocab:
                head_plan["output"] = _gather_sequence()
        if vocab:  # logits stay sharded over the vocabulary: the loss is vocab-parallel (vocab_parallel_loss)
            head_plan["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1))
        if head_plan:
            parallelize_module(model.head, tp_mesh, head_plan)
        if sequence_parallel:
            keep_input_shard(model.head.output, tp_mesh)
    if tied:  # both sides were sharded Shard(0) over the vocabulary: share one parameter again
        model.head.output.weight = model.embedding.tok.weight


def checkpointed_block(block: nn.Module) -> nn.Module:
    """Full recompute of one block: only its input is kept; the profiler times the same wrapper. All-gather
    CP and sequence-parallel inputs inside it keep nothing gathered either (`regather.paused`, in its forward
    and its recompute): the recompute gathers again."""
    return checkpoint_wrapper(block, preserve_rng_state=False, context_fn=lambda: (paused(), paused()))


def keep_input_shard(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Sequence parallelism as Megatron-LM holds it (Korthikanti et al. 2022, Eq. 5): `module` gets its
    input as this rank's sequence shard and all-gathers it for its column-parallel Linears (its forward
    pre-hook from apply_tp); what they save of the gathered input for backward is kept as the shard and
    gathered again there (executor/regather.py): 1/tp of that memory for one more all-gather in backward.
    That gather starts when the gradient of the module's output arrives, asynchronously, so that it runs
    behind the backward of the module's last layers (attention: the output projection and the core; MLP:
    w2 and the activation) and is waited for where the Linears need it, as Megatron-LM runs its gather
    behind the input-gradient GEMM."""
    group = tp_mesh.get_group()
    module.regathers = module.prefetched = 0  # gathers backward made, and those started early (tests)
    module.sources = weakref.WeakSet()  # the shards standing in for gathered inputs, while alive (tests)

    def gather(t: torch.Tensor) -> torch.Tensor:  # asynchronous: regathering's unpack waits
        return ALL_GATHER(t.contiguous(), 1, group)

    def counted() -> None:
        module.regathers += 1

    def capture(mod: nn.Module, args: tuple) -> None:  # before the gathering pre-hook
        mod._input_shard = args[0] if args else None

    module.register_forward_pre_hook(capture, prepend=True)
    forward = module.forward

    def forward_keeping_shard(*args, **kwargs):
        shard, module._input_shard = module._input_shard, None
        full = args[0] if args else None
        local = full._local_tensor if isinstance(full, DTensor) else full
        if shard is None or local is None or is_paused() or not torch.is_grad_enabled() or not whole(local):
            return forward(*args, **kwargs)
        shard = shard._local_tensor if isinstance(shard, DTensor) else shard
        source = Gathered(shard.detach())
        module.sources.add(source)
        with regathering({storage_of(local): source}, gather, counted):
            out = forward(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            # weakly: the hook lives as long as the graph, the gathered input only until its last saved view
            # is released
            source_ref = weakref.ref(source)

            def prefetch(grad: torch.Tensor) -> None:
                source = source_ref()
                if source is not None and source.full is None:
                    counted()
                    module.prefetched += 1
                    source.full = gather(source.local)
            out.register_hook(prefetch)
        return out

    module.forward = forward_keeping_shard


def recompute_attention_core(block: nn.Module, on: bool = True) -> None:
    """Selective recompute of one block (Korthikanti et al. 2022): checkpoint the attention core only,
    softmax(QKᵀ)V, keeping q, k, v; the rest of the block's activations stay saved."""
    block.attention.recompute_core = on


def apply_ac(model: Transformer, recompute: str, num_layers: int) -> None:
    """Full: wrap the stage's first `num_layers` blocks in activation checkpointing. Selective: every
    block recomputes its attention core."""
    if recompute == "selective":
        for block in model.blocks.values():
            recompute_attention_core(block)
    elif recompute == "full":
        for name in list(model.blocks.keys())[:num_layers]:
            model.blocks[name] = checkpointed_block(model.blocks[name])


def apply_dp(model: Transformer, dp_mesh: DeviceMesh, cfg: ParallelConfig,
             edp_mesh: DeviceMesh | None = None) -> None:
    """ZeRO-3: FSDP2 resharding after forward; ZeRO-1/2: FSDP2 keeping parameters gathered between
    forward and backward (optimizer state and gradients sharded); ZeRO-0: replicate (DDP semantics on
    FSDP2's engine, composable with TP DTensors and pipelining). Each block is its own group, so its
    gradient reduction starts as soon as its backward is done (overlap with the rest of backward).
    `edp_mesh` (expert parallelism): each MoE block's experts are wrapped first, over the
    expert-data-parallel ranks (expert_parallel.shard_experts)."""
    dtype = TORCH_DTYPES[cfg.dtype]
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    if cfg.zero == 0:
        from torch.distributed._composable.replicate_with_fsdp import replicate
        wrap = partial(replicate, mesh=dp_mesh, mp_policy=mp)
    else:
        wrap = partial(fully_shard, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=cfg.zero >= 3)
    for block in model.blocks.values():
        if edp_mesh is not None:
            shard_experts(block, edp_mesh, cfg, wrap)
        wrap(block)
    wrap(model)


def param_name(name: str) -> str:
    """The unsharded FQN of a parameter in the full Transformer."""
    return name.replace(WRAPPED, "")


def _shared_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The (module, attribute) places of every parameter held by more than one module (a tied LM head)."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is not None:
                places.setdefault(id(p), []).append((module, attr))
    return [group for group in places.values() if len(group) > 1]


@torch.no_grad()
def materialise(model: nn.Module, device: torch.device, seed: int) -> None:
    """Allocate this rank's shards and copy in the slices of each parameter's full initial value.
    `to_empty` gives every module its own new plain tensor (a meta tensor cannot be moved in place), so a
    tied weight would come back as two parameters: the shared places are pointed at one again."""
    shared = _shared_parameters(model)
    model.to_empty(device=device)
    for (owner, attr), *others in shared:
        for module, name in others:
            setattr(module, name, getattr(owner, attr))
    spec = model.spec
    for name, p in model.named_parameters():
        full = init_value(param_name(name), p.shape, spec, seed)
        if isinstance(p, DTensor):
            p.copy_(distribute_tensor(full.to(device), p.device_mesh, p.placements, src_data_rank=None))
        else:
            p.copy_(full)
