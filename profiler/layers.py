"""The layers the profiler measures, built from executor/model.py with the shard shapes of one TP rank.

A tensor-parallel rank of degree t computes a block with heads/t query heads, kv_heads/t key/value heads
and ffn/t hidden MLP units (column-/row-wise sharded Linears; norms replicated, hidden size unchanged),
and a head with vocab/t logits (and the loss over them: the executor's loss is vocabulary-parallel). One
device can therefore measure what a TP rank computes without the collectives, which the profiler
times separately as links.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from meshplan.executor.model import Block, Embedding, Head, loss_fn
from meshplan.executor.parallelize import checkpointed_block, recompute_attention_core, tp_loss
from meshplan.planner.errors import InputError
from meshplan.planner.model_spec import ModelSpec, vocab_shard
from torch.overrides import TorchFunctionMode

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_buildable(spec: ModelSpec) -> None:
    if spec.arch not in ("gpt2", "llama"):
        raise InputError(f"MODEL: the profiler builds gpt2/llama architectures from executor/model.py, not "
                         f"'{spec.arch}' ('{spec.name}'); pass a measured --profile or plan with presets")


def tp_degrees(spec: ModelSpec, max_tp: int) -> list[int]:
    """Powers of two up to max_tp that divide the query and key/value heads and the MLP width."""
    out, t = [], 1
    while t <= max_tp:
        if spec.num_heads % t == 0 and spec.num_kv_heads % t == 0 and spec.ffn_hidden_size % t == 0:
            out.append(t)
        t *= 2
    return out


def shard_spec(spec: ModelSpec, kind: str, tp: int) -> ModelSpec:
    if tp == 1:
        return spec
    if kind == "block":
        if spec.num_heads % tp or spec.num_kv_heads % tp or spec.ffn_hidden_size % tp:
            raise InputError(f"--tp: {tp} does not divide the heads ({spec.num_heads}), key/value heads "
                             f"({spec.num_kv_heads}) and MLP width ({spec.ffn_hidden_size}) of '{spec.name}'")
        return replace(spec, num_heads=spec.num_heads // tp, num_kv_heads=spec.num_kv_heads // tp,
                       ffn_hidden_size=spec.ffn_hidden_size // tp, layers=())
    if kind == "head":  # vocabulary-parallel when tp divides it, else replicated (executor.parallelize)
        return replace(spec, vocab_size=vocab_shard(spec, tp), tied_embeddings=False, layers=())
    return spec  # the embedding is not sharded by the plans meshplan makes


class HeadLoss(nn.Module):
    """The LM head followed by the loss on fixed targets: the head's measured forward ends in the scalar
    loss, as the last pipeline stage's does. A vocabulary-parallel head's loss is the executor's
    `vocab_parallel_loss` over the logits' shard (`loss`), run under `loss_parallel` (`context`)."""

    def __init__(self, head: nn.Module, targets: torch.Tensor,
                 loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = loss_fn,
                 context: Callable[[], AbstractContextManager] = nullcontext):
        super().__init__()
        self.head = head
        self.targets = targets
        self.loss = loss
        self.context = context

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.context():
            return self.loss(self.head(x), self.targets)


@dataclass
class LayerCase:
    """One measurable layer: the module (the head's includes the loss), a fresh input, and how to turn
    the output into a backward call."""

    kind: str
    module: nn.Module
    make_input: Callable[[], torch.Tensor]
    backward: Callable[[torch.Tensor], None]

    _checkpointed: nn.Module | None = None

    def parameters(self) -> list[nn.Parameter]:
        return list(self.module.parameters())

    def checkpointed(self) -> nn.Module:
        """The module in the executor's full-recompute wrapper, built once (not inside the timed passes)."""
        if self._checkpointed is None:
            self._checkpointed = checkpointed_block(self.module)
        return self._checkpointed


def measured_block(spec: ModelSpec) -> int:
    """The block the profiler times for kind "block": the first MoE block of a mixture-of-experts model
    (its feed-forward dominates; dense leading blocks are few), else block 0."""
    from meshplan.planner.model_spec import sparse_blocks

    return (sparse_blocks(spec) or [0])[0]


def build_case(spec: ModelSpec, kind: str, b: int, s: int, tp: int, dtype: str, device: torch.device,
               seed: int = 0) -> LayerCase:
    """The layer of `kind` as one TP rank holds it, in `dtype` on `device`, with inputs of b x s tokens."""
    shard = shard_spec(spec, kind, tp)
    torch.manual_seed(seed)
    tdtype = TORCH_DTYPES[dtype]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    if kind == "embedding":
        module: nn.Module = Embedding(shard)
        tokens = torch.randint(0, spec.vocab_size, (b, s), generator=gen).to(device)

        def make_input() -> torch.Tensor:
            return tokens
    else:
        module = Block(shard, measured_block(spec)) if kind == "block" else Head(shard)
        x0 = torch.randn(b, s, spec.hidden_size, generator=gen).to(device=device, dtype=tdtype)

        def make_input() -> torch.Tensor:
            return x0.detach().requires_grad_(True)  # the pipeline also computes the input's gradient
    module = module.to(device=device, dtype=tdtype)
    if kind == "head":  # head + loss: the forward ends in the scalar loss (see `forward`)
        targets = torch.randint(0, shard.vocab_size, (b, s), generator=gen).to(device)
        module = HeadLoss(module, targets)

        def backward(loss: torch.Tensor) -> None:
            loss.backward()
    else:
        grad = torch.randn(b, s, spec.hidden_size, generator=gen).to(device=device, dtype=tdtype)

        def backward(out: torch.Tensor) -> None:
            out.backward(grad)
    return LayerCase(kind, module, make_input, backward)


def build_tp_case(spec: ModelSpec, kind: str, b: int, s: int, tp_mesh, dtype: str, device: torch.device,
                  seed: int = 0) -> LayerCase:
    """The layer of `kind` parallelised over `tp_mesh` exactly as the executor does it (executor.parallelize
    .apply_tp with sequence parallelism, DTensor collectives included), seen from one rank of the group:
    block and head take this rank's sequence shard, the embedding the full token ids. Every rank of the
    mesh must run the same passes (the collectives pair them up)."""
    from meshplan.executor.model import Transformer
    from meshplan.executor.parallelize import apply_tp, materialise

    tp = tp_mesh.size()
    if s % tp:
        raise InputError(f"--seq-len: tensor parallel degree {tp} does not divide the sequence length {s}")
    index = {"embedding": 0, "block": 1 + measured_block(spec), "head": spec.num_layers + 1}[kind]
    with torch.device("meta"):
        model = Transformer(replace(spec, tied_embeddings=False)).keep_layers(index, index + 1)
    apply_tp(model, tp_mesh, sequence_parallel=True)
    materialise(model, device, seed)
    model = model.to(TORCH_DTYPES[dtype])
    gen = torch.Generator(device="cpu").manual_seed(seed)
    local = (b, s // tp, spec.hidden_size)
    if kind == "embedding":
        module: nn.Module = model.embedding
        tokens = torch.randint(0, spec.vocab_size, (b, s), generator=gen).to(device)

        def make_input() -> torch.Tensor:
            return tokens
    else:
        x0 = torch.randn(*local, generator=gen).to(device=device, dtype=TORCH_DTYPES[dtype])

        def make_input() -> torch.Tensor:
            return x0.detach().requires_grad_(True)
        module = model.blocks[str(measured_block(spec))] if kind == "block" else model.head
    if kind == "head":
        targets = torch.randint(0, spec.vocab_size, (b, s), generator=gen).to(device)
        loss, context = tp_loss(model, tp_mesh)

        def backward(out: torch.Tensor) -> None:
            with context():
                out.backward()
        return LayerCase(kind, HeadLoss(module, targets, loss, context), make_input, backward)
    grad = torch.randn(*local, generator=gen).to(device=device, dtype=TORCH_DTYPES[dtype])
    return LayerCase(kind, module, make_input, lambda out: out.backward(grad))


class _SeeAttentionCore(TorchFunctionMode):
    """Reports the inputs of the attention core, softmax(QKᵀ)V, to `on_inputs`: with selective recompute
    the checkpoint keeps them (outside the saved-tensor hooks that count the rest)."""

    def __init__(self, on_inputs: Callable[[list[torch.Tensor]], None]):
        super().__init__()
        self.on_inputs = on_inputs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention and torch.is_grad_enabled():
            self.on_inputs([a for a in args if isinstance(a, torch.Tensor)])
        return func(*args, **(kwargs or {}))


def forward(case: LayerCase, x: torch.Tensor, recompute: str = "none",
            on_kept: Callable[[list[torch.Tensor]], None] | None = None) -> torch.Tensor:
    """The layer's forward with the plan's recompute mode (block only; other layers ignore it), done
    the way the executor does it (executor.parallelize.apply_ac). Full: the block in a checkpoint
    wrapper, keeping its input. Selective: the block's attention core checkpointed. `on_kept` sees what
    the checkpoint keeps alive (for memory accounting)."""
    if case.kind != "block" or recompute == "none":
        return case.module(x)
    if recompute == "full":
        if on_kept is not None:
            on_kept([x])
        return case.checkpointed()(x)
    with _core_recomputed(case.module), _SeeAttentionCore(on_kept) if on_kept else nullcontext():
        return case.module(x)


@contextmanager
def _core_recomputed(block: nn.Module):
    """The block's attention core recomputed during this forward (the flag is read in forward only; the
    backward replays what the checkpoint recorded)."""
    recompute_attention_core(block)
    try:
        yield
    finally:
        recompute_attention_core(block, on=False)
